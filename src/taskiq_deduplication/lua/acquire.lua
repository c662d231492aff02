-- Take a deduplication lock, or report who holds it, in one atomic step.
--
-- KEYS[1]  the lock key
-- ARGV[1]  owner token of this send (unique per send, no spaces)
-- ARGV[2]  task_id of this send
-- ARGV[3]  TTL of the lock in milliseconds
-- ARGV[4]  the value of a lock this send may take over (a retry of the send or
--          run that holds it, marked " +" or not), or "" for an ordinary send
--
-- The lock's value is "<owner token> <task_id>".
-- Returns false (a nil reply) when the lock is now this send's, otherwise the
-- value of the lock that another send holds. Running it twice for the same
-- send (a batch resent after a dropped connection) takes the lock both times.
local value = ARGV[1] .. ' ' .. ARGV[2]
local current = redis.call('GET', KEYS[1])
if current and current ~= value and current ~= ARGV[4] and current ~= ARGV[4] .. ' +' then
  return current
end
redis.call('SET', KEYS[1], value, 'PX', ARGV[3])
return false
