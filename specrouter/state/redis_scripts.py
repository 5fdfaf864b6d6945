"""The store's Lua scripts: each runs atomically in Redis, so a reader never sees half of
a publish and a policy write bumps the version, appends the audit entry and publishes the
new version in one step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis

from specrouter.state.keys import KeySchema

# KEYS[1] this replica's hash, KEYS[2] replicas zset; ARGV[1] ttl_ms, ARGV[2] replica_id,
# ARGV[3..] backend, count pairs. DEL+HSET in one script: readers never see a half update.
_PUBLISH_LUA = """
redis.call('DEL', KEYS[1])
local ttl = tonumber(ARGV[1])
if #ARGV > 2 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 3))
  redis.call('PEXPIRE', KEYS[1], ttl)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now, ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - 3 * ttl)
redis.call('PEXPIRE', KEYS[2], 3 * ttl)
return 1
"""

# KEYS[1] replicas zset; ARGV[1] inflight key prefix, ARGV[2] ttl_ms.
# Returns {id1, {backend, count, ...}, id2, {...}, ...} for replicas heard from within the TTL.
# Every score is Redis's own TIME at a publish, so none is in the future: a member scored
# beyond now + TTL was written by someone else and is dropped with its hash, or it would
# count as load forever. A listed hash without a TTL gets one, so it expires like a replica's.
_REFRESH_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local future = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. (now + ttl), '+inf')
for _, id in ipairs(future) do
  redis.call('DEL', ARGV[1] .. id)
end
if #future > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '(' .. (now + ttl), '+inf')
end
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], now - ttl, now + ttl)
local out = {}
for _, id in ipairs(ids) do
  local key = ARGV[1] .. id
  if redis.call('PTTL', key) == -1 then
    redis.call('PEXPIRE', key, ttl)
  end
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGETALL', key)
end
return out
"""

# KEYS[1] policy hash, KEYS[2] audit list; ARGV[1] expected version (-1: any), ARGV[2] doc json,
# ARGV[3] updated_by, ARGV[4] audit cap, ARGV[5] channel, ARGV[6] floor (the writer's held
# version: after Redis restarted empty, versions continue above what replicas hold).
_CAS_LUA = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0') or 0
local floor = tonumber(ARGV[6])
if floor > cur then cur = floor end
local expected = tonumber(ARGV[1])
if expected >= 0 and cur ~= expected then return {0, tostring(cur)} end
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
local v = cur + 1
redis.call('HSET', KEYS[1], 'doc', ARGV[2], 'version', v, 'updated_at', now,
           'updated_by', ARGV[3])
redis.call('LPUSH', KEYS[2], '{"action":"put","version":' .. v .. ',"updated_at":' .. now ..
           ',"updated_by":' .. cjson.encode(ARGV[3]) .. ',"doc":' .. ARGV[2] .. '}')
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[4]) - 1)
redis.call('PUBLISH', ARGV[5], v)
return {1, tostring(v), now}
"""

# Re-seed after Redis lost the policy (restart empty), holds an older one or one whose version
# is not a number.
# KEYS as above; ARGV[1] held version, ARGV[2] doc json, ARGV[3] updated_by, ARGV[4] cap,
# ARGV[5] channel, ARGV[6] updated_at ('' = now). Writes only if Redis has nothing newer.
_SEED_LUA = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '-1') or -1
local v = tonumber(ARGV[1])
if v < 1 then v = 1 end
if cur >= v then return {0, tostring(cur)} end
local now = ARGV[6]
if now == '' then
  local t = redis.call('TIME')
  now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
end
redis.call('HSET', KEYS[1], 'doc', ARGV[2], 'version', v, 'updated_at', now,
           'updated_by', ARGV[3])
redis.call('LPUSH', KEYS[2], '{"action":"seed","version":' .. v .. ',"updated_at":' .. now ..
           ',"updated_by":' .. cjson.encode(ARGV[3]) .. ',"doc":' .. ARGV[2] .. '}')
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[4]) - 1)
redis.call('PUBLISH', ARGV[5], v)
return {1, tostring(v), now}
"""


# KEYS[1] a lock; ARGV[1] the token that took it. Deletes only the caller's own lock: one
# that expired and was taken by another holder stays with that holder.
_UNLOCK_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisScripts:
    """The scripts registered on one client, called with the store's keys."""

    def __init__(self, client: aioredis.Redis, keys: KeySchema, ttl_ms: int,
                 audit_cap: int) -> None:
        self._keys = keys
        self._ttl_ms = ttl_ms
        self._audit_cap = audit_cap
        self._publish = client.register_script(_PUBLISH_LUA)
        self._refresh = client.register_script(_REFRESH_LUA)
        self._cas = client.register_script(_CAS_LUA)
        self._seed = client.register_script(_SEED_LUA)
        self._unlock = client.register_script(_UNLOCK_LUA)

    async def publish(self, replica_id: str, counts: Mapping[str, int]) -> None:
        """Replace this replica's counts and mark it alive."""
        args: list[Any] = [self._ttl_ms, replica_id]
        for backend, count in counts.items():
            args += [backend, count]
        await self._publish(keys=[self._keys.inflight(replica_id), self._keys.replicas],
                            args=args)

    async def refresh(self) -> list[Any]:
        """[replica_id, [backend, count, ...], ...] of the replicas alive within the TTL."""
        raw: list[Any] = await self._refresh(keys=[self._keys.replicas],
                                             args=[self._keys.inflight_prefix, self._ttl_ms])
        return raw

    async def compare_and_set(self, expected: int, doc_json: str, actor: str,
                              floor: int) -> list[Any]:
        """[1, version, updated_at] when written, [0, current version] on a conflict."""
        result: list[Any] = await self._cas(
            keys=[self._keys.policy, self._keys.audit],
            args=[expected, doc_json, actor, self._audit_cap, self._keys.policy_channel, floor])
        return result

    async def seed(self, version: int, doc_json: str, actor: str, updated_at: str) -> list[Any]:
        """Like `compare_and_set`, written only if Redis holds nothing newer."""
        result: list[Any] = await self._seed(
            keys=[self._keys.policy, self._keys.audit],
            args=[version, doc_json, actor, self._audit_cap, self._keys.policy_channel,
                  updated_at])
        return result


    async def unlock(self, name: str, token: str) -> int:
        """1 when `token` held lock `name` and it is released, else 0."""
        result: int = await self._unlock(keys=[self._keys.lock(name)], args=[token])
        return result


def count_of(value: object) -> int | None:
    """An integer stored in Redis, or None for anything else (a key someone else wrote)."""
    if not isinstance(value, str | bytes | int):
        return None
    try:
        return int(value)
    except ValueError:
        return None
