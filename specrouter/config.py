"""The router's configuration: one pydantic-settings model, validated at start-up.

Precedence, highest first: CLI flags (passed in as overrides), environment variables
(`SPECROUTER_*`, nested sections with `__`, e.g. `SPECROUTER_TIMEOUTS__CONNECT=2`), the
config file (`--config FILE` or `SPECROUTER_CONFIG`, YAML or TOML by suffix), defaults.

Every mistake an operator can make in the backend list is caught here, before a socket is
opened, with a message naming the offending entry: a router that starts with a typo in a
URL would only fail later, on a user's request.

A feature adds its own section as one new field of `Settings`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from specrouter.backends import Pool
from specrouter.errors import describe_validation_error
from specrouter.observe.breaker import BreakerConfig
from specrouter.routing.costmodel import GroupCostModel
from specrouter.routing.costsource import CostModelSource
from specrouter.routing.policy import Policy
from specrouter.state import StateSettings

MIB = 1024 * 1024
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ConfigError(ValueError):
    """A configuration the router refuses to start with; the message is for the operator."""


class _Section(BaseModel):
    # A misspelt key in a config file must fail loudly, not be silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class BackendConfig(_Section):
    """One SGLang server. `group` names the GPU it shares with its sibling server."""

    name: str
    url: str
    pool: Pool
    group: str
    api_key: SecretStr | None = None

    @field_validator("name", "group")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        # Names end up in response headers and metric labels: keep them plain.
        if not _NAME_RE.match(value):
            raise ValueError(
                f"{value!r} is not a valid name: use letters, digits, '_', '.', '-'"
            )
        return value

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL like http://127.0.0.1:30000")
        try:
            parts.port  # noqa: B018 - raises on a non-numeric or out-of-range port
        except ValueError as exc:
            raise ValueError(f"{value!r} has a bad port: {exc}") from None
        if parts.query or parts.fragment:
            raise ValueError(f"{value!r} must not carry a query or fragment")
        return value.rstrip("/")


class ListenSettings(_Section):
    """Where the router itself listens."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    # Off by default: one log line per request costs real CPU at thousands of requests/s.
    access_log: bool = False
    # A generation request whose body arrives with its head runs on the connections'
    # callbacks (`proxy.fastpath`), without a task or ASGI messages: about a third of
    # the router's CPU per streamed request. Off: every request runs on the ASGI app.
    callback_path: bool = True


class TimeoutSettings(_Section):
    """Upstream timeouts in seconds.

    A streaming request has no total limit (a long generation is normal); it only has to
    start answering within `first_byte`. A non-streaming request must finish within `total`.
    """

    connect: float = Field(default=5.0, gt=0)
    first_byte: float = Field(default=60.0, gt=0)
    total: float = Field(default=600.0, gt=0)
    write: float = Field(default=30.0, gt=0)


class LimitSettings(_Section):
    """What one client may cost the router: body and request-head size, how long a request
    head and body may take to arrive (slowloris), idle keep-alive time, and open connections plus
    requests in progress (beyond `max_connections` new requests get 503); and what one backend
    answer may cost it (`max_response_*`, `max_stream_duration_s`)."""

    max_body_bytes: int = Field(default=32 * MIB, gt=0)
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    header_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=60.0, gt=0)
    keep_alive_timeout_s: float = Field(default=5.0, gt=0)
    max_connections: int = Field(default=4096, gt=0)
    # Request bodies held at once by this process (beyond it new requests get 503).
    max_inflight_body_bytes: int = Field(default=512 * MIB, gt=0)
    # What a backend may cost: a buffered (non-SSE) answer's body, its response head and
    # header count (502 beyond them), and optionally a stream's whole duration.
    max_response_body_bytes: int = Field(default=64 * MIB, gt=0)
    max_response_head_bytes: int = Field(default=64 * 1024, ge=1024)
    max_response_headers: int = Field(default=100, gt=0)
    max_stream_duration_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _a_whole_body_fits_the_budget(self) -> LimitSettings:
        if self.max_inflight_body_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_inflight_body_bytes ({self.max_inflight_body_bytes}) must be at least "
                f"max_body_bytes ({self.max_body_bytes}): a body of the largest allowed "
                "size would never be accepted")
        return self


