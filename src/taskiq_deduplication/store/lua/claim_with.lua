-- Begin the run of a task, in one step: wait for the live run of its key (an
-- exclusive run), wait out its debounce, claim the latest merged arguments,
-- and do its policy's step at the start.
--
-- KEYS[1]  the lock key
-- KEYS[2]  the merge key when ARGV[6] is "1", else KEYS[1] again
-- KEYS[3]  the fence counter when ARGV[7] is "1", else KEYS[1] again
-- KEYS[4]  the run slot of an exclusive run: KEYS[1] itself for the "finished"
--          policy (its lock is its run slot), else the run key beside the lock;
--          KEYS[1] again for a run that is not exclusive
-- KEYS[5]  where the success of the message's call is remembered (its done key),
--          or KEYS[1] again when ARGV[10] is ""
-- ARGV[1]  the lock's value as it was sent: "<owner token> <task_id>" (a lock
--          with a record may still have "!" after it: the run begins, so its
--          send was accepted, and the mark goes)
-- ARGV[2]  the TTL of the lock (and run slot) while the task runs or waits, in ms
-- ARGV[3]  the debounce's quiet period in ms (0: no debounce)
-- ARGV[4]  the debounce's maximum wait in ms (0: none)
-- ARGV[5]  the step at the start: "reassert", "release" or "nothing"
-- ARGV[6]  "1" for a task that merges its calls
-- ARGV[7]  "1" for a lock with a fence: taking it back draws a new one
-- ARGV[8]  the run token of an exclusive run ("~..."), or "" for a run that is not
-- ARGV[9]  the TTL of a run slot beside the lock, in ms (its own lease); "0" else
-- ARGV[10] the token of the message's call (its first send's), for an exclusive
--          run whose copies are told of its success; "" else
--
-- A run slot holds "<run token> <task_id>" while its run goes on, with " +"
-- after it once a copy of the same task waits for it; "=<...> <task_id>" once
-- that run succeeded (remembered for the success TTL, or kept briefly for the
-- copies that waited).
--
-- Returns one of:
--   {0, wait}               the debounce is not over: call again in wait ms
--   {3, wait, value}        another run of the key (value) goes on: call again
--                           in at most wait ms (nothing else was touched, but
--                           under "started" a waiting copy's own queued lock,
--                           and its merged arguments, were kept alive)
--   {4, 0, value}           this delivery must not run: a run of its task
--                           succeeded ("=...") or a retry took its lock over
--   {5, 0, ""}              this delivery must not run: it is a copy of a call
--                           whose run succeeded (its done key names the call)
--   {outcome, fence, args}  the run begins: outcome 1 (the lock was this send's,
--                           refreshed or released), 2 (it had vanished and was
--                           taken back, with a new fence if it has one), or the
--                           value of another send's lock (a run that is not
--                           exclusive leaves it untouched; an exclusive
--                           "finished" run takes it, with a new fence); args
--                           are the latest merged arguments, or "".
--   1                       the run begins as {1, 0, ""} says: most runs, in
--                           one reply for the client to read instead of four;
--                           also what a claim run again for the same run
--                           answers (a batch sent again after a lost connection)
-- An exclusive run that begins holds its run slot: "<run token> <task_id>".
local value = ARGV[1]
local ttl = ARGV[2]
local merging = ARGV[6] == '1'
local run = ARGV[8]
local exclusive = run ~= ''
local task = string.match(value, '^%S+ (%S+)')
if ARGV[10] ~= '' and redis.call('GET', KEYS[5]) == ARGV[10] then
  return {5, 0, ''}
end
local current = redis.call('GET', KEYS[1])
if current and current == value .. '!' then
  redis.call('SET', KEYS[1], value, 'KEEPTTL')
  current = value
end

if exclusive then
  local slot = current
  if KEYS[4] ~= KEYS[1] then
    slot = redis.call('GET', KEYS[4])
  end
  local own = run .. ' ' .. task
  if slot == own or slot == own .. ' +' then
    -- This claim ran already (a batch sent again after a lost connection):
    -- the run began then, and holds its slot. (Merged arguments it claimed
    -- and a fence it drew then are not told again.)
    if KEYS[4] == KEYS[1] then
      redis.call('PEXPIRE', KEYS[1], ttl)
    else
      redis.call('PEXPIRE', KEYS[4], ARGV[9])
    end
    return 1
  end
  if slot and slot ~= value then
    local same_task = string.match(slot, '^%S+ (%S+)') == task
    local first = string.sub(slot, 1, 1)
    if first == '~' then
      if same_task and string.sub(slot, -2) ~= ' +' then
        redis.call('SET', KEYS[4], slot .. ' +', 'KEEPTTL')
      end
      if ARGV[5] == 'release' and current == value then
        -- "started": a copy that waits is still queued, and keeps its lock.
        redis.call('PEXPIRE', KEYS[1], ttl)
        if merging then
          redis.call('PEXPIRE', KEYS[2], ttl)
        end
      end
      return {3, redis.call('PTTL', KEYS[4]), slot}
    end
    if same_task then
      return {4, 0, slot}
    end
  end
elseif current and current ~= value then
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
      if current == value then
        redis.call('PEXPIRE', KEYS[1], ttl)
      elseif not current then
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
if current and current ~= value then
  outcome = current
end
local fence = 0
local held = value
if exclusive then
  held = run .. ' ' .. task
end
if ARGV[5] == 'release' then
  if current == value then
    redis.call('DEL', KEYS[1])
  end
elseif ARGV[5] == 'reassert' then
  if current == value then
    if exclusive then
      redis.call('SET', KEYS[1], held, 'PX', ttl)
    else
      redis.call('PEXPIRE', KEYS[1], ttl)
    end
  elseif exclusive or not current then
    redis.call('SET', KEYS[1], held, 'PX', ttl)
    if not current then
      outcome = 2
    end
    if ARGV[7] == '1' then
      fence = redis.call('INCR', KEYS[3])
    end
  end
end
if exclusive and KEYS[4] ~= KEYS[1] then
  redis.call('SET', KEYS[4], held, 'PX', ARGV[9])
end
if outcome == 1 and fence == 0 and args == '' then
  return 1
end
return {outcome, fence, args}
