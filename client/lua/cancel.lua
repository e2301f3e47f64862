-- Cancel a task: at once unless it is running; a running one is flagged and stops at its next step
-- boundary. Returns {changed (0/1), status afterwards}.
-- KEYS: status indexes, task, stream, delayed, stats
-- ARGV: group, id
local task, stream, delayed, stats = KEYS[K + 1], KEYS[K + 2], KEYS[K + 3], KEYS[K + 4]
local group, id = ARGV[1], ARGV[2]
local status = redis.call('HGET', task, 'status')
if not status then return {0, ''} end
if status == 'running' then
  redis.call('HSET', task, 'cancel', '1')
  return {1, 'running'}
end
if status ~= 'queued' and status ~= 'retrying' and status ~= 'waiting_human' then return {0, status} end
local now = now_ms()
drop_entry(stream, group, task)
redis.call('ZREM', delayed, id)
redis.call('HSET', task, 'cancel', '1', 'finished', now)
redis.call('HDEL', task, 'due')
set_status(task, id, 'cancelled', now)
redis.call('HINCRBY', stats, 'cancelled', 1)
return {1, 'cancelled'}
