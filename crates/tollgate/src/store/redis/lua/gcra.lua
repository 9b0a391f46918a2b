-- GCRA (algorithm/gcra.rs): state = the exact theoretical arrival time (see
-- bucket_state). Quantities are scaled by r = limit / gcd.
ALG[5] = function(c, st, cost)
  if c.limit == 0 then return { 0, 0, 0, NEVER, 0 } end
  local r, wr = c.r, c.wr
  local tolerance = c.burst * wr
  local x = bucket_ahead(c, st)
  if x < 0 then x = 0 end
  local new = x + cost * wr
  if new <= tolerance then
    local nst = nil
    if cost > 0 then nst = bucket_state(c, new) end
    return { 1, fdiv(tolerance - new, wr), cdiv(new, r), 0, 0 }, nst
  end
  local room = tolerance - x
  if room < 0 then room = 0 end
  -- A cost above the burst never fits; the answer still says what is left.
  local retry = NEVER
  if cost <= c.burst then retry = cdiv(new - tolerance, r) end
  return { 0, fdiv(room, wr), cdiv(x, r), retry, 0 }
end

-- Takes back a charge: the instant moves back by cost x window / limit (prelude.lua).
REFUND[5] = bucket_refund

-- A charge that did not fit (`charge_rejected`): prelude.lua.
CHARGE[5] = bucket_charge

-- ALG[5] for a lone check (see ALONE in fixed_window.lua).
ALONE[5] = function(tick, limit, _, burst, r, wr, cost, _, ns, nn, tps)
  return function(key, raw)
    if limit == 0 then return 0, 0, 0, NEVER, 0 end
    if raw == nil then raw = CALL('GET', key) end
    local x = lone_bucket_ahead(raw, tick, ns, nn, tps, r)
    local tolerance = burst * wr
    local new = x + cost * wr
    if new <= tolerance then
      if cost > 0 then lone_bucket_put(key, raw, new, tick, ns, nn, tps, r) end
      return 1, fdiv(tolerance - new, wr), cdiv(new, r), 0, 0
    end
    local room = tolerance - x
    if room < 0 then room = 0 end
    local retry = NEVER
    if cost <= burst then retry = cdiv(new - tolerance, r) end
    return 0, fdiv(room, wr), cdiv(x, r), retry, 0
  end
end
