-- Begin the run of a task that merges its calls or has a fence: wait out its
-- debounce, claim the latest arguments, and do its policy's step at the start.
--
-- KEYS[1]      the lock key
-- KEYS[2]      the merge key, when ARGV[6] is "1"
-- KEYS[#KEYS]  the fence counter, when ARGV[7] is "1"
-- ARGV[1]      the lock's value: "<owner token> <task_id>"
-- ARGV[2]      the lock's TTL while its task runs (or waits), in milliseconds
-- ARGV[3]      the debounce's quiet period in ms (0: no debounce)
-- ARGV[4]      the debounce's maximum wait in ms (0: none)
-- ARGV[5]      the step at the start: "reassert", "release" or "nothing"
-- ARGV[6]      "1" for a task that merges its calls
-- ARGV[7]      "1" for a lock with a fence: taking it back draws a new one
--
-- Returns {0, wait}: the debounce is not over, call again in wait ms (the lock
-- and the merge key were given ARGV[2] more). Otherwise {outcome, fence,
-- args}: outcome 1 (the lock is still this run's, or was released), 2 (it had
-- vanished and was taken back, with a new fence if it has one, else fence 0),
-- or the value of the lock another send holds (then nothing was touched);
-- args are the latest merged arguments, or "" when there are none to claim.
local value = ARGV[1]
local ttl = ARGV[2]
local merging = ARGV[6] == '1'
local current = redis.call('GET', KEYS[1])
if current and current ~= value then
  return {current, 0, ''}
end
if merging and ARGV[3] ~= '0' then
  local times = redis.call('HMGET', KEYS[2], 'first', 'last')
  if times[2] then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local first = tonumber(times[1])
    local due = tonumber(times[2]) + tonumber(ARGV[3])
    if ARGV[4] ~= '0' and first > 0 then
      due = math.min(due, first + tonumber(ARGV[4]))
    end
    if first > 0 and due > now then
      if current then
        redis.call('PEXPIRE', KEYS[1], ttl)
      else
        redis.call('SET', KEYS[1], value, 'PX', ttl)
      end
      redis.call('PEXPIRE', KEYS[2], ttl)
      return {0, due - now}
    end
  end
end
local args = ''
if merging then
  args = redis.call('HGET', KEYS[2], 'args') or ''
  redis.call('DEL', KEYS[2])
end
local outcome = 1
local fence = 0
if ARGV[5] == 'release' then
  if current then
    redis.call('DEL', KEYS[1])
  end
elseif ARGV[5] == 'reassert' then
  if current then
    redis.call('PEXPIRE', KEYS[1], ttl)
  else
    redis.call('SET', KEYS[1], value, 'PX', ttl)
    outcome = 2
    if ARGV[7] == '1' then
      fence = redis.call('INCR', KEYS[#KEYS])
    end
  end
end
return {outcome, fence, args}
