"""The sample lines of named gauges in Prometheus text exposition (format 0.0.4).

SGLang's /metrics carries dozens of families (histograms with many buckets) the router
never reads. `gauge_samples` reads only the lines of the names asked for, with regular
expressions over each line's labels, where prometheus_client's parser walks every label
character by character in Python (docs/router.md section 6 has both costs). It reads the
samples that parser reads from such a line (tests/observe/test_gauge_text.py holds it to
the same ones) and rejects a malformed line of an asked-for gauge with `ValueError`, as
that parser does.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator

_NAME_END = re.compile(r"[^ \t{]*")
# a label: name = "value", the value's quotes, backslashes and line breaks escaped
_KEY, _VALUE = r"[a-zA-Z_][a-zA-Z0-9_]*", r'[^"\\\n]*(?:\\.[^"\\\n]*)*'
_PAIR = rf'[ \t]*{_KEY}[ \t]*=[ \t]*"{_VALUE}"[ \t]*'
# the braces: labels separated by commas, a trailing comma allowed
_LABELS = re.compile(rf"\{{((?:{_PAIR},)*(?:{_PAIR})?[ \t]*)\}}")
_PAIRS = re.compile(rf'[ \t]*({_KEY})[ \t]*=[ \t]*"({_VALUE})"')
_ESCAPE = re.compile(r"\\(.)")
_ESCAPED = {"\\": "\\", '"': '"', "n": "\n"}


def gauge_samples(text: str, names: Collection[str]
                  ) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line of `names`, in the text's order.
    Comments, blank lines and other families are skipped unread; `ValueError` for a
    line of `names` that is not a sample line."""
    prefixes = tuple(names)
    for line in text.splitlines():
        if line.startswith(prefixes):
            end = _NAME_END.match(line).end()  # type: ignore[union-attr]  # matches ""
            if line[:end] in names:
                yield line[:end], *_sample(line, line[end:].lstrip(" \t"))


def _sample(line: str, rest: str) -> tuple[dict[str, str], float]:
    labels: dict[str, str] = {}
    if rest.startswith("{"):
        braces = _LABELS.match(rest)
        if braces is None:
            raise ValueError(f"bad labels in {line!r}")
        labels = {key: _unescape(value) for key, value in _PAIRS.findall(braces.group(1))}
        rest = rest[braces.end():]
    tokens = rest.split()  # the value, then an optional timestamp in integer ms
    if len(tokens) == 2 and tokens[1].lstrip("-").isdigit():
        del tokens[1]
    if len(tokens) != 1:
        raise ValueError(f"not a sample line: {line!r}")
    try:
        return labels, float(tokens[0])
    except ValueError:
        raise ValueError(f"bad value in {line!r}") from None


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _ESCAPE.sub(lambda m: _ESCAPED.get(m.group(1), m.group(0)), value)
