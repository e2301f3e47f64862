-- admit_v3: admit one request against every limit that applies, all or nothing, and pick the
-- first candidate target whose provider has room and whose circuit breaker lets it through.
--
-- ARGV[1] is JSON: {"groups": [[check, ...], ...], "slot": "<id>", "lease_ms": N}
-- Group 1 (the tenant) must pass whole; of the groups after it (one per candidate target's
-- provider) the first that passes whole is chosen. Nothing is written unless the request is
-- admitted, and then only group 1 and the chosen group are written.
-- A check is one of:
--   {"b", key_index, capacity, cost}   token bucket holding `capacity`, refilled at capacity/60 per s
--   {"c", key_index, limit}            concurrency: a sorted set of slot leases scored by expiry
--   {"q", key_index, limit, reserve, spent_field, reserved_field, leases_index, member}
--                                      quota on a usage hash: spent + reserved + reserve <= limit.
--                                      The reservation is leased in the sorted set `leases`
--                                      (member "slot|field|amount", scored by expiry, renewed
--                                      while the request runs); expired ones are given back first,
--                                      so a dead worker's reservation does not hold the budget.
--   {"k", key_index, reset_ms, probes, probe_ttl_ms}  circuit breaker: hash {s, f, o, p, h}
--        s state (0 closed, 1 half-open, 2 open), f consecutive failures, o opened at (ms),
--        p probes let through while half-open, h half-open since (ms). Closed passes; open passes
--        once reset_ms has gone by, turning half-open with this request as its first probe;
--        half-open passes while fewer than `probes` probes are out (probes older than
--        probe_ttl_ms are forgotten, so a probe whose worker died cannot wedge the breaker).
-- Buckets are hashes {v = level, t = last update in ms}; the level may go below zero after a
-- settlement debits more than was reserved. Time comes from Redis, never from the caller.
-- Returns {1, chosen_group, report, probe}
--      or {0, 1, failed_check, wait_ms, report}    (the tenant's group refused)
--      or {0, 2, only_breakers, wait_ms, report}   (no candidate: 1 when every one was refused
--                                                    by its breaker, else 0)
-- where report is {level, ms until full} for each bucket of group 1 (after taking, if admitted).
-- `probe` is "half_open" when the chosen target's breaker turned half-open, "probe" when the
-- request is a half-open probe, else "".

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

local function breaker(key, reset_ms, probes, probe_ttl_ms)
  local state = redis.call('HMGET', key, 's', 'o', 'p', 'h')
  local s = tonumber(state[1]) or 0
  if s == 0 then return true, 0, nil end
  if s == 2 then
    local ready = (tonumber(state[2]) or 0) + reset_ms
    if now < ready then return false, ready - now, nil end
    return true, 0, 'half_open'
  end
  local out = tonumber(state[3]) or 0
  if now - (tonumber(state[4]) or 0) > probe_ttl_ms then out = 0 end
  if out < probes then return true, 0, 'probe' end
  return false, 1000, nil
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
  elseif kind == 'k' then
    return breaker(key, check[3], check[4], check[5])
  else
    local leases = KEYS[check[7]]
    local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now)
    for _, member in ipairs(expired) do
      local field, amount = string.match(member, '^[^|]*|([^|]*)|(.*)$')
      redis.call('HINCRBYFLOAT', key, field, -tonumber(amount))
    end
    if #expired > 0 then redis.call('ZREMRANGEBYSCORE', leases, '-inf', now) end
    local state = redis.call('HMGET', key, check[5], check[6])
    local used = (tonumber(state[1]) or 0) + (tonumber(state[2]) or 0)
    if used + check[4] <= check[3] then return true, 0, nil end
    return false, -1, nil
  end
end

local function try_group(group)
  local results = {}
  for i, check in ipairs(group) do
    local ok, wait, value = evaluate(check)
    if not ok then return false, i, wait, check[1] end
    results[i] = value
  end
  return true, results
end

local probe = ''
local function commit(group, results)
  for i, check in ipairs(group) do
    local kind, key = check[1], KEYS[check[2]]
    if kind == 'b' then
      redis.call('HSET', key, 'v', results[i], 't', now)
      redis.call('PEXPIRE', key, 120000)
    elseif kind == 'c' then
      redis.call('ZADD', key, now + spec.lease_ms, spec.slot)
      redis.call('PEXPIRE', key, spec.lease_ms * 2)
    elseif kind == 'k' then
      if results[i] == 'half_open' then
        redis.call('HSET', key, 's', 1, 'p', 1, 'h', now)
      elseif results[i] == 'probe' then
        local state = redis.call('HMGET', key, 'p', 'h')
        if now - (tonumber(state[2]) or 0) > check[5] then
          redis.call('HSET', key, 'p', 1, 'h', now)
        else
          redis.call('HINCRBY', key, 'p', 1)
        end
      end
      probe = results[i] or probe
    else
      redis.call('HINCRBYFLOAT', key, check[6], check[4])
      local leases = KEYS[check[7]]
      redis.call('ZADD', leases, now + spec.lease_ms, check[8])
      redis.call('PEXPIRE', leases, spec.lease_ms * 2)
    end
  end
end

local function levels(group)
  local report = {}
  for _, check in ipairs(group) do
    if check[1] == 'b' then
      local level = bucket_level(KEYS[check[2]], check[3])
      report[#report + 1] = {tostring(level), math.ceil((check[3] - level) * 60000 / check[3])}
    end
  end
  return report
end

local groups = spec.groups
local ok, tenant_results, wait = try_group(groups[1])
if not ok then return {0, 1, tenant_results, wait, levels(groups[1])} end

local chosen, chosen_results = nil, nil
local shortest, only_breakers = nil, 1
for g = 2, #groups do
  local passed, results, group_wait, kind = try_group(groups[g])
  if passed then
    chosen, chosen_results = g, results
    break
  end
  if kind ~= 'k' then only_breakers = 0 end
  if shortest == nil or (group_wait >= 0 and group_wait < shortest) then shortest = group_wait end
end
if #groups > 1 and chosen == nil then return {0, 2, only_breakers, shortest, levels(groups[1])} end

commit(groups[1], tenant_results)
if chosen ~= nil then commit(groups[chosen], chosen_results) end

local report = {}
for i, check in ipairs(groups[1]) do
  if check[1] == 'b' then
    local level = tenant_results[i]
    report[#report + 1] = {tostring(level), math.ceil((check[3] - level) * 60000 / check[3])}
  end
end
return {1, chosen or 0, report, probe}
