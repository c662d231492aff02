-- Delete a lock if it is still held by the given owner.
--
-- KEYS[1]  the lock key
-- ARGV[1]  owner token
--
-- Returns 1 when the lock was deleted, 0 when it is gone or held by another owner.
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
  return redis.call('DEL', KEYS[1])
end
return 0
