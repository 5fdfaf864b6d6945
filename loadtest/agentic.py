"""Agentic multi-turn sessions: the workload, and a driver that plays them against servers.

A session is a coding agent at work: one system prompt with the tool definitions (the
same text for every session), a repository context of its own, then turns that each add
a tool result or a user message of a few hundred to a few thousand tokens, resending the
whole conversation so far, the previous answers included, until the context is past a
target of 30-40k tokens. Inside a session the next turn leaves only after the previous
answer plus a think time (closed loop); sessions arrive as a Poisson process (open loop).

Equal prefixes are equal text: the system prompt is built once from the workload seed,
a session's repository and messages from (seed, session), and an answer goes back exactly
as the server streamed it, so a server with a prefix cache can reuse every earlier turn.
Token counts are estimated as the simulator counts them (characters / chars_per_token,
plus about four template tokens per message).

Everything is a pure function of `AgenticShape` and the seed; `play` is the only I/O.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.client import ConnectionPool, encode, stream_request
from loadtest.metrics import RequestResult

# Code-like words; every text below is built from them, so lengths are exact in chars.
_WORDS = ("def", "return", "self", "import", "class", "async", "await", "value", "config",
          "router", "request", "response", "cache", "prefix", "token", "session", "for",
          "in", "if", "else", "None", "True", "False", "error", "result", "list", "dict",
          "str", "int", "float", "yield", "with", "open", "path", "test", "assert", "pool",
          "engine", "batch", "queue", "lock", "state", "update", "handler", "client")
_TOOLS = ("read_file", "write_file", "run_tests", "grep", "list_dir", "apply_patch",
          "run_shell", "git_diff", "search_symbols", "open_issue")


@dataclass(frozen=True)
class AgenticShape:
    """Sizes of the agentic workload, in tokens (simulated seconds for times)."""

    system_tokens: int = 3000  # shared system prompt + tool definitions
    repo_tokens_min: int = 14000  # per-session repository context
    repo_tokens_max: int = 22000
    turn_tokens_median: float = 1800.0  # what a turn adds (tool result / user message)
    turn_tokens_sigma: float = 0.7
    turn_tokens_min: int = 300
    turn_tokens_max: int = 6000
    context_target_min: int = 30000  # a session ends once its context passes its target
    context_target_max: int = 40000
    max_turns: int = 24
    output_median: float = 200.0  # answer lengths: lognormal (heavy tail), capped
    output_sigma: float = 0.9
    output_min: int = 16
    output_max: int = 2000
    think_median_s: float = 2.0  # tool execution / user between an answer and the next turn
    think_sigma: float = 0.6
    think_max_s: float = 15.0
    chars_per_token: float = 4.0

    def scaled(self, factor: float) -> AgenticShape:
        """The same workload with every token size times `factor` (quick runs)."""
        def n(v: int) -> int:
            return max(1, round(v * factor))
        return AgenticShape(
            system_tokens=n(self.system_tokens), repo_tokens_min=n(self.repo_tokens_min),
            repo_tokens_max=n(self.repo_tokens_max),
            turn_tokens_median=self.turn_tokens_median * factor,
            turn_tokens_sigma=self.turn_tokens_sigma, turn_tokens_min=n(self.turn_tokens_min),
            turn_tokens_max=n(self.turn_tokens_max),
            context_target_min=n(self.context_target_min),
            context_target_max=n(self.context_target_max), max_turns=self.max_turns,
            output_median=self.output_median * factor, output_sigma=self.output_sigma,
            output_min=n(self.output_min), output_max=n(self.output_max),
            think_median_s=self.think_median_s, think_sigma=self.think_sigma,
            think_max_s=self.think_max_s, chars_per_token=self.chars_per_token)


@dataclass(frozen=True)
class Turn:
    message: str  # the user / tool-result message this turn appends
    max_tokens: int  # the answer's length (ignore_eos: exactly this many tokens)
    think_s: float  # simulated seconds after the previous answer before this turn leaves


@dataclass(frozen=True)
class Session:
    index: int
    key: str  # a stable session id (sent as the OpenAI `user` field)
    arrival_s: float  # simulated seconds from the start of the run
    repo: str  # repository context, the head of the first user message
    turns: tuple[Turn, ...]
    context_tokens: tuple[int, ...]  # estimated prompt tokens of each turn


def _rng(seed: int, *parts: object) -> random.Random:
    return random.Random(f"{seed}/" + "/".join(map(str, parts)))


def filler(rng: random.Random, chars: int, head: str = "") -> str:
    """`head` then code-like lines, exactly `chars` characters long."""
    out = [head]
    size = len(head)
    while size < chars:
        line = " ".join(rng.choices(_WORDS, k=rng.randint(4, 12))) + "\n"
        out.append(line)
        size += len(line)
    return "".join(out)[:chars]


def text_tokens(text: str, chars_per_token: float) -> int:
    """Tokens of one message's text as the simulator counts them."""
    return max(1, math.ceil(len(text) / chars_per_token)) if text else 0


