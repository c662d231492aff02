-- Give a lock a new TTL if it is still held by the given owner; never create one.
--
-- KEYS[1]  the lock key
-- ARGV[1]  owner token
-- ARGV[2]  new TTL in milliseconds
--
-- Returns 1 when the TTL was set, 0 when the lock is gone or held by another owner.
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
