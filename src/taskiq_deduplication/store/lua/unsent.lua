-- The broker refused a send: delete its lock, and the arguments kept beside it,
-- if the send still owns the lock.
--
-- KEYS[1]  the lock key
-- KEYS[2]  the merge key, for a task that merges its calls (optional)
-- ARGV[1]  owner token
--
-- Returns 1 when the lock was deleted, 0 when it is gone or held by another owner.
-- The merge key belongs to the lock's holder (its acquire wrote it), and no
-- call merged into it: calls merge only once the broker accepted the message.
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
  if KEYS[2] then
    redis.call('DEL', KEYS[2])
  end
  return redis.call('DEL', KEYS[1])
end
return 0
