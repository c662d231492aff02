-- A limit: at most N runs at once (slots), at most so many starts per period
-- (a rate, GCRA), and the runs that wait for a slot, in arrival order.
--
-- KEYS[1]  holders: sorted set, task_id -> lease deadline (us); also the
--          channel on which a freed slot is handed to its next waiter
-- KEYS[2]  tokens: hash, task_id -> "<run token> <start (us)>" of each holder
-- KEYS[3]  waiting: sorted set, "<run token> <task_id>" -> arrival number
-- KEYS[4]  leases: sorted set, the same members -> lease deadline (us)
-- KEYS[5]  meta: hash, n (slots; 0: none), lease (us), interval and tolerance
--          of the rate (us; 0: none), rate (as its label says it, "" for
--          none), tat (the rate's theoretical arrival time, us), seq (the last
--          arrival number); what the locks page and `taskiq dedup limits` read
-- ARGV[1]  "take", "free" or "keep"
--
-- take: ARGV[2] task_id, ARGV[3] run token, ARGV[4] N (0: no concurrency
--   limit), ARGV[5] lease (ms), ARGV[6] rate interval (us, 0: no rate),
--   ARGV[7] rate tolerance (us), ARGV[8] the rate as its label says it ("2/s")
--   Returns {1, delay}: the run holds a slot (if N) and may start in delay us
--   (its place in the rate, reserved); {2, ahead}: it waits, behind ahead
--   others; its slot comes on the channel, "<member> <delay>".
-- free: ARGV[2] task_id, ARGV[3] run token. Frees the run's slot, or takes it
--   out of the waiting line. Returns 1 if it held or waited, else 0.
-- keep: ARGV[2] lease (ms), then pairs task_id, run token. Refreshes each
--   holder's and waiter's lease. Returns per pair {1, delay} (it holds a
--   slot: one handed to it whose message was lost is found so), {2, 0} (it
--   waits), or {0, 0} (it holds nothing: its lease lapsed).
--
-- A slot whose lease lapsed (its worker died) is freed by the next call of
-- any kind, and handed on; so is a waiter's place. Every key lives as long as
-- a lease lasts past its last use, or as long as the rate remembers.
local H, TOKENS, WAITING, LEASES, META = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
-- The limit's record, read once: every call below uses it.
local m = redis.call('HMGET', META, 'n', 'lease', 'interval', 'tolerance', 'tat', 'rate')
local n, lease = tonumber(m[1] or '0'), tonumber(m[2] or '0')
local interval, tolerance = tonumber(m[3] or '0'), tonumber(m[4] or '0')
local tat = tonumber(m[5] or '0')
local waiting = redis.call('ZCARD', WAITING)

local function int(x)
  return string.format('%d', x)
end

-- The rate's next start: when a start now may come (us); the rate moves on.
local function place()
  if tat < now then
    tat = now
  end
  local at = tat - tolerance
  if at < now then
    at = now
  end
  tat = tat + interval
  redis.call('HSET', META, 'tat', int(tat))
  return at
end

-- Free the slots and places in line whose lease lapsed (their worker died).
local function purge()
  local dead = redis.call('ZRANGEBYSCORE', H, '-inf', now)
  for _, task in ipairs(dead) do
    redis.call('ZREM', H, task)
    redis.call('HDEL', TOKENS, task)
  end
  if waiting > 0 then
    local gone = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now)
    for _, member in ipairs(gone) do
      redis.call('ZREM', LEASES, member)
      redis.call('ZREM', WAITING, member)
    end
    waiting = waiting - #gone
  end
end

-- Hand free slots to the first waiters (a copy of a run that still holds a
-- slot waits on, behind its run).
local function grant()
  if waiting <= 0 or n == 0 then
    return
  end
  local free = n - redis.call('ZCARD', H)
  if free <= 0 then
    return
  end
  for _, member in ipairs(redis.call('ZRANGE', WAITING, 0, free + 15)) do
    if free <= 0 then
      break
    end
    local token, task = string.match(member, '^(%S+) (.+)$')
    if redis.call('HEXISTS', TOKENS, task) == 0 then
      -- Held on the waiter's own lease (its worker may keep a longer one).
      local deadline = math.max(now + lease, tonumber(redis.call('ZSCORE', LEASES, member) or '0'))
      redis.call('ZREM', WAITING, member)
      redis.call('ZREM', LEASES, member)
      waiting = waiting - 1
      local start = now
      if interval > 0 then
        start = place()
      end
      redis.call('ZADD', H, int(deadline), task)
      redis.call('HSET', TOKENS, task, token .. ' ' .. int(start))
      redis.call('PUBLISH', H, member .. ' ' .. int(start - now))
      free = free - 1
    end
  end
end

