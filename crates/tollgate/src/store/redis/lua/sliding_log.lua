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
        UNDO[#UNDO + 1] = { 'log', c, k, used, es, en, last, meta_raw ~= nil, meta_raw }
      else
        CALL('RPUSH', c.key, PACK('ddd', k.ns, ns_of(k, k.nn), cost))
        UNDO[#UNDO + 1] = { 'log', c, k, used, es, en, false, meta_raw ~= nil, meta_raw }
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

-- Logs a charge that did not fit (`charge_rejected`, algorithm/sliding_log.rs `charge`):
-- an entry at now (or the newest entry's instant, after a clock step back), whatever the
-- log holds; nothing is trimmed. It is never taken back; it is recorded in UNDO (marked
-- as made anyway) only so that a cluster's receipt can put the log back whole before the
-- refund makes it again (driver.lua's `replay`), and a request that fails leaves nothing.
LOG_CHARGE = function(c, cost)
  local used, es, en, meta_raw = log_meta(c)
  -- The log's total stops at CHARGED_MAX, as the Rust's does.
  if used + cost > CHARGED_MAX then cost = CHARGED_MAX - used end
  if cost <= 0 then return end
  local k = { ns = c.ns, nn = c.nn, tps = c.tps, tick = c.tick }
  local last = CALL('LINDEX', c.key, -1)
  local ls, ln, lc
  if last then
    ls, ln, lc = UNPACK('ddd', last)
    ln = ticks_of(k, ln)
    if since(k, ls, ln) > 0 then k.ns, k.nn = ls, ln end
  end
  if last and ls == k.ns and ln == k.nn then
    CALL('LSET', c.key, -1, PACK('ddd', ls, ns_of(k, ln), lc + cost))
    UNDO[#UNDO + 1] = { 'log', c, k, used, es, en, last, meta_raw ~= nil, meta_raw, true }
  else
    CALL('RPUSH', c.key, PACK('ddd', k.ns, ns_of(k, k.nn), cost))
    UNDO[#UNDO + 1] = { 'log', c, k, used, es, en, false, meta_raw ~= nil, meta_raw, true }
  end
  local ns, nn = later(k, c.window)
  log_save_meta(c, k, used + cost, ns, nn, false)
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

-- Takes back a charge on a Redis Cluster (driver.lua's refund_request; `r` is the
-- charge's record: r.cost, what is to be taken back, and r.keep, 1 when charges that
-- stay (charge_rejected: all) were made too, plus 2 when charges were made anyway for
-- checks not admitted (r.cost 0 and keep 0: entries were trimmed, nothing charged); the log as the request left it (r.meta_new, r.tail_new,
-- r.llen), and as it found it (r.meta_old, r.old_last, r.gone: the entries trimmed,
-- false when there were too many to carry)). When the log is still exactly as the
-- request left it, it is put back as it was, trimmed entries included (as the general
-- path's undo does), and true is answered: the caller makes the charges that stay
-- again. Otherwise others have changed it since: only this request's cost comes off
-- its entry, the one at the charge's instant (entries are in time order, one per
-- instant), and off the meta's total.
REFUND[3] = function(c, r)
  local meta = CALL('GET', c.meta)
  if r.gone and meta == r.meta_new and CALL('LINDEX', c.key, -1) == r.tail_new
      and CALL('LLEN', c.key) == r.llen then
    if r.cost <= 0 and r.keep == 0 then
      -- Entries trimmed only: nothing charged.
    elseif r.old_last then
      CALL('LSET', c.key, -1, r.old_last)
    else
      CALL('RPOP', c.key)
    end
    for i = #r.gone, 1, -1 do CALL('LPUSH', c.key, r.gone[i]) end
    if r.meta_old then
      local _, es, en = UNPACK('ddd', r.meta_old)
      local px = px(ttl_ms(c, es, ticks_of(c, en)))
      CALL('SET', c.meta, r.meta_old, 'PX', px)
      CALL('PEXPIRE', c.key, px)
    else
      CALL('DEL', c.meta)
    end
    return true
  end
  if not meta or r.cost <= 0 then return false end
  local ks, kn = UNPACK('dd', r.tail_new)
  local n = CALL('LLEN', c.key)
  local at, entry = nil, nil
  local j = n - 1
  while j >= 0 and not at do
    local from = j - 15
    if from < 0 then from = 0 end
    local chunk = CALL('LRANGE', c.key, from, j)
    for i = #chunk, 1, -1 do
      local s, ns = UNPACK('dd', chunk[i])
      if s == ks and ns == kn then
        at, entry = from + i - 1, chunk[i]
        break
      end
      -- Older than the charge: its entry is gone (trimmed).
      if s < ks or (s == ks and ns < kn) then
        j = -1
        break
      end
    end
    if j >= 0 then j = from - 1 end
  end
  if not at then return false end
  local _, _, ec = UNPACK('ddd', entry)
  local d = r.cost
  if d > ec then d = ec end
  if ec > d then
    CALL('LSET', c.key, at, PACK('ddd', ks, kn, ec - d))
  elseif at == n - 1 then
    CALL('RPOP', c.key)
  else
    -- No entry is this short: LREM removes exactly the one marked.
    CALL('LSET', c.key, at, 'tollgate:refund')
    CALL('LREM', c.key, 1, 'tollgate:refund')
  end
  local used, es, en = UNPACK('ddd', meta)
  used = used - d
  if used < 0 then used = 0 end
  CALL('SET', c.meta, PACK('ddd', used, es, en), 'XX', 'KEEPTTL')
  return false
end
