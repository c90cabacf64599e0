"""The Redis ledger's Lua scripts. Each runs atomically on the server, so a check and the write
it justifies can never be split by another gateway's operation.

Keys of one worker (``P`` the ledger prefix, ``W`` the worker's address):
  ``P:worker:W``  hash  capacity, max_sessions, admitted (bytes of live leases), seen (ms)
  ``P:leases:W``  hash  lease id -> bytes it holds
  ``P:expiry:W``  zset  lease id scored by its expiry (ms)
Every script gets them as ``KEYS`` in this order (``acquire``: three per candidate). Time is the
server's (``TIME``), so gateways with skewed clocks agree on expiry. Every write refreshes the
three keys' own expiry (``keep_ms``), so the ledger of a worker no gateway talks to any more
disappears by itself.
"""

from __future__ import annotations

_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Leases whose expiry has passed give their bytes back.
local function reclaim(w, l, e, now)
  local expired = redis.call('ZRANGEBYSCORE', e, '-inf', now)
  if #expired == 0 then return end
  local freed = 0
  for _, id in ipairs(expired) do
    freed = freed + tonumber(redis.call('HGET', l, id) or 0)
    redis.call('HDEL', l, id)
  end
  redis.call('ZREMRANGEBYSCORE', e, '-inf', now)
  redis.call('HINCRBY', w, 'admitted', -freed)
end

local function keep(w, l, e, ms)
  redis.call('PEXPIRE', w, ms)
  redis.call('PEXPIRE', l, ms)
  redis.call('PEXPIRE', e, ms)
end

-- {capacity, max_sessions, admitted, sessions}
local function usage(w, l)
  local v = redis.call('HMGET', w, 'capacity', 'max_sessions', 'admitted')
  return {tonumber(v[1] or 0), tonumber(v[2] or 0), tonumber(v[3] or 0), redis.call('HLEN', l)}
end
"""

# KEYS: w l e. ARGV: capacity, max_sessions, keep_ms. Returns usage.
REGISTER = (
    _PRELUDE
    + """
local now = now_ms()
redis.call('HSET', KEYS[1], 'capacity', ARGV[1], 'max_sessions', ARGV[2], 'seen', now)
redis.call('HSETNX', KEYS[1], 'admitted', 0)
reclaim(KEYS[1], KEYS[2], KEYS[3], now)
keep(KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[3]))
return usage(KEYS[1], KEYS[2])
"""
)

# KEYS: w l e per candidate, in preference order. ARGV: lease id, ttl_ms, keep_ms, then the
# bytes needed on each candidate, then each candidate's group ('' alone). Consecutive
# candidates of one group are one choice: the one with room and the least admitted share of
# its capacity (ties: the first). Returns {i, usage...} for the candidate admitted (1-based),
# or {0}.
ACQUIRE = (
    _PRELUDE
    + """
local now = now_ms()
local id, ttl, keep_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local n = #KEYS / 3
local function group(i) return ARGV[3 + n + i] end
local i = 1
while i <= n do
  local j = i
  if group(i) ~= '' then
    while j < n and group(j + 1) == group(i) do j = j + 1 end
  end
  local pick, pick_share, pick_u = nil, nil, nil
  for k = i, j do
    local w, l, e = KEYS[3 * k - 2], KEYS[3 * k - 1], KEYS[3 * k]
    if redis.call('HEXISTS', w, 'capacity') == 1 then
      reclaim(w, l, e, now)
      local u = usage(w, l)
      local need = tonumber(ARGV[3 + k])
      if u[3] + need <= u[1] and (u[2] <= 0 or u[4] < u[2]) then
        local share = 0
        if u[1] > 0 then share = u[3] / u[1] end
        if pick == nil or share < pick_share then pick, pick_share, pick_u = k, share, u end
      end
    end
  end
  if pick ~= nil then
    local w, l, e = KEYS[3 * pick - 2], KEYS[3 * pick - 1], KEYS[3 * pick]
    local need = tonumber(ARGV[3 + pick])
    redis.call('HSET', l, id, need)
    redis.call('ZADD', e, now + ttl, id)
    redis.call('HINCRBY', w, 'admitted', need)
    keep(w, l, e, keep_ms)
    local u = pick_u
    return {pick, u[1], u[2], u[3] + need, u[4] + 1}
  end
  i = j + 1
end
return {0}
"""
)

# KEYS: w l e. ARGV: ttl_ms, keep_ms, lease ids. Returns the ids no longer held.
RENEW = (
    _PRELUDE
    + """
local now = now_ms()
local lost = {}
for i = 3, #ARGV do
  if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 1 then
    redis.call('ZADD', KEYS[3], now + tonumber(ARGV[1]), ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
keep(KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[2]))
return lost
"""
)

# KEYS: w l e. ARGV: lease id. Returns 1 if it was held, else 0.
RELEASE = """
local need = redis.call('HGET', KEYS[2], ARGV[1])
if not need then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'admitted', -tonumber(need))
end
return 1
"""

# KEYS: w l e. ARGV: dead_after_ms. Returns the leases released, or -1 when some gateway saw
# the worker healthy within dead_after_ms.
RELEASE_DEAD = (
    _PRELUDE
    + """
local seen = redis.call('HGET', KEYS[1], 'seen')
if not seen then return 0 end
if now_ms() - tonumber(seen) <= tonumber(ARGV[1]) then return -1 end
local n = redis.call('HLEN', KEYS[2])
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'admitted', 0)
return n
"""
)

# KEYS: w l per worker. Returns, per worker, {registered (0/1), usage...}.
USAGE = (
    _PRELUDE
    + """
local out = {}
for i = 1, #KEYS / 2 do
  local w, l = KEYS[2 * i - 1], KEYS[2 * i]
  local u = usage(w, l)
  table.insert(out, {redis.call('HEXISTS', w, 'capacity'), u[1], u[2], u[3], u[4]})
end
return out
"""
)
