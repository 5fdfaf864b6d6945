"""The SGLang release a simulated server imitates, and what differs between releases.

Every difference the router can observe over HTTP is one field here, read from that release's
wheel (`pip download --no-deps sglang==X`; paths under sglang/srt/, docs/simulator.md cites the
lines). The rest of the simulator asks this object instead of comparing version strings.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SglangVersion:
    name: str
    # /v1/loads is a snapshot published by the scheduler (0.5.23) or a live RPC (0.5.10)
    loads_from_snapshot: bool
    # /v1/loads top level: 0.5.23 adds accelerator fields, 0.5.10 dp_rank_count + aggregate
    loads_top_level: str  # "accelerator" | "aggregate"
    has_ready: bool  # GET /ready
    has_get_load: bool  # GET /get_load
    # chat chunks encoded by msgspec with None fields omitted (0.5.23) or pydantic with nulls
    chat_chunks_omit_none: bool
    # sim seconds between a client leaving a running stream and the abort reaching the scheduler
    running_stream_abort_delay_s: float
    # a graceful abort (POST /abort_request) ends a stream with an error event (0.5.10) or a
    # finish chunk with finish_reason "abort" (0.5.23)
    graceful_abort_is_error_event: bool
    # labels of the tokenizer-side counters and histograms, besides `priority`
    tokenizer_labels: tuple[str, ...]
    # counters and TTFT/e2e histograms split by is_streaming (0.5.23)
    is_streaming_label: bool
    # UsageInfo carries completion_tokens_details (0.5.23)
    usage_has_completion_details: bool
    # with --enable-cache-report, prompt_tokens_details is None when nothing was cached
    # (0.5.10 usage_processor.py:13-15); 0.5.23 always writes {"cached_tokens": N}
    cache_report_omits_zero: bool
    # the decode log writes cache_hit_rate 0.0 (0.5.10 scheduler_metrics_mixin.py:633,700);
    # 0.5.23 sets it only from prefill batches (metrics_reporter.py:834-865)
    decode_log_clears_hit_rate: bool
    # --speculative-adaptive exists (0.5.23: speculative/adaptive_spec_params.py)
    has_adaptive_speculation: bool


V0_5_23 = SglangVersion(
    name="0.5.23", loads_from_snapshot=True, loads_top_level="accelerator", has_ready=True,
    has_get_load=False, chat_chunks_omit_none=True, running_stream_abort_delay_s=0.0,
    graceful_abort_is_error_event=False, tokenizer_labels=("model_name", "engine_type"),
    is_streaming_label=True, usage_has_completion_details=True,
    cache_report_omits_zero=False, decode_log_clears_hit_rate=False,
    has_adaptive_speculation=True)

V0_5_10 = SglangVersion(
    name="0.5.10", loads_from_snapshot=False, loads_top_level="aggregate", has_ready=False,
    has_get_load=True, chat_chunks_omit_none=False, running_stream_abort_delay_s=2.0,
    graceful_abort_is_error_event=True, tokenizer_labels=("model_name",),
    is_streaming_label=False, usage_has_completion_details=False,
    cache_report_omits_zero=True, decode_log_clears_hit_rate=True,
    has_adaptive_speculation=False)

VERSIONS = {v.name: v for v in (V0_5_23, V0_5_10)}
DEFAULT_VERSION = V0_5_23.name

# Shared by both releases (tokenizer_manager.py, environ.py, http_server.py):
REQUEST_STATE_WAIT_TIMEOUT_S = 4.0  # a request with no output notices a gone client this often
HEALTH_POLL_S = 1.0  # /health checks for any scheduler output once a second
HEALTH_CHECK_TIMEOUT_S = 20.0  # then gives up: 503 and status UnHealthy
LOAD_STALL_REFRESH_S = 0.05  # 0.5.23: snapshot refresh while work waits but no batch runs


def get_version(name: str) -> SglangVersion:
    try:
        return VERSIONS[name]
    except KeyError:
        raise ValueError(f"unknown SGLang version {name!r}; "
                         f"choose one of {', '.join(sorted(VERSIONS))}") from None
