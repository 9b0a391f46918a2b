-- wrk script for tools/bench-adaptive.sh: counts the answers by status (2xx, 503,
-- other) in every thread and, after a 503, waits PAUSE_MS before the thread's next
-- request (a thread's last answer decides, whichever of its connections it came on).
-- Prints, at the end, one line that the script reads:
--   STATUS ok=<2xx> shed=<503s> other=<any other> p50_us=<all answers> p99_us=<...>
--
-- Usage: wrk ... -s tools/wrk-shed.lua URL -- PAUSE_MS

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

-- Globals: the main thread reads them with thread:get in done().
ok, shed, other = 0, 0, 0
local last = 200
local pause = 0

function init(args)
  pause = tonumber(args[1] or "0")
end

function response(status, headers, body)
  last = status
  if status >= 200 and status < 300 then
    ok = ok + 1
  elseif status == 503 then
    shed = shed + 1
  else
    other = other + 1
  end
end

function delay()
  if last == 503 then
    return pause
  end
  return 0
end

function done(summary, latency, requests)
  local o, s, x = 0, 0, 0
  for _, t in ipairs(threads) do
    o = o + t:get("ok")
    s = s + t:get("shed")
    x = x + t:get("other")
  end
  io.write(string.format("STATUS ok=%d shed=%d other=%d p50_us=%d p99_us=%d\n",
    o, s, x, latency:percentile(50), latency:percentile(99)))
end
