-- admit_v1: admit one request against every limit that applies, all or nothing.
--
-- ARGV[1] is JSON: {"groups": [[check, ...], ...], "slot": "<id>", "lease_ms": N}
-- Group 1 (the tenant) must pass whole; of the groups after it (one per candidate target's
-- provider) the first that passes whole is chosen. Nothing is written unless the request is
-- admitted, and then only group 1 and the chosen group are written.
-- A check is one of:
--   {"b", key_index, capacity, cost}   token bucket holding `capacity`, refilled at capacity/60 per s
--   {"c", key_index, limit}            concurrency: a sorted set of slot leases scored by expiry
--   {"q", key_index, limit, reserve, reason}  quota: hash {spent, reserved}; spent+reserved+reserve <= limit
-- Buckets are hashes {v = level, t = last update in ms}; the level may go below zero after a
-- settlement debits more than was reserved. Time comes from Redis, never from the caller.
-- Returns {1, chosen_group, {level, wait_ms} per bucket of group 1}
--      or {0, failed_group, failed_check, wait_ms}.

local spec = cjson.decode(ARGV[1])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local function bucket_level(key, capacity)
  local state = redis.call('HMGET', key, 'v', 't')
  local level, updated = tonumber(state[1]), tonumber(state[2])
  if level == nil then return capacity end
  local elapsed = now - updated
  if elapsed < 0 then elapsed = 0 end
  return math.min(capacity, level + elapsed * capacity / 60000)
end

-- Returns ok, wait_ms, and the value to write if admitted.
local function evaluate(check)
  local kind, key = check[1], KEYS[check[2]]
  if kind == 'b' then
    local capacity = check[3]
    local cost = math.min(check[4], capacity)
    local level = bucket_level(key, capacity)
    if level >= cost then return true, 0, level - cost end
    return false, math.ceil((cost - level) * 60000 / capacity), level
  elseif kind == 'c' then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    if redis.call('ZCARD', key) < check[3] then return true, 0, nil end
    local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    return false, math.max(1, tonumber(first[2]) - now), nil
  else
    local state = redis.call('HMGET', key, 'spent', 'reserved')
    local used = (tonumber(state[1]) or 0) + (tonumber(state[2]) or 0)
    if used + check[4] <= check[3] then return true, 0, nil end
    return false, -1, nil
  end
end

local function try_group(group)
  local results = {}
  for i, check in ipairs(group) do
    local ok, wait, value = evaluate(check)
    if not ok then return false, i, wait end
    results[i] = value
  end
  return true, results
end

local function commit(group, results)
  for i, check in ipairs(group) do
    local kind, key = check[1], KEYS[check[2]]
    if kind == 'b' then
      redis.call('HSET', key, 'v', results[i], 't', now)
      redis.call('PEXPIRE', key, 120000)
    elseif kind == 'c' then
      redis.call('ZADD', key, now + spec.lease_ms, spec.slot)
      redis.call('PEXPIRE', key, spec.lease_ms * 2)
    else
      redis.call('HINCRBYFLOAT', key, 'reserved', check[4])
    end
  end
end

local groups = spec.groups
local ok, tenant_results, wait = try_group(groups[1])
if not ok then return {0, 1, tenant_results, wait} end

local chosen, chosen_results = nil, nil
local shortest = nil
for g = 2, #groups do
  local passed, results, group_wait = try_group(groups[g])
  if passed then
    chosen, chosen_results = g, results
    break
  end
  if shortest == nil or (group_wait >= 0 and group_wait < shortest) then shortest = group_wait end
end
if #groups > 1 and chosen == nil then return {0, 2, 0, shortest} end

commit(groups[1], tenant_results)
if chosen ~= nil then commit(groups[chosen], chosen_results) end

local report = {}
for i, check in ipairs(groups[1]) do
  if check[1] == 'b' then
    local level = tenant_results[i]
    report[#report + 1] = {tostring(level), math.ceil((check[3] - level) * 60000 / check[3])}
  end
end
return {1, chosen or 0, report}
