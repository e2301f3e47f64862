-- Renew a lease: the task's lease_until, the idle time of its stream entry (so no worker finds it
-- idle in XPENDING) and its tenant slot. Returns 'lost' when the token is no longer the task's,
-- 'cancel' when a cancel was requested, else 'ok'.
-- KEYS: status indexes, task, stream, tenant_slots
-- ARGV: token, lease_ms, group, worker, id
local task, stream, slots = KEYS[K + 1], KEYS[K + 2], KEYS[K + 3]
local token, lease_ms, group, worker, id = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
if not owns(task, token) then return 'lost' end
local lease = now_ms() + lease_ms
redis.call('HSET', task, 'lease_until', lease)
local entry = redis.call('HGET', task, 'entry')
if entry then redis.call('XCLAIM', stream, group, worker, 0, entry, 'JUSTID') end
if redis.call('ZSCORE', slots, id) then redis.call('ZADD', slots, lease, id) end
if cancel_requested(task) then return 'cancel' end
return 'ok'
