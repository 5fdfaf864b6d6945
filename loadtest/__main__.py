"""`python -m loadtest run|sweep|trace|openloop|overhead|peer|alternatives|connect-burst ...`.

The scenarios are listed in loadtest/__init__.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from loadtest import loopback
from loadtest.generator import LoadGenerator
from loadtest.metrics import SLO, RequestResult, summarize, write_csv, write_json
from loadtest.promptset import DEFAULT_PROMPTS, RequestShape, load_prompts
from loadtest.scenarios.common import run_async
from loadtest.traces import load_trace


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_common(parser: argparse.ArgumentParser, time_scale: float) -> None:
    parser.add_argument("--out", help="folder for JSON and CSV results")
    parser.add_argument("--input-tokens", type=int, default=1000,
                        help="prompt length to pad/trim to (4 characters per token)")
    parser.add_argument("--output-tokens", type=int, default=256,
                        help="max_tokens, with ignore_eos so every request generates them all")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--time-scale", type=float, default=time_scale,
                        help="simulator --time-scale; results are converted to simulated time")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name (default: the first of /v1/models)")
    parser.add_argument("--api", choices=["chat", "completions"], default="chat")
    parser.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    parser.add_argument("--header", action="append", default=[], metavar="NAME:VALUE")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL prompt file")
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", help="closed loop: comma-separated levels, e.g. 1,2,4")
    load.add_argument("--rate", help="open loop: Poisson arrivals per second, e.g. 0.5,1,2")
    load.add_argument("--trace", help="phased trace: a built-in name or a JSON file")
    parser.add_argument("--num-requests", type=int,
                        help="per level (default: 4 x concurrency, or 32 for --rate)")
    parser.add_argument("--duration", type=float, help="seconds per level instead of a count")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO: TTFT seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.05,
                        help="goodput SLO: seconds per output token")
    add_common(parser, time_scale=1.0)


def _headers(args: argparse.Namespace) -> dict[str, str]:
    headers: dict[str, str] = {}
    for item in args.header:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise SystemExit(f"--header {item!r}: expected NAME:VALUE")
        headers[name.strip()] = value.strip()
    if args.api_key:
        headers["authorization"] = f"Bearer {args.api_key}"
    return headers


def _model(args: argparse.Namespace, headers: dict[str, str]) -> str:
    if args.model:
        return str(args.model)
    response = loopback.get(f"{args.url.rstrip('/')}/v1/models", headers=headers, timeout=10.0)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def _run_levels(args: argparse.Namespace, gen: LoadGenerator
                      ) -> list[tuple[dict[str, Any], list[RequestResult]]]:
    out: list[tuple[dict[str, Any], list[RequestResult]]] = []
    if args.concurrency:
        for c in _ints(args.concurrency):
            n = None if args.duration else (args.num_requests or 4 * c)
            out.append(({"concurrency": c},
                        await gen.closed_loop(c, num_requests=n, duration=args.duration)))
    elif args.rate:
        for rate in _floats(args.rate):
            n = None if args.duration else (args.num_requests or 32)
            out.append(({"rate": rate},
                        await gen.open_loop(rate, duration=args.duration, num_requests=n)))
    else:
        out.append(({"trace": args.trace}, await gen.trace(load_trace(args.trace))))
    return out


def cmd_run(args: argparse.Namespace) -> int:
    headers = _headers(args)
    shape = RequestShape(_model(args, headers), args.input_tokens, args.output_tokens, args.api)
    gen = LoadGenerator(args.url.rstrip("/"), shape, load_prompts(args.prompts), seed=args.seed,
                        headers=headers, progress=not args.no_progress,
                        time_scale=args.time_scale)

    async def go() -> list[tuple[dict[str, Any], list[RequestResult]]]:
        async with gen:
            return await _run_levels(args, gen)

    levels = run_async(go())
    slo = SLO(args.slo_ttft, args.slo_tpot)
    summaries = [{**tag, **summarize(results, time_scale=args.time_scale, slo=slo)}
                 for tag, results in levels]
    for s in summaries:
        print(_one_line(s))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "run.json", {"url": args.url, "model": shape.model,
                                      "shape": vars(shape), "levels": summaries})
        write_csv(out / "requests.csv", [r for _, results in levels for r in results])
        print(f"wrote {out / 'run.json'} and {out / 'requests.csv'}")
    return 1 if all(s["completed"] == 0 for s in summaries) else 0


def _one_line(s: dict[str, Any]) -> str:
    tag = ", ".join(f"{k}={s[k]}" for k in ("concurrency", "rate", "trace") if k in s)
    return (f"{tag}: {s['completed']}/{s['requests']} ok, {s['output_tok_s']:.1f} tok/s, "
            f"{s['req_s']:.2f} req/s, TTFT p50/p99 {s['ttft']['p50'] * 1e3:.1f}/"
            f"{s['ttft']['p99'] * 1e3:.1f} ms, TPOT p50 {s['tpot']['p50'] * 1e3:.2f} ms, "
            f"e2e p50/p90/p99 {s['e2e']['p50']:.2f}/{s['e2e']['p90']:.2f}/"
            f"{s['e2e']['p99']:.2f} s, errors {s['errors']}")


def main(argv: list[str] | None = None) -> int:
    from loadtest.scenarios import (
        agentic,
        alternatives,
        connect_burst,
        openloop,
        overhead,
        peer,
        sweep,
        trace,
    )

    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_arguments(sub.add_parser("run", help="load any OpenAI-compatible endpoint"))
    scenarios = {"sweep": sweep, "trace": trace, "openloop": openloop, "overhead": overhead,
                 "peer": peer, "agentic": agentic, "alternatives": alternatives,
                 "connect-burst": connect_burst}
    for name, module in scenarios.items():
        p = sub.add_parser(name, help=(module.__doc__ or "").splitlines()[0])
        add_common(p, time_scale=module.DEFAULT_TIME_SCALE)
        p.add_argument("--quick", action="store_true", help="a short smoke version")
        module.add_arguments(p)
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            if args.trace:
                load_trace(args.trace)  # a bad trace fails before any request is sent
            return cmd_run(args)
        result = scenarios[args.command].main(args)
    except (ValueError, RuntimeError, OSError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.get("comparison", result.get("summary", {})), indent=2,
                     default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
