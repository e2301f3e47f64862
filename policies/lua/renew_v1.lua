-- renew_v1: extend the leases of this process's in-flight concurrency slots.
-- KEYS are slot sets, ARGV[1] the lease in ms, ARGV[2..] the slot id for each key.
-- A slot that already expired (and may have been reclaimed) is not brought back.
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local lease = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', 'GT', now + lease, ARGV[i + 1])
  redis.call('PEXPIRE', key, lease * 2)
end
return now