-- Every key lives two leases past its last use, and past the last deadline
-- of its holders and waiters (workers may keep longer leases than this call's);
-- the record as long as the rate remembers a start too.
local function keep_alive()
  local last = now + 2 * lease
  local top = redis.call('ZRANGE', H, -1, -1, 'WITHSCORES')
  if top[2] and tonumber(top[2]) > last then
    last = tonumber(top[2])
  end
  if waiting > 0 then
    top = redis.call('ZRANGE', LEASES, -1, -1, 'WITHSCORES')
    if top[2] and tonumber(top[2]) > last then
      last = tonumber(top[2])
    end
  end
  local ms = math.ceil((last - now) / 1000) + 1000
  redis.call('PEXPIRE', H, ms)
  redis.call('PEXPIRE', TOKENS, ms)
  if waiting > 0 then
    redis.call('PEXPIRE', WAITING, ms)
    redis.call('PEXPIRE', LEASES, ms)
  end
  redis.call('PEXPIRE', META, math.max(ms, math.ceil((tat - now) / 1000) + 1000))
end

local function holds(task, token)
  local value = redis.call('HGET', TOKENS, task)
  if value and string.sub(value, 1, #token + 1) == token .. ' ' then
    return tonumber(string.match(value, ' (%d+)$'))
  end
  return nil
end

local op = ARGV[1]
purge()
if op == 'take' then
  local task, token = ARGV[2], ARGV[3]
  -- The record keeps what each take says of its own: a take with a rate alone
  -- leaves the slots' N as it is, and one without a rate the rate.
  local lease_us = int(tonumber(ARGV[5]) * 1000)
  if (ARGV[4] ~= '0' and m[1] ~= ARGV[4]) or m[2] ~= lease_us then
    redis.call('HSET', META, 'n', ARGV[4] ~= '0' and ARGV[4] or (m[1] or '0'), 'lease', lease_us)
  end
  if ARGV[6] ~= '0' and (m[3] ~= ARGV[6] or m[4] ~= ARGV[7] or m[6] ~= ARGV[8]) then
    redis.call('HSET', META, 'interval', ARGV[6], 'tolerance', ARGV[7], 'rate', ARGV[8])
  end
  if ARGV[4] ~= '0' then
    n = tonumber(ARGV[4])
  end
  -- This run's own N: a run with a rate alone takes no slot and waits in no line.
  local mine = tonumber(ARGV[4])
  lease = tonumber(lease_us)
  if ARGV[6] ~= '0' then
    interval, tolerance = tonumber(ARGV[6]), tonumber(ARGV[7])
  end
  local start = holds(task, token)
  if start then
    -- This take ran already (a batch sent again after a lost connection).
    redis.call('ZADD', H, int(now + lease), task)
    keep_alive()
    return {1, math.max(start - now, 0)}
  end
  local member = token .. ' ' .. task
  if mine > 0 then
    if waiting > 0 and redis.call('ZSCORE', WAITING, member) then
      redis.call('ZADD', LEASES, int(now + lease), member)
      keep_alive()
      return {2, redis.call('ZRANK', WAITING, member)}
    end
    if waiting > 0 or redis.call('HEXISTS', TOKENS, task) == 1
        or redis.call('ZCARD', H) >= n then
      local seq = redis.call('HINCRBY', META, 'seq', 1)
      redis.call('ZADD', WAITING, seq, member)
      redis.call('ZADD', LEASES, int(now + lease), member)
      waiting = waiting + 1
      grant()
      keep_alive()
      if redis.call('ZSCORE', WAITING, member) then
        return {2, redis.call('ZRANK', WAITING, member)}
      end
      -- Handed a slot at once (a copy whose run had just ended).
      start = holds(task, token)
      return {1, math.max(start - now, 0)}
    end
  end
  start = now
  if interval > 0 then
    start = place()
  end
  if mine > 0 then
    redis.call('ZADD', H, int(now + lease), task)
    redis.call('HSET', TOKENS, task, token .. ' ' .. int(start))
  end
  keep_alive()
  return {1, start - now}
elseif op == 'free' then
  local task, token = ARGV[2], ARGV[3]
  local found = 0
  if holds(task, token) then
    redis.call('ZREM', H, task)
    redis.call('HDEL', TOKENS, task)
    found = 1
  elseif waiting > 0 then
    local member = token .. ' ' .. task
    found = redis.call('ZREM', WAITING, member)
    redis.call('ZREM', LEASES, member)
    waiting = waiting - found
  end
  grant()
  keep_alive()
  return found
end
-- keep
local ms = tonumber(ARGV[2]) * 1000
if lease < ms then
  lease = ms  -- a record lost (evicted) must not cut the keys' lives short
end
local replies = {}
for i = 3, #ARGV, 2 do
  local task, token = ARGV[i], ARGV[i + 1]
  local member = token .. ' ' .. task
  local start = holds(task, token)
  if start then
    redis.call('ZADD', H, int(now + ms), task)
    replies[#replies + 1] = {1, math.max(start - now, 0)}
  elseif waiting > 0 and redis.call('ZSCORE', WAITING, member) then
    redis.call('ZADD', LEASES, int(now + ms), member)
    replies[#replies + 1] = {2, 0}
  else
    replies[#replies + 1] = {0, 0}
  end
end
grant()
keep_alive()
return replies
