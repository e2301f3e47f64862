-- Delete finished tasks last updated before a cutoff: record, checkpoints, index entry and the
-- idempotency key that points at them (so the key may be used again). Only tasks still in `status`
-- are touched; an index entry whose record is gone or has moved on is dropped from that index.
-- KEYS: status indexes, idem, then the task and steps keys of each candidate, in ARGV's order
-- ARGV: cutoff_ms, status, then the candidates' ids
local idem = KEYS[K + 1]
local cutoff, status = tonumber(ARGV[1]), ARGV[2]
local index = KEYS[INDEX[status]]
local purged = 0
for i = 3, #ARGV do
  local id = ARGV[i]
  local task, steps = KEYS[K + 2 * (i - 2)], KEYS[K + 2 * (i - 2) + 1]
  local f = redis.call('HMGET', task, 'status', 'updated', 'idempotency_key')
  if f[1] ~= status then
    redis.call('ZREM', index, id)
  elseif (tonumber(f[2]) or 0) < cutoff then
    if f[3] and f[3] ~= '' and redis.call('HGET', idem, f[3]) == id then redis.call('HDEL', idem, f[3]) end
    redis.call('DEL', task, steps)
    redis.call('ZREM', index, id)
    purged = purged + 1
  end
end
return purged
