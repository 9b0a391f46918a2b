-- The arithmetic the bucket algorithms share (algorithm/bucket.rs): the token bucket,
-- GCRA and the leaky bucket keep one exact instant (see bucket_state) and decide a
-- request the same way from how far it is ahead of now. Each algorithm's file maps
-- itself onto bucket_alg and bucket_alone. In the script when the set holds one of
-- them. Quantities are scaled by r = limit / gcd, in the check's ticks.

-- The exact instant now + x / r (x, r in the check's scaled ticks) as a bucket state:
-- {whole seconds, ticks, deficit}, the instant being ticks - deficit / r.
local function bucket_state(c, x)
  local whole = cdiv(x, c.r)
  local s, n = later(c, whole)
  return { s, n, whole * c.r - x, 0 }
end

-- The scaled distance from now to a bucket state's instant (negative when past).
local function bucket_ahead(c, st)
  local ahead = since(c, st[1], st[2])
  if ahead < 0 then return ahead end
  return ahead * c.r - st[3]
end

-- Warm-up (algorithm/bucket.rs, "Warm-up"; token bucket and GCRA, never with an
-- overdraft). The check's `extra` from WARM on is a warm-up: its M = warmup x r (in the
-- check's scaled ticks) is extra - WARM (call.lua sets c.warm). The state is the exact
-- instant the key is fresh again (full and fully cold), as bucket_state keeps one, and
-- in its 4th slot `used`: how far from fully cold the key is at its bucket's instant,
-- which is the fresh instant less used / r. (WARM is the prelude's.)

-- A warm state's bucket instant ahead of now (at least 0) and how far from fully cold
-- the key is now: two stable intervals (2 wr, the grace) past its bucket's instant, a
-- key cools by r per tick. The fresh instant is the bucket's plus the grace plus used / r.
local function warm_read(c, st)
  local d = since(c, st[1], st[2])
  if d < 0 then return 0, 0 end
  local f = d * c.r - st[3]
  if f <= 0 then return 0, 0 end
  local u = st[4]
  local x = f - u - 2 * c.wr
  if x < 0 then x = 0 end
  if u > f then u = f end
  return x, u
end

-- The warm state whose bucket instant is x past now, the key used u from fully cold.
local function warm_state(c, x, u)
  local st = bucket_state(c, x + 2 * c.wr + u)
  st[4] = u
  return st
end

-- The time beyond `need` an admission of `need` takes from a key `u` from fully cold,
-- `m` its M: (A - B)(A + B) / 2M rounded up, with A = max(0, M - 2u) and
-- B = max(0, A - 2 need) (the products pass 2^53: muldiv and mulmod, exact below 2^51).
local function warm_extra(m, u, need)
  local a = m - 2 * u
  if a <= 0 then return 0 end
  local b = a - 2 * need
  if b < 0 then b = 0 end
  local p, q = a - b, a + b
  local e = muldiv(p, q, 2 * m)
  if mulmod(p, q, 2 * m) ~= 0 then e = e + 1 end
  return e
end

-- The decision of a bucket with a warm-up (algorithm/bucket.rs `check_warm`): x, u as
-- warm_read gives them, `m` the warm-up's M, `empties` as bucket_decide's. A request
-- fits as in the bucket; admitted, the instant moves by need plus warm_extra and the
-- key is used by need more (at most m). Returns the decision's five numbers, then the
-- new x and u (nil: nothing to store).
local function warm_decide(x, u, cost, burst, r, wr, m, empties)
  local capacity = burst * wr
  local need = cost * wr
  local filled = x
  if empties and filled > capacity then filled = capacity end
  if filled + need <= capacity then
    local after = filled + need
    if cost <= 0 then return 1, fdiv(capacity - after, wr), cdiv(after, r), 0, 0 end
    after = after + warm_extra(m, u, need)
    u = u + need
    if u > m then u = m end
    local room = capacity - after
    if room < 0 then room = 0 end
    return 1, fdiv(room, wr), cdiv(after, r), 0, 0, after, u
  end
  local room = capacity - x
  if room < 0 then room = 0 end
  local retry = NEVER
  if cost <= burst then retry = cdiv(x + need - capacity, r) end
  return 0, fdiv(room, wr), cdiv(x, r), retry, 0
end

-- For a lone bucket check (ALONE): bucket_ahead of a state as read (false: none),
-- clamped at 0 as every bucket algorithm clamps it.
local function lone_bucket_ahead(raw, tick, ns, nn, tps, r)
  if not raw then return 0 end
  local s, sn, deficit = UNPACK('ddd', raw)
  local y = sn / tick
  local ahead = (s - ns) * tps + ((y - y % 1) - nn)
  if ahead < 0 then return 0 end
  return ahead * r - deficit
end

-- For a lone bucket check: writes bucket_state(x) as put_state would, with its TTL,
-- over `raw` (the state read; false: none); `used` the 4th slot (a warm-up's; nil: 0).
local function lone_bucket_put(key, raw, x, tick, ns, nn, tps, r, used)
  local whole = cdiv(x, r)
  local q, n = divmod(nn + whole, tps)
  local ms = SLACK_MS
  if whole > 0 then ms = ms + tick_to_ms(tick, whole) end
  if ms < 1 then ms = 1 end
  local state = PACK('dddd', ns + q, n * tick, whole * r - x, used or 0)
  if raw then
    CALL('SET', key, state, 'PX', px(ms))
  else
    lone_create(key, state, px(ms))
  end
end

-- A bucket's charge that did not fit (CHARGE[4], [5], [6]; `charge_rejected`,
-- algorithm/*.rs `charge`): the exact instant moves later by the cost, past the
-- bucket's capacity (a debt of at most one bucket: algorithm/bucket.rs `charged`),
-- at most two tolerances ((burst + overdraft) x wr) ahead, and never earlier.
local function bucket_charge(c, st, cost)
  if c.limit == 0 then return nil end
  local x, u = nil, 0
  -- A warm-up's key gets no warmer: only its bucket's instant moves.
  if c.warm then
    x, u = warm_read(c, st)
  else
    x = bucket_ahead(c, st)
  end
  if x < 0 then x = 0 end
  local new, most = x + cost * c.wr, 2 * (c.burst + c.over) * c.wr
  if new > most then new = most end
  -- Never earlier than it was (algorithm/bucket.rs `charged`).
  if new < x then new = x end
  if c.warm then return warm_state(c, new, u) end
  return bucket_state(c, new)
end

-- A bucket's refund (REFUND[4], [5], [6]): the exact instant moved back by the
-- request's cost x window / limit (cost x wr in the scaled units), but by no more than
-- the charge still holds: `charged` is the instant the charge left, and a charge is
-- spent by now as far as that instant is past. Others' charges since then (each at
-- most now) only add on top of it, so what is taken back is never more than what the
-- state holds because of this request: never below the state without the charge.
local function bucket_refund(c, st, charged, cost)
  if c.limit == 0 then return nil end
  local held, x, u
  -- A warm-up's instant moves back by the cost alone (the extra time it took stays,
  -- as does how warm the key is: never below the state without the charge).
  if c.warm then
    held = warm_read(c, charged)
    x, u = warm_read(c, st)
  else
    held = bucket_ahead(c, charged)
    x = bucket_ahead(c, st)
  end
  if held <= 0 then return nil end
  if x <= 0 then return nil end
  local d = cost * c.wr
  if d > held then d = held end
  x = x - d
  if x < 0 then x = 0 end
  if c.warm then return warm_state(c, x, u) end
  return bucket_state(c, x)
end

-- The decision of a bucket (algorithm/bucket.rs `Bucket::check`): `x` how far the
-- state's instant is ahead of now (at least 0), the check's burst, overdraft, r and
-- window / gcd. A request fits within the tolerance, (burst + overdraft) x wr; what is
-- left is counted against the capacity, burst x wr.
-- `empties`: a debt (x past the tolerance) leaves the bucket empty, so a cost of 0 still
-- fits it (the token bucket); otherwise a debt rejects any cost. `queue`: an admitted
-- request waits for x to drain (the leaky bucket's queue). Returns the decision's five
-- numbers, then the scaled distance from now of the instant to store (nil: none). An
-- admission of a cost above 0 that leaves the bucket in debt (past the capacity: an
-- overdraft) answers -1 as its delay, which no queue answers (call.lua).
local function bucket_decide(x, cost, burst, over, r, wr, empties, queue)
  local capacity = burst * wr
  local tolerance = (burst + over) * wr
  local need = cost * wr
  local filled = x
  if empties and filled > tolerance then filled = tolerance end
  if filled + need <= tolerance then
    local after = filled + need
    local new = nil
    if cost > 0 then new = after end
    local delay = 0
    if queue then delay = cdiv(x, r) end
    local room = capacity - after
    if room < 0 then
      room = 0
      if cost > 0 then delay = -1 end
    end
    return 1, fdiv(room, wr), cdiv(after, r), 0, delay, new
  end
  -- A cost above the burst and overdraft never fits; the answer still says what is left.
  local room = capacity - x
  if room < 0 then room = 0 end
  local retry = NEVER
  if cost <= burst + over then retry = cdiv(x + need - tolerance, r) end
  return 0, fdiv(room, wr), cdiv(x, r), retry, 0
end

-- ALG[alg] of a bucket algorithm (the general path, driver.lua), `empties` as
-- bucket_decide's.
local function bucket_alg(empties)
  return function(c, st, cost)
    if c.limit == 0 then return { 0, 0, 0, NEVER, 0 } end
    if c.warm then
      local x, u = warm_read(c, st)
      local a, b, d, e, f, nx, nu = warm_decide(x, u, cost, c.burst, c.r, c.wr, c.warm, empties)
      local nst = nil
      if nx then nst = warm_state(c, nx, nu) end
      return { a, b, d, e, f }, nst
    end
    local x = bucket_ahead(c, st)
    if x < 0 then x = 0 end
    local a, b, d, e, f, new = bucket_decide(x, cost, c.burst, c.over, c.r, c.wr, empties, c.queue)
    local nst = nil
    if new then nst = bucket_state(c, new) end
    return { a, b, d, e, f }, nst
  end
end

-- ALONE[alg] of a bucket algorithm (a lone check, with its state read and written
-- here: see ALONE in fixed_window.lua), `empties` as bucket_decide's. `extra` is the
-- check's last argument: the leaky bucket's queue (`leaky`: 1 for a queue), the token
-- bucket's and GCRA's overdraft otherwise (or, from WARM on, a warm-up's M).
local function bucket_alone(empties, leaky)
  return function(tick, limit, _, burst, r, wr, cost, extra, ns, nn, tps)
    if not leaky and extra >= WARM then
      -- A warm-up (warm_read, warm_decide and warm_state written out).
      local m = extra - WARM
      return function(key, raw)
        if limit == 0 then return 0, 0, 0, NEVER, 0 end
        if raw == nil then raw = CALL('GET', key) end
        local x, u = 0, 0
        if raw then
          local s, sn, deficit, used = UNPACK('dddd', raw)
          local y = sn / tick
          local d = (s - ns) * tps + ((y - y % 1) - nn)
          if d >= 0 then
            local f = d * r - deficit
            if f > 0 then
              u = used
              x = f - u - 2 * wr
              if x < 0 then x = 0 end
              if u > f then u = f end
            end
          end
        end
        local a, b, c, d, e, nx, nu = warm_decide(x, u, cost, burst, r, wr, m, empties)
        if nx then lone_bucket_put(key, raw, nx + 2 * wr + nu, tick, ns, nn, tps, r, nu) end
        return a, b, c, d, e
      end
    end
    local queue, over = false, extra
    if leaky then queue, over = extra == 1, 0 end
    return function(key, raw)
      if limit == 0 then return 0, 0, 0, NEVER, 0 end
      if raw == nil then raw = CALL('GET', key) end
      local x = lone_bucket_ahead(raw, tick, ns, nn, tps, r)
      local a, b, c, d, e, new = bucket_decide(x, cost, burst, over, r, wr, empties, queue)
      if new then lone_bucket_put(key, raw, new, tick, ns, nn, tps, r) end
      return a, b, c, d, e
    end
  end
end
