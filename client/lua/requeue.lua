-- dead, failed or cancelled -> queued: attempt counter reset, history and checkpoints kept.
-- KEYS: status indexes, task, stream
-- ARGV: id
local task, stream = KEYS[K + 1], KEYS[K + 2]
local id = ARGV[1]
local status = redis.call('HGET', task, 'status')
if status ~= 'dead' and status ~= 'failed' and status ~= 'cancelled' then return {0, status or ''} end
redis.call('HSET', task, 'attempt', 0)
redis.call('HDEL', task, 'cancel', 'finished', 'result')
add_entry(stream, task, id)
set_status(task, id, 'queued', now_ms())
return {1, 'queued'}
