-- Whether a lock is still held by the given owner (a running task asks).
--
-- KEYS[1]  the lock key
-- ARGV[1]  the lock's value: "<owner token> <task_id>"
--
-- Returns 1 when the lock's value is ARGV[1] (with " +" after it when a copy of
-- the run waits for it, or "!" while its send is not known to be accepted),
-- else 0 (expired, or another holder).
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] or current == ARGV[1] .. ' +' or current == ARGV[1] .. '!' then
  return 1
end
return 0
