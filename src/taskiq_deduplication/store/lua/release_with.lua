-- Delete a lock if it is still held by the given owner, and with it the keys
-- that belong to it (its merged arguments), in one atomic step. (A worker's
-- own release uses release.lua: a run has claimed its merged arguments.)
--
-- KEYS[1]     the lock key
-- KEYS[2..n]  keys that belong to the lock (on a cluster, those in its slot)
-- ARGV[1]     owner token
--
-- Returns 1 when the lock was deleted, with the others; 0 when it is gone or
-- held by another owner, and then nothing was touched.
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
  redis.call('DEL', unpack(KEYS))
  return 1
end
return 0
