"""The Redis key schema, in one place so docs/state.md and the code cannot drift apart.

All keys live under `{prefix}:`, so clusters sharing one Redis are isolated by prefix.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeySchema:
    prefix: str

    def inflight(self, replica_id: str) -> str:
        """Hash backend -> in-flight count of ONE replica, with a TTL refreshed by heartbeat."""
        return f"{self.prefix}:inflight:{replica_id}"

    @property
    def inflight_prefix(self) -> str:
        return f"{self.prefix}:inflight:"

    @property
    def replicas(self) -> str:
        """Sorted set replica_id -> last heartbeat (Redis clock, ms): how readers find hashes."""
        return f"{self.prefix}:replicas"

    @property
    def policy(self) -> str:
        """Hash {doc, version, updated_at, updated_by}: the one source of truth for the policy."""
        return f"{self.prefix}:policy"

    @property
    def audit(self) -> str:
        """List of JSON audit entries, newest first, capped by LTRIM."""
        return f"{self.prefix}:policy:audit"

    @property
    def policy_channel(self) -> str:
        """Pub/sub channel; the message is the new version number."""
        return f"{self.prefix}:policy:changed"

    def lock(self, name: str) -> str:
        """String holding the token of the lock's holder, with the lock's TTL (SET NX PX)."""
        return f"{self.prefix}:lock:{name}"

    @property
    def probe_readings(self) -> str:
        """Stream of shared cost-probe readings (field `r`: JSON), capped by MAXLEN."""
        return f"{self.prefix}:probe:readings"
