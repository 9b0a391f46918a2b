-- wrk script: POST /v1/check of {"domain": D, "descriptors": [{"user": "kN"}]}, the key
-- N taken round-robin over KEYS keys (from a random start, so that several wrk
-- processes do not walk the keys in step). Counts the answers by status in every
-- thread and prints, at the end, one line that tools/bench-scale.sh reads:
--   STATUS ok=<200s> limited=<429s> other=<any other status> first_other=<status|->
--
-- Usage: wrk ... -s tools/wrk-check.lua URL -- DOMAIN KEYS
--   DOMAIN  the rule file's domain (default: bench)
--   KEYS    how many keys (default: 1: one hot key, `k0`)

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

local bodies = {}
local n = 1
local next_key = 1
-- Globals: the main thread reads them with thread:get in done().
ok, limited, other, first_other = 0, 0, 0, 0

function init(args)
  local domain = args[1] or "bench"
  n = tonumber(args[2] or "1")
  math.randomseed(os.time() + math.floor(os.clock() * 1e6))
  next_key = math.random(n)
  local headers = { ["Content-Type"] = "application/json" }
  for i = 1, n do
    local body = string.format('{"domain":"%s","descriptors":[{"user":"k%d"}]}', domain, i - 1)
    bodies[i] = wrk.format("POST", "/v1/check", headers, body)
  end
end

function request()
  local r = bodies[next_key]
  next_key = next_key + 1
  if next_key > n then
    next_key = 1
  end
  return r
end

function response(status, headers, body)
  if status == 200 then
    ok = ok + 1
  elseif status == 429 then
    limited = limited + 1
  else
    other = other + 1
    if first_other == 0 then
      first_other = status
    end
  end
end

function done(summary, latency, requests)
  local o, l, x, f = 0, 0, 0, 0
  for _, t in ipairs(threads) do
    o = o + t:get("ok")
    l = l + t:get("limited")
    x = x + t:get("other")
    if f == 0 then
      f = t:get("first_other")
    end
  end
  io.write(string.format("STATUS ok=%d limited=%d other=%d first_other=%s\n", o, l, x,
    f == 0 and "-" or tostring(f)))
end
