-- A stopping worker hands back an entry it was delivered but did not claim: a fresh entry replaces it,
-- so another worker gets the task now rather than after the lease.
-- KEYS: status indexes, task, stream
-- ARGV: group, entry, id
local task, stream = KEYS[K + 1], KEYS[K + 2]
local group, entry, id = ARGV[1], ARGV[2], ARGV[3]
local f = redis.call('HMGET', task, 'status', 'entry')
if f[1] ~= 'queued' or f[2] ~= entry then return 0 end
drop_entry(stream, group, task)
add_entry(stream, task, id)
return 1
