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
