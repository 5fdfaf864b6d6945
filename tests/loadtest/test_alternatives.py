"""The `alternatives` driver end to end at toy size (real simulator, real servers, real
HTTP), and the aiohttp transport it plugs in against the simulator."""

from __future__ import annotations

from loadtest.procs import Stack, served_model
from loadtest.scenarios import alternatives, overhead
from loadtest.scenarios.common import run_async


def test_one_level_rotates_every_path_without_errors() -> None:
    s = overhead.OverheadSettings(rounds=1, seconds=0.5, rate_seconds=0.5)
    result = alternatives.compare(s, [alternatives.GRANIAN, alternatives.AIOHTTP], levels=(2,))
    assert result["paths"] == ["direct", "specrouter", "granian", "aiohttp"]
    (level,) = result["levels"]
    for name in result["paths"]:
        assert level["streams"][name]["requests"] > 0, name
        assert level["streams"][name]["errors"] == 0, name
        assert level["rate"][name]["req_s"] > 0, name
        assert level["streams"][name]["cpu_ms_per_request"] > 0, name
    assert len(alternatives.table(result)) == 2 + 4


async def _stream_once(url: str, model: str) -> tuple[int, bytes]:
    from loadtest.alt_transport import AiohttpUpstream
    from specrouter.backends import Backend
    from specrouter.config import LimitSettings, TimeoutSettings, UpstreamSettings

    backend = Backend(name="b", url=url, pool="baseline", group="gpu0")
    upstream = AiohttpUpstream(backend, TimeoutSettings(), UpstreamSettings(), LimitSettings())
    body = (b'{"model": "%s", "stream": true, "max_tokens": 3, "ignore_eos": true, '
            b'"messages": [{"role": "user", "content": "hi"}]}' % model.encode())
    try:
        response = await upstream.open("POST", "/v1/chat/completions",
                                       [(b"content-type", b"application/json")], body,
                                       stream=True)
        data = b"".join([chunk async for chunk in response.iter_raw()])
        await response.aclose()
        return response.status, data
    finally:
        await upstream.aclose()


def test_aiohttp_transport_relays_a_stream() -> None:
    s = overhead.OverheadSettings()
    with Stack() as stack:
        sim = stack.sim_group("gpu0", str(overhead.zero_cost_profile(1.0)), s.time_scale)
        engine = sim.urls()["baseline"]
        status, data = run_async(_stream_once(engine, served_model(engine)))
    assert status == 200
    assert data.count(b"data:") >= 4 and data.rstrip().endswith(b"data: [DONE]")
