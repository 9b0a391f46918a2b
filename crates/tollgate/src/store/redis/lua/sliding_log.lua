-- Sliding window log (algorithm/sliding_log.rs). KEYS: a list of entries
-- {s, ticks, cost} (one per admitted instant, oldest first) and a meta string
-- {used, newest entry + window: s, ticks}. Charges are recorded in UNDO.
local function log_meta(c)
  local raw = redis.call('GET', c.meta)
  if raw then
    local used, es, en = struct.unpack('ddd', raw)
    return used, es, ticks_of(c, en)
  end
  return 0, 0, 0
end

local function log_save_meta(c, k, used, es, en, keep_ttl)
  local packed = struct.pack('ddd', used, es, ns_of(k, en))
  if keep_ttl then
    redis.call('SET', c.meta, packed, 'KEEPTTL')
    return
  end
  local ttl = ttl_ms(k, es, en)
  if ttl > 0 then
    local px = format('%d', ttl)
    redis.call('SET', c.meta, packed, 'PX', px)
    redis.call('PEXPIRE', c.key, px)
  else
    redis.call('DEL', c.meta, c.key)
  end
end

LOG_CHECK = function(c, cost)
  local w, limit = c.window, c.limit
  local used, es, en = log_meta(c)
  -- Never rewind: a clock that stepped back counts as the newest entry's time.
  local k = { ns = c.ns, nn = c.nn, tps = c.tps, tick = c.tick }
  local last = redis.call('LINDEX', c.key, -1)
  if last then
    local ls, ln = struct.unpack('ddd', last)
    ln = ticks_of(k, ln)
    if since(k, ls, ln) > 0 then k.ns, k.nn = ls, ln end
  end
  local popped, empty = false, false
  while true do
    local first = redis.call('LINDEX', c.key, 0)
    if not first then
      empty = true
      break
    end
    local fs, fn, fc = struct.unpack('ddd', first)
    fn = ticks_of(k, fn)
    if since(k, fs, fn) + w > 0 then break end
    redis.call('LPOP', c.key)
    used = used - fc
    popped = true
  end
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
        ls, ln, lc = struct.unpack('ddd', last)
        ln = ticks_of(k, ln)
      end
      if last and ls == k.ns and ln == k.nn then
        redis.call('LSET', c.key, -1, struct.pack('ddd', ls, ns_of(k, ln), lc + cost))
        UNDO[#UNDO + 1] = { 'log', c, k, cost, es, en, last }
      else
        redis.call('RPUSH', c.key, struct.pack('ddd', k.ns, ns_of(k, k.nn), cost))
        UNDO[#UNDO + 1] = { 'log', c, k, cost, es, en, false }
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
    local chunk = redis.call('LRANGE', c.key, at, at + 15)
    if #chunk == 0 then break end
    for i = 1, #chunk do
      local s, n, count = struct.unpack('ddd', chunk[i])
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

-- Takes back one charge of a log (newest first, as UNDO is replayed backwards).
LOG_UNDO = function(u)
  local c, k, cost, es, en, old_last = u[2], u[3], u[4], u[5], u[6], u[7]
  if old_last then
    redis.call('LSET', c.key, -1, old_last)
  else
    redis.call('RPOP', c.key)
  end
  local used = log_meta(c)
  used = used - cost
  if used <= 0 then
    redis.call('DEL', c.meta)
    if not old_last then return end
  end
  log_save_meta(c, k, used, es, en, false)
end
