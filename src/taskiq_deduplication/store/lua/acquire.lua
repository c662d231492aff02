-- Take a deduplication lock, or report who holds it, in one atomic step.
--
-- KEYS[1]  the lock key
-- ARGV[1]  the lock's value for this send: "<token> <task_id>", where the token
--          is unique per send (no spaces), and "!" follows the task_id of a lock
--          with a record until a broker accepts the send (sent.lua, extend.lua)
-- ARGV[2]  TTL of the lock in milliseconds
-- ARGV[3]  the value of a lock this send may take over (a retry of the send or
--          run that holds it, marked " +" or "!" or not), or "" for an ordinary send
--
-- The caller builds the whole value (the token's record, the sender's time in
-- it included: see model/formats.py), so the script reads one key and writes it.
-- Returns 1 when the lock is now this send's, otherwise the value of the lock
-- that another send holds. Running it twice for the same send (a batch resent
-- after a dropped connection) takes the lock both times.
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[1] then
  local replaces = ARGV[3]
  if replaces == '' or (current ~= replaces and current ~= replaces .. ' +'
      and current ~= replaces .. '!') then
    return current
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
