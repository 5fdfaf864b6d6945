"""Abandoned requests: the `rid` the router gives each generation attempt, and the abort
it sends when it leaves an attempt before the backend finished it.

SGLang drops a request whose client left only when it notices: a request still queued
or prefilling at its 4 s poll, a running stream at once (0.5.23) or after 2 s (0.5.10).
Until then the request keeps its queue place or batch slot. So when the router recalls
an attempt, or its client leaves, or it gives up on a silent backend, it sends
`POST /abort_request {"rid": ...}`, which SGLang acts on at once, and the attempt keeps
counting in its backend's in-flight load until that abort is acknowledged (HTTP 2xx) or
`hold_s` passed: the time SGLang itself takes to notice.

The rid is `<16 hex>-<x-request-id>`: the fixed-length random head makes the router's
rids prefix-free, which matters because SGLang's scheduler aborts every request whose
rid *starts with* the one given. A client that set its own `rid` keeps it, and the
abort uses it (what SGLang does itself on a disconnect).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from specrouter.errors import JSON_HEADERS
from specrouter.proxy.ids import fresh_id
from specrouter.proxy.upstream import RawHeaders, RequestBody, Upstream, UpstreamError
from specrouter.routing.router import Router, Target
from specrouter.tasks import cancel_and_wait

log = logging.getLogger("specrouter.proxy")

ABORT_PATH = "/abort_request"
_ABORT_HEADERS = frozenset({b"authorization", b"x-request-id"})


class _RidPeek(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rid: Any = None


def client_rids(body: RequestBody) -> tuple[str, ...] | None:
    """The rids the client set itself (a list for a batch), or None when it set no `rid`
    field. A `rid` that SGLang would refuse or ignore gives `()`: nothing to abort."""
    if b'"rid"' not in body:  # the common case costs one scan, not a second parse
        return None
    try:
        peek = _RidPeek.model_validate_json(body)
    except ValidationError:
        return ()
    rid = peek.rid
    if rid is None:  # "rid" only inside another field, or an explicit null
        return () if "rid" in peek.model_fields_set else None
    if isinstance(rid, str):
        return (rid,) if rid else ()
    if isinstance(rid, list) and all(isinstance(r, str) and r for r in rid):
        return tuple(rid)
    return ()


def new_rid(request_id: bytes) -> str:
    """A fresh rid for one attempt of the request `request_id`."""
    return f"{fresh_id()}-{request_id.decode('latin-1')}"


def rid_field(rid: str) -> bytes:
    """The `rid` field that names one attempt, for `request.with_first_fields`."""
    return b'"rid":' + json.dumps(rid).encode()


def abort_headers(request_headers: RawHeaders) -> RawHeaders:
    """The abort's headers: the credentials and request id the attempt was sent with."""
    return [*JSON_HEADERS, *((k, v) for k, v in request_headers if k in _ABORT_HEADERS)]


async def send_abort(upstream: Upstream, rid: str, headers: RawHeaders) -> int:
    """`POST /abort_request {"rid": rid}` to one server, its answer read to the end; the
    HTTP status it answered (`UpstreamError` when it answered none)."""
    body = json.dumps({"rid": rid}).encode()
    response = await upstream.open("POST", ABORT_PATH, headers, body, stream=False)
    try:
        async for _ in response.iter_raw():
            pass
    finally:
        await response.aclose()
    return response.status


class Abandoner:
    """Releases abandoned attempts once their backend dropped them (see the module
    docstring); `aclose` ends the waits still running, releasing their attempts."""

    def __init__(self, router: Router, upstreams: Mapping[str, Upstream], *,
                 abort: bool, hold_s: float) -> None:
        self._router = router
        self._upstreams = upstreams
        self._abort = abort
        self._hold_s = hold_s
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def pending(self) -> int:
        """Abandoned attempts still counted in flight."""
        return len(self._tasks)

    def abandon(self, target: Target, rids: tuple[str, ...], headers: RawHeaders) -> None:
        """The attempt on `target` was left unfinished: release it once its backend
        dropped it. Never raises; `router.release(target)` happens exactly once."""
        if not rids or self._hold_s <= 0:
            self._router.release(target)
            return
        try:
            task = asyncio.get_running_loop().create_task(self._hold(target, rids, headers))
        except BaseException:
            self._router.release(target)
            raise
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _hold(self, target: Target, rids: tuple[str, ...], headers: RawHeaders) -> None:
        try:
            async with asyncio.timeout(self._hold_s):
                if self._abort and await self._aborted(target, rids, headers):
                    return
                await asyncio.Event().wait()  # SGLang notices by itself within hold_s
        except TimeoutError:
            pass
        finally:
            self._router.release(target)

    async def _aborted(self, target: Target, rids: tuple[str, ...], headers: RawHeaders
                       ) -> bool:
        """Whether the backend acknowledged an abort of every rid."""
        name = target.backend.name
        upstream = self._upstreams[name]
        for rid in rids:
            try:
                status = await send_abort(upstream, rid, headers)
            except UpstreamError as exc:
                log.info("abort of %s on %s failed: %s", rid, name, exc)
                return False
            if not 200 <= status < 300:
                log.info("abort of %s on %s answered HTTP %d", rid, name, status)
                return False
        return True

    async def aclose(self) -> None:
        await cancel_and_wait(list(self._tasks))
