-- peek_v1: the levels of some token buckets, without taking anything.
-- KEYS are bucket hashes {v, t} (see admit_v3); ARGV[i] is the capacity of KEYS[i].
-- Returns {level, ms until full} per bucket, with the refill up to Redis' TIME.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local report = {}
for i, key in ipairs(KEYS) do
  local capacity = tonumber(ARGV[i])
  local state = redis.call('HMGET', key, 'v', 't')
  local level, updated = tonumber(state[1]), tonumber(state[2])
  if level == nil then
    level = capacity
  else
    local elapsed = now - updated
    if elapsed < 0 then elapsed = 0 end
    level = math.min(capacity, level + elapsed * capacity / 60000)
  end
  report[i] = {tostring(level), math.ceil((capacity - level) * 60000 / capacity)}
end
return report
