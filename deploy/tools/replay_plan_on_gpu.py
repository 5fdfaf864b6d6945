"""Replay a `specrouter plan --json` on a real GPU, allocating memory in SGLang's order.

Not SGLang itself (no weights needed, PyTorch only): each server is a process that does what
SGLang does with GPU memory, in SGLang's order, on the real CUDA allocator:

  start-up: create its CUDA context; total = free memory (torch.cuda.mem_get_info);
            load the weights (target, and the draft before the pool as SGLang 0.5.23 does,
            or after it as 0.5.10 does: --draft-after-pool);
            rest = free - total * (1 - fraction); pool = min(rest // cell, max_total_tokens)
            (without the cap with --uncapped); allocate the pool; report ready.
  serving:  allocate its activations and CUDA graphs (the plan's headroom) only when told,
            i.e. lazily, as SGLang allocates them when it serves.

The second server starts when the first reports ready, before any activation exists (the
memory the first will use when it serves is free when the second measures). Once both are
ready, both allocate their headroom (both at their peak at once) and the GPU's free memory
is printed. Exit 0 when the plan fits: each pool is the planned size and both peaks fit.

  specrouter plan ... --json > plan.json
  python deploy/tools/replay_plan_on_gpu.py plan.json [--uncapped] [--draft-after-pool]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

GIB = 1 << 30


def server(spec: dict[str, Any], capped: bool, draft_after_pool: bool) -> int:
    import torch

    def out(**data: Any) -> None:
        print(json.dumps(data), flush=True)

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the CUDA context
    total = torch.cuda.mem_get_info()[0] / GIB
    held = [torch.empty(int(spec["weights_gib"] * GIB), dtype=torch.uint8, device="cuda")]
    draft = int(spec.get("draft_gib", 0.0) * GIB)
    if draft and not draft_after_pool:
        held.append(torch.empty(draft, dtype=torch.uint8, device="cuda"))
    avail = torch.cuda.mem_get_info()[0] / GIB
    rest = avail - total * (1 - spec["mem_fraction_static"])
    bpt = int(spec["kv_bytes_per_token"])
    tokens = int(rest * GIB) // bpt
    if capped:
        tokens = min(tokens, int(spec["max_total_tokens"]))
    held.append(torch.empty(tokens * bpt, dtype=torch.uint8, device="cuda"))
    if draft and draft_after_pool:
        held.append(torch.empty(draft, dtype=torch.uint8, device="cuda"))
    out(state="ready", total_at_start_gib=round(total, 3), kv_tokens=tokens,
        free_when_ready_gib=round(torch.cuda.mem_get_info()[0] / GIB, 3))
    sys.stdin.readline()  # "serve": the parent says both servers are up
    try:
        held.append(torch.empty(int(spec["headroom_gib"] * GIB), dtype=torch.uint8,
                                device="cuda"))
    except torch.OutOfMemoryError:
        out(state="oom", free_gib=round(torch.cuda.mem_get_info()[0] / GIB, 3))
        return 1
    out(state="serving", free_gib=round(torch.cuda.mem_get_info()[0] / GIB, 3))
    sys.stdin.read()  # hold the memory until the parent closes stdin
    return 0


def _read(child: subprocess.Popen[str]) -> dict[str, Any]:
    assert child.stdout is not None
    line = child.stdout.readline()
    return json.loads(line) if line else {"state": "died", "code": child.wait()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan")
    parser.add_argument("--uncapped", action="store_true",
                        help="leave out --max-total-tokens (the pool takes all it measures)")
    parser.add_argument("--draft-after-pool", action="store_true",
                        help="load the draft after the pool (SGLang 0.5.10)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    with open(args.plan) as fh:
        plan = json.load(fh)
    if args.child is not None:
        return server(plan["servers"][args.child], not args.uncapped, args.draft_after_pool)
    children: list[subprocess.Popen[str]] = []
    ok = True
    try:
        for index, spec in enumerate(plan["servers"]):
            argv = [sys.executable, __file__, args.plan, "--child", str(index)]
            argv += ["--uncapped"] if args.uncapped else []
            argv += ["--draft-after-pool"] if args.draft_after_pool else []
            child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
            children.append(child)
            got = _read(child)
            if got["state"] != "ready":
                print(f"{spec['role']}: failed to start: {got}")
                return 1
            fits = got["kv_tokens"] == spec["max_total_tokens"]
            ok &= fits
            print(f"{spec['role']}: started with {got['total_at_start_gib']} GiB free "
                  f"(plan: at least {spec['free_at_start_gib']}), KV pool {got['kv_tokens']} "
                  f"tokens (plan {spec['max_total_tokens']}{'' if fits else ', DIFFERS'}), "
                  f"GPU free once ready {got['free_when_ready_gib']} GiB")
        for child in children:  # both up: now both serve, activations allocated lazily
            assert child.stdin is not None
            child.stdin.write("serve\n")
            child.stdin.flush()
        for spec, child in zip(plan["servers"], children, strict=True):
            got = _read(child)
            ok &= got["state"] == "serving"
            print(f"{spec['role']}: at its peak ({spec['headroom_gib']} GiB of activations "
                  f"and graphs): {got['state']}, GPU free {got.get('free_gib')} GiB")
    finally:
        for child in children:
            if child.stdin is not None:
                child.stdin.close()
            child.wait()
    print("the plan fits" if ok else "the plan does NOT fit")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
