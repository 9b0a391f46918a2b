-- Sliding window counter (algorithm/sliding_window.rs): the classic estimate of two
-- aligned windows, held to the true rolling count by 17 sub-window counts.
-- State, little-endian (WFMT), 192 bytes: as doubles, the instant it expires (s, ns),
-- the aligned window's end (s, ns) and the newest sub-window's start (s, ns); as 4-byte
-- integers, the previous and current counts, the 17 sub-window counts (newest first)
-- and each sub-window's last admission (its offset, rounded up to a unit: the first power
-- of ten of nanoseconds at least sub-window / (2^32 - 1), one nanosecond up to a 68 s
-- window). It starts with the instant it expires, as every state does (undo_all reads
-- the TTL from there).
-- Here a state is a table of instants relative to the check's "now", in its ticks:
-- { exp, fin (the window's end), fin_ok (end >= window), new, prev, cur, counts, lasts }.
local SW_SUB = 16
local SW_RING = 17
local SW_MARGIN = 2
local SW_UNITS = 4294967295
local WFMT = '<ddddddI4I4' ..
  'I4I4I4I4I4I4I4I4I4I4I4I4I4I4I4I4I4' ..
  'I4I4I4I4I4I4I4I4I4I4I4I4I4I4I4I4I4'

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

-- An admission x ticks into its sub-window, in units (rounded up).
local function sw_quantum(c, x, b)
  return cdiv(x, sw_unit(c, b))
end

-- Where a sub-window's last admission lies after its start, in ticks.
local function sw_offset(c, q, b)
  return q * sw_unit(c, b)
end

-- A stored state (raw bytes; false: none) as a table of relative instants.
local function sw_read(c, raw)
  local counts, lasts = {}, {}
  for i = 1, SW_RING do
    counts[i], lasts[i] = 0, 0
  end
  local st = { exp = 0, fin = 0, fin_ok = false, new = 0, prev = 0, cur = 0,
    counts = counts, lasts = lasts }
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
    local w = c.window
    local b = cdiv(w, SW_SUB)
    local at = nowmod(c, b)
    st.fin = st.exp - w
    st.fin_ok = s * c.tps + ticks_of(c, n) >= 2 * w
    st.prev, st.cur, st.new = prev, cur, -at
    counts[1], lasts[1] = cur, sw_quantum(c, at, b)
    local p = st.fin - w - 1
    if prev > 0 and p + w > 0 then
      local _, r = divmod(at + p, b)
      local d = (-at - (p - r)) / b
      local q = sw_quantum(c, r, b)
      -- An old state from a clock now behind it: held in the newest sub-window.
      if d < 0 then d, q = 0, sw_quantum(c, b - 1, b) end
      if d <= SW_SUB then
        counts[d + 1] = counts[d + 1] + prev
        if q > lasts[d + 1] then lasts[d + 1] = q end
      end
    end
    return st
  end
  local v = { UNPACK(WFMT, raw) }
  st.exp = since(c, v[1], ticks_of(c, v[2]))
  st.fin = since(c, v[3], ticks_of(c, v[4]))
  st.fin_ok = v[3] * c.tps + ticks_of(c, v[4]) >= c.window
  st.new = since(c, v[5], ticks_of(c, v[6]))
  st.prev, st.cur = v[7], v[8]
  for i = 1, SW_RING do
    counts[i], lasts[i] = v[8 + i], v[8 + SW_RING + i]
  end
  return st
end

-- The bytes of a state (relative instants) and its TTL in milliseconds.
local function sw_bytes(c, st)
  local es, en = later(c, st.exp)
  local fs, fn = later(c, st.fin)
  local ns, nn = later(c, st.new)
  local a = { es, ns_of(c, en), fs, ns_of(c, fn), ns, ns_of(c, nn), st.prev, st.cur }
  for i = 1, SW_RING do a[8 + i] = st.counts[i] end
  for i = 1, SW_RING do a[8 + SW_RING + i] = st.lasts[i] end
  local ms = SLACK_MS
  if st.exp > 0 then ms = ms + to_ms(c, st.exp) end
  if ms < 1 then ms = 1 end
  return PACK(WFMT, unpack(a)), ms
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
-- the oldest sub-windows leave first, each when its last admission leaves.
local function sw_first(st, last, w, bound, cost, cap)
  local excess = bound + cost - cap
  if excess <= 0 then return 0 end
  for i = SW_RING, 1, -1 do
    local n = st.counts[i]
    if n > 0 then
      local leaves = last[i] + w
      if leaves > 0 then
        if n >= excess then return leaves end
        excess = excess - n
      end
    end
  end
  return TWO53
end

-- The state after charging `cost` now: the window counts, then the sub-window of now
-- (the ring moved forward first; a clock that stepped back charges the newest one).
local function sw_charge(c, st, e, prev, cur, cost, b)
  local w = c.window
  local counts, lasts = {}, {}
  local empty = true
  for i = 1, SW_RING do
    counts[i], lasts[i] = st.counts[i], st.lasts[i]
    if counts[i] > 0 then empty = false end
  end
  local new = st.new
  if empty or -new >= b then
    local steps = SW_RING
    if not empty then steps = fdiv(-new, b) end
    if steps >= SW_RING then
      for i = 1, SW_RING do
        counts[i], lasts[i] = 0, 0
      end
      new = -nowmod(c, b)
    else
      for i = SW_RING, steps + 1, -1 do
        counts[i], lasts[i] = counts[i - steps], lasts[i - steps]
      end
      for i = 1, steps do
        counts[i], lasts[i] = 0, 0
      end
      new = new + steps * b
    end
  end
  counts[1] = counts[1] + cost
  if new <= 0 then
    local q = sw_quantum(c, -new, b)
    if q > lasts[1] then lasts[1] = q end
  end
  local exp = e + w
  local leaves = new + sw_offset(c, lasts[1], b) + w
  if leaves > exp then exp = leaves end
  return { exp = exp, fin = e, new = new, prev = prev, cur = cur + cost,
    counts = counts, lasts = lasts }
end

-- The first elapsed time (ticks into the window) at which
-- floor(count * (w - e) / w) <= room.
local function first_fitting(count, room, w)
  if count <= room then return 0 end
  local e = muldiv(count - room - 1, w, count) + 1
  if e > w then e = w end
  return e
end

ALG[2] = function(c, st, cost)
  local w, limit = c.window, c.limit
  -- The classic estimate.
  local aligned = w - nowmod(c, w)
  local e, prev, cur = aligned, 0, 0
  if st.exp > 0 and st.fin_ok then
    local stored = st.fin
    if stored >= aligned then
      e, prev, cur = stored, st.prev, st.cur
    elseif stored + w == aligned then
      e, prev, cur = aligned, st.cur, 0
    end
  end
  local elapsed = w - e
  if elapsed < 0 then elapsed = 0 end
  if elapsed > w then elapsed = w end
  local estimate = cur + muldiv(prev, w - elapsed, w)
  -- The bound: what sub-windows whose last admission is still in the window hold.
  local b = cdiv(w, SW_SUB)
  local bound, last = 0, {}
  for i = 1, SW_RING do
    local n = st.counts[i]
    if n > 0 then
      last[i] = st.new - (i - 1) * b + sw_offset(c, st.lasts[i], b)
      if last[i] + w > 0 then bound = bound + n end
    end
  end
  local reset = e
  if reset < 0 then reset = 0 end
  if bound + cost <= limit or (estimate + cost <= limit and bound + cost <= limit + SW_MARGIN) then
    local nst = nil
    if cost > 0 then nst = sw_charge(c, st, e, prev, cur, cost, b) end
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
  local at = sw_first(st, last, w, bound, cost, limit + SW_MARGIN)
  if by_estimate > at then at = by_estimate end
  local by_bound = sw_first(st, last, w, bound, cost, limit)
  if by_bound < at then at = by_bound end
  return { 0, remaining, reset, at, 0 }
end
READ[2], WRITE[2] = sw_read, sw_put

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
  local b = cdiv(w, SW_SUB)
  local steps, off = divmod(st.new - charged.new, b)
  if off == 0 and steps >= 0 and steps < SW_RING then
    st.counts[steps + 1] = less(st.counts[steps + 1])
  end
  if taken then return st end
  return nil
end

-- ALG[2] for a lone check (see ALONE in fixed_window.lua): ALG[2] itself, with only
-- the fields it reads, and the state read and written here.
ALONE[2] = function(tick, limit, w, _, _, _, cost, _, ns, nn, tps)
  return function(key, raw)
    if raw == nil then raw = CALL('GET', key) end
    local c = { tick = tick, limit = limit, window = w, ns = ns, nn = nn, tps = tps }
    local d, new = ALG[2](c, sw_read(c, raw), cost)
    if new then
      local state, ms = sw_bytes(c, new)
      if raw then
        CALL('SET', key, state, 'PX', px(ms))
      else
        lone_create(key, state, px(ms))
      end
    end
    return d[1], d[2], d[3], d[4], d[5]
  end
end
