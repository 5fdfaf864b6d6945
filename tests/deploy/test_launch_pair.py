"""launch-pair with stand-in servers: start order, signal forwarding, the pair dies together,
no process of a server's group is left behind, extra arguments are passed untouched."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from tests.fixtures.procs import ManagedProcess, free_port, specrouter_argv, wait_until

STANDIN = str(Path(__file__).with_name("standin_server.py"))


def journal(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if line.strip()]


def events(path: Path) -> list[tuple[str, str]]:
    return [(e[0], e[1]) for e in journal(path)]


def pid_of(path: Path, role: str) -> int:
    return next(int(e[2]) for e in journal(path) if e[0] == "start" and e[1] == role)


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting for its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def launch(tmp_path: Path, started: list[ManagedProcess], *extra: str,
           eagle_opts: str = "", baseline_opts: str = "") -> ManagedProcess:
    log = tmp_path / "journal"
    eagle_port, baseline_port = free_port(), free_port()
    cmd = f"{sys.executable} {STANDIN} --journal {log}"
    argv = specrouter_argv(
        "launch-pair", "--gpu-mem-gib", "139.8", "--model-gib", "14.96", "--draft-gib", "0.8",
        "--model-shape", "llama3-8b", "--eagle-kv-tokens", "200000",
        "--eagle-port", str(eagle_port), "--baseline-port", str(baseline_port),
        "--eagle-cmd", f"{cmd} --role eagle --gate {tmp_path / 'eagle-loaded'} {eagle_opts}",
        "--baseline-cmd", f"{cmd} --role baseline {baseline_opts}",
        "--stop-timeout", "20", *extra,
    )
    proc = ManagedProcess(argv).start()
    started.append(proc)
    return proc


def test_baseline_starts_only_after_eagle_is_ready(tmp_path: Path, process_factory) -> None:
    proc = launch(tmp_path, process_factory)
    log = tmp_path / "journal"
    wait_until(lambda: ("start", "eagle") in events(log), 60, "eagle to start")
    # EAGLE is "loading" (503 on /ready): several probes later, still no baseline.
    wait_until(lambda: events(log).count(("probe-while-loading", "eagle")) >= 3, 60,
               "launch-pair to probe the loading EAGLE server")
    assert ("start", "baseline") not in events(log)
    (tmp_path / "eagle-loaded").touch()
    wait_until(lambda: ("start", "baseline") in events(log), 60, "baseline to start")
    order = [e for e in events(log) if e[0] in ("start", "ready")]
    assert order[:3] == [("start", "eagle"), ("ready", "eagle"), ("start", "baseline")]
    # each got its planned fraction
    fractions = {e[1]: e[3] for e in journal(log) if e[0] == "start"}
    assert fractions == {"eagle": "0.294", "baseline": "0.84"}
    assert proc.proc is not None and proc.proc.poll() is None


def _up(tmp_path: Path, started: list[ManagedProcess], *extra: str, eagle_opts: str = "",
        baseline_opts: str = "") -> tuple[ManagedProcess, Path]:
    (tmp_path / "eagle-loaded").touch()
    proc = launch(tmp_path, started, *extra, eagle_opts=eagle_opts, baseline_opts=baseline_opts)
    log = tmp_path / "journal"
    wait_until(lambda: ("start", "baseline") in events(log), 60, "both servers to start")
    wait_until(lambda: "pair is up" in proc.output(), 60, "launch-pair to report the pair up")
    return proc, log


def test_sigterm_is_forwarded_to_both(tmp_path: Path, process_factory) -> None:
    proc, log = _up(tmp_path, process_factory)
    assert proc.proc is not None
    os.kill(proc.proc.pid, signal.SIGTERM)  # the launcher only, as a container runtime does
    assert proc.proc.wait(60) == 0
    got = set(events(log))
    assert {("signal-SIGTERM", "eagle"), ("signal-SIGTERM", "baseline")} <= got
    assert {("exit", "eagle"), ("exit", "baseline")} <= got


def test_sigint_is_forwarded_too(tmp_path: Path, process_factory) -> None:
    proc, log = _up(tmp_path, process_factory)
    assert proc.proc is not None
    os.kill(proc.proc.pid, signal.SIGINT)
    assert proc.proc.wait(60) == 0
    assert {("signal-SIGINT", "eagle"), ("signal-SIGINT", "baseline")} <= set(events(log))


def test_sighup_stops_the_pair_like_sigterm(tmp_path: Path, process_factory) -> None:
    proc, log = _up(tmp_path, process_factory)
    assert proc.proc is not None
    os.kill(proc.proc.pid, signal.SIGHUP)  # the session that started it ended
    assert proc.proc.wait(60) == 0
    got = set(events(log))
    assert {("signal-SIGTERM", "eagle"), ("signal-SIGTERM", "baseline")} <= got
    assert {("exit", "eagle"), ("exit", "baseline")} <= got


def test_a_sigkilled_launcher_takes_both_servers_down(tmp_path: Path, process_factory) -> None:
    proc, log = _up(tmp_path, process_factory)
    assert proc.proc is not None
    os.kill(proc.proc.pid, signal.SIGKILL)  # no cleanup runs: the parent-death signal does
    assert proc.proc.wait(60) == -signal.SIGKILL
    wait_until(lambda: {("exit", "eagle"), ("exit", "baseline")} <= set(events(log)), 30,
               "both servers to exit after their parent died")
    assert {("signal-SIGTERM", "eagle"), ("signal-SIGTERM", "baseline")} <= set(events(log))


def test_one_dies_the_other_is_stopped_and_exit_is_nonzero(
    tmp_path: Path, process_factory
) -> None:
    proc, log = _up(tmp_path, process_factory)
    assert proc.proc is not None
    os.kill(pid_of(log, "baseline"), signal.SIGKILL)
    code = proc.proc.wait(60)
    assert code != 0
    assert ("signal-SIGTERM", "eagle") in events(log)
    assert ("exit", "eagle") in events(log)
    assert "baseline exited with code -9: stopping the other server" in proc.output()


def test_refused_plan_starts_nothing(tmp_path: Path, process_factory) -> None:
    proc = launch(tmp_path, process_factory, "--eagle-kv-tokens", "5000000")
    assert proc.proc is not None
    assert proc.proc.wait(60) == 2
    assert "refused" in proc.output()
    assert events(tmp_path / "journal") == []


def test_eagle_dying_while_loading_means_no_baseline(tmp_path: Path, process_factory) -> None:
    proc = launch(tmp_path, process_factory)
    log = tmp_path / "journal"
    wait_until(lambda: ("start", "eagle") in events(log), 60, "eagle to start")
    os.kill(pid_of(log, "eagle"), signal.SIGKILL)
    assert proc.proc is not None
    assert proc.proc.wait(60) != 0
    assert ("start", "baseline") not in events(log)
    assert "eagle exited with code -9" in proc.output()


def child_of(path: Path, role: str) -> int:
    return next(int(e[2]) for e in journal(path) if e[0] == "child" and e[1] == role)


def test_a_dead_leaders_children_are_stopped_with_it(tmp_path: Path, process_factory) -> None:
    proc, log = _up(tmp_path, process_factory, baseline_opts="--fork-child")
    child = child_of(log, "baseline")
    assert alive(child)
    os.kill(pid_of(log, "baseline"), signal.SIGKILL)  # the leader dies, its child stays
    assert proc.proc is not None and proc.proc.wait(60) != 0
    wait_until(lambda: not alive(child), 10, "the dead leader's child to be stopped")


def test_a_child_ignoring_sigterm_is_killed_after_the_stop_timeout(
    tmp_path: Path, process_factory
) -> None:
    proc, log = _up(tmp_path, process_factory, "--stop-timeout", "0.5",
                    eagle_opts="--fork-child --child-ignores-term")
    child = child_of(log, "eagle")
    assert proc.proc is not None
    os.kill(proc.proc.pid, signal.SIGTERM)
    assert proc.proc.wait(60) == 0
    assert "eagle: processes left 0s after SIGTERM: SIGKILL" in proc.output()
    wait_until(lambda: not alive(child), 10, "the SIGTERM-proof child to be killed")
    assert ("exit", "eagle") in events(log)


def test_extra_args_are_shell_split_and_passed_untouched(
    tmp_path: Path, process_factory
) -> None:
    _up(tmp_path, process_factory,
                     """--eagle-extra-args=--json-model-override-args '{"rope": {"x": 1}}'""",
                     "--baseline-extra-args=--enable-cache-report")
    eagle = json.loads((tmp_path / "argv-eagle.json").read_text())
    baseline = json.loads((tmp_path / "argv-baseline.json").read_text())
    assert eagle[-2:] == ["--json-model-override-args", '{"rope": {"x": 1}}']
    assert baseline[-1] == "--enable-cache-report"
    for argv in (eagle, baseline):  # the planned caps and workspace are on both
        assert {"--max-total-tokens", "--chunked-prefill-size",
                "--cuda-graph-max-bs-decode"} <= set(argv)
    assert eagle[eagle.index("--max-total-tokens") + 1] == "200000"
