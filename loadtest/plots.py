"""PNG plots for the report (matplotlib, Agg backend: no display on a server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtest.scenarios.openloop import judged_ttft

STYLE = {"eagle": ("tab:orange", "o", "eagle-only"),
         "baseline": ("tab:blue", "s", "baseline-only"),
         "router": ("tab:green", "D", "specrouter"),
         "router-w0": ("tab:olive", "v", "specrouter, arrival window 0"),
         "router-goodput": ("tab:purple", "^", "specrouter, goodput strategy"),
         "router-goodput-noprobe": ("tab:pink", "<", "specrouter, goodput, no probes"),
         "router-calibrated": ("tab:cyan", "P", "specrouter, calibrated policy")}


def _label(axes: Any, profile: str, xlabel: str,
           panels: tuple[tuple[str, str], ...]) -> None:
    """Title (profile: what), axis labels and grid of each panel."""
    for ax, (title, ylabel) in zip(axes, panels, strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{profile}: {title}")
        ax.grid(True, alpha=0.3)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_plot(profile: str, configs: dict[str, Any], path: Path) -> Path:
    """Throughput and median latency against concurrency, one line per config."""
    fig, (tput, lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    for config, data in configs.items():
        levels = data.get("levels") or []
        if not levels:
            continue
        color, marker, label = STYLE.get(config, ("gray", "x", config))
        xs = [lv["concurrency"] for lv in levels]
        tput.plot(xs, [lv["output_tok_s"] for lv in levels], color=color, marker=marker,
                  label=label)
        lat.plot(xs, [lv["e2e"]["p50"] for lv in levels], color=color, marker=marker,
                 label=label)
    _label((tput, lat), profile, "concurrent requests (closed loop)",
           (("output throughput", "tokens/s"), ("median request latency", "seconds")))
    for ax in (tput, lat):
        ax.set_xscale("log", base=2)
        ax.legend()
    return _save(fig, path)


def trace_plot(trace: dict[str, Any], path: Path) -> Path:
    """Goodput over time per config; below, the router's share of new requests sent to
    EAGLE-3 with its switch events; phase boundaries shaded."""
    fig, (good, share) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    bin_s = trace["settings"]["bin_s"]
    for config, data in trace["configs"].items():
        bins = data.get("timeline") or []
        if not bins:
            continue
        color, _, label = STYLE.get(config, ("gray", "x", config))
        ts = [b["t"] + bin_s / 2 for b in bins]
        good.plot(ts, [b["goodput_tok_s"] for b in bins], color=color, label=f"{label} goodput")
        good.plot(ts, [b["output_tok_s"] for b in bins], color=color, alpha=0.35,
                  linestyle="--", label=f"{label} throughput")
    any_router = False
    for config, data in trace["configs"].items():
        bins = data.get("timeline") or []
        if not config.startswith("router") or not bins:
            continue
        any_router = True
        color, _, label = STYLE.get(config, ("gray", "x", config))
        pts = [(b["t"] + bin_s / 2, b["eagle_share"]) for b in bins if b["eagle_share"] is not None]
        share.step([t for t, _ in pts], [v for _, v in pts], where="mid", color=color,
                   label=f"{label}: share of new requests to EAGLE-3")
        events = data.get("switch_events", [])
        for event in events[:300]:
            share.axvline(event["t"], color=color, alpha=0.3, linewidth=0.8, linestyle=":")
        share.plot([], [], color=color, alpha=0.6, linestyle=":",
                   label=f"{label}: switch events ({len(events)})")
    start = 0.0
    for i, phase in enumerate(trace["phases"]):
        end = start + phase["duration_s"]
        for ax in (good, share):
            if i % 2:
                ax.axvspan(start, end, color="gray", alpha=0.08)
        good.text((start + end) / 2, 1.0, phase["name"], transform=good.get_xaxis_transform(),
                  ha="center", va="bottom", fontsize=8)
        start = end
    good.set_ylabel("tokens/s (simulated)")
    good.grid(True, alpha=0.3)
    good.legend(fontsize=7, ncol=3, loc="center left", framealpha=0.9)
    share.set_ylabel("EAGLE-3 share")
    share.set_ylim(-0.05, 1.05)
    share.set_xlabel("time (simulated seconds)")
    share.grid(True, alpha=0.3)
    if any_router:
        share.legend(fontsize=7, loc="center right", framealpha=0.9)
    fig.suptitle(f"trace {trace['settings']['trace']} ({trace['settings']['profile']})")
    return _save(fig, path)


def openloop_plot(profile: str, data: dict[str, Any], path: Path) -> Path:
    """Median end-to-end latency, TTFT p99 (the one the target judges:
    `openloop.judged_ttft`) and throughput against the Poisson rate, one line per config
    (the burst pattern is in the report's table, not here)."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for config, cfg in data.get("configs", {}).items():
        rows = [lv for lv in cfg.get("loads", []) if lv.get("rate") is not None]
        if not rows:
            continue
        color, marker, label = STYLE.get(config, ("gray", "x", config))
        xs = [lv["rate"] for lv in rows]
        for ax, values in zip(axes, ([lv["e2e"]["p50"] for lv in rows],
                                     [judged_ttft(lv)["p99"] for lv in rows],
                                     [lv["output_tok_s"] for lv in rows]), strict=True):
            ax.plot(xs, values, color=color, marker=marker, label=label)
    _label(axes, profile, "Poisson arrival rate (requests/s, simulated)",
           (("median end-to-end latency", "seconds"), ("TTFT p99 deployed", "seconds"),
            ("output throughput", "tokens/s")))
    for ax in axes:
        ax.set_xscale("log")
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    return _save(fig, path)


AGENTIC_STYLE = {**STYLE,
                 "router": ("tab:green", "D", "specrouter (affinity)"),
                 "router-noaffinity": ("tab:olive", "v", "specrouter, no affinity"),
                 "router-slo": ("tab:cyan", "P", "specrouter (affinity), TPOT SLO stated"),
                 "sglang-cache_aware": ("tab:red", "X", "sglang-router cache_aware"),
                 "sglang-round_robin": ("tab:brown", "x", "sglang-router round_robin"),
                 "adaptive": ("tab:gray", "*", "adaptive engine (one per GPU)")}


def agentic_plot(profile: str, levels: list[dict[str, Any]], path: Path) -> Path:
    """Goodput, cached-token share and TTFT p99 against the session arrival rate, one line
    per config."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    configs = {c for lv in levels for c in lv.get("configs", {})}
    for config in sorted(configs):
        rows = [(lv["rate"], lv["configs"][config]) for lv in levels
                if "error" not in lv.get("configs", {}).get(config, {"error": ""})]
        if not rows:
            continue
        color, marker, label = AGENTIC_STYLE.get(config, ("gray", "x", config))
        xs = [rate for rate, _ in rows]
        series = ([v["goodput_tok_s"] for _, v in rows],
                  [100.0 * (v.get("cached_share") or 0.0) for _, v in rows],
                  [v["ttft"]["p99"] for _, v in rows])
        for ax, values in zip(axes, series, strict=True):
            ax.plot(xs, values, color=color, marker=marker, label=label)
    _label(axes, profile, "session arrival rate (sessions/s, simulated)",
           (("goodput (turns within the SLO)", "tokens/s"), ("cached-token share", "%"),
            ("TTFT p99", "seconds")))
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    return _save(fig, path)
