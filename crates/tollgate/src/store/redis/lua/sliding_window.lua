-- Sliding window counter (algorithm/sliding_window.rs): the classic estimate of two
-- aligned windows, held to the true rolling count by 33 sub-window counts.
-- State, little-endian, 332 bytes: a header of 68 (as doubles, the instant it expires
-- (s, ns), the aligned window's end (s, ns) and the newest sub-window's start (s, ns); as
-- 4-byte integers, the previous and current counts; as a double, the sum of the
-- sub-window counts; as a 4-byte integer, the oldest slot that may hold one: none past
-- it does),
-- then 33 slots of 8, newest first: each sub-window's count and its last admission (the
-- offset from its start, rounded up to a unit: the first power of ten of nanoseconds at
-- least sub-window / (2^32 - 1), one nanosecond up to a 137 s window). It starts with the
-- instant it expires, as every state does (undo_all reads the TTL from there).
-- Only the slots a decision needs are read (struct.unpack at their offset) and only the
-- newest is written (the rest is carried over as bytes): packing and unpacking the 66
-- numbers of every slot cost Redis several times what the rest of the decision does
-- (docs/benchmarks.md, "What the sliding window's bound costs Redis").
-- The bound (see the Rust) is the sum minus the sub-windows that
-- have left the window, which are the oldest slots: a decision reads from the oldest
-- until the first one still in the window. A charge within the same window and
-- sub-window, which leaves the instant the state expires where it was, rewrites only the
-- 24 bytes that change (current count, sum, oldest, newest slot) with SETRANGE, as the
-- fixed window does. Counts stop at 2^32 - 1 (only charges past the limit, under
-- charge_rejected, can reach it), as the Rust's do.
-- Here a state is a table of instants relative to the check's "now", in its ticks:
-- { exp, fin (the window's end), fin_ok (end >= window), new, prev, cur, total, oldest,
--   ring (bytes holding the slots from offset base), base }.
-- A check's table carries the sub-window's length (b) and the unit of last admissions
-- (unit), in ticks: sw_limit sets them once per limit.
local SW_SUB = 32
local SW_RING = 33
local SW_MARGIN = 2
local SW_UNITS = 4294967295
local SW_HEAD = '<ddddddI4I4dI4'
local SW_PATCH = '<I4dI4I4I4'
local SW_U32 = 4294967295
local SW_SLOT = '<I4I4'
-- The header's length, and a slot's.
local SW_HEAD_LEN = 68
local SW_SLOT_LEN = 8

-- The unit of a sub-window's last admission, in ticks: the first power of ten of
-- nanoseconds at least sub-window / (2^32 - 1), as algorithm/sliding_window.rs has it.
-- Coarse ticks come only with windows of weeks or more, whose unit is a multiple of them.
local function sw_unit(c, b)
  local at_least = cdiv(b * c.tick, SW_UNITS)
  local unit = 1
  while unit < at_least do unit = unit * 10 end
  if unit < c.tick then return 1 end
  return unit / c.tick
end

-- Sets the check's sub-window length and unit.
local function sw_limit(c)
  c.b = cdiv(c.window, SW_SUB)
  c.unit = sw_unit(c, c.b)
  return c
end

-- Slot i (0: the newest) of a state: its count and last admission (units).
local function sw_slot(st, i)
  return UNPACK(SW_SLOT, st.ring, st.base + i * SW_SLOT_LEN + 1)
end

-- A ring of 33 slots, all empty but the newest.
local function sw_ring(count, last)
  return PACK(SW_SLOT, count, last) .. string.rep('\0', (SW_RING - 1) * SW_SLOT_LEN)
end

-- A stored state (raw bytes; false: none) as a table of relative instants.
local function sw_read(c, raw)
  local st = { exp = 0, fin = 0, fin_ok = false, new = 0, prev = 0, cur = 0, total = 0,
    oldest = 0, ring = nil, base = 0 }
  if not raw then return st end
  if #raw == 32 then
    -- A state written before the sub-windows came: {end + window: s, ns; previous;
    -- current}. Its counts go into the sub-windows as late as they can have been
    -- admitted: the previous window's at that window's end, the current window's now.
    -- So nothing is let through that the old state held back; the current count is
    -- held until the key is charged again or the old state expires.
    local s, n, prev, cur = UNPACK('<dddd', raw)
    st.exp = since(c, s, ticks_of(c, n))
    if st.exp <= 0 then return st end
    local w, b, unit = c.window, c.b, c.unit
    local at = nowmod(c, b)
    st.fin = st.exp - w
    st.fin_ok = s * c.tps + ticks_of(c, n) >= 2 * w
    st.prev, st.cur, st.new, st.total = prev, cur, -at, cur
    local counts, lasts = { cur }, { cdiv(at, unit) }
    for i = 2, SW_RING do
      counts[i], lasts[i] = 0, 0
    end
    local p = st.fin - w - 1
    if prev > 0 and p + w > 0 then
      local _, r = divmod(at + p, b)
      local d = (-at - (p - r)) / b
      local q = cdiv(r, unit)
      -- An old state from a clock now behind it: held in the newest sub-window.
      if d < 0 then d, q = 0, cdiv(b - 1, unit) end
      if d <= SW_SUB then
        counts[d + 1] = counts[d + 1] + prev
        if q > lasts[d + 1] then lasts[d + 1] = q end
        st.total, st.oldest = cur + prev, d
      end
    end
    local slots = {}
    for i = 1, SW_RING do slots[i] = PACK(SW_SLOT, counts[i], lasts[i]) end
    st.ring = table.concat(slots)
    return st
  end
  local es, en, fs, fn, ns, nn, prev, cur, total, oldest = UNPACK(SW_HEAD, raw)
  -- since(c, s, ticks_of(c, n)), written out: a Lua call costs Redis more than this
  -- arithmetic (docs/benchmarks.md, Redis).
  local tick, tps, cs, cn = c.tick, c.tps, c.ns, c.nn
  local x = en / tick
  st.exp = (es - cs) * tps + ((x - x % 1) - cn)
  x = fn / tick
  x = x - x % 1
  st.fin = (fs - cs) * tps + (x - cn)
  st.fin_ok = fs * tps + x >= c.window
  x = nn / tick
  st.new = (ns - cs) * tps + ((x - x % 1) - cn)
  st.prev, st.cur, st.total, st.oldest = prev, cur, total, oldest
  st.ring, st.base = raw, SW_HEAD_LEN
  return st
end

-- The bytes of a state (relative instants) and its TTL in milliseconds.
local function sw_bytes(c, st)
  local tick, tps, cs, cn = c.tick, c.tps, c.ns, c.nn
  -- later(c, dt), written out (see sw_read).
  local es, en = divmod(cn + st.exp, tps)
  local fs, fn = divmod(cn + st.fin, tps)
  local ns, nn = divmod(cn + st.new, tps)
  local head = PACK(SW_HEAD, cs + es, en * tick, cs + fs, fn * tick, cs + ns, nn * tick,
    st.prev, st.cur, st.total, st.oldest)
  local ms = SLACK_MS
  if st.exp > 0 then ms = ms + to_ms(c, st.exp) end
  if ms < 1 then ms = 1 end
  local ring
  if not st.count then
    -- A state as read (a refund changed it): its slots as they are.
    ring = string.sub(st.ring, st.base + 1, st.base + SW_RING * SW_SLOT_LEN)
  elseif st.src then
    ring = PACK(SW_SLOT, st.count, st.last) ..
      string.sub(st.src, st.srcbase + SW_SLOT_LEN + 1, st.srcbase + SW_RING * SW_SLOT_LEN)
  else
    ring = sw_ring(st.count, st.last)
  end
  return head .. ring, ms
end

local function sw_put(c, st)
  local bytes, ms = sw_bytes(c, st)
  CALL('SET', c.key, bytes, 'PX', px(ms))
end

-- How much more would pass now by either arm (algorithm/sliding_window.rs, `room`).
local function sw_room(estimate, bound, limit)
  local by_bound = limit - bound
  if by_bound < 0 then by_bound = 0 end
  local by_estimate = limit - estimate
  if by_estimate < 0 then by_estimate = 0 end
  local cap = limit + SW_MARGIN - bound
  if cap < 0 then cap = 0 end
  if cap < by_estimate then by_estimate = cap end
  if by_estimate > by_bound then return by_estimate end
  return by_bound
end

-- When bound + cost <= cap first holds if nothing else is admitted (relative ticks):
-- the oldest sub-windows still in the window leave first, from `from` (the oldest slot
-- still in it), each when its last admission and those of every older one have left.
local function sw_first(st, from, w, b, unit, bound, cost, cap)
  -- (w, b, unit: the check's window, sub-window and unit.)
  local excess = bound + cost - cap
  if excess <= 0 then return 0 end
  local at = 0
  if from < 0 then from = 0 end
  for i = from, 0, -1 do
    local n, q = sw_slot(st, i)
    if n > 0 then
      local leaves = st.new - i * b + q * unit + w
      if leaves > at then at = leaves end
      if n >= excess then return at end
      excess = excess - n
    end
  end
  return TWO53
end

-- The state after charging `cost` now: the window counts, then the sub-window of now
-- (the ring moved forward first; a clock that stepped back charges the newest one).
-- The state after charging `cost` now: the window counts, then the sub-window of now
-- (the ring moved forward first; a clock that stepped back charges the newest one).
-- `inplace` is set when only the current count, the sum and the newest slot changed
-- (the same window, the same sub-window, the same expiry): then `patch` holds them.
local function sw_charge(c, st, e, prev, cur, cost)
  local w, b, unit = c.window, c.b, c.unit
  local new, total, oldest = st.new, st.total, st.oldest
  -- The slots after the move, as bytes from offset `base` of `ring` (nil: all empty),
  -- or still those of the state read (`moved` false).
  local ring, base, moved = st.ring, st.base, false
  if not ring or total == 0 then
    ring, total, new, moved = nil, 0, -nowmod(c, b), true
  elseif -new >= b then
    local steps = fdiv(-new, b)
    moved = true
    if steps >= SW_RING then
      ring, total, new = nil, 0, -nowmod(c, b)
    else
      -- The `steps` oldest slots leave the ring (they have left the window).
      for i = SW_RING - steps, oldest do
        total = total - sw_slot(st, i)
      end
      oldest = oldest + steps
      if oldest > SW_SUB then oldest = SW_SUB end
      ring = string.rep('\0', steps * SW_SLOT_LEN) ..
        string.sub(st.ring, base + 1, base + (SW_RING - steps) * SW_SLOT_LEN)
      base = 0
      new = new + steps * b
    end
  end
  local count, last = 0, 0
  if ring then count, last = UNPACK(SW_SLOT, ring, base + 1) end
  if new <= 0 then
    local q = cdiv(-new, unit)
    if q > last then last = q end
  end
  local grown = count + cost
  if grown > SW_U32 then grown = SW_U32 end
  count, total = grown, total + (grown - count)
  local now_cur = cur + cost
  if now_cur > SW_U32 then now_cur = SW_U32 end
  local exp = e + w
  local leaves = new + last * unit + w
  if leaves > exp then exp = leaves end
  if not ring then oldest = 0 end
  -- The slots are made into bytes only when written whole (sw_bytes): `src`, from
  -- offset `srcbase`, holds them but for the newest, `count` and `last`.
  local nst = { exp = exp, fin = e, new = new, prev = prev, cur = now_cur, total = total,
    oldest = oldest, count = count, last = last, src = ring, srcbase = base, patch = false }
  if not moved and st.exp > 0 and exp == st.exp and e == st.fin and prev == st.prev then
    nst.patch = PACK(SW_PATCH, now_cur, total, oldest, count, last)
  end
  return nst
end

-- The first elapsed time (ticks into the window) at which
-- floor(count * (w - e) / w) <= room.
local function first_fitting(count, room, w)
  if count <= room then return 0 end
  local e = muldiv(count - room - 1, w, count) + 1
  if e > w then e = w end
  return e
end

-- The aligned window of now: its end (relative), the previous and the current count.
local function sw_counts(c, st)
  local w = c.window
  local aligned = w - nowmod(c, w)
  if st.exp > 0 and st.fin_ok then
    local stored = st.fin
    if stored >= aligned then
      return stored, st.prev, st.cur
    elseif stored + w == aligned then
      return aligned, st.cur, 0
    end
  end
  return aligned, 0, 0
end

-- A charge that did not fit (charge_rejected, algorithm/sliding_window.rs `charge`): the
-- counts pass the limit.
CHARGE[2] = function(c, st, cost)
  local e, prev, cur = sw_counts(c, st)
  return sw_charge(c, st, e, prev, cur, cost)
end

ALG[2] = function(c, st, cost)
  local w, limit = c.window, c.limit
  -- The classic estimate.
  local e, prev, cur = sw_counts(c, st)
  local elapsed = w - e
  if elapsed < 0 then elapsed = 0 end
  if elapsed > w then elapsed = w end
  local estimate = cur + muldiv(prev, w - elapsed, w)
  -- The bound: the sum of the sub-windows, less those (the oldest) whose last admission
  -- has left the window.
  local b, unit = c.b, c.unit
  local bound, from = st.total, -1
  if bound > 0 then
    local ring, base, new = st.ring, st.base, st.new
    for i = st.oldest, 0, -1 do
      local n, q = UNPACK(SW_SLOT, ring, base + i * SW_SLOT_LEN + 1)
      if n > 0 then
        if new - i * b + q * unit + w > 0 then
          from = i
          break
        end
        bound = bound - n
      end
    end
  end
  local reset = e
  if reset < 0 then reset = 0 end
  if bound + cost <= limit or (estimate + cost <= limit and bound + cost <= limit + SW_MARGIN) then
    local nst = nil
    if cost > 0 then nst = sw_charge(c, st, e, prev, cur, cost) end
    return { 1, sw_room(estimate + cost, bound + cost, limit), reset, 0, 0 }, nst
  end
  local remaining = sw_room(estimate, bound, limit)
  if cost > limit then return { 0, remaining, reset, NEVER, 0 } end
  local by_estimate
  if limit - cost >= cur then
    by_estimate = first_fitting(prev, limit - cost - cur, w) - elapsed
    if by_estimate < 0 then by_estimate = 0 end
  else
    by_estimate = (w - elapsed) + first_fitting(cur, limit - cost, w)
  end
  local at = sw_first(st, from, w, b, unit, bound, cost, limit + SW_MARGIN)
  if by_estimate > at then at = by_estimate end
  local by_bound = sw_first(st, from, w, b, unit, bound, cost, limit)
  if by_bound < at then at = by_bound end
  return { 0, remaining, reset, at, 0 }
end
READ[2] = function(c, raw) return sw_read(sw_limit(c), raw) end
WRITE[2] = sw_put

-- Takes back a charge (see REFUND in prelude.lua; both states as sw_read reads them,
-- relative to now): the cost comes off the aligned window's count it went into (the
-- current one, or the previous one once the aligned window has moved on) and off the
-- sub-window it went into (the newest one when it was charged, wherever the ring has
-- moved it since). The sub-window's last admission cannot be restored and stays, which
-- can only hold its other admissions longer.
REFUND[2] = function(c, st, charged, cost)
  if st.exp <= 0 then return nil end
  local w = c.window
  local taken = false
  local function less(n)
    local d = cost
    if d > n then d = n end
    if d > 0 then taken = true end
    return n - d
  end
  if st.fin == charged.fin then
    st.cur = less(st.cur)
  elseif st.fin == charged.fin + w then
    st.prev = less(st.prev)
  end
  local b = c.b
  local steps, off = divmod(st.new - charged.new, b)
  if off == 0 and steps >= 0 and steps < SW_RING and st.total > 0 then
    local n, q = sw_slot(st, steps)
    local m = less(n)
    if m ~= n then
      -- The slot rewritten in place among the others' bytes.
      local at = st.base + steps * SW_SLOT_LEN
      st.ring = string.sub(st.ring, st.base + 1, at) .. PACK(SW_SLOT, m, q) ..
        string.sub(st.ring, at + SW_SLOT_LEN + 1, st.base + SW_RING * SW_SLOT_LEN)
      st.base, st.total = 0, st.total - (n - m)
    end
  end
  if taken then return st end
  return nil
end

-- ALG[2] for a lone check (see ALONE in fixed_window.lua): ALG[2] itself, with only
-- the fields it reads, and the state read and written here.
ALONE[2] = function(tick, limit, w, _, _, _, cost, _, ns, nn, tps)
  local c = sw_limit({ tick = tick, limit = limit, window = w, ns = ns, nn = nn, tps = tps })
  return function(key, raw)
    if raw == nil then raw = CALL('GET', key) end
    local d, new = ALG[2](c, sw_read(c, raw), cost)
    if new then
      if new.patch and #raw > 32 then
        -- Current count, sum, oldest slot and newest slot are contiguous, from byte 52;
        -- the key keeps its TTL, as the expiry did not move.
        CALL('SETRANGE', key, '52', new.patch)
      else
        local state, ms = sw_bytes(c, new)
        if raw then
          CALL('SET', key, state, 'PX', px(ms))
        else
          lone_create(key, state, px(ms))
        end
      end
    end
    return d[1], d[2], d[3], d[4], d[5]
  end
end
