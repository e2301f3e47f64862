-- Move due tasks from the delayed set to the stream. The caller passes candidates (the earliest
-- scores); the script checks each against Redis time, so no client clock is trusted.
-- KEYS: status indexes, delayed, stream, task_1 .. task_n
-- ARGV: id_1 .. id_n
local delayed, stream = KEYS[K + 1], KEYS[K + 2]
local now = now_ms()
local moved = 0
for i, id in ipairs(ARGV) do
  local task = KEYS[K + 2 + i]
  local due = redis.call('ZSCORE', delayed, id)
  if due and tonumber(due) <= now then
    redis.call('ZREM', delayed, id)
    local status = redis.call('HGET', task, 'status')
    if status == 'retrying' or status == 'queued' then
      add_entry(stream, task, id)
      redis.call('HDEL', task, 'due')
      if status == 'retrying' then set_status(task, id, 'queued', now) end
      moved = moved + 1
    end
  end
end
return moved
