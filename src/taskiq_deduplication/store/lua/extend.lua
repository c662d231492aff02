-- Give a lock a new TTL if it is still held by the given owner; never create one.
-- The owner's broker accepted its send, or its run goes on: a lock with a
-- record loses its "!" (not accepted yet), in the same write as its new TTL.
--
-- KEYS[1]  the lock key
-- ARGV[1]  owner token (with the lock's record, if it has one)
-- ARGV[2]  new TTL in milliseconds, or 0 to leave it as it is
--
-- Returns 1 when the lock is the owner's (its TTL set), 0 when it is gone or
-- held by another owner.
local current = redis.call('GET', KEYS[1])
if not (current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ') then
  return 0
end
if string.sub(current, -1) == '!' and string.find(ARGV[1], '/', 1, true) then
  if ARGV[2] == '0' then
    redis.call('SET', KEYS[1], string.sub(current, 1, -2), 'KEEPTTL')
  else
    redis.call('SET', KEYS[1], string.sub(current, 1, -2), 'PX', ARGV[2])
  end
  return 1
end
if ARGV[2] == '0' then
  return 1
end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
