"""EAGLE-3 / baseline throughput ratio and crossover batch per accept length and draft config.

Same model as ../shared/calibration/crossover.py, which the simulator also uses:
  eagle step    = verify(B, q = draft tokens) + steps * draft(B);  tokens = B * accept_len
  baseline step = target(B, q = 1);                                 tokens = B
ratio = accept_len * target_q1(B) / eagle_step(B); > 1 means EAGLE-3 gives more throughput.
The crossover is the batch where the ratio falls through 1, interpolated linearly in log2(B)
between measured batches ("<1" if EAGLE never wins, ">Bmax" if it always wins).

Run: python3 loadtest/gpu/crossover.py specrouter/sim/profiles/h200-llama3-8b-measured.jsonl [...]
     (--markdown prints the crossover tables as markdown)
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from typing import Any

CONFIGS = {"chain s3 t1 d4": (3, 4), "tree s5 t4 d8": (5, 8), "tree s5 t4 d16": (5, 16)}
ACCEPTS = (1.6, 2.0, 2.5, 3.0, 4.0)


def ratios(rows: list[dict[str, Any]], steps: int, dtoks: int, acc: float) -> list[float]:
    return [acc * r["target_q1_ms"] / (r[f"target_q{dtoks}_ms"] + steps * r["draft_step_ms"])
            for r in rows]


def crossover(batches: list[int], rs: list[float]) -> str:
    if rs[0] < 1:
        return "<1"
    points = list(zip(batches, rs, strict=True))
    for (b0, r0), (b1, r1) in itertools.pairwise(points):
        if r0 >= 1 > r1:
            x = math.log2(b0) + (r0 - 1) / (r0 - r1) * (math.log2(b1) - math.log2(b0))
            return f"{2 ** x:.0f}"
    return f">{batches[-1]}"


def main(argv: list[str]) -> int:
    markdown = "--markdown" in argv
    for path in [a for a in argv if a != "--markdown"]:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        rows = [r for r in rows if "skipped" not in r]
        for ctx in sorted({r["ctx"] for r in rows}):
            sub = sorted((r for r in rows if r["ctx"] == ctx), key=lambda r: r["batch"])
            batches = [r["batch"] for r in sub]
            model = sub[0].get("model", "?")
            if markdown:
                span = f"batches {batches[0]}..{batches[-1]}"
                print(f"\n{model} ctx {ctx} ({span}): crossover batch\n")
                print("| config | " + " | ".join(f"acc {a}" for a in ACCEPTS) + " |")
                print("|---|" + "---|" * len(ACCEPTS))
            for name, (steps, dtoks) in CONFIGS.items():
                cells = []
                if not markdown:
                    print(f"\n{path} {model} ctx {ctx} {name}: EAGLE/baseline ratio"
                          " (>1: EAGLE wins)")
                    print("accept " + " ".join(f"B={b:<4}" for b in batches) + "  crossover")
                for acc in ACCEPTS:
                    if acc > dtoks:
                        cells.append("-")
                        continue
                    rs = ratios(sub, steps, dtoks, acc)
                    cells.append(crossover(batches, rs))
                    if not markdown:
                        print(f"{acc:>6} " + " ".join(f"{x:6.2f}" for x in rs) + f"  B~{cells[-1]}")
                if markdown:
                    print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
