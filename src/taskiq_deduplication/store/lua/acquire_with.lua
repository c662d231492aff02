-- Take a deduplication lock for a task that merges its calls or takes a fence,
-- or merge this call into the queued holder, or report who holds it: one step.
-- (Tasks with neither use acquire.lua, whose reply and cost are unchanged.)
--
-- KEYS[1]      the lock key
-- KEYS[2]      the merge key (the latest arguments), when ARGV[4] is not ""
-- KEYS[#KEYS]  the fence counter, when ARGV[5] is "1"
-- ARGV[1]      the lock's value for this send, as for acquire.lua
-- ARGV[2]      TTL of the lock in milliseconds (the grace TTL of a send)
-- ARGV[3]      the value of a lock this send may take over (a retry), or ""
-- ARGV[4]      the call's arguments, serialised, for a task that merges; or ""
-- ARGV[5]      "1" to draw a fence for this send, else "0"
-- ARGV[6]      TTL of the merge key in milliseconds (the lock's full TTL)
-- ARGV[7]      "1" when this send is a retry: it runs as soon as it is delivered,
--              and never merges into another send's arguments
-- ARGV[8]      the task's name, for a task that merges
--
-- The merge key is a hash: args (the latest arguments), task (the task's
-- name), first and last (the server's time in ms of the first and the latest
-- call; first is 0 for a retry), and pending, present until the broker has
-- accepted the holder's message (sent.lua removes it). It exists from the send
-- until a worker claims it at the start. A call merges only into a message of
-- its own task that a broker has accepted: several tasks may share a key, and
-- a message the broker refuses never runs.
--
-- Returns {1, fence} when the lock is now this send's (fence 0 without one),
-- {2, holder} when the call was merged into the queued holder's arguments,
-- {3, holder} when the holder merges calls but the broker has not accepted its
-- message yet, or {0, holder} when another send holds the lock. Run twice for the same send (a
-- batch resent after a dropped connection), it takes the lock both times,
-- with a new fence the second time.
local current = redis.call('GET', KEYS[1])
local merging = ARGV[4] ~= ''
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local value = ARGV[1]
if current and current ~= value and current ~= ARGV[3] and current ~= ARGV[3] .. ' +'
    and current ~= ARGV[3] .. '!' then
  if merging and ARGV[7] ~= '1' and redis.call('EXISTS', KEYS[2]) == 1 then
    local holder = redis.call('HMGET', KEYS[2], 'task', 'pending')
    -- A hash without a task was written by an older version: of this task.
    if not holder[1] or holder[1] == ARGV[8] then
      if holder[2] then
        return {3, current}
      end
      redis.call('HSET', KEYS[2], 'args', ARGV[4], 'last', now_ms())
      return {2, current}
    end
  end
  return {0, current}
end
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
local fence = 0
if ARGV[5] == '1' then
  fence = redis.call('INCR', KEYS[#KEYS])
end
if merging then
  local now = now_ms()
  local first = now
  if ARGV[7] == '1' then
    first = 0
  end
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'args', ARGV[4], 'task', ARGV[8], 'first', first, 'last', now,
    'pending', 1)
  redis.call('PEXPIRE', KEYS[2], ARGV[6])
end
return {1, fence}
