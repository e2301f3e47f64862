-- breaker_v1: record one failed call at a target, or reset its breaker, atomically.
--
-- KEYS[1] is the breaker hash {s, f, o, p, h} (see admit_v3). ARGV[1] is "fail" or "reset";
-- for "fail", ARGV[2] is the failure threshold. A failure while closed counts towards the
-- threshold and opens the breaker when it is reached; a failure while half-open (a probe
-- failed) opens it again at once; a failure while open changes nothing.
-- Returns {state, failures, transition}: transition is "open", "closed" or "".
local key = KEYS[1]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

if ARGV[1] == 'reset' then
  local s = tonumber(redis.call('HGET', key, 's')) or 0
  redis.call('HSET', key, 's', 0, 'f', 0, 'p', 0)
  return {0, 0, s ~= 0 and 'closed' or ''}
end

local threshold = tonumber(ARGV[2])
local state = redis.call('HMGET', key, 's', 'f')
local s, f = tonumber(state[1]) or 0, (tonumber(state[2]) or 0) + 1
if s == 2 then return {2, f - 1, ''} end
if s == 1 or f >= threshold then
  redis.call('HSET', key, 's', 2, 'f', f, 'o', now, 'p', 0)
  return {2, f, 'open'}
end
redis.call('HSET', key, 'f', f)
return {0, f, ''}
