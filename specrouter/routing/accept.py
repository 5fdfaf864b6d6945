"""The accept-length estimate of a group's EAGLE-3 server, from its telemetry readings.

Two averages of the readings: a fast one that the goodput decisions use, and a slow
trend whose recent peak gates the goodput shadow probe. The readings are windowed means
(SGLang's /metrics gauge over its last 40 decode batches), never the lifetime mean of
/v1/loads or /server_info. Each engine window counts once, and by the requests behind
it. Pure: readings come from a `GroupView`, the estimate is returned, never mutated.
docs/policy.md section 5 has the measurements behind the constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, Field

from specrouter.observe.loadview import GroupView

#: EWMA weight of the slow accept trend (the fast average's is `accept_smoothing`): slow
#: enough that the scatter of single readings does not make its peak.
TREND_WEIGHT = 0.1
#: A reading that averages this many requests gets the plain EWMA weight; fewer, less;
#: more, more, up to MAX_BATCH.
REFERENCE_BATCH = 4
MAX_BATCH = 16
#: Windows that renew the reading after a quiet period: SGLang folds its gauge every 40
#: decode batches counted across the gap, so the first window holds steps from before it.
RENEW_WINDOWS = 2
#: Reference readings the trend must hold before its peak counts (about 1 / its weight).
PEAK_MIN_EVIDENCE = 10.0


class AcceptParams(BaseModel):
    """The policy fields the estimate reads (flat in the /policy document)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # EWMA weight of each new accept-length reading (1 = no smoothing)
    accept_smoothing: float = Field(default=0.3, gt=0, le=1)
    # While goodput keeps a group on the baseline and its EAGLE-3 server is idle, its
    # accept length is re-measured at most this often by a shadow probe (a copy of the
    # routed request, cut to `goodput_probe_tokens`, sent to the EAGLE-3 server and
    # discarded), and only when the trend's peak would put EAGLE-3 ahead by
    # `goodput_margin`. 0: never. The estimate's staleness decay follows this period.
    goodput_probe_s: float = Field(default=30.0, ge=0)
    # How long the trend's peak is remembered: after this long at a lower accept length
    # the workload counts as changed for good and probing stops.
    goodput_probe_memory_s: float = Field(default=600.0, gt=0)


@dataclass(frozen=True)
class AcceptEstimate:
    """The averages and what they already include (reading times are monotonic s)."""

    ewma: float | None = None  # the fast average
    seen_at: float | None = None  # the newest reading seen, folded in or not
    trend: float | None = None
    evidence: float = 0.0  # reference readings folded into the trend
    # the engine window last folded in (EngineSample.accept_window; for a source without
    # one, the idle server's accept length)
    last_snapshot: tuple[float, ...] | None = None
    folded_at: float = float("-inf")  # reading time of the last reading folded in
    # after a quiet period: windows still to fold against the decayed average, and
    # the time of the last reading before the gap
    renew_left: int = 0
    renew_from: float = float("-inf")
    peak: float | None = None  # the trend's highest value within goodput_probe_memory_s
    peak_at: float = float("-inf")


def ewma(previous: float | None, sample: float, alpha: float) -> float:
    """Exponentially weighted mean; the first sample is taken as is."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError("alpha must be in (0, 1]")
    return sample if previous is None else previous + alpha * (sample - previous)


def fold(params: AcceptParams, group: GroupView, estimate: AcceptEstimate,
         nominal: float | None = None) -> AcceptEstimate:
    """`estimate` with the group's newest EAGLE-3 reading folded in.

    A reading already seen, or a window already folded in, changes nothing but
    `seen_at`. The fast average starts at `nominal` (the cost model's accept length)
    when given, so a lone first reading moves it by its weight instead of replacing it.
    """
    accept, seen_at = group.eagle_accept()
    if accept is None or seen_at is None or accept <= 0:
        return estimate
    if estimate.seen_at is not None and seen_at <= estimate.seen_at:
        return estimate
    batch = group.eagle_accept_batch()
    idle = batch is not None and batch <= 0
    known = group.eagle_accept_window()
    snapshot = known if known is not None else (accept,) if idle else None
    if snapshot is not None and snapshot == estimate.last_snapshot:
        return replace(estimate, seen_at=seen_at)  # the engine repeats its window
    evidence = _reading_evidence(batch)
    keep, renew_left, renew_from = _kept_weight(params, estimate, seen_at, idle,
                                                known is not None)
    trend = ewma(estimate.trend, accept, _weight(TREND_WEIGHT, evidence, keep))
    start = estimate.ewma if estimate.ewma is not None else nominal
    fast = ewma(start, accept, _weight(params.accept_smoothing, evidence, keep))
    estimate = replace(estimate, ewma=fast, seen_at=seen_at, trend=trend,
                       evidence=estimate.evidence + evidence, last_snapshot=snapshot,
                       folded_at=seen_at, renew_left=renew_left, renew_from=renew_from)
    if estimate.evidence < PEAK_MIN_EVIDENCE:
        return estimate  # the trend is still mostly its first readings
    if (estimate.peak is None or trend >= estimate.peak
            or seen_at - estimate.peak_at > params.goodput_probe_memory_s):
        estimate = replace(estimate, peak=trend, peak_at=seen_at)
    return estimate


def _kept_weight(params: AcceptParams, estimate: AcceptEstimate, seen_at: float, idle: bool,
                 whole_window: bool) -> tuple[float, int, float]:
    """(keep, renew_left, renew_from): the weight the average keeps against this reading
    (`_freshness`), and the renewal after a quiet period it is in."""
    # Only new steps outweigh a stale average: an idle server's window holds old ones.
    fresh_steps = estimate.ewma is not None and not idle
    keep = _freshness(params, seen_at - estimate.folded_at) if fresh_steps else 1.0
    renew_left, renew_from = estimate.renew_left, estimate.renew_from
    if not whole_window or estimate.ewma is None:
        return keep, renew_left, renew_from
    if renew_left == 0 and fresh_steps and keep < 0.5:
        renew_left, renew_from = RENEW_WINDOWS, estimate.folded_at
    if renew_left > 0:  # a window after the gap still holds steps from before it
        return _freshness(params, seen_at - renew_from), renew_left - 1, renew_from
    return keep, renew_left, renew_from


def _reading_evidence(batch: int | None) -> float:
    """How many reference readings one reading is worth: its scatter falls with the
    square root of the requests it averages, so `batch` requests count
    batch / REFERENCE_BATCH times (capped); an idle server's reading or one without a
    request count counts once."""
    if batch is None:
        return 1.0
    return min(max(batch, 1), MAX_BATCH) / REFERENCE_BATCH


def _weight(alpha: float, evidence: float, keep: float = 1.0) -> float:
    """The EWMA weight of a reading worth `evidence` reference readings, against an
    average that kept `keep` of its own weight since its last reading."""
    new = 1.0 - (1.0 - alpha) ** evidence
    return float(new / (new + keep * (1.0 - new)))


def _freshness(params: AcceptParams, age_s: float) -> float:
    """The weight an average keeps after `age_s` without a reading: it decays with a
    time constant of a quarter probe period, so that a probe's few readings can move it.
    Without probes nothing re-measures it, and it keeps its weight."""
    if params.goodput_probe_s <= 0:
        return 1.0
    return math.exp(-max(0.0, age_s) / (params.goodput_probe_s / 4))
