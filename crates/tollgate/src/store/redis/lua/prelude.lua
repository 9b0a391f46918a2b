-- Tollgate Redis scripts: shared arithmetic and instants.
--
-- Lua numbers are doubles, exact for integers below 2^53. The caller (Rust) chooses
-- for every check a tick (1 ns, 1 us, 1 ms or 1 s) small enough that every quantity below
-- stays under 2^52 ticks, so that these scripts decide exactly what the pure Rust
-- algorithms decide. Instants are kept as (seconds, ticks within the second): an
-- absolute time in nanoseconds (about 1.7e18) would not fit in a double.
-- No global (math, string, struct, redis) is read outside a function: Redis Functions
-- load a library where only `redis.register_function` may be reached.
local NEVER = -1
-- redis.call, struct.pack and struct.unpack, set by call.lua at the start of every call
-- (they may not be read here, see above): an upvalue is read for a few instructions,
-- where a global's field costs Redis two table lookups (docs/benchmarks.md, Redis).
local CALL, PACK, UNPACK
local TWO53 = 9007199254740992
-- A check's last argument from this on is a token bucket's or GCRA's warm-up (bucket.lua).
local WARM = 2251799813685248
-- Where charges past the limit stop counting (algorithm/fixed_window.rs CHARGED_MAX).
local CHARGED_MAX = 2251799813685248
-- Set per call (call.lua) and by the general path (driver.lua): extra milliseconds on
-- every TTL, the charges to take back, and the sliding log's hooks (when the script
-- includes it).
local SLACK_MS = 0
local UNDO = {}
local ALG = {}
-- Per algorithm code, optionally: the same decision for a request of one check with
-- no lockout, written out without the driver's tables and calls (see driver.lua).
local ALONE = {}
-- Per algorithm code, optionally: how its state is read and written by the general path
-- (driver.lua), when it is not the four doubles every other state is.
local READ, WRITE = {}, {}
-- Per algorithm code: how a charge is taken back from a state that others have changed
-- since (Redis Cluster, see driver.lua's refund_request): function(c, st, charged, cost),
-- `st` the state now, `charged` the state the charge left (both as READ gives them),
-- `cost` what the request charged; it returns the state to write, or nil to leave it.
-- It subtracts that request's charge and nothing else (other requests may have charged
-- the key in between), never below what the key would hold without the charge.
local REFUND = {}
local LOG_CHECK = nil
local LOG_UNDO = nil
-- Per algorithm code: the state after charging a check that was not admitted
-- (`charge_rejected`), past its limit: function(c, st, cost) -> the state to write, as
-- ALG's. The sliding log's is LOG_CHARGE(c, cost), which writes it.
local CHARGE = {}
local LOG_CHARGE = nil
-- Whether the request being decided has several checks: only then does a rejection
-- restore a snapshot (the in-memory store's check of a lone key has nothing to undo).
local MULTI = false

-- q, r with a = q * b + r and 0 <= r < b, exact for integers a, b below 2^53.
-- (x - x % 1 is floor(x), without a call to math.floor: Lua's % is floored.)
local function divmod(a, b)
  local x = a / b
  local q = x - x % 1
  local r = a - q * b
  if r < 0 then
    q = q - 1
    r = r + b
  elseif r >= b then
    q = q + 1
    r = r - b
  end
  return q, r
end

-- floor(a / b) and ceil(a / b): divmod written out, as these two are called several
-- times per decision and a Lua call costs Redis more than the division it makes
-- (docs/benchmarks.md, Redis).
local function fdiv(a, b)
  local x = a / b
  local q = x - x % 1
  local r = a - q * b
  if r < 0 then
    q = q - 1
  elseif r >= b then
    q = q + 1
  end
  return q
end

local function cdiv(a, b)
  local x = a / b
  local q = x - x % 1
  local r = a - q * b
  if r < 0 then
    r = r + b
    q = q - 1
  elseif r >= b then
    r = r - b
    q = q + 1
  end
  if r > 0 then q = q + 1 end
  return q
end

-- The bits of a non-negative integer, least significant first.
local function bits_of(a)
  local bits = {}
  while a > 0 do
    local q, r = divmod(a, 2)
    bits[#bits + 1] = r
    a = q
  end
  return bits
end

-- (a * b) mod m, exact for m below 2^51 even when a * b is not representable.
local function mulmod(a, b, m)
  local _, ra = divmod(a, m)
  local _, rb = divmod(b, m)
  if ra * rb < TWO53 then
    local _, r = divmod(ra * rb, m)
    return r
  end
  local bits, r = bits_of(ra), 0
  for i = #bits, 1, -1 do
    r = r * 2
    if r >= m then r = r - m end
    if bits[i] == 1 then
      r = r + rb
      if r >= m then r = r - m end
    end
  end
  return r
end

-- floor(a * b / c), exact for a, b, c below 2^51 when the result is below 2^53.
local function muldiv(a, b, c)
  if a * b < TWO53 then return fdiv(a * b, c) end
  -- a * b / c = a * qb + a * rb / c with b = qb * c + rb; the second term is built
  -- bit by bit of a so that no intermediate exceeds 2 * c.
  local qb, rb = divmod(b, c)
  local q, r = 0, 0
  local bits = bits_of(a)
  for i = #bits, 1, -1 do
    q = q * 2
    r = r * 2
    if r >= c then
      r = r - c
      q = q + 1
    end
    if bits[i] == 1 then
      r = r + rb
      if r >= c then
        r = r - c
        q = q + 1
      end
    end
  end
  return a * qb + q
end

-- An instant minus the check's "now", in the check's ticks.
local function since(c, s, n)
  return (s - c.ns) * c.tps + (n - c.nn)
end

-- The instant `dt` ticks after the check's "now", as (seconds, ticks).
local function later(c, dt)
  local q, r = divmod(c.nn + dt, c.tps)
  return c.ns + q, r
end

-- now mod w (ticks): where "now" falls in an epoch-aligned window of w ticks.
local function nowmod(c, w)
  local q, r = divmod(w, c.tps)
  if r == 0 then
    local _, sr = divmod(c.ns, q)
    return sr * c.tps + c.nn
  end
  local _, m = divmod(mulmod(c.ns, c.tps, w) + c.nn, w)
  return m
end

-- Stored instants keep their sub-second part in nanoseconds, whatever the tick, so a
-- reload that moves a limit to another tick still reads its state right.
local function ticks_of(c, ns)
  local x = ns / c.tick
  return x - x % 1
end
local function ns_of(c, ticks) return ticks * c.tick end

-- A number of milliseconds as the text of a PX argument. Redis turns a number
-- argument into text slowly, and string.format is not cheap either: the text of the
-- last TTL is kept, since the checks of a batch often share their window's end.
local LAST_MS, LAST_PX = -1, '0'
local function px(ms)
  if ms ~= LAST_MS then
    LAST_MS, LAST_PX = ms, string.format('%d', ms)
  end
  return LAST_PX
end

-- A duration in the check's ticks as whole milliseconds, rounded up.
local function tick_to_ms(tick, dt)
  if tick >= 1000000 then return dt * (tick / 1000000) end
  return cdiv(dt, 1000000 / tick)
end
local function to_ms(c, dt) return tick_to_ms(c.tick, dt) end

-- Milliseconds (rounded up, plus the caller's slack, at least 1) until an instant: a
-- key's TTL. A state that is already fresh is kept for the slack too, so that a clock
-- stepping back by less than the slack finds it as the in-memory store would.
local function ttl_ms(c, s, n)
  local dt = since(c, s, n)
  local ms = SLACK_MS
  if dt > 0 then ms = ms + to_ms(c, dt) end
  if ms < 1 then ms = 1 end
  return ms
end

-- A lone check's state: `raw` as read before the first request (MGET, see PRE in
-- driver.lua; false: none), or, when that was not read (nil), GET now. Written out in
-- each fast path, as are the writes below: a call to a helper function would cost
-- Redis more than writing it out (docs/benchmarks.md, Redis).
--   if raw == nil then raw = CALL('GET', key) end

-- Writes a lone check's new state (TTL `ms`, text) where no state was read (raw
-- false): only if the key is still missing (NX). MGET answers false for a key holding
-- another type too, and such a key is someone else's: the request fails (as GET's
-- WRONGTYPE makes it fail) rather than overwrite it. Where a state was read, the fast
-- paths SET ... PX it, or where its TTL stays, SETRANGE it in place (cheaper for Redis
-- than SET ... KEEPTTL, which makes a new value: docs/benchmarks.md, Redis).
local function lone_create(key, state, ms)
  if not CALL('SET', key, state, 'PX', ms, 'NX') then
    error('tollgate: ' .. key .. ' holds a value that is not a Tollgate state')
  end
end
