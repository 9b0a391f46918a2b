-- The general path: a request of several checks, with a lockout, or already rejected
-- (see call.lua) is decided here, check after check, all or nothing. Definitions only:
-- the per-call code is call.lua (under Redis Functions these are made once, when the
-- library loads, not on every call).

-- Keys whose state the request being decided has saved for taking back (MULTI only).
local saved = {}
-- Whether a check of the request being decided started a lockout (which a check of the
-- same key admitted before it finds when it is decided again), or was charged although
-- not admitted (charge_rejected: an admitted check of the same key may find it).
local LOCKED = false

local function unpack_state(c, raw)
  if not raw then return { 0, 0, 0, 0 } end
  local s, n, a, b = UNPACK('dddd', raw)
  return { s, ticks_of(c, n), a, b }
end

local function put_state(c, st)
  local ttl = ttl_ms(c, st[1], st[2])
  CALL('SET', c.key, PACK('dddd', st[1], ns_of(c, st[2]), st[3], st[4]), 'PX', px(ttl))
end

local function run(c, cost)
  if c.alg == 3 then return LOG_CHECK(c, cost) end
  local raw = CALL('GET', c.key)
  local read = READ[c.alg] or unpack_state
  local d, new = ALG[c.alg](c, read(c, raw), cost)
  if new then
    -- A lone check (MULTI false) has nothing to take back: a rejected check writes
    -- no state (its lockout stays anyway).
    if MULTI and not saved[c.key] then
      saved[c.key] = true
      UNDO[#UNDO + 1] = { 'state', c, raw }
    end
    local write = WRITE[c.alg] or put_state
    write(c, new)
  end
  return d
end

local function decide(c, cost)
  if c.lockout <= 0 then return run(c, cost) end
  local raw = CALL('GET', c.lock)
  if raw then
    local s, n = UNPACK('dd', raw)
    local left = since(c, s, ticks_of(c, n))
    if left > 0 then return { 0, 0, left, left, 0 } end
    -- An ended lockout is forgotten, as the in-memory store forgets it: a clock that
    -- then steps back does not find it again.
    CALL('DEL', c.lock)
  end
  local d = run(c, cost)
  if d[1] == 0 then
    -- Any rejection starts the lockout, whatever its cost (algorithm/lockout.rs); it
    -- keeps reporting what the limit has left uncharged.
    local s, n = later(c, c.lockout)
    CALL('SET', c.lock, PACK('dd', s, ns_of(c, n)), 'PX', px(to_ms(c, c.lockout) + SLACK_MS))
    LOCKED = true
    d[3] = c.lockout
    if d[4] ~= NEVER then d[4] = c.lockout end
  end
  return d
end

-- Puts a state key back to `raw` (false: none), with the TTL that state has.
local function restore(c, raw)
  if raw then
    -- The very bytes read (not re-encoded at this check's tick, which may be coarser
    -- than the stored nanoseconds). Every state starts with the instant it expires.
    local st = unpack_state(c, raw)
    CALL('SET', c.key, raw, 'PX', px(ttl_ms(c, st[1], st[2])))
  else
    CALL('DEL', c.key)
  end
end

-- Whether a request whose checks were so decided is rejected (store/mod.rs `rejects`):
-- a check in neither shadow nor quota mode was, or every quota group has a check (not in
-- shadow mode) that was.
local function rejects(checks, count, decisions)
  local groups, quota = {}, false
  for i = 1, count do
    local c = checks[i]
    -- A check in shadow mode counts as admitted.
    local over = decisions[i][1] ~= 1 and not c.shadow
    if c.quota then
      quota = true
      groups[c.group] = groups[c.group] or over
    elseif over then
      return true
    end
  end
  if not quota then return false end
  for _, over in pairs(groups) do
    if not over then return false end
  end
  return true
end

-- Charges a check that was not admitted (charge_rejected), past its limit; never
-- taken back, so not recorded in UNDO.
local function force(c, cost)
  if cost <= 0 then return end
  if c.alg == 3 then
    LOG_CHARGE(c, cost)
    return
  end
  local read = READ[c.alg] or unpack_state
  local new = CHARGE[c.alg](c, read(c, CALL('GET', c.key)), cost)
  if new then
    local write = WRITE[c.alg] or put_state
    write(c, new)
  end
end

-- Takes back every charge recorded in UNDO, newest first (lockouts stay).
local function undo_all()
  for j = #UNDO, 1, -1 do
    local u = UNDO[j]
    if u[1] == 'state' then
      restore(u[2], u[3])
    else
      LOG_UNDO(u)
    end
  end
  UNDO = {}
end

-- Receipts (Redis Cluster). A request whose checks span several slots is one call per
-- slot, and when one slot rejects it, the others must take back what they charged: a
-- second call per slot (refund_request below) with the receipt its first call answered.
-- A receipt is a string of little-endian doubles and byte strings (each its length as a
-- double, then its bytes; -1: none): the number of checks, whether each was admitted,
-- then a record per key changed: the index of its first check, the cost charged to it
-- in all (by admitted checks), the charges that stay (1: an admitted check's under
-- charge_rejected: all; +2: a log charged anyway for a check not admitted), and the key
-- as the request found it and as it left it (for a sliding log: its
-- meta, its last entry and its trimmed entries before; its meta, last entry and length
-- after). '' when nothing was changed and no lockout started: its answers stand.
-- At most this many trimmed entries are carried; beyond, a log is not put back whole
-- (only its charge is taken back, see REFUND[3]).
local RECEIPT_GONE = 1000

local function rstr(v)
  if v then return PACK('<d', #v) .. v end
  return PACK('<d', -1)
end

local function rtake(blob, pos)
  local n, at = UNPACK('<d', blob, pos)
  if n < 0 then return false, at end
  return string.sub(blob, at, at + n - 1), at + n
end

-- The receipt of a request admitted here: a record per key its checks changed (as
-- recorded in UNDO: a charge, or a sliding log's trimmed entries). Also when nothing
-- changed but a check started a lockout: the admitted checks are decided again.
local function receipt_of(checks, count, decisions)
  if not UNDO[1] and not LOCKED then return '' end
  local first, recs, order = {}, {}, {}
  for i = count, 1, -1 do first[checks[i].key] = i end
  for j = 1, #UNDO do
    local u = UNDO[j]
    local r = recs[u[2].key]
    if not r then
      r = { i = first[u[2].key], cost = 0, gone = {} }
      recs[u[2].key] = r
      order[#order + 1] = r
      if u[1] == 'logpop' then
        r.meta_old = u[4]
      elseif u[1] == 'log' then
        r.meta_old = u[9]
      end
    end
    if u[1] == 'state' then
      r.old = u[3]
    elseif u[1] == 'logpop' then
      for g = 1, #u[3] do r.gone[#r.gone + 1] = u[3][g] end
    elseif not r.charged then
      r.charged, r.old_last = true, u[7]
    end
    -- A log charged anyway (LOG_CHARGE): put back whole, that charge goes too, and the
    -- refund makes it again.
    if u[10] then r.forced = true end
  end
  for i = 1, count do
    local c = checks[i]
    if decisions[i][1] == 1 and c.cost > 0 then
      local r = recs[c.key]
      -- A charge under charge_rejected: all stays in a rejected request: the refund
      -- takes back only the others' (and never puts the key back whole).
      if c.charge == 2 then
        r.keep = 1
      else
        r.cost = r.cost + c.cost
      end
    end
  end
  local parts = { PACK('<d', count) }
  for i = 1, count do parts[#parts + 1] = PACK('<d', decisions[i][1]) end
  for j = 1, #order do
    local r = order[j]
    local c = checks[r.i]
    parts[#parts + 1] = PACK('<ddd', r.i, r.cost, (r.keep or 0) + (r.forced and 2 or 0))
    if c.alg == 3 then
      parts[#parts + 1] = rstr(r.meta_old) .. rstr(r.old_last)
      if #r.gone > RECEIPT_GONE then
        parts[#parts + 1] = PACK('<d', -1)
      else
        parts[#parts + 1] = PACK('<d', #r.gone)
        for g = 1, #r.gone do parts[#parts + 1] = rstr(r.gone[g]) end
      end
      parts[#parts + 1] = rstr(CALL('GET', c.meta)) .. rstr(CALL('LINDEX', c.key, -1))
        .. PACK('<d', CALL('LLEN', c.key))
    else
      parts[#parts + 1] = rstr(r.old) .. rstr(CALL('GET', c.key))
    end
  end
  return table.concat(parts)
end

-- A lone check asking for a receipt (Redis Cluster): its algorithm's fast path (ALONE:
-- `lone`), with its state read here first, and read again after a charge, for the
-- receipt (one check, admitted, and its one record).
local function lone_receipt(lone, key, cost)
  local raw = CALL('GET', key)
  local a, b, c, d, e = lone(key, raw)
  if a ~= 1 or cost <= 0 then return a, b, c, d, e, '' end
  return a, b, c, d, e, PACK('<ddddd', 1, 1, 1, cost, 0) .. rstr(raw) .. rstr(CALL('GET', key))
end

-- Decides one request's checks, all or nothing. With `receipt` (a Redis Cluster call
-- for one slot of a request spanning several), also answers the receipt of what an
-- admitted request charged ('' when rejected here: its charges are already taken back).
local function decide_request(checks, count, forced, receipt)
  -- Fresh tables only when the last request used them (most requests are one check
  -- whose charge is never taken back, and a table per request is not free).
  if UNDO[1] then UNDO = {} end
  MULTI = count > 1 or forced or receipt
  if MULTI then saved = {} end
  LOCKED = false
  local decisions = {}
  for i = 1, count do
    decisions[i] = decide(checks[i], checks[i].cost)
  end
  local rejected = forced or rejects(checks, count, decisions)
  if rejected then
    undo_all()
    -- An admitted check that keeps its charge in a rejected request
    -- (charge_rejected: all) is charged again.
    for i = 1, count do
      if decisions[i][1] == 1 and checks[i].charge == 2 then
        decisions[i] = decide(checks[i], checks[i].cost)
      end
    end
  end
  -- The checks not admitted that are charged anyway (charge_rejected).
  for i = 1, count do
    if decisions[i][1] == 0 and checks[i].charge > 0 then
      force(checks[i], checks[i].cost)
      decisions[i][2] = 0
      if checks[i].cost > 0 then LOCKED = true end
    end
  end
  if rejected then
    -- The admitted checks report their keys as they are now: uncharged, or with the
    -- charges that stay.
    for i = 1, count do
      if decisions[i][1] == 1 then decisions[i] = decide(checks[i], 0) end
    end
    return decisions, ''
  end
  -- The receipt (a cluster's slot) shows the keys as this call leaves them, charges
  -- made anyway included: a refund puts a key back and makes those again.
  if receipt then return decisions, receipt_of(checks, count, decisions) end
  return decisions
end

-- After a key of a refunded request is put back as the request found it: the charges
-- that stay made again, as the single call makes them (decide_request): the admitted
-- checks under charge_rejected: all, then the checks not admitted charged anyway.
-- A check admitted at first that its second decision rejects (a lockout another check
-- of the request started) is charged anyway, as there.
local function replay(checks, count, admitted, key)
  local over = {}
  for i = 1, count do
    local c = checks[i]
    if c.key == key and admitted[i] == 1 and c.charge == 2 and c.cost > 0 then
      over[i] = decide(c, c.cost)[1] == 0
    end
  end
  for i = 1, count do
    local c = checks[i]
    if c.key == key and (admitted[i] == 0 or over[i]) and c.charge > 0 then
      force(c, c.cost)
    end
  end
end

-- Takes back what a request charged in this slot, from the receipt its first call
-- answered, because another slot rejected it (Redis Cluster). A key still exactly as
-- the charge left it is put back as the charge found it (what the general path's undo
-- does); a key others have changed since loses this request's charge only (its
-- algorithm's REFUND). Lockouts stay. Then the checks admitted at first are decided
-- again with cost 0, as a single Redis answers them: their answers, in order.
local function refund_request(checks, count, receipt)
  if UNDO[1] then UNDO = {} end
  MULTI = false
  local n, pos = UNPACK('<d', receipt)
  local admitted = {}
  for i = 1, n do admitted[i], pos = UNPACK('<d', receipt, pos) end
  while pos <= #receipt do
    local i, cost
    local keep
    i, cost, keep, pos = UNPACK('<ddd', receipt, pos)
    local c = checks[i]
    if c.alg == 3 then
      local r = { cost = cost, keep = keep }
      r.meta_old, pos = rtake(receipt, pos)
      r.old_last, pos = rtake(receipt, pos)
      local gone
      gone, pos = UNPACK('<d', receipt, pos)
      if gone >= 0 then
        r.gone = {}
        for g = 1, gone do r.gone[g], pos = rtake(receipt, pos) end
      end
      r.meta_new, pos = rtake(receipt, pos)
      r.tail_new, pos = rtake(receipt, pos)
      r.llen, pos = UNPACK('<d', receipt, pos)
      -- Put back whole (then the charges that stay made again), or only this
      -- request's charges taken back where others changed the log since.
      if REFUND[3](c, r) then replay(checks, n, admitted, c.key) end
    else
      local old, new
      old, pos = rtake(receipt, pos)
      new, pos = rtake(receipt, pos)
      local now = CALL('GET', c.key)
      if now and now == new then
        restore(c, old)
        replay(checks, n, admitted, c.key)
      elseif now and new and cost > 0 then
        local read = READ[c.alg] or unpack_state
        local st = REFUND[c.alg](c, read(c, now), read(c, new), cost)
        local write = WRITE[c.alg] or put_state
        if st then write(c, st) end
      end
    end
  end
  local decisions = {}
  for i = 1, n do
    if admitted[i] == 1 then decisions[#decisions + 1] = decide(checks[i], 0) end
  end
  return decisions
end

-- Gives back unspent units of a lease (leased counting, store/lease.rs): the request's
-- one check, its cost the units, and the receipt the lease's call answered (a lone
-- check's, lone_receipt: the key before and after the charge). A fixed window counts
-- down by them while the stored window is still the one charged (REFUND[1]; others'
-- charges since change nothing: the units were charged and never spent). A bucket
-- only while nothing has changed it since the lease (a charge on top of it holds the
-- slice above, which must not shrink): its instant moves back by the units, but never
-- before now (REFUND, algorithm/bucket.rs `give_back`). Anything else changes nothing.
-- Answers the check decided again with cost 0.
local function give_back_request(checks, count, receipt)
  if UNDO[1] then UNDO = {} end
  MULTI = false
  local c = checks[1]
  local n, pos = UNPACK('<d', receipt)
  pos = pos + 8 * n
  if count == 1 and c.cost > 0 and c.alg ~= 2 and c.alg ~= 3 and pos < #receipt then
    local _, new
    _, _, _, pos = UNPACK('<ddd', receipt, pos)
    _, pos = rtake(receipt, pos)
    new = rtake(receipt, pos)
    local now = CALL('GET', c.key)
    if now and new and (c.alg == 1 or now == new) then
      local read = READ[c.alg] or unpack_state
      local st = REFUND[c.alg](c, read(c, now), read(c, new), c.cost)
      if st then (WRITE[c.alg] or put_state)(c, st) end
    end
  end
  local decisions = {}
  for i = 1, count do decisions[i] = decide(checks[i], 0) end
  return decisions
end
