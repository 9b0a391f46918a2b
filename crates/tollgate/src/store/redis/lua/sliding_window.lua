-- Sliding window counter (algorithm/sliding_window.rs):
-- state {window end + one window: s, ticks; previous count; current count}.

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
  local aligned = w - nowmod(c, w)
  local expires = since(c, st[1], st[2])
  local e, prev, cur = aligned, 0, 0
  if expires > 0 and st[1] * c.tps + st[2] >= w then
    local stored = expires - w
    if stored >= aligned then
      e, prev, cur = stored, st[3], st[4]
    elseif stored + w == aligned then
      e, prev, cur = aligned, st[4], 0
    end
  end
  local elapsed = w - e
  if elapsed < 0 then elapsed = 0 end
  if elapsed > w then elapsed = w end
  local estimate = cur + muldiv(prev, w - elapsed, w)
  local reset = e
  if reset < 0 then reset = 0 end
  if estimate + cost <= limit then
    local nst = nil
    if cost > 0 then
      local s, n = later(c, e + w)
      nst = { s, n, prev, cur + cost }
    end
    return { 1, limit - estimate - cost, reset, 0, 0 }, nst
  end
  local remaining = limit - estimate
  if remaining < 0 then remaining = 0 end
  if cost > limit then return { 0, remaining, reset, NEVER, 0 } end
  local retry
  if limit - cost >= cur then
    retry = first_fitting(prev, limit - cost - cur, w) - elapsed
    if retry < 0 then retry = 0 end
  else
    retry = (w - elapsed) + first_fitting(cur, limit - cost, w)
  end
  return { 0, remaining, reset, retry, 0 }
end

-- ALG[2] for a lone check (see ALONE in fixed_window.lua): ALG[2] itself, with only
-- the fields it reads, and the state read and written here.
ALONE[2] = function(tick, limit, w, _, _, _, cost, _, ns, nn, tps)
  return function(key, raw)
    if raw == nil then raw = CALL('GET', key) end
    local c = { tick = tick, limit = limit, window = w, ns = ns, nn = nn, tps = tps }
    local st = { 0, 0, 0, 0 }
    if raw then
      local s, sn, prev, cur = UNPACK('dddd', raw)
      local y = sn / tick
      st = { s, y - y % 1, prev, cur }
    end
    local d, new = ALG[2](c, st, cost)
    if new then
      local ms = ttl_ms(c, new[1], new[2])
      local state = PACK('dddd', new[1], new[2] * tick, new[3], new[4])
      if raw then
        CALL('SET', key, state, 'PX', px(ms))
      else
        lone_create(key, state, px(ms))
      end
    end
    return d[1], d[2], d[3], d[4], d[5]
  end
end
