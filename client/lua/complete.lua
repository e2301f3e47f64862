-- Store the result, then acknowledge: fenced, atomic. A cancel requested meanwhile wins.
-- Errors of earlier attempts stay in the history; `error` is cleared.
-- KEYS: status indexes, task, stream, tenant_slots, stats
-- ARGV: token, result (JSON), group, history_limit, id
local task, stream, slots, stats = KEYS[K + 1], KEYS[K + 2], KEYS[K + 3], KEYS[K + 4]
local token, group, limit_h, id = ARGV[1], ARGV[3], tonumber(ARGV[4]), ARGV[5]
if not owns(task, token) then return 'lost' end
local now = now_ms()
local final = 'done'
if cancel_requested(task) then final = 'cancelled' end
redis.call('HSET', task, 'result', ARGV[2], 'finished', now)
close_attempt(task, final, '', now, limit_h)
drop_entry(stream, group, task)
redis.call('HDEL', task, 'token', 'lease_until', 'step', 'error')
redis.call('ZREM', slots, id)
set_status(task, id, final, now)
redis.call('HINCRBY', stats, final, 1)
return final
