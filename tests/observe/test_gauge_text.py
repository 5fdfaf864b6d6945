"""`gauge_samples` reads the samples prometheus_client's parser reads from gauge lines."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from specrouter.observe.gauge_text import gauge_samples

NAMES = ("sglang:num_running_reqs", "sglang:spec_accept_length")
blanks = st.sampled_from(["", " ", "\t", "  "])
label_values = st.lists(st.sampled_from(['a', '0', '"', '\\', '\n', ',', '}', '{', '=', ' ',
                                         'é', 'llama/3.1']), max_size=6).map("".join)
# names beginning with "__" are reserved for Prometheus' own use and its parser refuses
# them; no exporter writes one
label_keys = st.from_regex(r"(?:[a-zA-Z]|_[a-zA-Z0-9])[a-zA-Z0-9_]{0,7}", fullmatch=True)
numbers = st.one_of(st.integers(-10**6, 10**6).map(str),
                    st.floats(allow_nan=False, allow_infinity=False).map(repr),
                    st.sampled_from(["NaN", "+Inf", "-Inf", "1e3", "2.5E-2"]))


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@st.composite
def sample_lines(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(NAMES))
    labels = draw(st.dictionaries(label_keys, label_values, max_size=5))
    pairs = [f'{draw(blanks)}{k}="{escape(v)}"{draw(blanks)}' for k, v in labels.items()]
    braces = ""
    if pairs or draw(st.booleans()):
        trailing = "," if pairs and draw(st.booleans()) else ""
        braces = "{" + ",".join(pairs) + trailing + "}"
    timestamp = draw(st.one_of(st.just(""), st.integers(0, 2**40).map(lambda t: f" {t}")))
    return f"{name}{braces} {draw(blanks)}{draw(numbers)}{timestamp}{draw(blanks)}"


def reference(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples]


def same(a: list[tuple[str, dict[str, str], float]],
         b: list[tuple[str, dict[str, str], float]]) -> bool:
    return len(a) == len(b) and all(
        x[:2] == y[:2] and (x[2] == y[2] or (math.isnan(x[2]) and math.isnan(y[2])))
        for x, y in zip(a, b, strict=True))


@settings(max_examples=400, deadline=None)
@given(st.lists(sample_lines(), min_size=1, max_size=6))
def test_the_samples_are_the_prometheus_parsers(lines: list[str]) -> None:
    text = "\n".join(lines) + "\n"
    assert same(list(gauge_samples(text, NAMES)), reference(text))


def test_other_families_comments_and_prefixes_are_skipped_unread() -> None:
    text = "\n".join([
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        'sglang:num_running_reqs{tp_rank="0"} 3.0',
        'sglang:num_running_reqs_offline_batch{tp_rank="0"} 40.0',
        'sglang:time_to_first_token_seconds_bucket{le="0.1"} 2.0',
        'sglang:broken_family{a="1" 2.0',
        "",
    ])
    assert list(gauge_samples(text, NAMES)) == [
        ("sglang:num_running_reqs", {"tp_rank": "0"}, 3.0)]


@pytest.mark.parametrize("line", [
    'sglang:num_running_reqs{a="1" 2.0',  # no closing brace
    'sglang:num_running_reqs{a=1} 2.0',  # unquoted value
    'sglang:num_running_reqs{a="1"b="2"} 2.0',  # no comma between labels
    'sglang:num_running_reqs{a="1"}',  # no value
    'sglang:num_running_reqs{a="1"} two',  # not a number
    'sglang:num_running_reqs{a="x\\"} 2.0',  # the closing quote escaped
])
def test_a_malformed_line_of_an_asked_gauge_is_an_error_as_for_prometheus(line: str) -> None:
    with pytest.raises(ValueError):
        reference(line + "\n")
    with pytest.raises(ValueError):
        list(gauge_samples(line + "\n", NAMES))
