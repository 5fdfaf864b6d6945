"""When SGLang notices that a client went away, and aborts its request.

Until the abort reaches the scheduler the request keeps its queue place or batch slot, is
prefilled and decoded, and counts in the load:

- no output yet (queued or prefilling; a stream has no response head then, because SGLang sends
  the head with the first output): the tokenizer wakes every 4 s without output
  (SGLANG_REQUEST_STATE_WAIT_TIMEOUT, tokenizer_manager.py:1946-1975) and only then checks the
  connection; an output that comes first ends the wait like below;
- a non-streaming request with output: checked at its next output (tokenizer_manager.py
  "type 3"), so at the next engine step;
- a running stream: 0.5.23 aborts at once (the cancelled generator aborts, tokenizer_manager.py
  955-964); 0.5.10 only in the response's background task, after `asyncio.sleep(2)`
  (tokenizer_manager.py:1484-1496).

The delays run on the simulated clock, like every other duration of the engine: what matters to
a router is how many engine steps an abandoned request still occupies, and at --time-scale 0.05
a real-time 4 s would be 80 simulated seconds.
"""

from __future__ import annotations

import asyncio
import math

from specrouter.sim.engine import Engine, SimRequest
from specrouter.sim.version import REQUEST_STATE_WAIT_TIMEOUT_S, SglangVersion


async def abandon(engine: Engine, req: SimRequest, version: SglangVersion, *,
                  stream: bool, head_sent: bool, last_wait_start_real: float) -> None:
    """Abort `req` when SGLang would; `last_wait_start_real` is when the tokenizer last began
    waiting for an output (the request's arrival, or its last output)."""
    if head_sent:
        await _abort_running_stream(engine, req, version)
        return
    clock = engine.clock
    tick = REQUEST_STATE_WAIT_TIMEOUT_S * clock.time_scale
    seen = req.generated
    while not req.done:
        if req.generated > seen:  # an output came first
            if stream:
                await _abort_running_stream(engine, req, version)
            else:
                engine.abort(req)
            return
        now = clock.real()
        ticks = max(1, math.ceil((now - last_wait_start_real) / tick))
        deadline = last_wait_start_real + ticks * tick
        req.event.clear()
        try:
            await asyncio.wait_for(req.event.wait(), timeout=max(0.0, deadline - now))
        except TimeoutError:
            engine.abort(req)
            return


async def _abort_running_stream(engine: Engine, req: SimRequest, version: SglangVersion
                                ) -> None:
    delay = version.running_stream_abort_delay_s * engine.clock.time_scale
    if delay > 0:
        await asyncio.sleep(delay)
    engine.abort(req)
