-- End an exclusive run: free its run slot, or leave it saying the run succeeded,
-- or hand it to the send that carries the run on. Owner-checked by run token.
--
-- KEYS[1]  the run slot (the lock itself for the "finished" policy)
-- KEYS[2]  "succeeded", optional: where the call's success is remembered for
--          copies of its message (its done key)
-- ARGV[1]  the run token
-- ARGV[2]  "succeeded", "failed" or "handed" (to a requeued message or a retry)
-- ARGV[3]  "succeeded": ms to remember the success (0: not remembered);
--          "handed": the value to hand the slot to
-- ARGV[4]  "succeeded": ms to keep the success for the copies that waited on
--          the run (marked " +"), when it is not remembered;
--          "handed": the TTL of the value handed to, in ms
-- ARGV[5]  the run's task_id
-- ARGV[6]  with KEYS[2]: the token of the run's call, to remember there
-- ARGV[7]  with KEYS[2]: how long to remember it, in ms (the redelivery window)
--
-- Returns 1 when the slot was this run's (and was ended), else 0. A success to
-- remember is remembered even when the slot had vanished under its run (a Redis
-- restart, a lease that lapsed in an outage), unless another run holds it now:
-- a copy of the run delivered later must still find that it succeeded. The
-- call's success is remembered in its done key whatever became of the slot.
if KEYS[2] and ARGV[2] == 'succeeded' then
  redis.call('SET', KEYS[2], ARGV[6], 'PX', ARGV[7])
end
local current = redis.call('GET', KEYS[1])
local run = ARGV[1]
if not current then
  if ARGV[2] == 'succeeded' and ARGV[3] ~= '0' then
    redis.call('SET', KEYS[1], '=' .. string.sub(run, 2) .. ' ' .. ARGV[5], 'PX', ARGV[3])
  end
  return 0
end
if string.sub(current, 1, #run + 1) ~= run .. ' ' then
  return 0
end
if ARGV[2] == 'handed' then
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
  return 1
end
local ms = '0'
if ARGV[2] == 'succeeded' then
  ms = ARGV[3]
  if ms == '0' and string.sub(current, -2) == ' +' then
    ms = ARGV[4]
  end
end
if ms == '0' then
  redis.call('DEL', KEYS[1])
else
  local task = string.match(current, '^%S+ (%S+)')
  redis.call('SET', KEYS[1], '=' .. string.sub(run, 2) .. ' ' .. task, 'PX', ms)
end
return 1
