-- KEYS: a queue's priority lists. ARGV: messages read at most a list. Jobs waiting in them:
-- each envelope of a message's body opens with {\"job\": (the envelope's JSON inside the
-- body's JSON string; the same text inside a job's own strings is escaped once more, so it
-- cannot match), and a message without one (another sender's) is one job. A list longer than
-- ARGV[1] messages is counted from its oldest ones, scaled to its length, so that a deep queue
-- costs Redis a bounded read.
local total = 0
for _, key in ipairs(KEYS) do
  local n = redis.call('LLEN', key)
  if n > 0 then
    local seen = math.min(n, tonumber(ARGV[1]))
    local jobs = 0
    for _, m in ipairs(redis.call('LRANGE', key, -seen, -1)) do
      local k, at = 0, 1
      while true do
        local s = string.find(m, '{\\"job\\":', at, true)
        if not s then break end
        k, at = k + 1, s + 8
      end
      jobs = jobs + math.max(k, 1)
    end
    total = total + jobs * n / seen
  end
end
return math.floor(total + 0.5)
