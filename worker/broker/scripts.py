"""The Lua scripts that make taking, handing back and acknowledging messages atomic in Redis.

A script runs alone on the server, so a message is always in exactly one place: its queue, or the unacked
hash with a lease. No lock is taken, so a worker killed at any moment leaves nothing held. Messages are
never parsed on the fetch path; only a handed-back message is read, for its task id (a rare path).
"""

from __future__ import annotations

# KEYS: unacked hash, unacked index, lost-counts hash, delivery-tag counter, then the queues, most urgent
# first. ARGV: now (Unix seconds), the most messages to take, then the most to take from each queue.
# Pops up to ARGV[2] messages (filling from the first queue, then the next) and, in the same step, records
# each as held: unacked[tag] = "queue\nmessage", unacked_index[tag] = now. Returns a flat list of
# tag, queue, message, lost count (times a worker holding it vanished) per message taken.
FETCH = """
local limit = tonumber(ARGV[2])
local counting = redis.call('HLEN', KEYS[3]) > 0
local taken = {}
for q = 5, #KEYS do
  if limit <= 0 then break end
  local messages = nil
  local most = math.min(limit, tonumber(ARGV[q - 2]))
  if most > 0 then messages = redis.call('RPOP', KEYS[q], most) end
  if messages then
    local first = redis.call('INCRBY', KEYS[4], #messages) - #messages
    local records, scores = {}, {}
    for i, message in ipairs(messages) do
      local tag = tostring(first + i)
      records[#records + 1] = tag
      records[#records + 1] = KEYS[q] .. '\\n' .. message
      scores[#scores + 1] = ARGV[1]
      scores[#scores + 1] = tag
      local lost = 0
      if counting then
        local ok, decoded = pcall(cjson.decode, message)
        if ok and type(decoded) == 'table' and type(decoded['headers']) == 'table' then
          local id = decoded['headers']['id']
          if type(id) == 'string' then lost = tonumber(redis.call('HGET', KEYS[3], id) or '0') end
        end
      end
      taken[#taken + 1] = tag
      taken[#taken + 1] = KEYS[q]
      taken[#taken + 1] = message
      taken[#taken + 1] = lost
    end
    redis.call('HSET', KEYS[1], unpack(records))
    redis.call('ZADD', KEYS[2], unpack(scores))
    limit = limit - #messages
  end
end
return taken
"""

# Puts one held message back at the head of its queue (it is the oldest there) and forgets its lease; with
# ``lost``, counts that its worker vanished (under its task id, read from the message: the rare path).
_PUT_BACK = """
local function put_back(unacked, index, lost_counts, tag, lost)
  local record = redis.call('HGET', unacked, tag)
  redis.call('HDEL', unacked, tag)
  redis.call('ZREM', index, tag)
  if not record then return 0 end
  local cut = string.find(record, '\\n', 1, true)
  local message = string.sub(record, cut + 1)
  redis.call('RPUSH', string.sub(record, 1, cut - 1), message)
  if lost then
    local ok, decoded = pcall(cjson.decode, message)
    if ok and type(decoded) == 'table' and type(decoded['headers']) == 'table' then
      local id = decoded['headers']['id']
      if type(id) == 'string' then redis.call('HINCRBY', lost_counts, id, 1) end
    end
  end
  return 1
end
"""

# KEYS: unacked hash, unacked index, lost-counts hash. ARGV: the tags a worker hands back because it will not
# run them (at shutdown). Not counted as lost.
RESTORE = (
    _PUT_BACK
    + """
local restored = 0
for i = 1, #ARGV do
  restored = restored + put_back(KEYS[1], KEYS[2], KEYS[3], ARGV[i], false)
end
return restored
"""
)

# KEYS: unacked hash, unacked index, lost-counts hash. ARGV: the lease horizon (Unix seconds), the most
# messages to restore. Hands back every message whose lease was last renewed before the horizon (its worker is
# gone), counting it as lost; finding and restoring are one step, so a lease renewed meanwhile is never lost.
RESTORE_EXPIRED = (
    _PUT_BACK
    + """
local tags = redis.call('ZRANGE', KEYS[2], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, ARGV[2])
for _, tag in ipairs(tags) do
  put_back(KEYS[1], KEYS[2], KEYS[3], tag, true)
end
return #tags
"""
)
