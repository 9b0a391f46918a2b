-- Token bucket (algorithm/token_bucket.rs): state = the exact instant the bucket is
-- full again (see bucket_state). Quantities are scaled by r = limit / gcd.
ALG[4] = function(c, st, cost)
  if c.limit == 0 then return { 0, 0, 0, NEVER, 0 } end
  local r, wr = c.r, c.wr
  local capacity = c.burst * wr
  local x = bucket_ahead(c, st)
  if x < 0 then x = 0 end
  local missing = x
  if missing > capacity then missing = capacity end
  local tokens = capacity - missing
  local need = cost * wr
  if need <= tokens then
    local left = tokens - need
    local nst = nil
    if cost > 0 then nst = bucket_state(c, x + need) end
    return { 1, fdiv(left, wr), cdiv(capacity - left, r), 0, 0 }, nst
  end
  -- A cost above the burst never fits; the answer still says what is left. Past the
  -- capacity, x is a debt (a charge the bucket could not hold): it counts in full.
  local retry = NEVER
  if cost <= c.burst then retry = cdiv(need + x - capacity, r) end
  return { 0, fdiv(tokens, wr), cdiv(x, r), retry, 0 }
end

-- Takes back a charge: the instant moves back by cost x window / limit (prelude.lua).
REFUND[4] = bucket_refund

-- A charge that did not fit (`charge_rejected`): prelude.lua.
CHARGE[4] = bucket_charge

-- ALG[4] for a lone check (no lockout, not already rejected), state read and written
-- here (see ALONE in fixed_window.lua).
ALONE[4] = function(tick, limit, _, burst, r, wr, cost, _, ns, nn, tps)
  return function(key, raw)
    if limit == 0 then return 0, 0, 0, NEVER, 0 end
    if raw == nil then raw = CALL('GET', key) end
    local x = lone_bucket_ahead(raw, tick, ns, nn, tps, r)
    local capacity = burst * wr
    local missing = x
    if missing > capacity then missing = capacity end
    local tokens = capacity - missing
    local need = cost * wr
    if need <= tokens then
      local left = tokens - need
      if cost > 0 then lone_bucket_put(key, raw, x + need, tick, ns, nn, tps, r) end
      return 1, fdiv(left, wr), cdiv(capacity - left, r), 0, 0
    end
    local retry = NEVER
    if cost <= burst then retry = cdiv(need + x - capacity, r) end
    return 0, fdiv(tokens, wr), cdiv(x, r), retry, 0
  end
end
