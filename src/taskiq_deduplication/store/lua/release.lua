-- Delete a lock if it is still held by the given owner.
--
-- KEYS[1]  the lock key
-- ARGV[1]  owner token: with the lock's record, or its random part alone (the
--          undo of an acquire whose reply never came, which knows no more)
--
-- Returns 1 when the lock was deleted, 0 when it is gone or held by another owner.
local current = redis.call('GET', KEYS[1])
local head = current and string.sub(current, 1, #ARGV[1] + 1)
if head and (head == ARGV[1] .. ' ' or head == ARGV[1] .. '/') then
  return redis.call('DEL', KEYS[1])
end
return 0
