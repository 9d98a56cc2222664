-- Claiming a job, by its id or its line (after marks.lua): its flag, 1 new (counted in
-- total), 0 enqueued before but not done (send again: the earlier send may be lost), -1 done
-- (skip); the key it touched, whose expiry the script renews.
local function claim(id, line)
  if line ~= '' then
    if line_done(line) then return -1, lines end
    if redis.call('HSETNX', open, id, line) == 1 then return 1, open end
    return 0, open
  end
  local marks = mark(id)
  if redis.call('HSETNX', marks, id, '') == 1 then return 1, marks end
  if redis.call('HGET', marks, id) == '' then return 0, marks end
  return -1, marks
end
