-- A side-effect step failed with a definite answer (it did not happen): drop its in-doubt marker.
-- KEYS: status indexes, task, steps
-- ARGV: token, name
local task, steps = KEYS[K + 1], KEYS[K + 2]
if not owns(task, ARGV[1]) then return 'lost' end
redis.call('HDEL', steps, 'sfx:' .. ARGV[2])
redis.call('HSET', task, 'step', '')
return 'ok'
