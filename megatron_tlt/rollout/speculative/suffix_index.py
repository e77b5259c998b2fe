"""The lookup model-free kinds share: every n-gram (n = ``min_n`` .. ``max_n``) of a set
of token sequences and where it ended, and the continuations that followed it, as a
chain or a tree of the distinct continuations.

``SuffixIndex.extend(seq, tokens)`` appends tokens to a sequence and indexes the
n-grams ending at each new position: O(new tokens x (max_n - min_n + 1)) per call.
An n-gram is indexed once a token follows it; each keeps its ``per_key`` latest
occurrences, and the index holds at most
``max_tokens`` tokens: past it the oldest finished sequences are dropped (their
entries removed), so memory is bounded whatever the history. ``candidates(context)``
takes the longest n-gram ending ``context`` that occurred before and returns what
followed each occurrence (latest first); ``chain`` / ``tree`` turn them into a
proposal: the most frequent continuation, or the trie of the distinct continuations
where they diverge (children by frequency, then recency).

``state_dict`` / ``load_state_dict``: the index as tensors (its sequences in insertion
order, which sequences still grow, and every n-gram's occurrences in order), restored
entry for entry, so a restored index proposes exactly what the saved one would.
"""

from __future__ import annotations

from collections import deque
import itertools
from typing import Optional, Sequence

import numpy as np
import torch


