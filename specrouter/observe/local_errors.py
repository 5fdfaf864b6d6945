"""Failures of the router's own resources, which say nothing about a backend.

A health check, a telemetry poll or an upstream connect that fails because the router ran
out of file descriptors or socket buffers (EMFILE, ENFILE, ENOBUFS, ENOMEM) is not evidence
against the backend: the caller keeps the backend's last state and logs the failure, at most once
per `RateLimitedLog.every_s`.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_LOCAL_TEXT = ("Too many open files", "No buffer space available")


class LocalFailure(Exception):
    """A request failed on the router's side (out of file descriptors or buffers)."""


def local_resource_error(exc: BaseException) -> BaseException | None:
    """The exception in `exc`'s chain (cause, context) that is a local resource failure,
    or None. httpx wraps the OSError of a failed socket() or connect()."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in LOCAL_ERRNOS:
            return current
        if any(text in str(current) for text in _LOCAL_TEXT):
            return current
        current = current.__cause__ or current.__context__
    return None


@dataclass
class RateLimitedLog:
    """A warning per `key` at most once per `every_s` seconds; the rest are counted."""

    logger: logging.Logger
    every_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _last: dict[str, float] = field(default_factory=dict)
    suppressed: dict[str, int] = field(default_factory=dict)

    def warning(self, key: str, message: str, *args: object) -> bool:
        """Log unless `key` was logged within `every_s`; True if it was logged."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self.suppressed[key] = self.suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        skipped = self.suppressed.pop(key, 0)
        suffix = f" ({skipped} more since the last report)" if skipped else ""
        self.logger.warning(message + suffix, *args)
        return True
