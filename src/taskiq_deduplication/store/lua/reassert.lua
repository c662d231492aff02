-- Re-assert the locks of running tasks: refresh the ones still ours, take back
-- the ones that vanished (TTL expiry, a Redis restart), report the rest.
--
-- KEYS[i]      the key of lock i (all keys in one hash slot on a cluster)
-- ARGV[1]      the TTL of every lock in the call, in milliseconds
-- ARGV[i + 1]  the value of lock i: "<owner token> <task_id>"
--
-- Returns one entry per key: 1 refreshed, 2 taken back, or the value of the
-- lock that another send now holds (left untouched). A value with " +" after
-- it (an exclusive run that a copy of its task waits for) is still the lock's,
-- and so is one with "!" (its send not marked accepted yet): it runs, so it
-- was, and the mark goes.
local ttl = ARGV[1]
local results = {}
for i, key in ipairs(KEYS) do
  local value = ARGV[i + 1]
  local current = redis.call('GET', key)
  if not current then
    redis.call('SET', key, value, 'PX', ttl)
    results[i] = 2
  elseif current == value or current == value .. ' +' then
    redis.call('PEXPIRE', key, ttl)
    results[i] = 1
  elseif current == value .. '!' then
    redis.call('SET', key, value, 'PX', ttl)
    results[i] = 1
  else
    results[i] = current
  end
end
return results
