"""Shadow probes: re-measure an idle EAGLE-3 server's accept length without a client's
request.

While the goodput strategy holds a group on the baseline, its EAGLE server decodes
nothing, so the accept length the router knows would stay frozen and a workload whose
accept length rose again would never win EAGLE-3 back. When the policy asks for a probe
(`Target.probe`), the proxy sends a copy of the request it is routing, cut to a few
output tokens and not streamed, to the EAGLE server and drops the answer. A copy, not a
fixed prompt, because the accept length is a property of the live workload; the client's
own request still goes where the policy chose.

A probe counts as in flight on its server while it runs and its outcome feeds passive
health like any exchange.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

from specrouter.proxy.upstream import RawHeaders, RequestBody, Upstream, UpstreamError
from specrouter.routing.router import Router, Target
from specrouter.tasks import cancel_and_wait

log = logging.getLogger("specrouter.proxy.shadow")

# Fields that would make the probe stream, sample several answers or return extras it
# does not need (the server's defaults are the cheap ones), and the client's `rid`, which
# names the client's own request.
_DROPPED = ("stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs",
            "echo", "return_logprob", "return_hidden_states", "rid")


def probe_body(path: str, body: RequestBody, max_tokens: int) -> bytes | None:
    """The shadow copy of a generation request, or None when the body is not a JSON
    object (the proxy already answered such a request with 400)."""
    try:
        data: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    for key in _DROPPED:
        data.pop(key, None)
    if path.startswith("/generate"):
        params = data.get("sampling_params")
        params = dict(params) if isinstance(params, dict) else {}
        params["max_new_tokens"] = _cut(params.get("max_new_tokens"), max_tokens)
        data["sampling_params"] = params
    else:
        data["max_tokens"] = _cut(data.get("max_tokens", data.get("max_completion_tokens")),
                                  max_tokens)
        data.pop("max_completion_tokens", None)
    return json.dumps(data, separators=(",", ":")).encode()


def _cut(asked: Any, limit: int) -> int:
    return min(asked, limit) if isinstance(asked, int) and asked > 0 else limit


class ShadowProber:
    """Sends probes in the background; `aclose` cancels the ones still running."""

    def __init__(self, router: Router, upstreams: Mapping[str, Upstream],
                 timeout_s: float) -> None:
        self._router = router
        self._upstreams = upstreams
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def send(self, target: Target, path: str, headers: RawHeaders, body: bytes) -> None:
        """Start one probe to `target` (the EAGLE server) with this already-shadowed body."""
        task = asyncio.get_running_loop().create_task(self._run(target, path, headers, body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, target: Target, path: str, headers: RawHeaders, body: bytes) -> None:
        name = target.backend.name
        self._router.acquire(target)
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await self._upstreams[name].open("POST", path, headers, body,
                                                            stream=False)
                try:
                    async for _ in response.iter_raw():
                        pass
                finally:
                    await response.aclose()
            ok = response.status < 500
            self._router.record_outcome(name, ok, None if ok else f"HTTP {response.status}")
        except (UpstreamError, TimeoutError) as exc:
            log.info("probe of %s failed: %s", name, exc or "timed out")
            self._router.record_outcome(name, False, f"probe: {exc or 'timed out'}")
        finally:
            self._router.release(target)

    async def aclose(self) -> None:
        await cancel_and_wait(list(self._tasks))