def chat_tokens(contents: Sequence[str], chars_per_token: float) -> int:
    """Prompt tokens of a chat: 4 template tokens per message, 1 + 4 around them."""
    return 1 + sum(4 + text_tokens(c, chars_per_token) for c in contents) + 4


@functools.lru_cache(maxsize=8)
def system_prompt(shape: AgenticShape, seed: int) -> str:
    """The shared system prompt with the tool definitions (the same for every session)."""
    rng = _rng(seed, "system")
    tools = "".join(
        f'{{"type":"function","function":{{"name":"{name}","description":"'
        f'{filler(rng, 160).replace(chr(10), " ")}","parameters":{{"type":"object"}}}}}}\n'
        for name in _TOOLS)
    head = "You are a coding agent working in a repository. Tools:\n" + tools
    return filler(rng, round(shape.system_tokens * shape.chars_per_token), head)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, median * math.exp(rng.gauss(0.0, sigma))))


def make_session(shape: AgenticShape, seed: int, index: int, arrival_s: float) -> Session:
    """One session: its repository, then turns until the context passes its target."""
    rng = _rng(seed, "session", index)
    cpt = shape.chars_per_token
    repo_tokens = rng.randint(shape.repo_tokens_min, shape.repo_tokens_max)
    repo = filler(rng, round(repo_tokens * cpt), f"# repository snapshot {index}\n")
    target = rng.randint(shape.context_target_min, shape.context_target_max)
    system_tokens = text_tokens(system_prompt(shape, seed), cpt)
    turns: list[Turn] = []
    contexts: list[int] = []
    context = 1 + (4 + system_tokens) + 4  # the chat without its messages after the system
    previous_answer = 0
    while len(turns) < shape.max_turns and (not turns or context < target):
        added = round(_lognormal(rng, shape.turn_tokens_median, shape.turn_tokens_sigma,
                                 shape.turn_tokens_min, shape.turn_tokens_max))
        kind = "user" if not turns or rng.random() < 0.25 else rng.choice(_TOOLS)
        head = (f"[task {index}.{len(turns)}]\n" if kind == "user"
                else f"<tool_result name={kind} turn={len(turns)}>\n")
        message = filler(rng, round(added * cpt), head)
        max_tokens = round(_lognormal(rng, shape.output_median, shape.output_sigma,
                                      shape.output_min, shape.output_max))
        think = 0.0 if not turns else _lognormal(rng, shape.think_median_s, shape.think_sigma,
                                                 0.0, shape.think_max_s)
        if turns:
            context += 4 + previous_answer  # the previous answer, resent
        body = (repo + "\n" + message) if not turns else message
        context += 4 + text_tokens(body, cpt)
        turns.append(Turn(message, max_tokens, round(think, 4)))
        contexts.append(context)
        previous_answer = max_tokens
    return Session(index, f"agent-{seed}-{index}", arrival_s, repo, tuple(turns),
                   tuple(contexts))


def arrivals(rate_per_s: float, window_s: float, seed: int) -> list[float]:
    """Poisson session arrivals (simulated seconds) within [0, window_s)."""
    if rate_per_s <= 0:
        raise ValueError("the session arrival rate must be positive")
    rng = _rng(seed, "arrivals", rate_per_s)
    out: list[float] = []
    t = rng.expovariate(rate_per_s) * 0.5  # the first session need not wait a full gap
    while t < window_s:
        out.append(round(t, 6))
        t += rng.expovariate(rate_per_s)
    return out


def make_sessions(shape: AgenticShape, seed: int, rate_per_s: float, window_s: float,
                  first_index: int = 0) -> list[Session]:
    """Sessions first_index, first_index + 1, ... arriving at `rate_per_s` in the window."""
    return [make_session(shape, seed, first_index + i, t)
            for i, t in enumerate(arrivals(rate_per_s, window_s, seed))]


