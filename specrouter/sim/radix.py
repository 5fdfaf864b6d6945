"""One engine's prefix cache, shaped like SGLang's radix cache (mem_cache/radix_cache.py).

Pure bookkeeping, no clock of its own and no I/O: the engine passes the time of each access.
Nodes hold runs of block keys (prefix.py); a key names its whole prefix, so one dict from
key to node finds the deepest cached prefix of a prompt in one pass over its keys. What the
tree guarantees, as SGLang's does:

- `match` returns the deepest cached prefix and touches every node on its path (LRU time);
  a match ending inside a node splits it, so the matched part can be locked alone
  (`_match_prefix_helper` / `_split_node`, radix_cache.py 0.5.23:651-700).
- `lock` / `unlock` count references up the path to the root; a locked node is never
  evicted, and `evictable_tokens` / `protected_tokens` move with the first and last lock
  (`inc_lock_ref` / `dec_lock_ref`, :582-616).
- `evict(n)` deletes unlocked leaves, least recently used first, whole nodes at a time, and
  a parent left childless and unlocked becomes a candidate (`evict`, :552-580, LRU policy).
  Candidates live in a heap with lazy deletion instead of SGLang's heap rebuilt per call, so
  an eviction costs O(log n) per node removed, not O(leaves).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class Node:
    __slots__ = ("block_tokens", "children", "dead", "depth", "keys", "last_access",
                 "lock_ref", "parent", "tokens")

    def __init__(self, keys: list[int], block_tokens: list[int], depth: int,
                 parent: Node | None, now: float) -> None:
        self.keys = keys
        self.block_tokens = block_tokens
        self.tokens = sum(block_tokens)
        self.depth = depth  # index of this node's first key in any chain through it
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access = now
        self.dead = False


class RadixCache:
    def __init__(self) -> None:
        self.root = Node([], [], 0, None, 0.0)
        self.root.lock_ref = 1  # never evicted, never counted
        self._index: dict[int, Node] = {}
        self._heap: list[tuple[float, int, Node]] = []
        self._seq = itertools.count()
        self._nodes = 0
        self.total_tokens = 0
        self.evictable_tokens = 0
        self.protected_tokens = 0
        self.evicted_tokens = 0  # lifetime, for /sim/state

    # --- lookup ---------------------------------------------------------------------------
    def match(self, keys: Sequence[int], now: float) -> tuple[Node, int]:
        """The node ending the deepest cached prefix of `keys`, and that prefix's block count.
        Touches the path; splits a node the prefix ends inside."""
        index = self._index
        m = 0
        for key in keys:
            if key not in index:
                break
            m += 1
        if m == 0:
            return self.root, 0
        node = index[keys[m - 1]]
        used = m - node.depth
        if used < len(node.keys):
            node = self._split(node, used)
        self._touch(node, now)
        return node, m

    def prefix_tokens(self, node: Node) -> int:
        """Tokens from the root to the end of `node`."""
        total = 0
        while node is not self.root:
            assert node.parent is not None
            total += node.tokens
            node = node.parent
        return total

    # --- insertion ------------------------------------------------------------------------
    def insert(self, keys: Sequence[int], block_tokens: Sequence[int], now: float
               ) -> tuple[Node, int]:
        """Cache the chain `keys`; returns its last node and the tokens newly added (the
        part another request had not already cached)."""
        node, m = self.match(keys, now)
        if m == len(keys):
            return node, 0
        rest = list(keys[m:])
        child = Node(rest, list(block_tokens[m:]), m, node, now)
        node.children[rest[0]] = child
        for key in rest:
            self._index[key] = child
        self._nodes += 1
        self.total_tokens += child.tokens
        self.evictable_tokens += child.tokens
        self._push(child)
        return child, child.tokens

    # --- locks ----------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_tokens -= node.tokens
                self.protected_tokens += node.tokens
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_tokens += node.tokens
                self.protected_tokens -= node.tokens
                if not node.children:
                    self._push(node)
            assert node.parent is not None
            node = node.parent

    # --- eviction -------------------------------------------------------------------------
    def evict(self, tokens: int) -> int:
        """Free at least `tokens` (or every evictable token); returns the tokens freed."""
        freed = 0
        heap = self._heap
        while freed < tokens and heap:
            access, _, node = heapq.heappop(heap)
            if (node.dead or node.children or node.lock_ref or node.last_access != access):
                continue  # stale entry: touched, locked, deleted or no longer a leaf
            freed += node.tokens
            self._delete(node)
        self.evicted_tokens += freed
        if len(heap) > 4 * self._nodes + 64:
            self._compact()
        return freed

    def reset(self) -> None:
        """/flush_cache: forget every unlocked prefix."""
        self.evict(self.evictable_tokens)

    # --- internals --------------------------------------------------------------------------
    def _touch(self, node: Node, now: float) -> None:
        leaf = node
        while node is not self.root:
            node.last_access = now
            assert node.parent is not None
            node = node.parent
        if not leaf.children and leaf is not self.root and leaf.lock_ref == 0:
            self._push(leaf)

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node` after `at` keys; the new upper node keeps its place in the tree."""
        parent = node.parent
        assert parent is not None
        upper = Node(node.keys[:at], node.block_tokens[:at], node.depth, parent,
                     node.last_access)
        upper.lock_ref = node.lock_ref
        upper.children = {node.keys[at]: node}
        parent.children[node.keys[0]] = upper
        for key in upper.keys:
            self._index[key] = upper
        node.keys = node.keys[at:]
        node.block_tokens = node.block_tokens[at:]
        node.tokens -= upper.tokens
        node.depth += at
        node.parent = upper
        self._nodes += 1
        return upper

    def _delete(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.keys[0]]
        index = self._index
        for key in node.keys:
            del index[key]
        node.dead = True
        self._nodes -= 1
        self.total_tokens -= node.tokens
        self.evictable_tokens -= node.tokens
        if parent is not self.root and not parent.children and parent.lock_ref == 0:
            self._push(parent)

    def _compact(self) -> None:
        self._heap = [e for e in self._heap
                      if not e[2].dead and not e[2].children and e[2].lock_ref == 0
                      and e[2].last_access == e[0]]
        heapq.heapify(self._heap)
