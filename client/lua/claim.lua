-- Turn a delivered stream entry into a fenced lease, or say why not.
-- A running task is taken over only when its lease has expired (its worker died, hung or froze);
-- that attempt is recorded as 'lease_expired' and the task is dead if it was the last one.
-- A task over its tenant's fleet-wide limit is deferred (back to the delayed set), not failed.
-- KEYS: status indexes, task, steps, stream, delayed, tenant_slots, tenant_limits, stats
-- ARGV: group, entry, worker, token, lease_ms, defer_ms, tenant, history_limit, id
-- Returns {'claimed', {attempt, kind, payload, tenant, cancel}, step fields} or
-- {'skip'|'busy'|'deferred'|'dead'|'cancelled'}.
local task, steps, stream, delayed = KEYS[K + 1], KEYS[K + 2], KEYS[K + 3], KEYS[K + 4]
local slots, limits, stats = KEYS[K + 5], KEYS[K + 6], KEYS[K + 7]
local group, entry, worker, token = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local lease_ms, defer_ms, tenant = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
local limit_h, id = tonumber(ARGV[8]), ARGV[9]
local now = now_ms()

local function discard()
  redis.call('XACK', stream, group, entry)
  redis.call('XDEL', stream, entry)
end

local f = redis.call('HMGET', task, 'status', 'entry', 'lease_until', 'attempt', 'max_attempts')
local status = f[1]
if not status or f[2] ~= entry or (status ~= 'queued' and status ~= 'running') then
  discard()
  return {'skip'}
end

if status == 'running' then
  if tonumber(f[3]) > now then return {'busy'} end
  close_attempt(task, 'lease_expired', 'lease expired: its worker stopped renewing it (died, hung or frozen)',
    now, limit_h)
  redis.call('ZREM', slots, id)
  redis.call('HDEL', task, 'token', 'lease_until')
  local final = nil
  if cancel_requested(task) then
    final = 'cancelled'
  elseif tonumber(f[4]) >= tonumber(f[5]) then
    final = 'dead'
    redis.call('HSET', task, 'error', 'lease expired on the last attempt (' .. f[4] .. ')')
  end
  if final then
    drop_entry(stream, group, task)
    redis.call('HSET', task, 'finished', now)
    set_status(task, id, final, now)
    redis.call('HINCRBY', stats, final, 1)
    return {final}
  end
end

if tenant ~= '' then
  local limit = tonumber(redis.call('HGET', limits, tenant))
  if limit then
    redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
    if redis.call('ZCARD', slots) >= limit then
      drop_entry(stream, group, task)
      redis.call('ZADD', delayed, now + defer_ms, id)
      redis.call('HSET', task, 'due', now + defer_ms)
      if status ~= 'queued' then set_status(task, id, 'queued', now) end
      return {'deferred'}
    end
    redis.call('ZADD', slots, now + lease_ms, id)
  end
end

redis.call('HINCRBY', task, 'attempt', 1)
redis.call('HSET', task, 'token', token, 'worker', worker, 'lease_until', now + lease_ms, 'started', now,
  'step', '')
set_status(task, id, 'running', now)
return {'claimed', redis.call('HMGET', task, 'attempt', 'kind', 'payload', 'tenant', 'cancel'),
  redis.call('HGETALL', steps)}
