-- Re-assert the locks of running tasks: refresh the ones still ours, take back
-- the ones that vanished (TTL expiry, a Redis restart), report the rest.
--
-- KEYS[i]        the key of lock i (all keys in one hash slot on a cluster)
-- ARGV[3*i - 2]  owner token of lock i
-- ARGV[3*i - 1]  task_id of lock i
-- ARGV[3*i]      TTL of lock i in milliseconds
--
-- Returns one entry per key: 1 refreshed, 2 taken back, or the value of the
-- lock that another send now holds (left untouched).
local results = {}
for i, key in ipairs(KEYS) do
  local token, task_id, ttl = ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
  local current = redis.call('GET', key)
  if not current then
    redis.call('SET', key, token .. ' ' .. task_id, 'PX', ttl)
    results[i] = 2
  elseif string.sub(current, 1, #token + 1) == token .. ' ' then
    redis.call('PEXPIRE', key, ttl)
    results[i] = 1
  else
    results[i] = current
  end
end
return results
