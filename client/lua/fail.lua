-- End an attempt that did not produce a result (fenced): retry later, or fail, park, cancel.
-- 'retry' on the last attempt makes the task dead. The stream entry is acknowledged; a retry waits
-- in the delayed set until a worker promotes it.
-- KEYS: status indexes, task, stream, delayed, tenant_slots, stats
-- ARGV: token, outcome (retry|failed|waiting_human|cancelled), error, delay_ms, group, history_limit, id
local task, stream, delayed, slots, stats = KEYS[K + 1], KEYS[K + 2], KEYS[K + 3], KEYS[K + 4], KEYS[K + 5]
local token, outcome, err, delay_ms = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local group, limit_h, id = ARGV[5], tonumber(ARGV[6]), ARGV[7]
if not owns(task, token) then return 'lost' end
local now = now_ms()
local final = outcome
if outcome == 'retry' then
  local f = redis.call('HMGET', task, 'attempt', 'max_attempts')
  if tonumber(f[1]) >= tonumber(f[2]) then final = 'dead' else final = 'retrying' end
end
close_attempt(task, final, err, now, limit_h)
if err ~= '' then redis.call('HSET', task, 'error', err) end
drop_entry(stream, group, task)
redis.call('HDEL', task, 'token', 'lease_until', 'step')
redis.call('ZREM', slots, id)
if final == 'retrying' then
  redis.call('ZADD', delayed, now + delay_ms, id)
  redis.call('HSET', task, 'due', now + delay_ms)
elseif final ~= 'waiting_human' then
  redis.call('HSET', task, 'finished', now)
  redis.call('HINCRBY', stats, final, 1)
end
set_status(task, id, final, now)
return final
