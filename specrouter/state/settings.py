"""Configuration of the state layer, validated up front so a typo fails at startup, not mid-load."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-]+(:[A-Za-z0-9_.\-]+)*$")
_SCHEMES = ("redis", "rediss")


def redact_url(url: str) -> str:
    """The URL with its password replaced by `***`: the only form of a Redis URL fit for logs.

    The user name is kept (it tells an operator which ACL user is in use); anything that does
    not parse is replaced wholesale, because a half-parsed URL might still carry the secret.
    """
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<unparseable redis url>"
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{host}"
    if port is not None:
        netloc += f":{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class StateSettings(BaseModel):
    """How (and whether) replicas share state. No `redis_url`: the in-memory store, one replica.

    Defaults give: a dead replica's counts gone within `ttl_s` (5 s); other replicas' counts
    at most `publish_interval_s + refresh_interval_s` (+ two Redis round trips) old; a policy
    change seen everywhere within `reconcile_interval_s` even if its pub/sub message is lost.
    """

    # hide_input_in_errors: a rejected URL may carry a password; the message shows it redacted.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    redis_url: SecretStr | None = Field(
        default=None, description="redis:// or rediss:// URL; user/password go in the URL."
    )
    key_prefix: str = Field(default="specrouter", min_length=1, max_length=64)
    ttl_s: float = Field(default=5.0, ge=0.5, le=60.0, description="life of a replica's counts")
    heartbeat_s: float = Field(default=1.0, gt=0.0, le=30.0, description="TTL refresh period")
    publish_interval_s: float = Field(
        default=0.02, gt=0.0, le=1.0, description="local changes are coalesced this long"
    )
    refresh_interval_s: float = Field(
        default=0.05, gt=0.0, le=1.0, description="period of the cluster view refresh"
    )
    reconcile_interval_s: float = Field(
        default=0.5, gt=0.0, le=10.0, description="policy version check, covers lost pub/sub"
    )
    socket_timeout_s: float = Field(default=0.25, gt=0.0, le=10.0)
    connect_timeout_s: float = Field(default=0.25, gt=0.0, le=10.0)
    backoff_initial_s: float = Field(default=0.05, gt=0.0, le=10.0)
    backoff_max_s: float = Field(default=1.0, gt=0.0, le=30.0)
    audit_cap: int = Field(default=100, ge=1, le=10_000)

    @field_validator("redis_url")
    @classmethod
    def _check_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or value.get_secret_value() == "":
            return None
        url = value.get_secret_value()
        shown = redact_url(url)
        try:
            parts = urlsplit(url)
            _ = parts.port  # raises on a non-numeric port
        except ValueError as exc:
            raise ValueError(f"redis_url is not a valid URL: {shown}") from exc
        if parts.scheme not in _SCHEMES:
            raise ValueError(
                f"redis_url must start with redis:// or rediss:// (got scheme "
                f"{parts.scheme or '<none>'!r} in {shown})"
            )
        if not parts.hostname:
            raise ValueError(f"redis_url has no host: {shown}")
        return value

    @field_validator("key_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        if not _PREFIX_RE.match(value):
            raise ValueError(
                "key_prefix must be letters, digits, '_', '.', '-' in ':'-separated parts "
                f"(no spaces, no leading/trailing ':'), got {value!r}"
            )
        return value

    @model_validator(mode="after")
    def _check_timing(self) -> StateSettings:
        if self.heartbeat_s > self.ttl_s / 2:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s}) must be at most ttl_s/2 ({self.ttl_s / 2}) "
                "so one late heartbeat does not expire a live replica's counts"
            )
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")
        return self

    @property
    def password_warning(self) -> str | None:
        """A start-up warning when the Redis URL carries no password (anyone who can reach
        that Redis can rewrite the policy and the load view); None otherwise. The URL in it
        is redacted."""
        if self.redis_url is None or urlsplit(self.redis_url.get_secret_value()).password:
            return None
        return (f"shared state: the Redis URL {self.redacted_url} has no password: anyone who "
                "can reach that Redis can change the routing policy and the load the "
                "replicas see; use redis://user:password@host (a Redis ACL user) or rediss://")

    @property
    def redacted_url(self) -> str | None:
        return None if self.redis_url is None else redact_url(self.redis_url.get_secret_value())
