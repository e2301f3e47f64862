-- A step is about to run: note it as the current step and, for a side-effect step, leave a marker
-- that survives a crash (so the next attempt knows the outcome is in doubt).
-- KEYS: status indexes, task, steps
-- ARGV: token, name, side_effect ('1'/'0'), attempt
local task, steps = KEYS[K + 1], KEYS[K + 2]
if not owns(task, ARGV[1]) then return 'lost' end
if cancel_requested(task) then return 'cancel' end
redis.call('HSET', task, 'step', ARGV[2])
if ARGV[3] == '1' then redis.call('HSET', steps, 'sfx:' .. ARGV[2], ARGV[4]) end
return 'ok'
