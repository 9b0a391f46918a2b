-- Decides a batch of requests, one after another (each all or nothing on its own).
-- ARGV: TTL slack in ms, the number of requests, the index (per request, two little-
-- endian bytes: which of the arguments that follow is the request's, 0 for the first,
-- plus 32768 when a key of the request is a key of an earlier request: see PRE below),
-- then each distinct request once (requests of the same bytes share one, as requests of
-- one limit and cost under Redis TIME do: docs/benchmarks.md, Redis, has Redis's cost per
-- argument):
-- little-endian doubles (exact integers), packed so that the script reads them with one
-- struct.unpack instead of a slow tonumber each: time mode (0: Redis TIME, read once
-- per batch; 1: the next two; +2: the request is already rejected; +4: answer a
-- receipt; +8: take back a charge; +16: give back a lease's units), now seconds, now nanoseconds, the number of checks,
-- then 11 per check: algorithm, tick (ns), limit, window (ticks), burst, r,
-- window / gcd, cost, flags (1: shadow mode, 2: quota mode, 4 x charge_rejected: 0 none,
-- 1 over_limit, 2 all, 16 x the quota group), lockout (ticks), and extra: the leaky
-- bucket's queue (1: a queue), the token bucket's and GCRA's overdraft (units; 0 for
-- the others), or 2^51 plus a token bucket's or GCRA's warm-up, M = warmup x r in the
-- check's scaled ticks (see bucket.lua).
-- Modes +4 and +8 are a Redis Cluster's, for one slot of a request spanning several,
-- alone in its call: +4 decides the request as usual (a lone check on its fast path, its
-- state read first: lone_receipt) and answers, besides the answers' string, the receipt
-- of what it changed (an array of the two strings; see driver.lua); +8 takes that charge back, the receipt being the argument after the
-- request's, and answers the checks admitted at first, decided again with cost 0.
-- Mode +16 (leased counting, a request of one check alone in its call) gives back the
-- check's cost, unspent units of a lease whose call (+4) answered the receipt that is the
-- argument after the request's (give_back_request in driver.lua).
-- KEYS, request after request: per check its state key, then its log meta key
-- (sliding log), then its lockout key (when it has a lockout).
-- Returns one string: per check, little-endian doubles (exact integers), all times in
-- the check's ticks: either -1 and five numbers, allowed (1, 0, or -2 when the script
-- failed on this request), remaining, reset_after, retry_after (-1: never) and delay
-- (-1 for an overdraft: an admission that left a bucket in debt); or,
-- for a check admitted with no retry and no delay (most answers), just remaining (never
-- negative) and reset_after. (Redis turned each integer of a table into its reply for
-- more than packing it as a double costs, and packing every check's numbers once at
-- the end costs less than a struct.pack per check; the short form saves packing three
-- numbers per admitted check: docs/benchmarks.md, Redis.)
-- All or nothing, as the in-memory store: if a check not in shadow mode is rejected,
-- every charge made by its request is taken back (lockouts stay), and the request's
-- admitted checks are decided again without charging.
-- A request of one check without lockout, not already rejected (most requests), goes
-- to its algorithm's ALONE function when it has one: the same decision and the same
-- state written, without the check table, the undo log and the calls between
-- (which cost Redis more than the two commands: with them a decision cost about twice
-- what it does on ALONE, and ALONE costs about what a script doing nothing but GET and
-- SET ... PX does; docs/benchmarks.md, Redis). The sliding log has no ALONE. Under Redis
-- TIME the requests of one limit and cost are the same argument, so a lone request's
-- unpacked arguments are kept for the rest of the call (LONE below), which saves
-- unpacking them again for each request.

-- The code run on every call (under EVAL the whole chunk runs per call; under Redis
-- Functions this is the registered function's body, and what is above it was made once
-- when the library loaded).
SLACK_MS = tonumber(ARGV[1])
CALL, PACK, UNPACK = redis.call, struct.pack, struct.unpack
local requests = tonumber(ARGV[2])
local INDEX = ARGV[3]
local byte = string.byte
local TIME_S, TIME_N
-- Set when the call asks for a receipt (mode +4): then the receipt, answered with the
-- answers.
local RECEIPT = false