class ShutdownSettings(_Section):
    """On SIGTERM `/ready` turns 503 and new requests are refused at once; requests in
    flight get up to `drain_timeout_s` to finish before the process exits."""

    drain_timeout_s: float = Field(default=30.0, ge=0)


class UpstreamSettings(_Section):
    """The client the router uses to talk to backends (see `specrouter.proxy.upstream`).

    `native` is a small HTTP/1.1 client on asyncio protocols and httptools with an O(1)
    keep-alive pool; `httpx` is the reference implementation, whose pool bookkeeping is
    quadratic in open connections and costs milliseconds per request at 100 streams.
    """

    transport: Literal["native", "httpx"] = "native"
    # Every in-flight stream holds one upstream connection; the pool must be bigger than
    # the largest batch a server runs, or requests queue in the router instead of SGLang.
    max_connections_per_backend: int = Field(default=1024, gt=0)
    # A released connection is kept while fewer than this many are idle, else closed: the
    # pool keeps as many as the concurrency it serves (every connection it may open, by
    # default), so a steady load opens none. Idle ones close on the server's keep-alive
    # timeout; the descriptor budget lowers this where RLIMIT_NOFILE cannot hold them.
    max_idle_per_backend: int = Field(default=1024, ge=0)
    # A generation the router leaves unfinished (recalled, client gone, backend silent) gets
    # `POST /abort_request` with its rid (`specrouter.proxy.abort`) and counts in flight
    # until the abort is acknowledged, or for at most `abandoned_hold_s`: SGLang's own
    # 4 s disconnect poll. 0 releases it at once.
    abort_abandoned: bool = True
    abandoned_hold_s: float = Field(default=4.0, ge=0, le=60)


class RetrySettings(_Section):
    """Retry before the first byte only: after it, a retry would duplicate output."""

    enabled: bool = True
    retry_statuses: tuple[int, ...] = (502, 503)


class TelemetrySettings(_Section):
    """Background polls of each server's load (/v1/loads, else /get_load, else /metrics).

    A sample older than 3 intervals is ignored (the load falls back to the router's own
    in-flight count), so a slow or dead server cannot pin a stale load on its group.

    A server whose last sample showed it idle, while no replica has a request in flight
    to its group, is polled every `idle_interval_s` instead (its sample then holds for 3 of
    those; a value below `interval_s` counts as `interval_s`): its load changes only when a
    request reaches it, and the router's own request brings the poll back to `interval_s`
    within one interval. Work that reaches it past the router shows within
    `idle_interval_s`.
    """

    enabled: bool = True
    interval_s: float = Field(default=0.1, gt=0)
    idle_interval_s: float = Field(default=1.0, gt=0)
    timeout_s: float = Field(default=2.0, gt=0)
    # The online cost model (routing/online.py): half-life of its readings, and the
    # pseudo-readings of its prior (a configured cost model seeds it instead).
    learn_half_life_s: float = Field(default=300.0, gt=0)
    learn_prior_weight: float = Field(default=4.0, gt=0)
    # Time constants of each group's sustained load (routing/learning.py): as it rises,
    # and as it falls (a lull between arrivals does not read as a light load).
    sustained_s: float = Field(default=5.0, gt=0)
    sustained_fall_s: float = Field(default=30.0, gt=0)
    # The online model's batch caps follow the engines' KV room (routing/online.py
    # `note_load`): off by default, since on the agentic trace alone it moved groups to
    # the baseline sooner and lost goodput (docs/policy.md section 9, "KV room").
    learn_kv_room: bool = False

    @property
    def idle_poll_s(self) -> float:
        """The idle servers' poll interval: never shorter than a busy server's."""
        return max(self.idle_interval_s, self.interval_s)


