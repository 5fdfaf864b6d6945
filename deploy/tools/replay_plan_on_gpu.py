"""Replay a `specrouter plan --json` on a real GPU with SGLang's sizing rule, using torch.

Not SGLang itself (no weights needed): each server is a process that does what SGLang's
start-up does with memory, in order, on the real CUDA allocator:
  create its CUDA context; total = free memory (torch.cuda.mem_get_info);
  allocate the weights; rest = free - total * (1 - fraction); allocate rest // bpt tokens;
  then allocate its headroom (activations + CUDA graphs) and stay alive.
The second starts only when the first has allocated everything. The KV tokens each gets
are compared with the plan, and the memory left at the end is printed.

  specrouter plan ... --json > plan.json
  python deploy/tools/replay_plan_on_gpu.py plan.json --eagle-bpt 135168 --baseline-bpt 131072
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

GIB = 1 << 30


def server(fraction: float, weights_gib: float, bpt: int, headroom_gib: float) -> None:
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the CUDA context
    total = torch.cuda.mem_get_info()[0] / GIB
    held = [torch.empty(int(weights_gib * GIB), dtype=torch.uint8, device="cuda")]
    avail = torch.cuda.mem_get_info()[0] / GIB
    rest = avail - total * (1 - fraction)
    tokens = int(rest * GIB) // bpt
    held.append(torch.empty(tokens * bpt, dtype=torch.uint8, device="cuda"))
    held.append(torch.empty(int(headroom_gib * GIB), dtype=torch.uint8, device="cuda"))
    free_after = torch.cuda.mem_get_info()[0] / GIB
    print(json.dumps({"total_at_start_gib": round(total, 3), "kv_tokens": tokens,
                      "free_after_gib": round(free_after, 3)}), flush=True)
    sys.stdin.read()  # hold the memory until the parent closes stdin


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan")
    parser.add_argument("--eagle-bpt", type=int, required=True)
    parser.add_argument("--baseline-bpt", type=int, required=True)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        f, w, b, h = args.child
        server(float(f), float(w), int(b), float(h))
        return 0
    with open(args.plan) as fh:
        plan = json.load(fh)
    children = []
    ok = True
    for s in plan["servers"]:
        bpt = args.eagle_bpt if s["role"] == "eagle" else args.baseline_bpt
        child = subprocess.Popen(
            [sys.executable, __file__, args.plan, "--eagle-bpt", "0", "--baseline-bpt", "0",
             "--child", str(s["mem_fraction_static"]), str(s["weights_gib"]), str(bpt),
             str(s["headroom_gib"])], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        children.append(child)
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line:
            print(f"{s['role']}: failed (out of memory?)")
            ok = False
            break
        got = json.loads(line)
        print(f"{s['role']}: free at start {got['total_at_start_gib']} GiB "
              f"(plan {s['free_at_start_gib']}), kv tokens {got['kv_tokens']} "
              f"(plan {s['kv_tokens']}), GPU free after its headroom {got['free_after_gib']} GiB")
    for child in children:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