# --- playing sessions against servers ---------------------------------------------------------

@dataclass
class TurnResult:
    """One turn as the client saw it."""

    session: int
    turn: int
    request: RequestResult
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (0 when absent)
    cached_reported: bool = False  # whether the server reported cached tokens at all
    target: str = ""  # the server the session is pinned to ("" when a proxy decides)


@dataclass
class _Answer:
    parts: list[str] = field(default_factory=list)
    cached: int | None = None

    def __call__(self, payload: dict[str, Any]) -> None:
        for choice in payload.get("choices") or ():
            delta = choice.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                self.parts.append(delta["content"])
        usage = payload.get("usage")
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                self.cached = int(details["cached_tokens"])


def turn_body(model: str, session: Session, history: list[dict[str, str]],
              turn: Turn) -> dict[str, Any]:
    return {"model": model, "messages": history, "max_tokens": turn.max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "user": session.key}


@dataclass
class Player:
    """Plays sessions: each pinned to `targets[index % len(targets)]` (one target: a
    router decides). Times are simulated seconds, run `time_scale` times faster."""

    targets: Sequence[str]
    model: str
    system: str
    time_scale: float
    headers: dict[str, str] = field(default_factory=dict)
    session_header: str = ""  # when set, the session key also goes in this header
    # no turn leaves after this many simulated seconds (turns in flight finish): bounds
    # the drain of an overloaded run; the turns left count in `unsent_turns`
    stop_s: float | None = None

    def __post_init__(self) -> None:
        self._pools = {t: ConnectionPool(t) for t in self.targets}
        self.results: list[TurnResult] = []
        self.unsent_turns = 0

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()

    async def play(self, sessions: Sequence[Session]) -> list[TurnResult]:
        t0 = time.perf_counter()
        await asyncio.gather(*(self._session(s, t0) for s in sessions))
        return self.results

    async def _session(self, session: Session, t0: float) -> None:
        target = self.targets[session.index % len(self.targets)]
        pool = self._pools[target]
        headers = dict(self.headers)
        if self.session_header:
            headers[self.session_header] = session.key
        await asyncio.sleep(max(0.0, session.arrival_s * self.time_scale
                                - (time.perf_counter() - t0)))
        history: list[dict[str, str]] = [{"role": "system", "content": self.system}]
        for n, turn in enumerate(session.turns):
            if turn.think_s > 0:
                await asyncio.sleep(turn.think_s * self.time_scale)
            if (self.stop_s is not None
                    and time.perf_counter() - t0 >= self.stop_s * self.time_scale):
                self.unsent_turns += len(session.turns) - n
                return
            content = (session.repo + "\n" + turn.message) if n == 0 else turn.message
            history.append({"role": "user", "content": content})
            answer = _Answer()
            result = RequestResult(start=time.perf_counter() - t0, phase=f"turn-{n}")
            body = encode(turn_body(self.model, session, history, turn))
            await stream_request(pool, "/v1/chat/completions", body, result, headers, answer)
            self.results.append(TurnResult(
                session.index, n, result, answer.cached or 0, answer.cached is not None,
                target if len(self.targets) > 1 else ""))
            if not result.ok:  # an agent without its answer cannot go on
                self.unsent_turns += len(session.turns) - n - 1
                return
            history.append({"role": "assistant", "content": "".join(answer.parts)})


def describe(sessions: Sequence[Session]) -> dict[str, Any]:
    """Size of a session set: turns, prompt tokens, largest contexts."""
    contexts = [c for s in sessions for c in s.context_tokens]
    finals = sorted(s.context_tokens[-1] for s in sessions)
    return {
        "sessions": len(sessions), "turns": len(contexts),
        "prompt_tokens": sum(contexts),
        "output_tokens": sum(t.max_tokens for s in sessions for t in s.turns),
        "final_context_median": finals[len(finals) // 2] if finals else 0,
        "final_context_max": finals[-1] if finals else 0,
        "turns_per_session": (len(contexts) / len(sessions)) if sessions else 0.0,
    }


def dumps_session(session: Session) -> str:
    """A session's shape without its text (for logs and raw results)."""
    return json.dumps({"index": session.index, "arrival_s": session.arrival_s,
                       "contexts": session.context_tokens,
                       "max_tokens": [t.max_tokens for t in session.turns]})