-- Every key's value, read with one MGET before the first request when the call holds
-- more than one request (a GET per lone check costs Redis much more than a key more in
-- an MGET: docs/benchmarks.md, Redis). MGET answers false for a key that is missing or holds
-- another type; the fast paths write such a key only if it is still missing (SET NX),
-- so someone else's value is never overwritten. A request whose index entry has its
-- top bit set shares a key with an earlier request, whose write the value read here
-- predates: its fast path reads the key again. The general path always reads.
local PRE = nil
if requests > 1 then
  local n = #KEYS
  if n <= 1000 then
    PRE = redis.call('MGET', unpack(KEYS))
  else
    -- unpack's results live on Lua's stack, which holds about 8,000.
    PRE = {}
    for i = 1, n, 1000 do
      local j = i + 999
      if j > n then j = n end
      local part = redis.call('MGET', unpack(KEYS, i, j))
      for k = 1, #part do PRE[i + k - 1] = part[k] end
    end
  end
end

-- The answers' numbers, check after check (see the top: two for a plain admission, six
-- otherwise), packed into one string of little-endian doubles at the end: Redis turns
-- a string into its reply for far less than the integers, and one struct.pack costs
-- less than one per check.
local out, o, key = {}, 0, 1
local spread, rep = unpack, string.rep
local unpack, pack = UNPACK, PACK
-- The function deciding a lone check (made by its algorithm's ALONE), by its request's
-- argument: under Redis TIME the same argument (the same limit and cost) decides the
-- same way for the whole batch, so each distinct request is unpacked and its function
-- made once per script call, not once per request.
local LONE = {}
for q = 1, requests do
  local lo, hi = byte(INDEX, 2 * q - 1, 2 * q)
  local reread = hi >= 128
  if reread then hi = hi - 128 end
  local arg = 4 + lo + 256 * hi
  local blob = ARGV[arg]
  local lone = LONE[arg]
  local mode, NS, NN, count, pos, cost
  local forced, special, refund, wants, give = false, false, false, false, false
  if not lone then
    mode, NS, NN, count, pos = unpack('<dddd', blob)
    if mode >= 2 then
      special = true
      -- Mode +16: give back a lease's unspent units (the receipt is the argument after
      -- it).
      if mode >= 16 then
        give = true
        mode = mode - 16
      end
      -- Mode +8: take back what the request charged (Redis Cluster; the receipt is the
      -- argument after it). +4: answer a receipt too. +2: the request is already
      -- rejected (by the caller's blocked-key cache): its checks are decided and then
      -- taken back, as if one more check had been rejected.
      if mode >= 8 then
        refund = true
        mode = mode - 8
      end
      if mode >= 4 then
        wants, RECEIPT = true, true
        mode = mode - 4
      end
      if mode >= 2 then
        forced = true
        mode = mode - 2
      end
    end
    if mode == 0 then
      if not TIME_S then
        local t = redis.call('TIME')
        TIME_S, TIME_N = tonumber(t[1]), tonumber(t[2]) * 1000
      end
      NS, NN = TIME_S, TIME_N
    end
    -- A lone check with a fast path (ALONE) takes it: no tables, no undo log. So does
    -- one asking for a receipt (see lone_receipt in driver.lua).
    if count == 1 and (wants or not special) then
      local alg, tick, limit, window, burst, r, wr, flags, lockout, extra
      alg, tick, limit, window, burst, r, wr, cost, flags, lockout, extra =
        unpack('<ddddddddddd', blob, pos)
      -- A check charged when not admitted (charge_rejected) takes the general path.
      local alone = lockout == 0 and flags % 16 < 4 and ALONE[alg]
      if alone then
        lone = alone(tick, limit, window, burst, r, wr, cost, extra, NS,
          (NN - NN % tick) / tick, 1000000000 / tick)
        if mode == 0 and not wants then LONE[arg] = lone end
      end
    end
  end
  if lone then
    -- nil: not read yet (the fast path reads it).
    local raw = nil
    if PRE and not reread then raw = PRE[key] end
    local ok, a, b, c, d, e
    if wants then
      ok, a, b, c, d, e, RECEIPT = pcall(lone_receipt, lone, KEYS[key], cost)
      if not ok then RECEIPT = '' end
    else
      ok, a, b, c, d, e = pcall(lone, KEYS[key], raw)
    end
    if not ok then
      if type(a) == 'table' then a = a.err end
      redis.log(redis.LOG_WARNING, 'tollgate: a request failed: ' .. tostring(a))
      a, b, c, d, e = -2, 0, 0, 0, 0
    end
    if a == 1 and d == 0 and e == 0 then
      out[o + 1], out[o + 2] = b, c
      o = o + 2
    else
      out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5], out[o + 6] =
        -1, a, b, c, d, e
      o = o + 6
    end
    key = key + 1
  end
  if not lone then
    local checks = {}
    for i = 1, count do
      local alg, tick, limit, window, burst, r, wr, cost, flags, lockout, extra, after =
        unpack('<ddddddddddd', blob, pos)
      local charge = (flags % 16 - flags % 4) / 4
      local quota = (flags % 4 - flags % 2) / 2
      pos = after
      local c = {
        alg = alg,
        tick = tick,
        limit = limit,
        window = window,
        burst = burst,
        r = r,
        wr = wr,
        cost = cost,
        shadow = flags % 2 == 1,
        quota = quota == 1,
        group = (flags - flags % 16) / 16,
        charge = charge,
        lockout = lockout,
        queue = alg == 6 and extra == 1,
        over = 0,
        ns = NS,
        nn = (NN - NN % tick) / tick,
        tps = 1000000000 / tick,
        key = KEYS[key],
      }
      if alg ~= 6 then
        -- From WARM on: a warm-up's M (bucket.lua), never with an overdraft.
        if extra >= WARM then c.warm = extra - WARM else c.over = extra end
      end
      key = key + 1
      if alg == 3 then
        c.meta = KEYS[key]
        key = key + 1
      end
      if lockout > 0 then
        c.lock = KEYS[key]
        key = key + 1
      end
      checks[i] = c
    end

    local ok, decisions, receipt
    if give then
      ok, decisions = pcall(give_back_request, checks, count, ARGV[arg + 1])
    elseif refund then
      ok, decisions = pcall(refund_request, checks, count, ARGV[arg + 1])
    else
      ok, decisions, receipt = pcall(decide_request, checks, count, forced, RECEIPT)
      if RECEIPT then RECEIPT = receipt or '' end
    end
    if not ok then
      -- One request's failure (a key of the wrong type, say) fails that request
      -- alone: its charges are taken back and it answers -2; the batch goes on.
      pcall(undo_all)
      local e = decisions
      if type(e) == 'table' then e = e.err end
      redis.log(redis.LOG_WARNING, 'tollgate: a request failed: ' .. tostring(e))
      decisions = {}
      for i = 1, count do decisions[i] = { -2, 0, 0, 0, 0 } end
    end
    for i = 1, #decisions do
      local d = decisions[i]
      out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5], out[o + 6] =
        -1, d[1], d[2], d[3], d[4], d[5]
      o = o + 6
    end
  end
end
-- Packed at the end, at most 1,000 numbers per struct.pack (their arguments live on
-- Lua's stack).
local answers
if o <= 1000 then
  answers = pack('<' .. rep('d', o), spread(out, 1, o))
else
  local parts = {}
  for i = 1, o, 1000 do
    local j = i + 999
    if j > o then j = o end
    parts[#parts + 1] = pack('<' .. rep('d', j - i + 1), spread(out, i, j))
  end
  answers = table.concat(parts)
end
-- A call asked for a receipt (one request: a Redis Cluster call) answers it as well.
if RECEIPT then return { answers, RECEIPT } end
return answers
