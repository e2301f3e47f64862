-- waiting_human -> queued, resuming at the checkpoint with a fresh attempt budget. In-doubt markers of
-- side-effect steps without a checkpoint are cleared (the human says they may run again), unless the
-- human resolved a step by giving its output: that becomes its checkpoint.
-- KEYS: status indexes, task, steps, stream
-- ARGV: id, then pairs of step name and output (JSON)
local task, steps, stream = KEYS[K + 1], KEYS[K + 2], KEYS[K + 3]
local id = ARGV[1]
local status = redis.call('HGET', task, 'status')
if status ~= 'waiting_human' then return {0, status or ''} end
for i = 2, #ARGV - 1, 2 do
  redis.call('HSET', steps, 'out:' .. ARGV[i], ARGV[i + 1])
  push_json(task, 'steps_done', ARGV[i], 0)
end
for _, field in ipairs(redis.call('HKEYS', steps)) do
  if string.sub(field, 1, 4) == 'sfx:' and redis.call('HEXISTS', steps, 'out:' .. string.sub(field, 5)) == 0 then
    redis.call('HDEL', steps, field)
  end
end
redis.call('HSET', task, 'attempt', 0)
add_entry(stream, task, id)
set_status(task, id, 'queued', now_ms())
return {1, 'queued'}
