-- Take a deduplication lock, or report who holds it, in one atomic step.
--
-- KEYS[1]  the lock key
-- ARGV[1]  owner token of this send (unique per send, no spaces, no "/")
-- ARGV[2]  task_id of this send
-- ARGV[3]  TTL of the lock in milliseconds
-- ARGV[4]  the value of a lock this send may take over (a retry of the send or
--          run that holds it, marked " +" or "!" or not), or "" for an ordinary send
-- ARGV[5]  the lock's record after the time: "<policy letter>[/<task name>]",
--          or "" (or nothing) for a lock without one (a tick lock)
--
-- The lock's value is "<token> <task_id>", where the token is
-- "<owner>/<server ms>/<record>" with a record (and "!" follows the task_id
-- until sent.lua or extend.lua says a broker accepted the send), else the owner.
-- Returns {token} when the lock is now this send's, otherwise the value of the
-- lock that another send holds. Running it twice for the same send (a batch
-- resent after a dropped connection) takes the lock both times, under the
-- token of the first.
local current = redis.call('GET', KEYS[1])
local token = ARGV[1]
local value = token .. ' ' .. ARGV[2]
local record = ARGV[5] or ''
if record ~= '' then
  local mine = current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. '/'
  if mine then
    token = string.match(current, '^(%S+) ')
  else
    local t = redis.call('TIME')
    token = ARGV[1] .. '/' .. string.format('%.0f', t[1] * 1000 + math.floor(t[2] / 1000))
      .. '/' .. record
  end
  value = token .. ' ' .. ARGV[2] .. '!'
end
if current and current ~= value and current ~= ARGV[4] and current ~= ARGV[4] .. ' +'
    and current ~= ARGV[4] .. '!' then
  return current
end
redis.call('SET', KEYS[1], value, 'PX', ARGV[3])
return {token}
