-- Checkpoint a step's output (fenced) and add the model usage it carried.
-- KEYS: status indexes, task, steps
-- ARGV: token, name, output (JSON), requests, prompt_tokens, completion_tokens
local task, steps = KEYS[K + 1], KEYS[K + 2]
if not owns(task, ARGV[1]) then return 'lost' end
redis.call('HSET', steps, 'out:' .. ARGV[2], ARGV[3])
push_json(task, 'steps_done', ARGV[2], 0)
redis.call('HSET', task, 'step', '')
if tonumber(ARGV[4]) > 0 then
  redis.call('HINCRBY', task, 'usage_requests', ARGV[4])
  redis.call('HINCRBY', task, 'usage_prompt_tokens', ARGV[5])
  redis.call('HINCRBY', task, 'usage_completion_tokens', ARGV[6])
end
if cancel_requested(task) then return 'cancel' end
return 'ok'
