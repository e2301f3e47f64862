-- settle_v4: settle one finished request, and account for it, in one atomic step.
--
-- ARGV[1] is JSON: {"ops": [op, ...], "slot": "<id>"}. An op is one of:
--   {"b", key_index, capacity, delta}   move a token bucket by -delta after refilling it
--                                       (delta = actual - reserved: a refund when negative)
--   {"c", key_index}                    free this request's concurrency slot
--   {"q", key_index, field, amount, leases_index, member}
--                                       a quota: release `amount` of the reservation in `field`,
--                                       only if its lease is still there (else admission already
--                                       gave it back when it expired)
--   {"i", [key_index, ...], field, amount, field, amount, ...}
--                                       add each `amount` to its hash field in every key (usage
--                                       accounting: the day, month and total hashes get the same
--                                       amounts); a field named with a leading "." is a float
--                                       (HINCRBYFLOAT, e.g. ".usd" adds to `usd`), the others are
--                                       integers (HINCRBY, three times cheaper in Redis)
--   {"s", key_index, field, value}      set a hash field (e.g. last_seen)
--   {"n", key_index, field, value}      set a hash field only if it is not set yet (first_seen)
--   {"x", key_index, seconds}           let a key expire after `seconds` (0: never)
--   {"k", key_index}                    a call at this target succeeded: a half-open breaker
--                                       closes, a closed one forgets its failures
-- Time comes from Redis. Returns the keys (indices) of breakers that closed.

local spec = cjson.decode(ARGV[1])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local closed = {}
for _, op in ipairs(spec.ops) do
  local kind = op[1]
  local key = kind ~= 'i' and KEYS[op[2]] or nil
  if kind == 'b' then
    local capacity = op[3]
    local state = redis.call('HMGET', key, 'v', 't')
    local level, updated = tonumber(state[1]), tonumber(state[2])
    if level == nil then level, updated = capacity, now end
    local elapsed = now - updated
    if elapsed < 0 then elapsed = 0 end
    level = math.min(capacity, level + elapsed * capacity / 60000) - op[4]
    redis.call('HSET', key, 'v', math.min(capacity, level), 't', now)
    redis.call('PEXPIRE', key, 120000)
  elseif kind == 'c' then
    redis.call('ZREM', key, spec.slot)
  elseif kind == 'q' then
    if redis.call('ZREM', KEYS[op[5]], op[6]) == 1 then
      redis.call('HINCRBYFLOAT', key, op[3], -op[4])
    end
  elseif kind == 'i' then
    for _, index in ipairs(op[2]) do
      local target = KEYS[index]
      for j = 3, #op, 2 do
        local field = op[j]
        if string.byte(field, 1) == 46 then
          redis.call('HINCRBYFLOAT', target, string.sub(field, 2), op[j + 1])
        else
          redis.call('HINCRBY', target, field, op[j + 1])
        end
      end
    end
  elseif kind == 's' then
    redis.call('HSET', key, op[3], op[4])
  elseif kind == 'n' then
    redis.call('HSETNX', key, op[3], op[4])
  elseif kind == 'k' then
    local state = redis.call('HMGET', key, 's', 'f')
    local s = tonumber(state[1]) or 0
    if s == 1 then
      redis.call('HSET', key, 's', 0, 'f', 0, 'p', 0)
      closed[#closed + 1] = op[2]
    elseif s == 0 and (tonumber(state[2]) or 0) > 0 then
      redis.call('HSET', key, 'f', 0)
    end
  elseif kind == 'x' then
    if op[3] > 0 then redis.call('EXPIRE', key, op[3]) else redis.call('PERSIST', key) end
  end
end
return closed