class CostProbeSettings(_Section):
    """Probes of a pool's decode step cost (proxy/shadow.py `CostProber`).

    A pool the online model has no reading of is priced from the other pool through fixed
    ratios that differ by model and GPU; a probe measures it instead: while the whole
    group is idle, a warm-up generation prefills a prefix of the traffic's context in
    tokens (unique to the probe), then for each of the pool's batches `batch`
    generations of that prefix and a few tokens of their own, once for one output token
    and once for `tokens`, sent together to the pool's server; the difference of their
    end-to-end latencies over the difference of their decode steps is one step at that
    batch and context. A pool read only by probes is probed again once the traffic's
    context is twice or half the probe's.
    A request arriving for the group cancels the probe.

    With shared state a probe runs only under its group's cluster-wide lock, which lives
    `timeout_s` + 4 s (the probe's own limit, its aborts and a margin) unless the probe
    releases it first; its readings are shared with every replica (proxy/shadow.py).
    """

    enabled: bool = True
    tokens: int = Field(default=64, ge=2, le=1024)
    # the context a probe decodes at: the mean prompt of the generations lately sent to
    # the group, at least `prompt_tokens` (all of it before any) and at most
    # `max_prompt_tokens` and half the pool's KV pool (routing/costprobe.py)
    prompt_tokens: int = Field(default=512, ge=1, le=32768)
    max_prompt_tokens: int = Field(default=32768, ge=1, le=1_048_576)
    # batches probed per pool: EAGLE-3's slope needs two (light traffic reads EAGLE-3
    # alone, at batch 1); the baseline's intercept is what the transfer from EAGLE-3's
    # curve gets wrong. Its slope the transfer gets right at short contexts only, but a
    # line through the baseline's readings at batches 1 and 4 or 1 and 16 lost more than
    # it won on the benchmarks (docs/policy.md section 5b, "At the traffic's context")
    eagle_batches: tuple[int, ...] = Field(default=(1, 4))
    baseline_batches: tuple[int, ...] = Field(default=(1,))
    # how often an idle group is checked for a pool without readings
    check_s: float = Field(default=1.0, gt=0)
    # start-up waits this long at most for each group's servers to be healthy and probed
    # before the router serves, so that its first decision prices both pools (0: probe
    # in the background only)
    startup_wait_s: float = Field(default=15.0, ge=0)
    # a probe's time limit, all its batches and rounds together
    timeout_s: float = Field(default=30.0, gt=0, le=600)

    @field_validator("eagle_batches", "baseline_batches")
    @classmethod
    def _positive(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(b < 1 or b > 64 for b in value):
            raise ValueError("batches must be between 1 and 64")
        return value

    @model_validator(mode="after")
    def _context_range(self) -> CostProbeSettings:
        if self.max_prompt_tokens < self.prompt_tokens:
            raise ValueError(f"max_prompt_tokens ({self.max_prompt_tokens}) is below "
                             f"prompt_tokens ({self.prompt_tokens})")
        return self

    def batches(self, pool: Pool) -> tuple[int, ...]:
        return self.eagle_batches if pool == "eagle" else self.baseline_batches


class HealthSettings(_Section):
    """Active health checks: `/ready` where the server has it, else `/health`.

    SGLang's `/health` runs a one-token generation (a second or more under load), hence
    its own, longer timeout; `/ready` is a cheap status read. SGLang's `/ready` still
    answers 200 when its scheduler is wedged, so where `/ready` is the check, a
    `/health_generate` (a generation SGLang does not queue behind a busy batch) also runs
    every `generation_check_s` (0: never), and at every check while the last one failed.
    SGLang answers it no sooner than 1 s (it polls for the output once a second), hence
    `generation_timeout_s` above that.
    """

    enabled: bool = True
    interval_s: float = Field(default=2.0, gt=0)
    ready_timeout_s: float = Field(default=2.0, gt=0)
    health_timeout_s: float = Field(default=8.0, gt=0)
    generation_check_s: float = Field(default=10.0, ge=0)
    generation_timeout_s: float = Field(default=8.0, gt=1.0)


class AdmissionSettings(_Section):
    """How the load-aware router admits requests to a lightly loaded group.

    Closed-loop clients, batch jobs and agents often send many requests at the same
    instant. Decided one by one, the first of such a burst sees an idle group and goes to
    EAGLE-3, then runs interleaved with the baseline's batch on the shared GPU and slows
    all of it. A request that would go to EAGLE-3 therefore waits until no other request
    arrived for `arrival_window_ms` (at most `arrival_max_wait_ms`: a burst whose clients
    connect one after another keeps the first ones waiting), and requests arriving
    meanwhile count as load; a burst still arriving at the cap counts twice. Only the
    EAGLE-3 regime pays it (one window at low load, a few ms on generations of seconds),
    and only where a plausible burst would change the decision: twice the most arrivals
    seen within one max wait over the last `arrival_memory_s` (over its life, for a router
    younger than that); 0 turns it off.

    A burst spread wider than the window still leaks requests to EAGLE-3. With
    `recall_unstarted`, when a group switches pools (under a strategy that moves whole
    groups), its streams on the pool it left that have not sent their first byte yet are
    cancelled there (SGLang aborts a request whose client left) and sent where a new
    request goes: no byte has reached the client, so the move is as invisible as a retry.
    Streams only: a non-streamed answer arrives whole at the end, so the router cannot
    tell a queued request from one that has decoded for a minute.
    """

    arrival_window_ms: float = Field(default=2.0, ge=0, le=1000)
    arrival_max_wait_ms: float = Field(default=16.0, ge=0, le=10000)
    # how long the largest burst seen is remembered (routing/arrivals.py)
    arrival_memory_s: float = Field(default=60.0, gt=0, le=86400)
    recall_unstarted: bool = True
    # After the first byte: a switch hands the started streams of the pool it left over
    # to the other pool as continuations (proxy/handover.py) while their contexts (prompt
    # and output so far, estimated tokens) total at most `handover_max_tokens` per
    # switch: that is what the new server prefills again, on a GPU its sibling shares,
    # ahead of the requests arriving then. 0 turns handovers off.
    handover_max_tokens: int = Field(default=8192, ge=0, le=1_000_000)


class AffinitySettings(_Section):
    """Prefix and session affinity (specrouter.routing.affinity, docs/policy.md).

    Each SGLang server caches the prompts it prefilled (its radix cache, as big as its KV
    pool); a request sent to another server prefills its whole prompt again on a GPU both
    servers of a group share. The router keeps an approximate index of the prompt blocks
    it sent to each backend, bounded by that server's KV pool (`cache_tokens`, or
    `cache_tokens_by_backend[name]`), and prices a move in prefill time
    (`prefill_ms_per_token`, the profile's per-token prefill cost: 0.021 ms for an 8B
    model on an H200) against the load difference (`load_ms` per request in flight) and,
    for an EAGLE-3 decision, against what EAGLE-3 saves on one answer
    (`expected_output_tokens` x the cost model's per-token saving, else
    `eagle_saving_ms_per_token`). A group holding less than `min_match` of a prompt is
    priced as holding none of it. A client names a conversation with the `x-session-id`
    header; with `session_home` (for several router replicas) a session is placed in the
    group its key hashes to, so that every replica agrees. A session seen within
    `session_live_s` counts against its server's cache: a new prefix that would push
    live sessions out of a full cache is priced as their re-prefill. `bytes_per_token`
    converts body bytes into tokens. The online cost model also takes its telemetry
    readings net of the prefill the router sent (`prefill_ms_per_token` times the
    uncached prompt tokens: routing/learning.py); with affinity off it has no prompt
    estimate and takes them whole.
    """

    enabled: bool = True
    block_bytes: int = Field(default=2048, ge=256, le=1 << 20)
    bytes_per_token: float = Field(default=4.0, gt=0, le=64)
    cache_tokens: int = Field(default=400_000, ge=1)
    cache_tokens_by_backend: dict[str, int] = Field(default_factory=dict)
    max_sessions: int = Field(default=100_000, ge=1)
    session_live_s: float = Field(default=30.0, gt=0, le=3600)
    prefill_ms_per_token: float = Field(default=0.021, ge=0, le=100)
    load_ms: float = Field(default=50.0, ge=0)
    balance_abs: float = Field(default=8.0, ge=0)
    balance_rel: float = Field(default=2.0, ge=1)
    min_match: float = Field(default=0.5, ge=0, le=1)
    session_home: bool = False
    expected_output_tokens: int = Field(default=256, ge=0)
    eagle_saving_ms_per_token: float = Field(default=2.0, ge=0)
    # the time per output token the operator's SLO allows, in ms as the router relays
    # streamed answers (first chunk to last over the tokens after the first): while the
    # servers holding a group's live sessions answer within it, the group does not move
    # them to a faster pool (0: no objective; routing/affinity/objective.py)
    tpot_slo_ms: float = Field(default=0.0, ge=0)
    # weight of one engine report of cached tokens in a backend's retention
    # (routing/affinity/retention.py)
    retention_weight: float = Field(default=0.2, gt=0, le=1)
    # a session whose turn on a backend came back with less than this share of the
    # index's prediction cached has no credit there until a turn comes back cached
    # (0: never)
    retention_lost_below: float = Field(default=0.5, ge=0, le=1)
    # whether the retention scales the index's prediction (and the lost credit counts),
    # or is measured and shown only (docs/policy.md section 9: applied, it lost goodput)
    retention_applied: bool = False

    @field_validator("cache_tokens_by_backend")
    @classmethod
    def _positive_caches(cls, value: dict[str, int]) -> dict[str, int]:
        bad = sorted(k for k, v in value.items() if v < 1)
        if bad:
            raise ValueError(f"cache_tokens_by_backend: {', '.join(bad)} must be at least 1")
        return value


#: The shortest admin token accepted without allow_weak_admin_token.
MIN_ADMIN_TOKEN_CHARS = 16
#: Placeholders found in examples, compared lower-case without punctuation.
_PLACEHOLDER_TOKENS = ("changeme", "replaceme", "password", "placeholder", "yourtoken")
#: Fewer distinct characters than this is a repeated pattern ("xxxx...", "abab..."): a
#: random 16-character hex token has fewer with probability below 1e-5.
_MIN_DISTINCT_CHARS = 5


def weak_admin_token(token: str) -> str | None:
    """Why `token` is too weak to guard policy writes, or None; the reason never quotes it."""
    if len(token) < MIN_ADMIN_TOKEN_CHARS:
        return f"shorter than {MIN_ADMIN_TOKEN_CHARS} characters"
    folded = re.sub(r"[^a-z0-9]", "", token.lower())
    if any(word in folded for word in _PLACEHOLDER_TOKENS):
        return "a placeholder from an example"
    if len(set(token)) < _MIN_DISTINCT_CHARS:
        return f"made of fewer than {_MIN_DISTINCT_CHARS} distinct characters"
    return None


class Settings(BaseSettings):
    """Everything `specrouter serve` needs; see the module docstring for precedence."""

    # hide_input_in_errors: the inputs hold the admin token and backend API keys, and a
    # ValidationError's text would otherwise print them.
    model_config = SettingsConfigDict(
        env_prefix="SPECROUTER_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        hide_input_in_errors=True,
    )

    listen: ListenSettings = Field(default_factory=ListenSettings)
    backends: list[BackendConfig] = Field(default_factory=list)
    # Optional explicit list of GPU groups: when given, each must have a server and each
    # server's group must be listed, which catches a typo in one server's `group`.
    groups: list[str] | None = None
    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    shutdown: ShutdownSettings = Field(default_factory=ShutdownSettings)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    retry: RetrySettings = Field(default_factory=RetrySettings)
    # `prefer_eagle`: the load-aware router starting in policy mode `eagle`.
    router: Literal["load_aware", "prefer_eagle"] = "load_aware"
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    cost_probe: CostProbeSettings = Field(default_factory=CostProbeSettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    affinity: AffinitySettings = Field(default_factory=AffinitySettings)
    # The policy in force at start-up; PUT/PATCH /policy change it at run time.
    policy: Policy = Field(default_factory=Policy)
    # Bearer token for policy writes; none configured means writes are refused. A weak one
    # (`weak_admin_token`) is refused at start-up unless allow_weak_admin_token is set
    # (SPECROUTER_ALLOW_WEAK_ADMIN_TOKEN=1), for a demo on loopback only.
    admin_token: SecretStr | None = None
    allow_weak_admin_token: bool = False
    # Policy write bodies are tiny: anything bigger is refused before parsing.
    admin_max_body_bytes: int = Field(default=64 * 1024, gt=0)
    # Shared state of router replicas: SPECROUTER_REDIS_URL, redis:// or rediss://,
    # credentials in the URL. None: the in-memory store, this process alone.
    redis_url: SecretStr | None = None
    # uvicorn worker processes (`serve --workers`); more than one needs redis_url.
    workers: int = Field(default=1, ge=1, le=256)
    # Key prefix, TTL and intervals of the store (StateSettings without redis_url).
    state: StateSettings = Field(default_factory=StateSettings)
    # Cost models of the `goodput` strategy: `cost_model` for every group,
    # `cost_models` per group (wins over `cost_model`). Read and checked at start-up.
    cost_model: CostModelSource | None = None
    cost_models: dict[str, CostModelSource] = Field(default_factory=dict)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        try:
            StateSettings(redis_url=value)
        except ValidationError as exc:  # the message is redacted by StateSettings
            raise ValueError(exc.errors(include_url=False, include_input=False)[0]["msg"]
                             .removeprefix("Value error, ")) from None
        return value

    @model_validator(mode="after")
    def _strong_admin_token(self) -> Settings:
        if self.admin_token is None or self.allow_weak_admin_token:
            return self
        weakness = weak_admin_token(self.admin_token.get_secret_value())
        if weakness:
            raise ValueError(
                f"admin_token: refused, the token is {weakness}; set a random one, e.g. "
                "SPECROUTER_ADMIN_TOKEN=$(openssl rand -hex 32), or "
                "SPECROUTER_ALLOW_WEAK_ADMIN_TOKEN=1 for a demo that nobody else can reach")
        return self

    @property
    def admin_token_warning(self) -> str | None:
        """The start-up warning for a weak admin token let through by
        allow_weak_admin_token; it never quotes the token."""
        if self.admin_token is None or not self.allow_weak_admin_token:
            return None
        weakness = weak_admin_token(self.admin_token.get_secret_value())
        return None if weakness is None else (
            f"admin_token is {weakness}, allowed by allow_weak_admin_token: anyone who can "
            "reach the router can guess it and rewrite the routing policy")

    def state_settings(self) -> StateSettings:
        """The store's settings: the `state` section plus the top-level `redis_url`."""
        return self.state.model_copy(update={"redis_url": self.redis_url})

    @model_validator(mode="after")
    def _consistent_backends(self) -> Settings:
        if not self.backends:
            raise ValueError(
                "no backends configured: give at least one with --backend, "
                "SPECROUTER_BACKENDS or `backends:` in the config file"
            )
        _check_unique("backend name", [b.name for b in self.backends])
        _check_unique("backend url", [b.url for b in self.backends])
        if self.groups is not None:
            _check_declared_groups(self.groups, self.backends)
        if self.state.redis_url is not None:
            raise ValueError("state.redis_url: give the URL as redis_url "
                             "(SPECROUTER_REDIS_URL or --redis-url), not inside `state`")
        unknown = sorted(set(self.cost_models) - set(self.group_names()))
        if unknown:
            raise ValueError(f"cost_models: no GPU group named {', '.join(unknown)} "
                             f"(groups: {', '.join(self.group_names())})")
        stray = sorted(set(self.affinity.cache_tokens_by_backend)
                       - {b.name for b in self.backends})
        if stray:
            raise ValueError(f"affinity.cache_tokens_by_backend: no backend named "
                             f"{', '.join(stray)}")
        if self.workers > 1 and self.redis_url is None:
            raise ValueError(
                f"workers: {self.workers} workers need shared state: set SPECROUTER_REDIS_URL "
                "(or --redis-url) to a redis:// URL, or run one worker"
            )
        return self

    def group_names(self) -> list[str]:
        """GPU groups in configuration order."""
        return list(dict.fromkeys(b.group for b in self.backends))

    def group_cost_models(self) -> dict[str, GroupCostModel]:
        """The cost model of each group that has one (its own entry, else `cost_model`)."""
        models: dict[str, GroupCostModel] = {}
        for group in self.group_names():
            source = self.cost_models.get(group, self.cost_model)
            if source is not None:
                models[group] = source.model()
        return models

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        file_source = _file_source(settings_cls, _CONFIG_FILE.get())
        if file_source is None:
            return init_settings, env_settings
        return init_settings, env_settings, file_source


def _check_unique(what: str, values: list[str]) -> None:
    duplicates = sorted(v for v, n in Counter(values).items() if n > 1)
    if duplicates:
        raise ValueError(f"duplicate {what}: {', '.join(duplicates)}")


def _check_declared_groups(groups: list[str], backends: list[BackendConfig]) -> None:
    _check_unique("group", groups)
    used = {b.group for b in backends}
    empty = [g for g in groups if g not in used]
    if empty:
        raise ValueError(f"group(s) with no server: {', '.join(empty)}")
    undeclared = sorted({b.name for b in backends if b.group not in groups})
    if undeclared:
        raise ValueError(
            f"backend(s) {', '.join(undeclared)} name a group that is not in `groups` "
            f"({', '.join(groups)})"
        )


_CONFIG_FILE: ContextVar[Path | None] = ContextVar("specrouter_config_file", default=None)


def _file_source(
    settings_cls: type[BaseSettings], path: Path | None
) -> PydanticBaseSettingsSource | None:
    if path is None:
        return None
    if path.suffix in (".yaml", ".yml"):
        return YamlConfigSettingsSource(settings_cls, yaml_file=path)
    return TomlConfigSettingsSource(settings_cls, toml_file=path)


@contextmanager
def _reading(path: Path | None) -> Iterator[None]:
    token = _CONFIG_FILE.set(path)
    try:
        yield
    finally:
        _CONFIG_FILE.reset(token)


def load_settings(
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build the settings from all sources, or raise ConfigError with a readable message.

    `overrides` are the CLI flags (nested dicts for sections). `environ` defaults to
    os.environ; it is only read for `SPECROUTER_CONFIG` when no file is given.
    """
    import os

    env = os.environ if environ is None else environ
    path = _resolve_config_path(config_file or env.get("SPECROUTER_CONFIG"))
    try:
        with _reading(path):
            return Settings(**dict(overrides or {}))
    except ValidationError as exc:
        raise ConfigError("invalid configuration:\n  "
                          + describe_validation_error(exc, separator="\n  ")) from None


def _resolve_config_path(raw: str | Path | None) -> Path | None:
    if not raw:
        return None
    path = Path(raw)
    if path.suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError(f"config file {path}: use a .yaml, .yml or .toml file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    return path


_BACKEND_KEYS = ("name", "url", "pool", "group", "api_key")


def parse_backend_spec(spec: str) -> dict[str, str]:
    """Parse one `--backend name=e0,url=http://h:1,pool=eagle,group=gpu0[,api_key=K]`."""
    fields: dict[str, str] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _BACKEND_KEYS:
            raise ConfigError(
                f"--backend {_redact(spec)!r}: expected comma-separated "
                f"key=value pairs with keys {', '.join(_BACKEND_KEYS)}"
            )
        if key in fields:
            raise ConfigError(f"--backend {_redact(spec)!r}: {key} given twice")
        fields[key] = value.strip()
    missing = [k for k in _BACKEND_KEYS[:4] if k not in fields]
    if missing:
        raise ConfigError(f"--backend {_redact(spec)!r}: missing {', '.join(missing)}")
    return fields


def _redact(spec: str) -> str:
    """The spec with any api_key value masked: error messages end up in logs."""
    return re.sub(r"(api_key=)[^,]*", r"\1***", spec)