class SuffixIndex:
    def __init__(self, *, min_n: int = 2, max_n: int = 4, per_key: int = 8,
                 max_tokens: int = 1 << 15):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.per_key = min_n, max_n, per_key
        self.max_tokens = max_tokens
        self.seqs: dict[int, list[int]] = {}  # sequence id -> its tokens
        self.live: set[int] = set()  # sequences still growing (never dropped)
        self.table: dict[tuple, deque] = {}  # n-gram -> (sequence, end) latest last
        self.tokens = 0

    def __len__(self) -> int:
        return self.tokens

    # ------------------------------------------------------------ writing
    def extend(self, seq: int, tokens: Sequence[int], *, live: bool = True) -> None:
        """Append ``tokens`` to sequence ``seq`` (made when new); ``live=False``: it is
        finished and may be dropped to keep the bound."""
        s = self.seqs.setdefault(seq, [])
        start = len(s)
        s.extend(int(t) for t in tokens)
        # an n-gram is indexed once a token follows it: every entry has a continuation
        # (siblings decoding at the same position do not crowd out those that have one)
        for end in range(max(start, 1), len(s)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(s[end - n: end])
                q = self.table.get(key)
                if q is None:
                    q = self.table[key] = deque(maxlen=self.per_key)
                q.append((seq, end))
        self.tokens += len(s) - start
        if live:
            self.live.add(seq)
        else:
            self.live.discard(seq)
        self._bound()

    def finish(self, seq: int) -> None:
        self.live.discard(seq)
        self._bound()

    def _bound(self) -> None:
        while self.tokens > self.max_tokens:
            old = next((k for k in self.seqs if k not in self.live), None)
            if old is None:
                return  # only growing sequences: the next finish frees room
            self._drop(old)

    def _drop(self, seq: int) -> None:
        s = self.seqs.pop(seq)
        for end in range(1, len(s)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(s[end - n: end])
                q = self.table.get(key)
                if q is None:
                    continue
                try:
                    q.remove((seq, end))
                except ValueError:  # pushed out by later occurrences already
                    continue
                if not q:
                    del self.table[key]
        self.tokens -= len(s)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The index as int64 tensors: ``ids`` / ``lens`` / ``tokens`` its sequences in
        insertion order (the order ``_bound`` drops them in), ``live`` the growing ones,
        ``entries`` every n-gram's occurrences as rows (n, sequence, end), key after key,
        latest last, and ``sizes`` each key's count (a key is its first entry's last n
        tokens). Its loops run in C (``np.fromiter`` over chained iterators): a
        262,144-token history takes ~0.8 s on a loaded 2-core machine."""
        def ints(values, count: int) -> torch.Tensor:
            return torch.from_numpy(np.fromiter(values, np.int64, count))

        flat = itertools.chain.from_iterable
        qs = list(self.table.values())
        sizes = ints(map(len, qs), len(qs))
        pairs = ints(flat(flat(qs)), 2 * int(sizes.sum())).reshape(-1, 2)
        ns = ints(map(len, self.table), len(qs)).repeat_interleave(sizes)
        return {"ids": ints(self.seqs, len(self.seqs)),
                "lens": ints(map(len, self.seqs.values()), len(self.seqs)),
                "tokens": ints(flat(self.seqs.values()), self.tokens),
                "live": torch.tensor(sorted(self.live), dtype=torch.int64),
                "entries": torch.cat([ns[:, None], pairs], 1), "sizes": sizes}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s index (saved with the same n-gram lengths and
        ``per_key``)."""
        self.seqs = dict(self.sequences(state))
        self.live = set(state["live"].tolist())
        self.table, at = {}, 0
        n_seq_end = state["entries"].tolist()
        pairs = [(s, e) for _, s, e in n_seq_end]
        seqs, per_key = self.seqs, self.per_key
        for size in state["sizes"].tolist():
            n, seq, end = n_seq_end[at]
            self.table[tuple(seqs[seq][end - n: end])] = deque(pairs[at: at + size],
                                                               maxlen=per_key)
            at += size
        self.tokens = sum(len(s) for s in self.seqs.values())

    @staticmethod
    def sequences(state: dict) -> list[tuple[int, list[int]]]:
        """(id, tokens) of the sequences of a ``state_dict()``, in insertion order."""
        tokens, out, at = state["tokens"].tolist(), [], 0
        for seq, n in zip(state["ids"].tolist(), state["lens"].tolist()):
            out.append((seq, tokens[at: at + n]))
            at += n
        return out

    # ------------------------------------------------------------ reading
    def candidates(self, context: Sequence[int], depth: int, limit: int = 8
                   ) -> list[list[int]]:
        """What followed the longest n-gram ending ``context`` (up to ``depth`` tokens
        each, latest occurrence first, at most ``limit``); [] when none occurred."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            q = self.table.get(tuple(context[len(context) - n:]))
            if not q:
                continue
            out = []
            for seq, end in reversed(q):
                cont = self.seqs[seq][end: end + depth]
                if cont:
                    out.append(cont)
                    if len(out) == limit:
                        break
            if out:
                return out
        return []


def _trie(conts: Sequence[Sequence[int]]):
    """Nodes of the continuations' trie: (token, parent, count, first-seen), node 0 the
    root; children in first-seen order."""
    nodes = [(-1, -1, len(conts), 0)]
    child: dict[tuple[int, int], int] = {}
    counts = [len(conts)]
    for c in conts:
        at = 0
        for t in c:
            nxt = child.get((at, t))
            if nxt is None:
                nxt = child[(at, t)] = len(nodes)
                nodes.append((t, at, 0, len(nodes)))
                counts.append(0)
            counts[nxt] += 1
            at = nxt
    return [(t, p, counts[i], i) for i, (t, p, _, _) in enumerate(nodes)]


def chain(conts: Sequence[Sequence[int]], depth: int) -> list[int]:
    """The path of the most frequent continuation (ties: the latest), ``depth`` tokens
    at most."""
    return tree(conts, depth, 1, depth + 1)[0][1:]


def tree(conts: Sequence[Sequence[int]], depth: int, top_k: int, nodes: int
         ) -> tuple[list[int], list[int]]:
    """The distinct continuations as a tree of at most ``nodes`` nodes (the root
    included), ``depth`` deep and ``top_k`` children per node: nodes chosen by
    frequency (a child is never more frequent than its parent, and ties go to the
    shallower, then the earlier node, so every chosen node's parent is chosen). Returns
    the chosen nodes' tokens (node 0: the root, token -1) and parents, parents before
    children, each node's children in order of frequency."""
    all_nodes = _trie(conts)
    depth_of = [0] * len(all_nodes)
    for i in range(1, len(all_nodes)):
        depth_of[i] = depth_of[all_nodes[i][1]] + 1
    order = sorted(range(1, len(all_nodes)),
                   key=lambda i: (-all_nodes[i][2], depth_of[i], i))
    chosen, kids = [0], {0: 0}
    where = {0: 0}
    for i in order:
        if len(chosen) >= nodes:
            break
        t, p, _, _ = all_nodes[i]
        if depth_of[i] > depth or p not in where or kids[p] >= top_k:
            continue
        kids[p] += 1
        kids[i] = 0
        where[i] = len(chosen)
        chosen.append(i)
    return [all_nodes[i][0] for i in chosen], [where.get(all_nodes[i][1], -1) for i in chosen]


def tree_from(conts, depth: int, top_k: int, nodes: int) -> Optional[tuple[list[int], list[int]]]:
    """``tree`` or None when there is nothing to propose."""
    toks, par = tree(conts, depth, top_k, nodes) if conts else ([-1], [-1])
    return (toks, par) if len(toks) > 1 else None
