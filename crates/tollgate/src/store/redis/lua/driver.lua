-- Decides a batch of requests, one after another (each all or nothing on its own).
-- ARGV: TTL slack in ms, the number of requests, then one argument per request: little-
-- endian doubles (exact integers), packed so that the script reads them with one
-- struct.unpack instead of a slow tonumber each: time mode (0: Redis TIME, read once
-- per batch; 1: the next two; +2: the request is already rejected), now seconds, now nanoseconds, the number of checks,
-- then 11 per check: algorithm, tick (ns), limit, window (ticks), burst, r,
-- window / gcd, cost, shadow, lockout (ticks), queue.
-- KEYS, request after request: per check its state key, then its log meta key
-- (sliding log), then its lockout key (when it has a lockout).
-- Returns 5 integers per check: allowed (1, 0, or -2 when the script failed on this
-- request), remaining, reset_after, retry_after (-1: never), delay, all times in the
-- check's ticks.
-- All or nothing, as the in-memory store: if a check not in shadow mode is rejected,
-- every charge made by its request is taken back (lockouts stay), and the request's
-- admitted checks are decided again without charging.
SLACK_MS = tonumber(ARGV[1])
local requests = tonumber(ARGV[2])
local TIME_S, TIME_N
local saved = {}

local function unpack_state(c, raw)
  if not raw then return { 0, 0, 0, 0 } end
  local s, n, a, b = struct.unpack('dddd', raw)
  return { s, ticks_of(c, n), a, b }
end

local function put_state(c, st)
  local ttl = ttl_ms(c, st[1], st[2])
  -- Redis turns a number argument into text slowly; format it ourselves.
  redis.call('SET', c.key, struct.pack('dddd', st[1], ns_of(c, st[2]), st[3], st[4]), 'PX', format('%d', ttl))
end

local function run(c, cost)
  if c.alg == 3 then return LOG_CHECK(c, cost) end
  local raw = redis.call('GET', c.key)
  local d, new = ALG[c.alg](c, unpack_state(c, raw), cost)
  if new then
    if not saved[c.key] then
      saved[c.key] = true
      UNDO[#UNDO + 1] = { 'state', c, raw }
    end
    put_state(c, new)
  end
  return d
end

local function decide(c, cost)
  if c.lockout <= 0 then return run(c, cost) end
  local raw = redis.call('GET', c.lock)
  if raw then
    local s, n = struct.unpack('dd', raw)
    local left = since(c, s, ticks_of(c, n))
    if left > 0 then return { 0, 0, left, left, 0 } end
    -- An ended lockout is forgotten, as the in-memory store forgets it: a clock that
    -- then steps back does not find it again.
    redis.call('DEL', c.lock)
  end
  local d = run(c, cost)
  if d[1] == 0 and d[4] ~= NEVER then
    local s, n = later(c, c.lockout)
    redis.call('SET', c.lock, struct.pack('dd', s, ns_of(c, n)), 'PX', format('%d', to_ms(c, c.lockout) + SLACK_MS))
    d[2], d[3], d[4] = 0, c.lockout, c.lockout
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
        redis.call('SET', u[2].key, u[3], 'PX', format('%d', ttl_ms(u[2], st[1], st[2])))
      else
        redis.call('DEL', u[2].key)
      end
    else
      LOG_UNDO(u)
    end
  end
  UNDO = {}
end

-- Decides one request's checks, all or nothing.
local function decide_request(checks, count, forced)
  UNDO = {}
  saved = {}
  MULTI = count > 1 or forced
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

local out, key = {}, 1
local unpack = struct.unpack
for q = 1, requests do
  local blob = ARGV[2 + q]
  local mode, NS, NN, count, pos = unpack('<dddd', blob)
  -- Mode +2: the request is already rejected (by the caller's blocked-key cache): its
  -- checks are decided and then taken back, as if one more check had been rejected.
  local forced = mode >= 2
  if forced then mode = mode - 2 end
  if mode == 0 then
    if not TIME_S then
      local t = redis.call('TIME')
      TIME_S, TIME_N = tonumber(t[1]), tonumber(t[2]) * 1000
    end
    NS, NN = TIME_S, TIME_N
  end
  local checks = {}
  for i = 1, count do
    local alg, tick, limit, window, burst, r, wr, cost, shadow, lockout, queue, after =
      unpack('<ddddddddddd', blob, pos)
    pos = after
    local c = {
      alg = alg,
      tick = tick,
      limit = limit,
      window = window,
      burst = burst,
      r = r,
      wr = wr,
      cost = cost,
      shadow = shadow == 1,
      lockout = lockout,
      queue = queue == 1,
      ns = NS,
      nn = floor(NN / tick),
      tps = 1000000000 / tick,
      key = KEYS[key],
    }
    key = key + 1
    if alg == 3 then
      c.meta = KEYS[key]
      key = key + 1
    end
    if lockout > 0 then
      c.lock = KEYS[key]
      key = key + 1
    end
    checks[i] = c
  end

  local ok, decisions = pcall(decide_request, checks, count, forced)
  if not ok then
    -- One request's failure (a key of the wrong type, say) fails that request
    -- alone: its charges are taken back and it answers -2; the batch goes on.
    pcall(undo_all)
    local e = decisions
    if type(e) == 'table' then e = e.err end
    redis.log(redis.LOG_WARNING, 'tollgate: a request failed: ' .. tostring(e))
    decisions = {}
    for i = 1, count do decisions[i] = { -2, 0, 0, 0, 0 } end
  end
  for i = 1, count do
    local d = decisions[i]
    out[#out + 1] = d[1]
    out[#out + 1] = d[2]
    out[#out + 1] = d[3]
    out[#out + 1] = d[4]
    out[#out + 1] = d[5]
  end
end
return out
