-- A retry that keeps its attempt's lock as it is ("expired"), of a task that
-- merges its calls: keep its arguments where later calls merge into them.
--
-- KEYS[1]  the lock key
-- KEYS[2]  the merge key
-- ARGV[1]  the lock's value: "<owner token> <task_id>"
-- ARGV[2]  the retry's arguments, serialised
-- ARGV[3]  the task's name
--
-- The merge key is written as acquire_with.lua writes it for a retry (first 0:
-- it runs as soon as it is delivered), pending until sent.lua says that the
-- broker accepted the retry, and lives as long as the lock. The lock itself is
-- not touched. Returns 1 when written, 0 when the lock is no longer the retry's.
local current = redis.call('GET', KEYS[1])
if current ~= ARGV[1] and current ~= ARGV[1] .. '!' then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'args', ARGV[2], 'task', ARGV[3], 'first', 0, 'last', now,
  'pending', 1)
redis.call('PEXPIRE', KEYS[2], math.max(redis.call('PTTL', KEYS[1]), 1))
return 1
