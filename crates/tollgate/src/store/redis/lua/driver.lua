-- Decides one request: ARGV = now seconds, now nanoseconds (both empty: Redis TIME),
-- TTL slack in ms, the number of checks, then 11 fields per check: algorithm, tick (ns),
-- limit, window (ticks), burst, r, window / gcd, cost, shadow, lockout (ticks), queue.
-- KEYS: per check its state key, then its log meta key (sliding log), then its
-- lockout key (when it has a lockout).
-- Returns 5 integers per check: allowed, remaining, reset_after, retry_after (-1:
-- never), delay, all times in the check's ticks.
-- All or nothing, as the in-memory store: if a check not in shadow mode is rejected,
-- every charge made by this request is taken back (lockouts stay), and the admitted
-- checks are decided again without charging.
local NS, NN
if ARGV[1] == '' then
  local t = redis.call('TIME')
  NS, NN = tonumber(t[1]), tonumber(t[2]) * 1000
else
  NS, NN = tonumber(ARGV[1]), tonumber(ARGV[2])
end
SLACK_MS = tonumber(ARGV[3])
local count = tonumber(ARGV[4])
local checks, key = {}, 1
for i = 1, count do
  local b = 4 + (i - 1) * 11
  local c = {
    alg = tonumber(ARGV[b + 1]),
    tick = tonumber(ARGV[b + 2]),
    limit = tonumber(ARGV[b + 3]),
    window = tonumber(ARGV[b + 4]),
    burst = tonumber(ARGV[b + 5]),
    r = tonumber(ARGV[b + 6]),
    wr = tonumber(ARGV[b + 7]),
    cost = tonumber(ARGV[b + 8]),
    shadow = ARGV[b + 9] == '1',
    lockout = tonumber(ARGV[b + 10]),
    queue = ARGV[b + 11] == '1',
  }
  c.tps = 1000000000 / c.tick
  c.tpms = 1000000 / c.tick
  c.ns = NS
  c.nn = floor(NN / c.tick)
  c.key = KEYS[key]
  key = key + 1
  if c.alg == 3 then
    c.meta = KEYS[key]
    key = key + 1
  end
  if c.lockout > 0 then
    c.lock = KEYS[key]
    key = key + 1
  end
  checks[i] = c
end

UNDO = {}
local saved = {}

local function unpack_state(raw)
  if not raw then return { 0, 0, 0, 0 } end
  local s, n, a, b = struct.unpack('dddd', raw)
  return { s, n, a, b }
end

local function put_state(c, st)
  local ttl = ttl_ms(c, st[1], st[2])
  if ttl > 0 then
    redis.call('SET', c.key, struct.pack('dddd', st[1], st[2], st[3], st[4]), 'PX', ttl)
  else
    redis.call('DEL', c.key)
  end
end

local function run(c, cost)
  if c.alg == 3 then return LOG_CHECK(c, cost) end
  local raw = redis.call('GET', c.key)
  local d, new = ALG[c.alg](c, unpack_state(raw), cost)
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
    local left = since(c, s, n)
    if left > 0 then return { 0, 0, left, left, 0 } end
  end
  local d = run(c, cost)
  if d[1] == 0 and d[4] ~= NEVER then
    local s, n = later(c, c.lockout)
    redis.call('SET', c.lock, struct.pack('dd', s, n), 'PX', cdiv(c.lockout, c.tpms) + SLACK_MS)
    d[2], d[3], d[4] = 0, c.lockout, c.lockout
  end
  return d
end

local decisions, rejected = {}, false
for i = 1, count do
  local d = decide(checks[i], checks[i].cost)
  decisions[i] = d
  if d[1] == 0 and not checks[i].shadow then rejected = true end
end
if rejected then
  for j = #UNDO, 1, -1 do
    local u = UNDO[j]
    if u[1] == 'state' then
      if u[3] then
        put_state(u[2], unpack_state(u[3]))
      else
        redis.call('DEL', u[2].key)
      end
    else
      LOG_UNDO(u)
    end
  end
  for i = 1, count do
    if decisions[i][1] == 1 then decisions[i] = decide(checks[i], 0) end
  end
end
local out = {}
for i = 1, count do
  local d = decisions[i]
  for f = 1, 5 do out[#out + 1] = d[f] end
end
return out
