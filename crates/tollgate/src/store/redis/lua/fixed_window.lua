-- Fixed window (algorithm/fixed_window.rs): state {end s, end ticks, count, -}.
ALG[1] = function(c, st, cost)
  local w, limit = c.window, c.limit
  local e, count = since(c, st[1], st[2]), st[3]
  local es, en = st[1], st[2]
  if e <= 0 then
    count = 0
    e = w - nowmod(c, w)
    es, en = later(c, e)
  end
  local new = count + cost
  if new <= limit then
    local nst = nil
    if cost > 0 then nst = { es, en, new, 0 } end
    return { 1, limit - new, e, 0, 0 }, nst
  end
  local retry = e
  if cost > limit then retry = NEVER end
  local remaining = limit - count
  if remaining < 0 then remaining = 0 end
  return { 0, remaining, e, retry, 0 }
end

-- Takes back a charge (see REFUND in prelude.lua): the count goes down by the cost
-- while the stored window is still the one charged; a later window holds nothing of it.
REFUND[1] = function(c, st, charged, cost)
  if st[1] ~= charged[1] or st[2] ~= charged[2] then return nil end
  if since(c, st[1], st[2]) <= 0 then return nil end
  local count = st[3] - cost
  if count < 0 then count = 0 end
  return { st[1], st[2], count, 0 }
end

-- A charge that did not fit (`charge_rejected`, algorithm/fixed_window.rs `charge`):
-- the window's count passes the limit.
CHARGE[1] = function(c, st, cost)
  local w = c.window
  local es, en, count = st[1], st[2], st[3]
  if since(c, es, en) <= 0 then
    count = 0
    es, en = later(c, w - nowmod(c, w))
  end
  count = count + cost
  if count > CHARGED_MAX then count = CHARGED_MAX end
  return { es, en, count, 0 }
end

-- ALG[1] for a lone check (no lockout, not already rejected), with its state read and
-- written here: the decision's five numbers, as ALG[1] and the driver would give them.
-- Most requests are this, and the driver's tables and calls cost more than the two
-- Redis commands. ALONE[alg] is called with a request's check (tick, limit, window,
-- burst, r, window / gcd, cost, queue, and now: seconds, ticks, ticks per second) and
-- returns the function that decides it for a key: function(key, raw), `raw` being the
-- state read before the first request (see PRE in call.lua; false: none), or nil when it
-- was not read. The check's numbers are the function's upvalues, so a batch of requests
-- of one limit makes it once and calls it with two arguments per request, instead of
-- thirteen read from a table, which costs Redis more (docs/benchmarks.md, Redis).
ALONE[1] = function(tick, limit, w, _, _, _, cost, _, ns, nn, tps)
  return function(key, raw)
    if raw == nil then raw = CALL('GET', key) end
    local es, en, count = 0, 0, 0
    if raw then
      local sn
      es, sn, count = UNPACK('ddd', raw)
      local x = sn / tick
      en = x - x % 1
    end
    local e = (es - ns) * tps + (en - nn)
    local fresh = e <= 0
    if fresh then
      local c = { ns = ns, nn = nn, tps = tps }
      count = 0
      e = w - nowmod(c, w)
      es, en = later(c, e)
    end
    local new = count + cost
    if new <= limit then
      if cost > 0 then
        if fresh then
          local state = PACK('dddd', es, en * tick, new, 0)
          local ms = SLACK_MS + tick_to_ms(tick, e)
          if ms < 1 then ms = 1 end
          if raw then
            CALL('SET', key, state, 'PX', px(ms))
          else
            lone_create(key, state, px(ms))
          end
        else
          -- The same window (so a state was read): only the count (the third double,
          -- at byte 16) changes, and the key already expires at the window's end (plus
          -- the slack), as PX would set it again; SETRANGE keeps that TTL.
          CALL('SETRANGE', key, '16', PACK('d', new))
        end
      end
      return 1, limit - new, e, 0, 0
    end
    local retry = e
    if cost > limit then retry = NEVER end
    local remaining = limit - count
    if remaining < 0 then remaining = 0 end
    return 0, remaining, e, retry, 0
  end
end
