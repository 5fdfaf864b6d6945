"""The configured SGLang servers: a backend, its pool and its GPU group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from specrouter.config import BackendConfig

Pool = Literal["eagle", "baseline"]
POOLS: tuple[Pool, Pool] = ("eagle", "baseline")
#: The header a response names its pool in, and a client may ask for one with.
POOL_HEADER = "x-specrouter-pool"


def other_pool(pool: Pool) -> Pool:
    return "baseline" if pool == "eagle" else "eagle"


@dataclass(frozen=True, slots=True)
class Backend:
    """A configured SGLang server, as the request path sees it."""

    name: str
    url: str
    pool: Pool
    group: str
    api_key: str | None = field(default=None, repr=False)  # never printed

    @property
    def authorization(self) -> bytes | None:
        """The `authorization` header value the router sends this server, if it has a key."""
        return None if self.api_key is None else b"Bearer " + self.api_key.encode()

    @classmethod
    def from_config(cls, config: BackendConfig) -> Backend:
        key = config.api_key.get_secret_value() if config.api_key is not None else None
        return cls(config.name, config.url, config.pool, config.group, key)
