-- Leaky bucket, meter and queue (algorithm/leaky_bucket.rs): state = the exact
-- instant the bucket is empty (see bucket_state). Scaled by r = limit / gcd.
ALG[6] = function(c, st, cost)
  if c.limit == 0 then return { 0, 0, 0, NEVER, 0 } end
  local r, wr = c.r, c.wr
  local capacity = c.burst * wr
  local level = bucket_ahead(c, st)
  if level < 0 then level = 0 end
  local need = cost * wr
  if level + need <= capacity then
    local new_level = level + need
    local nst = nil
    if cost > 0 then nst = bucket_state(c, new_level) end
    local delay = 0
    if c.queue then delay = cdiv(level, r) end
    return { 1, fdiv(capacity - new_level, wr), cdiv(new_level, r), 0, delay }, nst
  end
  local room = capacity - level
  if room < 0 then room = 0 end
  -- A cost above the burst never fits; the answer still says what is left.
  local retry = NEVER
  if cost <= c.burst then retry = cdiv(level + need - capacity, r) end
  return { 0, fdiv(room, wr), cdiv(level, r), retry, 0 }
end

-- Takes back a charge: the instant moves back by cost x window / limit (prelude.lua).
REFUND[6] = bucket_refund

-- A charge that did not fit (`charge_rejected`): prelude.lua.
CHARGE[6] = bucket_charge

-- ALG[6] for a lone check (see ALONE in fixed_window.lua).
ALONE[6] = function(tick, limit, _, burst, r, wr, cost, queue, ns, nn, tps)
  return function(key, raw)
    if limit == 0 then return 0, 0, 0, NEVER, 0 end
    if raw == nil then raw = CALL('GET', key) end
    local level = lone_bucket_ahead(raw, tick, ns, nn, tps, r)
    local capacity = burst * wr
    local need = cost * wr
    if level + need <= capacity then
      local new_level = level + need
      if cost > 0 then lone_bucket_put(key, raw, new_level, tick, ns, nn, tps, r) end
      local delay = 0
      if queue then delay = cdiv(level, r) end
      return 1, fdiv(capacity - new_level, wr), cdiv(new_level, r), 0, delay
    end
    local room = capacity - level
    if room < 0 then room = 0 end
    local retry = NEVER
    if cost <= burst then retry = cdiv(level + need - capacity, r) end
    return 0, fdiv(room, wr), cdiv(level, r), retry, 0
  end
end
