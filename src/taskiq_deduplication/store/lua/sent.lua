-- The broker accepted the message of a task that merges its calls: give its
-- lock the full TTL and let later calls merge into it. A lock with a record
-- loses its "!" (not accepted yet).
--
-- KEYS[1]  the lock key
-- KEYS[2]  the merge key
-- ARGV[1]  owner token
-- ARGV[2]  new TTL of the lock in milliseconds, or 0 to leave it as it is
--
-- Returns 1 when the lock is still this owner's, else 0 (nothing is touched:
-- a worker that ran the task already released it, or the lock expired). A
-- merge key that a worker claimed already is not written again.
local current = redis.call('GET', KEYS[1])
if not (current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ') then
  return 0
end
if string.sub(current, -1) == '!' and string.find(ARGV[1], '/', 1, true) then
  redis.call('SET', KEYS[1], string.sub(current, 1, -2), 'KEEPTTL')
end
if ARGV[2] ~= '0' then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
redis.call('HDEL', KEYS[2], 'pending')
return 1
