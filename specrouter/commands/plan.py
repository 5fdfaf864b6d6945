"""`specrouter plan`: memory flags for an EAGLE-3 + baseline pair on one GPU.

The arithmetic lives in `specrouter.commands.memplan` (pure, unit-tested); this module turns flags
into a `PlanInput`, prints the plan and the exact SGLang flags of both servers: the fraction,
the pool cap (`--max-total-tokens`) and the workspace flags the headroom is derived from.
The flag builder is shared with `specrouter launch-pair`, so what is printed is what is
launched.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from specrouter.commands.memplan import (
    GIB,
    PRESETS,
    SGLANG_VERSIONS,
    ModelShape,
    Plan,
    PlanError,
    PlanInput,
    Role,
    ServerPlan,
    ServerWant,
    Workspace,
    plan_pair,
    sglang_reserve_gib,
)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The planner's inputs; `launch-pair` adds these too."""
    mem = parser.add_argument_group("memory")
    mem.add_argument("--gpu-mem-gib", type=float, required=True,
                     help="free memory of the idle GPU in GiB (nvidia-smi's free / 1024)")
    mem.add_argument("--model-gib", type=float, required=True, help="target weights, GiB")
    mem.add_argument("--draft-gib", type=float, required=True, help="EAGLE-3 draft weights, GiB")
    mem.add_argument("--headroom-gib", type=float,
                     help="activations + CUDA graphs per server, GiB (default: SGLang's own "
                          "reserve for the pinned workspace flags)")
    mem.add_argument("--eagle-headroom-gib", type=float, help="override for the EAGLE server")
    mem.add_argument("--baseline-headroom-gib", type=float, help="override for the baseline")
    mem.add_argument("--sglang-version", choices=SGLANG_VERSIONS, default="0.5.23",
                     help="SGLang's reserve rule and flag names to follow (default 0.5.23)")
    mem.add_argument("--chunked-prefill-size", type=int, default=8192,
                     help="pinned on both servers; bounds prefill activations (default 8192)")
    mem.add_argument("--eagle-cuda-graph-max-bs", type=int,
                     help="decode CUDA graph batch size, EAGLE (default: its max running)")
    mem.add_argument("--baseline-cuda-graph-max-bs", type=int,
                     help="decode CUDA graph batch size, baseline (default: its max running)")
    mem.add_argument("--cuda-context-gib", type=float, default=0.52,
                     help="CUDA context of each process (0.516 GiB measured on an H200)")
    mem.add_argument("--eagle-kv-tokens", type=int, required=True,
                     help="KV pool wanted for the EAGLE server, tokens")
    mem.add_argument("--baseline-kv-tokens", type=int,
                     help="KV pool wanted for the baseline (default: all that is left)")
    mem.add_argument("--first", choices=("eagle", "baseline"), default="eagle",
                     help="which server starts first (default eagle)")
    shape = parser.add_argument_group("KV bytes per token")
    shape.add_argument("--model-shape", choices=sorted(PRESETS), help="preset model shape")
    shape.add_argument("--layers", type=int)
    shape.add_argument("--kv-heads", type=int)
    shape.add_argument("--head-dim", type=int)
    shape.add_argument("--dtype-bytes", type=int, default=2, help="KV dtype size (bf16: 2)")
    shape.add_argument("--kv-bytes-per-token", type=int, help="target KV bytes per token")
    shape.add_argument("--draft-layers", type=int, default=1, help="EAGLE-3 draft layers")
    shape.add_argument("--draft-kv-bytes-per-token", type=int,
                       help="draft KV bytes per token (default: draft layers x per-layer)")
    srv = parser.add_argument_group("servers")
    srv.add_argument("--model-path", default="meta-llama/Llama-3.1-8B-Instruct")
    srv.add_argument("--draft-model-path", default="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    srv.add_argument("--host", default="0.0.0.0")
    srv.add_argument("--eagle-port", type=int, default=30000)
    srv.add_argument("--baseline-port", type=int, default=30001)
    srv.add_argument("--speculative-num-steps", type=int, default=5)
    srv.add_argument("--speculative-eagle-topk", type=int, default=4)
    srv.add_argument("--speculative-num-draft-tokens", type=int, default=8)
    srv.add_argument("--eagle-max-running-requests", type=int, default=48)
    srv.add_argument("--baseline-max-running-requests", type=int, default=256)
    srv.add_argument("--eagle-extra-args", default="",
                     help="more SGLang flags for the EAGLE server, one shell-quoted string "
                          "(split like a shell does, no templating); write it "
                          "--eagle-extra-args='--flag value' since it starts with --")
    srv.add_argument("--baseline-extra-args", default="", help="same, baseline server")
    srv.add_argument("--eagle-arg", action="append", default=[],
                     help="one more SGLang argument for the EAGLE server, verbatim "
                          "(repeatable; after --eagle-extra-args)")
    srv.add_argument("--baseline-arg", action="append", default=[], help="same, baseline")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_plan_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def plan_input_from_args(args: argparse.Namespace) -> PlanInput:
    """Flags -> PlanInput; raises PlanError on a missing or contradictory shape."""
    _check_inputs(args)
    target_bpt, draft_bpt = _bytes_per_token(args)
    headroom = {role: _headroom(args, role) for role in ("eagle", "baseline")}
    return PlanInput(
        gpu_free_gib=args.gpu_mem_gib,
        eagle=ServerWant("eagle", args.model_gib, target_bpt + draft_bpt, args.eagle_kv_tokens,
                         headroom["eagle"], draft_gib=args.draft_gib),
        baseline=ServerWant("baseline", args.model_gib, target_bpt, args.baseline_kv_tokens,
                            headroom["baseline"]),
        first=args.first,
        cuda_context_gib=args.cuda_context_gib,
    )


def workspace(args: argparse.Namespace, role: Role) -> Workspace:
    """The pinned workspace flags of one server; the graph batch defaults to its running cap
    (SGLang caps its own default there too)."""
    max_bs = getattr(args, f"{role}_cuda_graph_max_bs")
    if max_bs is None:
        max_bs = getattr(args, f"{role}_max_running_requests")
    return Workspace(chunked_prefill_size=args.chunked_prefill_size, cuda_graph_max_bs=max_bs)


def _headroom(args: argparse.Namespace, role: Role) -> float:
    explicit = _pick(getattr(args, f"{role}_headroom_gib"), args.headroom_gib)
    if explicit is not None:
        return float(explicit)
    return sglang_reserve_gib(args.gpu_mem_gib, workspace(args, role),
                              speculative=role == "eagle", version=args.sglang_version)


def _check_inputs(args: argparse.Namespace) -> None:
    """Nonsense sizes would give a plausible-looking but meaningless plan: refuse them."""
    positive = {"--gpu-mem-gib": args.gpu_mem_gib, "--model-gib": args.model_gib,
                "--eagle-kv-tokens": args.eagle_kv_tokens,
                "--chunked-prefill-size": args.chunked_prefill_size,
                "--eagle-max-running-requests": args.eagle_max_running_requests,
                "--baseline-max-running-requests": args.baseline_max_running_requests}
    non_negative = {"--draft-gib": args.draft_gib, "--headroom-gib": args.headroom_gib,
                    "--eagle-headroom-gib": args.eagle_headroom_gib,
                    "--baseline-headroom-gib": args.baseline_headroom_gib,
                    "--cuda-context-gib": args.cuda_context_gib,
                    "--baseline-kv-tokens": args.baseline_kv_tokens,
                    "--eagle-cuda-graph-max-bs": args.eagle_cuda_graph_max_bs,
                    "--baseline-cuda-graph-max-bs": args.baseline_cuda_graph_max_bs}
    for flag, value in positive.items():
        if value <= 0:
            raise PlanError(f"{flag} must be > 0, got {value}")
    for flag, value in non_negative.items():
        if value is not None and value < 0:
            raise PlanError(f"{flag} must be >= 0, got {value}")
    for role in ("eagle", "baseline"):
        extra_args(args, role)  # an unbalanced quote is refused before anything starts


def _pick(value: float | None, default: float | None) -> float | None:
    return default if value is None else value


def extra_args(args: argparse.Namespace, role: Role) -> list[str]:
    """`--{role}-extra-args` split like a shell splits it, then each `--{role}-arg` as it is;
    braces and all are literal."""
    text = getattr(args, f"{role}_extra_args", "") or ""
    try:
        split = shlex.split(text)
    except ValueError as exc:
        raise PlanError(f"--{role}-extra-args {text!r}: {exc}") from None
    verbatim: list[str] = getattr(args, f"{role}_arg", None) or []
    return split + verbatim


def _bytes_per_token(args: argparse.Namespace) -> tuple[int, int]:
    shape = _shape(args)
    if args.kv_bytes_per_token is not None:
        target = int(args.kv_bytes_per_token)
    elif shape is not None:
        target = shape.bytes_per_token()
    else:
        raise PlanError("give --model-shape, or --layers/--kv-heads/--head-dim, "
                        "or --kv-bytes-per-token")
    if args.draft_kv_bytes_per_token is not None:
        draft = int(args.draft_kv_bytes_per_token)
    elif shape is not None:
        draft = shape.bytes_per_token(layers=args.draft_layers)
    else:
        raise PlanError("with --kv-bytes-per-token, also give --draft-kv-bytes-per-token")
    if target <= 0 or draft < 0:
        raise PlanError("KV bytes per token must be positive")
    return target, draft


def _shape(args: argparse.Namespace) -> ModelShape | None:
    explicit = (args.layers, args.kv_heads, args.head_dim)
    if all(v is not None for v in explicit):
        return ModelShape(args.layers, args.kv_heads, args.head_dim, args.dtype_bytes)
    if any(v is not None for v in explicit):
        raise PlanError("--layers, --kv-heads and --head-dim go together")
    if args.model_shape is not None:
        return PRESETS[args.model_shape]
    return None


def server_args(plan: Plan, role: Role, args: argparse.Namespace) -> list[str]:
    """SGLang `launch_server` arguments for one server of the pair (no program name)."""
    server = plan.by_role(role)
    port = args.eagle_port if role == "eagle" else args.baseline_port
    space = workspace(args, role)
    graph_flag = ("--cuda-graph-max-bs-decode" if args.sglang_version == "0.5.23"
                  else "--cuda-graph-max-bs")
    argv = [
        "--model-path", args.model_path,
        "--host", args.host,
        "--port", str(port),
        "--mem-fraction-static", f"{server.mem_fraction_static}",
        "--max-total-tokens", str(server.max_total_tokens),
        "--chunked-prefill-size", str(space.chunked_prefill_size),
        graph_flag, str(space.cuda_graph_max_bs),
        # the router's telemetry reads /metrics; its affinity reads each answer's cached
        # tokens (usage.prompt_tokens_details) to tell a server that evicts its sessions
        "--enable-metrics", "--enable-cache-report",
    ]
    if role == "eagle":
        argv += [
            "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", args.draft_model_path,
            "--speculative-num-steps", str(args.speculative_num_steps),
            "--speculative-eagle-topk", str(args.speculative_eagle_topk),
            "--speculative-num-draft-tokens", str(args.speculative_num_draft_tokens),
            "--max-running-requests", str(args.eagle_max_running_requests),
        ]
    else:
        argv += ["--max-running-requests", str(args.baseline_max_running_requests)]
    return argv + extra_args(args, role)


def render_text(plan: Plan, args: argparse.Namespace) -> str:
    lines = [f"GPU free before either server: {plan.gpu_free_gib:.2f} GiB"]
    for server in plan.servers:
        lines += _describe(server)
    lines.append(f"left unused with both at their peaks: {plan.unused_gib:.2f} GiB")
    lines += [f"note: {n}" for n in plan.notes]
    for server in plan.servers:
        flags = " \\\n    ".join(_pairs(server_args(plan, server.role, args)))
        lines += ["", f"# {server.role} (start #{server.order})",
                  f"python -m sglang.launch_server \\\n    {flags}"]
    return "\n".join(lines)


def _describe(server: ServerPlan) -> list[str]:
    draft = f" + draft {server.draft_gib:.2f}" if server.draft_gib else ""
    return [
        f"{server.order}. {server.role}: --mem-fraction-static {server.mem_fraction_static}"
        f" --max-total-tokens {server.max_total_tokens}"
        f"  (free at start >= {server.free_at_start_gib:.2f} GiB)",
        f"   KV capacity {server.max_total_tokens} tokens, which is also its prefix-cache "
        f"capacity ({server.kv_pool_gib:.2f} GiB)",
        f"   weights {server.weights_gib:.2f}{draft} + KV {server.kv_pool_gib:.2f}"
        f" + headroom {server.headroom_gib:.2f} + CUDA context = peak {server.peak_gib:.2f} GiB",
    ]


def _pairs(argv: list[str]) -> list[str]:
    """Group `--flag value` pairs so the printed command reads one flag per line."""
    out: list[str] = []
    for item in argv:
        if out and not item.startswith("--") and out[-1].startswith("--") and " " not in out[-1]:
            out[-1] = f"{out[-1]} {item}"
        else:
            out.append(item)
    return out


def plan_to_json(plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    data = plan.to_dict()
    data["flags"] = {s.role: server_args(plan, s.role, args) for s in plan.servers}
    data["gib"] = GIB
    return data


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_pair(plan_input_from_args(args))
    except PlanError as exc:
        if args.json:
            print(json.dumps({"error": str(exc)}))
        else:
            print(f"specrouter plan: refused: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_to_json(plan, args), indent=2))
    else:
        print(render_text(plan, args))
    return 0
