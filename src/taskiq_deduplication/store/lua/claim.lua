-- Begin an exclusive run whose lock is its own run slot (the "finished"
-- policy), with nothing beside the lock: no merged arguments, no debounce, no
-- fence (those take claim_with.lua). One step: skip a copy of a call that
-- succeeded, wait for a live run of the key, or take the lock for this run.
--
-- KEYS[1]  the lock key: the run slot
-- KEYS[2]  where the success of the message's call is remembered (its done key),
--          when ARGV[4] is not ""
-- ARGV[1]  the lock's value as it was sent: "<owner token> <task_id>" (a lock
--          with a record may still have "!" after it: the run begins, so its
--          send was accepted, and the mark goes with the run token's write)
-- ARGV[2]  the TTL of the lock while the task runs (its lease), in ms
-- ARGV[3]  the run token ("~...")
-- ARGV[4]  the token of the message's call (its first send's), for a run whose
--          copies are told of its success; "" else
--
-- Replies as claim_with.lua does for such a run:
--   1                       the run begins: the lock was this send's
--   {2, 0, ""}              the run begins: the lock had vanished, taken back
--   {value, 0, ""}          the run begins: it took over another send's lock
--   {3, wait, value}        another run of the key (value) goes on: call again
--                           in at most wait ms (a copy of the same task marks
--                           the slot " +", so that its success is kept for it)
--   {4, 0, value}           a run of its task succeeded ("=...") or a retry
--                           took its lock over: this delivery must not run
--   {5, 0, ""}              a copy of a call whose run succeeded (its done key)
-- A run that begins holds the lock as "<run token> <task_id>". Run again for
-- the same run (a batch sent again), it finds that and answers 1.
local value = ARGV[1]
if ARGV[4] ~= '' and redis.call('GET', KEYS[2]) == ARGV[4] then
  return {5, 0, ''}
end
local current = redis.call('GET', KEYS[1])
local task = string.match(value, '^%S+ (%S+)')
local held = ARGV[3] .. ' ' .. task
if current == held or current == held .. ' +' then
  -- This claim ran already (a batch sent again after a lost connection): the
  -- run began then, and holds the lock.
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if current and string.sub(current, 1, 1) == '~' and string.sub(current, -1) == '!'
    and string.match(current, '^%S+ (%S+)!$') == task then
  -- A run's value that its send is still in flight with: only a send whose
  -- run begins inside it, in the same process (an in-process broker), takes
  -- its lock so (acquire.lua). This is that run, late or under a token of
  -- its own: it begins.
  redis.call('SET', KEYS[1], held, 'PX', ARGV[2])
  return 1
end
local outcome = 1
if not current then
  outcome = 2
elseif current ~= value and current ~= value .. '!' then
  if string.match(current, '^%S+ (%S+)') == task then
    if string.sub(current, 1, 1) ~= '~' then
      return {4, 0, current}
    end
    if string.sub(current, -2) ~= ' +' then
      redis.call('SET', KEYS[1], current .. ' +', 'KEEPTTL')
    end
    return {3, redis.call('PTTL', KEYS[1]), current}
  elseif string.sub(current, 1, 1) == '~' then
    return {3, redis.call('PTTL', KEYS[1]), current}
  end
  outcome = current
end
redis.call('SET', KEYS[1], ARGV[3] .. ' ' .. task, 'PX', ARGV[2])
if outcome == 1 then
  return 1
end
return {outcome, 0, ''}
