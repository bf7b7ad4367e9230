"""A depth-bounded suffix trie over several token sequences, with occurrence counts: the index of
suffix decoding (Oliaro et al., "SuffixDecoding", arXiv 2411.04975; Arctic Inference's SuffixTree).

The node of a string s (|s| <= max_depth) counts the occurrences of s in the sequences; its
children are the tokens that followed them. A proposal matches the context's last m tokens and
walks to the most frequent child, the path's probability the product of count(child)/count(node).

Memory: a plain trie holds max_depth nodes per token (most windows longer than a few tokens occur
once). Here a string seen once is a leaf that names its one occurrence (sequence, end) instead of
holding children: what followed it is read from that sequence. So text seen once costs about one
node per token, and only repeated strings are spelled out. Invariants:

- a leaf (children None) has count 1 and its `seq`/`end` name its occurrence; the strings under it
  (its implicit subtree) are that sequence's next tokens, up to max_depth;
- an internal node (children a dict) has a child for the continuation of each of its occurrences
  (a count-1 internal node is allowed: what removals leave; it is never turned back into a leaf).

When a leaf is seen again it becomes internal, its old occurrence's continuation an explicit leaf.

Updates are incremental. Each sequence keeps, for every window length L <= max_depth ending at its
last token, the deepest explicit node on that window's path (`_Seq.active`); an appended token
advances each one step, O(max_depth) per token. Removing positions (truncation, forgetting a
sequence's oldest positions, removing a sequence) walks the windows that start at each affected
position: one root-down path per start. Torch-free, imports no gRPC.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from fastdecode.runtime.errors import InvalidInput


class _Node:
    __slots__ = ("best", "children", "count", "end", "seq", "token")

    def __init__(self, token: int, seq: int, end: int) -> None:
        self.token = token  # the last token of its string (its key in its parent's children)
        self.count = 1
        self.children: dict[int, _Node] | None = None  # None: a leaf (count 1; (seq, end) its occurrence)
        # the child with the highest count (of equal ones, the first to reach it): kept as counts
        # change, so a proposal does not scan the children of a frequent token at every step
        self.best: _Node | None = None
        self.seq = seq
        self.end = end

    def rescan(self) -> None:
        best = None
        for child in (self.children or {}).values():
            if best is None or child.count > best.count:
                best = child
        self.best = best


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)
    front: int = 0  # positions before it are forgotten (not in the trie)
    # active[L-1]: (deepest explicit node on the path of the window of length L ending at the last
    # token, its depth); None: rebuilt on the next append (after a truncation, or for a closed sequence)
    active: list[tuple[_Node, int]] | None = field(default_factory=list)


@dataclass(frozen=True)
class Draft:
    """A proposal: the tokens, each one's estimated probability, their sum (the expected number
    accepted, what competing proposals are ranked by) and the length of the context match used."""

    tokens: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    score: float = 0.0
    match_len: int = 0


class SuffixTrie:
    """The trie over sequences keyed by int ids, bounded to `max_depth` tokens per string."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise InvalidInput(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self._root = _Node(-1, -1, -1)
        self._root.children = {}
        self._seqs: dict[int, _Seq] = {}  # insertion order: oldest first (eviction order)
        self.size = 0  # explicit nodes, the root aside

    def __contains__(self, seq: int) -> bool:
        return seq in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def sequences(self) -> Iterator[int]:
        """Sequence ids, oldest first."""
        return iter(self._seqs)

    def tokens(self, seq: int) -> Sequence[int]:
        return self._seqs[seq].tokens

    def indexed(self, seq: int) -> int:
        """How many of the sequence's tokens are in the trie (its oldest may have been forgotten)."""
        s = self._seqs[seq]
        return len(s.tokens) - s.front

    # -- updates -----------------------------------------------------------------------------

    def add(self, seq: int, tokens: Sequence[int] = ()) -> None:
        if seq in self._seqs:
            raise InvalidInput(f"sequence {seq} is already in the trie")
        self._seqs[seq] = _Seq()
        self.extend(seq, tokens)

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        s = self._seqs[seq]
        for t in tokens:
            self._append(seq, s, int(t))

    def _append(self, seq_id: int, s: _Seq, token: int) -> None:
        if s.active is None:
            s.active = self._rebuild_active(s)
        old = s.active
        s.tokens.append(token)
        p = len(s.tokens) - 1
        new: list[tuple[_Node, int]] = [(self._root, 0)] * min(self.max_depth, p + 1 - s.front)
        # Longest window first: a shorter window may turn a leaf internal and spell out its old
        # occurrence's continuation; when that occurrence ends at p - 1, its continuation is the
        # longer window ending at p, which must already have been counted (implicitly, under the
        # leaf) so that spelling it out with count 1 does not count it twice.
        for length in range(len(new), 0, -1):
            node, depth = (self._root, 0) if length == 1 else old[length - 2]
            new[length - 1] = self._step(seq_id, s.tokens, p, length, node, depth)
        s.active = new

    def _step(
        self, seq_id: int, toks: list[int], p: int, length: int, node: _Node, depth: int
    ) -> tuple[_Node, int]:
        """Count the window toks[p-length+1 .. p]; (node, depth) was its prefix's entry at p - 1."""
        start = p - length + 1
        # catch up: other sequences may have spelled out the prefix's path further since
        while depth < length - 1 and node.children is not None:
            node = node.children[toks[start + depth]]
            depth += 1
        if depth < length - 1 or node.children is None:
            return node, depth  # the prefix lies under a leaf (its occurrence is ours): so does the window
        token = toks[p]
        child = node.children.get(token)
        if child is None:
            node.children[token] = child = _Node(token, seq_id, p)
            self.size += 1
            if node.best is None:
                node.best = child
            return child, length
        if child.children is None:
            self._spell_out(child, length)
        child.count += 1
        if child.count > node.best.count:  # type: ignore[union-attr] - a node with children has a best
            node.best = child
        return child, length

    def _spell_out(self, leaf: _Node, depth: int) -> None:
        """A leaf seen a second time becomes internal: its one occurrence's continuation a leaf."""
        leaf.children = {}
        toks = self._seqs[leaf.seq].tokens
        nxt = leaf.end + 1
        if depth < self.max_depth and nxt < len(toks):
            leaf.children[toks[nxt]] = leaf.best = _Node(toks[nxt], leaf.seq, nxt)
            self.size += 1

    def _rebuild_active(self, s: _Seq) -> list[tuple[_Node, int]]:
        toks, n = s.tokens, len(s.tokens)
        out = []
        for length in range(1, min(self.max_depth, n - s.front) + 1):
            node, depth, start = self._root, 0, n - length
            while depth < length and node.children is not None:
                node = node.children[toks[start + depth]]
                depth += 1
            out.append((node, depth))
        return out

    def _unwind(self, s: _Seq, start: int, first_end: int) -> None:
        """Uncount the windows that start at `start` and end at `first_end` or later."""
        toks, node = s.tokens, self._root
        for depth in range(min(self.max_depth, len(toks) - start)):
            if node.children is None:
                return  # the rest lies under a leaf: counted implicitly, nothing stored
            end = start + depth
            child = node.children[toks[end]]
            if end >= first_end:
                child.count -= 1
                if child.count == 0:  # no occurrence left: neither under it (deeper ones go next)
                    del node.children[toks[end]]
                    self.size -= 1
                if child is node.best and node is not self._root:  # the root's is never used
                    node.rescan()
            node = child

    def truncate(self, seq: int, length: int) -> None:
        """Keep the sequence's first `length` tokens."""
        s = self._seqs[seq]
        n = len(s.tokens)
        if not 0 <= length <= n:
            raise InvalidInput(f"cannot truncate {n} tokens to {length}")
        for start in range(max(s.front, length - self.max_depth + 1), n):
            self._unwind(s, start, length)
        del s.tokens[length:]
        s.front = min(s.front, length)
        s.active = None

    def forget_front(self, seq: int, count: int) -> None:
        """Uncount the sequence's `count` oldest indexed positions (it keeps growing from its end)."""
        s = self._seqs[seq]
        stop = min(len(s.tokens), s.front + count)
        for start in range(s.front, stop):
            self._unwind(s, start, start)
        s.front = stop
        if s.active is not None:
            del s.active[len(s.tokens) - s.front :]  # windows that started before the new front

    def remove(self, seq: int) -> None:
        s = self._seqs[seq]
        self.forget_front(seq, len(s.tokens))
        del self._seqs[seq]

    def close(self, seq: int) -> None:
        """The sequence will not grow soon: drop its per-window state (rebuilt if it does)."""
        self._seqs[seq].active = None

    # -- proposals ---------------------------------------------------------------------------

    def _match(self, pattern: Sequence[int]) -> tuple[_Node, int] | None:
        """The pattern's position: (deepest explicit node on its path, tokens matched below it)."""
        node, below = self._root, 0
        for t in pattern:
            if node.children is None:
                toks = self._seqs[node.seq].tokens
                pos = node.end + 1 + below
                if pos >= len(toks) or toks[pos] != t:
                    return None
                below += 1
            else:
                child = node.children.get(t)
                if child is None:
                    return None
                node = child
        return node, below

    def _path(
        self, node: _Node, below: int, depth: int, max_tokens: int, min_prob: float
    ) -> tuple[list[int], list[float]]:
        """Follow the most frequent continuation from a matched position while its estimated
        probability stays >= min_prob and the strings stay within max_depth."""
        tokens: list[int] = []
        probs: list[float] = []
        prob = 1.0
        room = min(max_tokens, self.max_depth - depth)
        while len(tokens) < room:
            if node.children is None:  # one occurrence: its sequence says what came next
                toks = self._seqs[node.seq].tokens
                pos = node.end + 1 + below
                if pos >= len(toks):
                    break
                tokens.append(toks[pos])
                below += 1
            else:
                best = node.best
                if best is None:
                    break
                prob *= best.count / node.count
                if prob < min_prob:
                    break
                tokens.append(best.token)
                node, below = best, 0
            probs.append(prob)
        return tokens, probs

    def _positions(self, context: Sequence[int], seq: int | None) -> Iterator[tuple[int, _Node, int]]:
        """(m, node, below) for m = 1, 2, ... while the context's last m tokens (m < max_depth)
        occur in the trie. When `seq` is a sequence whose tokens end the context, its windows'
        entries give the positions without walking from the root."""
        tail = list(context[max(0, len(context) - self.max_depth + 1) :])
        entries: list[tuple[_Node, int]] = []
        if seq is not None:
            s = self._seqs[seq]
            if s.active is None:
                s.active = self._rebuild_active(s)
            entries = s.active
        for m in range(1, len(tail) + 1):
            if m <= len(entries):
                node, depth = entries[m - 1]
                start = len(tail) - m
                while depth < m and node.children is not None:  # catch up, as in _step
                    node = node.children[tail[start + depth]]
                    depth += 1
                yield m, node, m - depth
                continue
            found = self._match(tail[len(tail) - m :])
            if found is None:
                return
            yield m, found[0], found[1]

    def speculate(
        self,
        context: Sequence[int],
        max_tokens: int,
        *,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        seq: int | None = None,
    ) -> Draft:
        """The best draft over every match length m of the context's tail (1 <= m < max_depth):
        each m allows min(max_tokens, m * max_spec_factor + max_spec_offset) tokens; the highest
        score wins, the longer match on a tie. A failed match ends the search (longer ones fail too),
        as does a full-length draft of probability 1 (longer matches would propose it again)
        `seq`: a sequence of this trie whose tokens end the context (it only saves work)."""
        best: tuple[list[int], list[float], float, int] = ([], [], 0.0, 0)
        for m, node, below in self._positions(context, seq):
            limit = min(max_tokens, int(m * max_spec_factor + max_spec_offset + 1e-6))
            if limit <= 0:
                continue
            tokens, probs = self._path(node, below, m, limit, min_token_prob)
            if not tokens and node.children is None:
                # one occurrence, and nothing after it (the context itself): every longer match
                # is that occurrence too
                break
            score = sum(probs)
            if tokens and score >= best[2]:
                best = (tokens, probs, score, m)
            if score >= max_tokens:
                # every step had probability 1: each occurrence of this match continues alike, so
                # longer matches (fewer occurrences) propose the same tokens
                break
        return Draft(tuple(best[0]), tuple(best[1]), best[2], best[3])

    # -- checks ------------------------------------------------------------------------------

    def check(self) -> dict[tuple[int, ...], int]:
        """Check the invariants (a leaf: count 1, its occurrence live and spelling its string; an
        internal node: count >= its children's sum, `best` a child of the highest count; `size` the
        nodes) and return every string of <= max_depth tokens with its count, implicit ones
        included: what tests compare with the sequences' windows counted directly."""
        out: dict[tuple[int, ...], int] = {}
        nodes = 0
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, prefix = stack.pop()
            if prefix:
                nodes += 1
                out[prefix] = node.count
                assert node.count >= 1 and node.token == prefix[-1]
            if node.children is None:
                s = self._seqs[node.seq]
                start = node.end + 1 - len(prefix)
                assert node.count == 1 and s.front <= start, "a leaf names one live occurrence"
                assert tuple(s.tokens[start : node.end + 1]) == prefix, "a leaf spells its string"
                for pos in range(node.end + 1, min(len(s.tokens), start + self.max_depth)):
                    out[tuple(s.tokens[start : pos + 1])] = 1
                continue
            kids = list(node.children.values())
            assert sum(c.count for c in kids) <= node.count or not prefix
            assert (node.best is None) == (not kids) or not prefix
            assert not kids or not prefix or node.best.count == max(c.count for c in kids)  # type: ignore[union-attr]
            stack.extend((c, (*prefix, tok)) for tok, c in node.children.items())
        assert nodes == self.size, f"size {self.size}, {nodes} nodes"
        return out
