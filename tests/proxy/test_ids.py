"""Fresh ids: unique within a process, and a forked child does not repeat its parent's."""

from __future__ import annotations

import multiprocessing
import re

from specrouter.proxy.abort import new_rid
from specrouter.proxy.ids import fresh_id
from specrouter.proxy.request import valid_request_id

_HEX32 = re.compile(r"[0-9a-f]{32}")


def _child_ids(out: multiprocessing.SimpleQueue[list[str]]) -> None:
    out.put([fresh_id() for _ in range(100)])


def test_fresh_ids_are_32_hex_digits_and_distinct() -> None:
    ids = [fresh_id() for _ in range(10_000)]
    assert all(_HEX32.fullmatch(i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_a_forked_child_draws_ids_its_parent_does_not() -> None:
    fork = multiprocessing.get_context("fork")
    out: multiprocessing.SimpleQueue[list[str]] = fork.SimpleQueue()
    child = fork.Process(target=_child_ids, args=(out,))
    child.start()
    in_child = out.get()
    child.join(10)
    in_parent = [fresh_id() for _ in range(100)]  # the child's sequence, had it not reseeded
    assert not set(in_child) & set(in_parent)


def test_request_ids_and_rids_take_fresh_ids() -> None:
    assert _HEX32.fullmatch(valid_request_id(None).decode())
    assert valid_request_id(b"client-id-7") == b"client-id-7"
    rid = new_rid(b"client-id-7")
    head, _, tail = rid.partition("-")
    assert _HEX32.fullmatch(head) and tail == "client-id-7"
    assert new_rid(b"client-id-7") != rid
