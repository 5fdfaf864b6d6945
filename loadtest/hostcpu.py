"""How the host's CPU time went while a scenario ran, from /proc/stat's first line.

On a shared virtual machine the hypervisor gives the guest's cores to other guests for a
share of the time (`steal`): a run measured while steal is high, or while the cores sat
idle under a load meant to saturate them, reads slower and noisier than the code is, and
says nothing of the code. The bench records these shares for every scenario and the
report prints them next to its figures.
"""

from __future__ import annotations

from dataclasses import dataclass

STAT_PATH = "/proc/stat"
#: Where a scenario's result keeps the shares of its run.
RESULT_KEY = "host_cpu"
# /proc/stat's "cpu" line, in order: user nice system idle iowait irq softirq steal ...
_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


@dataclass(frozen=True)
class CpuTimes:
    """The host's cumulative CPU time per kind, in clock ticks."""

    ticks: tuple[int, ...]

    @classmethod
    def parse(cls, stat: str) -> CpuTimes:
        for line in stat.splitlines():
            words = line.split()
            if words and words[0] == "cpu":
                values = [int(w) for w in words[1:1 + len(_FIELDS)]]
                return cls(tuple(values + [0] * (len(_FIELDS) - len(values))))
        raise ValueError("no aggregate 'cpu' line in /proc/stat")

    @classmethod
    def read(cls) -> CpuTimes | None:
        """Now, or None where there is no /proc/stat (not Linux)."""
        try:
            with open(STAT_PATH, encoding="ascii") as fh:
                return cls.parse(fh.read())
        except (OSError, ValueError):
            return None


def shares(before: CpuTimes | None, after: CpuTimes | None) -> dict[str, float] | None:
    """Each kind's share of the host's CPU time between two readings (busy = user, nice,
    system, irq, softirq), or None without both readings or with no time between them."""
    if before is None or after is None:
        return None
    spent = dict(zip(_FIELDS, (a - b for a, b in zip(after.ticks, before.ticks, strict=True)),
                     strict=True))
    total = sum(spent.values())
    if total <= 0:
        return None
    busy = sum(spent[k] for k in ("user", "nice", "system", "irq", "softirq"))
    return {"busy": busy / total, "idle": (spent["idle"] + spent["iowait"]) / total,
            "steal": spent["steal"] / total}


def describe(share: dict[str, float]) -> str:
    return (f"busy {share['busy']:.0%}, idle {share['idle']:.0%}, "
            f"stolen by the hypervisor {share['steal']:.0%}")
