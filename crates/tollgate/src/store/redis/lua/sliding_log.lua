-- Sliding window log (algorithm/sliding_log.rs). KEYS: a list of entries
-- {s, ticks, cost} (one per admitted instant, oldest first) and a meta string
-- {used, newest entry + window: s, ticks}. Charges and trimmed entries are recorded
-- in UNDO, so that a rejected request leaves the log exactly as it found it (as the
-- in-memory store restores its snapshot).
local function log_meta(c)
  local raw = CALL('GET', c.meta)
  if raw then
    local used, es, en = UNPACK('ddd', raw)
    return used, es, ticks_of(c, en), raw
  end
  return 0, 0, 0, nil
end

local function log_save_meta(c, k, used, es, en, keep_ttl)
  local packed = PACK('ddd', used, es, ns_of(k, en))
  if keep_ttl then
    -- XX: a meta key that is gone (evicted) is not recreated without a TTL.
    CALL('SET', c.meta, packed, 'XX', 'KEEPTTL')
    return
  end
  -- The TTL counts from the real "now" (c), not the clamped one (k): after a clock
  -- step back the state matters for longer, not shorter.
  local px = px(ttl_ms(c, es, en))
  CALL('SET', c.meta, packed, 'PX', px)
  CALL('PEXPIRE', c.key, px)
end

LOG_CHECK = function(c, cost)
  local w, limit = c.window, c.limit
  local used, es, en, meta_raw = log_meta(c)
  -- Never rewind: a clock that stepped back counts as the newest entry's time.
  local k = { ns = c.ns, nn = c.nn, tps = c.tps, tick = c.tick }
  local last = CALL('LINDEX', c.key, -1)
  if last then
    local ls, ln = UNPACK('ddd', last)
    ln = ticks_of(k, ln)
    if since(k, ls, ln) > 0 then k.ns, k.nn = ls, ln end
  end
  local popped, empty, gone = false, false, {}
  while true do
    local first = CALL('LINDEX', c.key, 0)
    if not first then
      empty = true
      break
    end
    local fs, fn, fc = UNPACK('ddd', first)
    fn = ticks_of(k, fn)
    if since(k, fs, fn) + w > 0 then break end
    CALL('LPOP', c.key)
    gone[#gone + 1] = first
    used = used - fc
    popped = true
  end
  if popped and MULTI then UNDO[#UNDO + 1] = { 'logpop', c, gone, meta_raw } end
  if empty then
    used = 0
    last = nil
  end
  local reset = since(k, es, en)
  if reset < 0 then reset = 0 end
  if cost > limit then
    local remaining = limit - used
    if remaining < 0 then remaining = 0 end
    if popped then log_save_meta(c, k, used, es, en, true) end
    return { 0, remaining, reset, NEVER, 0 }
  end
  if used + cost <= limit then
    if cost > 0 then
      local ls, ln, lc
      if last then
        ls, ln, lc = UNPACK('ddd', last)
        ln = ticks_of(k, ln)
      end
      if last and ls == k.ns and ln == k.nn then
        CALL('LSET', c.key, -1, PACK('ddd', ls, ns_of(k, ln), lc + cost))
        UNDO[#UNDO + 1] = { 'log', c, k, used, es, en, last, meta_raw ~= nil }
      else
        CALL('RPUSH', c.key, PACK('ddd', k.ns, ns_of(k, k.nn), cost))
        UNDO[#UNDO + 1] = { 'log', c, k, used, es, en, false, meta_raw ~= nil }
      end
      used = used + cost
      es, en = later(k, w)
      log_save_meta(c, k, used, es, en, false)
    elseif popped then
      log_save_meta(c, k, used, es, en, true)
    end
    local left = since(k, es, en)
    if left < 0 then left = 0 end
    return { 1, limit - used, left, 0, 0 }
  end
  if popped then log_save_meta(c, k, used, es, en, true) end
  -- Retry when the oldest entries covering the excess have left the window.
  local excess, retry, at = used + cost - limit, 0, 0
  while excess > 0 do
    local chunk = CALL('LRANGE', c.key, at, at + 15)
    if #chunk == 0 then break end
    for i = 1, #chunk do
      local s, n, count = UNPACK('ddd', chunk[i])
      n = ticks_of(k, n)
      retry = since(k, s, n) + w
      excess = excess - count
      if excess <= 0 then break end
    end
    at = at + #chunk
  end
  local remaining = limit - used
  if remaining < 0 then remaining = 0 end
  return { 0, remaining, reset, retry, 0 }
end

-- Takes back one change to a log (newest first, as UNDO is replayed backwards): a
-- charge, or entries trimmed from its front.
LOG_UNDO = function(u)
  if u[1] == 'logpop' then
    local c, gone, meta_raw = u[2], u[3], u[4]
    for i = #gone, 1, -1 do CALL('LPUSH', c.key, gone[i]) end
    if meta_raw then
      local _, es, en = UNPACK('ddd', meta_raw)
      local px = px(ttl_ms(c, es, ticks_of(c, en)))
      CALL('SET', c.meta, meta_raw, 'PX', px)
      CALL('PEXPIRE', c.key, px)
    end
    return
  end
  -- The meta as it was before the charge (its end of window included, which the
  -- decision's reset_after reports even once the log is empty).
  local c, k, used, es, en, old_last, had_meta = u[2], u[3], u[4], u[5], u[6], u[7], u[8]
  if old_last then
    CALL('LSET', c.key, -1, old_last)
  else
    CALL('RPOP', c.key)
  end
  if had_meta then
    log_save_meta(c, k, used, es, en, false)
  else
    CALL('DEL', c.meta)
  end
end
