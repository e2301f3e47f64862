-- Helpers prepended to every script of the queue client (see client/scripts.py).
-- KEYS[1..8] are always the status indexes, in the order of STATUSES; a script's own keys follow.
-- Time comes from Redis TIME only, so workers on many machines share one clock.
local STATUSES = {'queued', 'running', 'retrying', 'waiting_human', 'done', 'failed', 'cancelled', 'dead'}
local INDEX = {}
for i, name in ipairs(STATUSES) do INDEX[name] = i end
local K = #STATUSES

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Move a task between status indexes and stamp it.
local function set_status(task, id, new, now)
  local old = redis.call('HGET', task, 'status')
  if old and INDEX[old] then redis.call('ZREM', KEYS[INDEX[old]], id) end
  redis.call('ZADD', KEYS[INDEX[new]], now, id)
  redis.call('HSET', task, 'status', new, 'updated', now)
end

-- The fence: only the holder of the current claim token of a running task may write.
local function owns(task, token)
  local f = redis.call('HMGET', task, 'status', 'token')
  return f[1] == 'running' and f[2] == token
end

-- Append to a JSON list held in a hash field, keeping at most `limit` items (0: no limit).
local function push_json(task, field, item, limit)
  local raw = redis.call('HGET', task, field)
  local list = {}
  if raw and raw ~= '' and raw ~= '[]' then list = cjson.decode(raw) end
  list[#list + 1] = item
  while limit > 0 and #list > limit do table.remove(list, 1) end
  redis.call('HSET', task, field, cjson.encode(list))
end

-- Record how the current attempt ended.
local function close_attempt(task, outcome, err, now, limit)
  local f = redis.call('HMGET', task, 'attempt', 'worker', 'started')
  local entry = {attempt = tonumber(f[1]), worker = f[2] or '', started = tonumber(f[3]) or now,
                 ended = now, outcome = outcome}
  if err and err ~= '' then entry['error'] = err end
  push_json(task, 'history', entry, limit)
end

-- Acknowledge and delete the task's stream entry, if it has one.
local function drop_entry(stream, group, task)
  local entry = redis.call('HGET', task, 'entry')
  if entry and entry ~= '' then
    redis.call('XACK', stream, group, entry)
    redis.call('XDEL', stream, entry)
  end
  redis.call('HDEL', task, 'entry')
end

-- Give the task a fresh stream entry, so that some worker claims it.
local function add_entry(stream, task, id)
  local tenant = redis.call('HGET', task, 'tenant') or ''
  local entry = redis.call('XADD', stream, '*', 'task', id, 'tenant', tenant)
  redis.call('HSET', task, 'entry', entry)
end

local function cancel_requested(task)
  return redis.call('HGET', task, 'cancel') == '1'
end
