-- KEYS: entry, its run claim. ARGV: hold_ms. The entry when it is there; else the claim taken
-- for the caller (1) or held by an identical job running now (0). One step, so that a job
-- never misses an entry stored between its look and its claim, and runs a second time.
local entry = redis.call('GET', KEYS[1])
if entry then return entry end
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[1]) then return 1 end
return 0
