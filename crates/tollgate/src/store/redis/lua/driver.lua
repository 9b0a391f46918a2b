-- The general path: a request of several checks, with a lockout, or already rejected
-- (see call.lua) is decided here, check after check, all or nothing. Definitions only:
-- the per-call code is call.lua (under Redis Functions these are made once, when the
-- library loads, not on every call).

-- Keys whose state the request being decided has saved for taking back (MULTI only).
local saved = {}

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
    d[3] = c.lockout
    if d[4] ~= NEVER then d[4] = c.lockout end
  end
  return d
end

-- Takes back every charge recorded in UNDO, newest first (lockouts stay).
local function undo_all()
  for j = #UNDO, 1, -1 do
    local u = UNDO[j]
    if u[1] == 'state' then
      if u[3] then
        -- The very bytes read (not re-encoded at this check's tick, which may be
        -- coarser than the stored nanoseconds).
        local st = unpack_state(u[2], u[3])
        CALL('SET', u[2].key, u[3], 'PX', px(ttl_ms(u[2], st[1], st[2])))
      else
        CALL('DEL', u[2].key)
      end
    else
      LOG_UNDO(u)
    end
  end
  UNDO = {}
end

-- Decides one request's checks, all or nothing.
local function decide_request(checks, count, forced)
  -- Fresh tables only when the last request used them (most requests are one check
  -- whose charge is never taken back, and a table per request is not free).
  if UNDO[1] then UNDO = {} end
  MULTI = count > 1 or forced
  if MULTI then saved = {} end
  local decisions, rejected = {}, forced
  for i = 1, count do
    local d = decide(checks[i], checks[i].cost)
    decisions[i] = d
    if d[1] == 0 and not checks[i].shadow then rejected = true end
  end
  if rejected then
    undo_all()
    for i = 1, count do
      if decisions[i][1] == 1 then decisions[i] = decide(checks[i], 0) end
    end
  end
  return decisions
end
