-- Create a task and its stream entry atomically; an idempotency key already seen returns its task id.
-- KEYS: status indexes, task, stream, idem
-- ARGV: id, kind, payload, tenant, max_attempts, idempotency_key ('' for none)
local task, stream, idem = KEYS[K + 1], KEYS[K + 2], KEYS[K + 3]
local id, key = ARGV[1], ARGV[6]
if key ~= '' then
  local existing = redis.call('HGET', idem, key)
  if existing then return existing end
  redis.call('HSET', idem, key, id)
end
local now = now_ms()
redis.call('HSET', task, 'id', id, 'kind', ARGV[2], 'payload', ARGV[3], 'tenant', ARGV[4],
  'attempt', 0, 'max_attempts', ARGV[5], 'created', now, 'steps_done', '[]', 'history', '[]',
  'idempotency_key', key)
set_status(task, id, 'queued', now)
add_entry(stream, task, id)
return id
