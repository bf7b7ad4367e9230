"""Suffix decoding (vLLM's `suffix` method; Oliaro et al., "SuffixDecoding", arXiv 2411.04975, as
Arctic Inference implements it): draft from two suffix tries and keep the better proposal.

- The request's own trie holds its prompt and output (what prompt lookup sees, with counts).
- Its tenant's trie holds the outputs of the tenant's recent requests, the running ones included:
  a continuation another request of the same tenant produced can be drafted. Tries are keyed by
  tenant and never shared across tenants (one tenant's outputs must not leak into another's drafts,
  not even as drafts the target then accepts). Each is bounded (`max_tenant_nodes`): past it, the
  oldest request's output is evicted first; at most `max_tenants` tries live, the least recently
  started first to go.

A proposal (`SuffixTrie.speculate`) matches the context's last m tokens (m < max_tree_depth), walks
to the most frequent continuation while the product of count(child)/count(node) stays >=
`min_token_prob`, at most min(k, m * max_spec_factor + max_spec_offset) tokens; the score (the sum
of the path's probabilities) picks among match lengths and between the two tries (the tenant's only
when strictly better), as Arctic's `SuffixDecodingCache.speculate`. Settings default to vLLM's.
Torch-free, imports no gRPC.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from fastdecode.runtime.errors import InvalidInput
from fastdecode.spec.base import check_k, check_length
from fastdecode.spec.suffix_tree import Draft, SuffixTrie

_OWN = 0  # the sequence id of a request's tokens in its own trie


@dataclass(frozen=True)
class SuffixConfig:
    """vLLM's suffix-decoding settings (`suffix_decoding_*`), plus our bounds on memory."""

    num_speculative_tokens: int
    max_tree_depth: int = 24
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    max_tenant_nodes: int = 1_000_000  # per tenant trie (~100 B a node)
    max_tenants: int = 256
    max_request_nodes: int | None = None  # per request trie; past it its oldest positions are forgotten

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise InvalidInput("num_speculative_tokens must be >= 1")
        if self.max_tree_depth < 2:
            raise InvalidInput("max_tree_depth must be >= 2")
        if self.max_spec_factor < 0 or not 0.0 <= self.min_token_prob <= 1.0:
            raise InvalidInput("want max_spec_factor >= 0 and 0 <= min_token_prob <= 1")
        if self.max_tenant_nodes < 1 or self.max_tenants < 1:
            raise InvalidInput("max_tenant_nodes and max_tenants must be >= 1")
        if self.max_request_nodes is not None and self.max_request_nodes < 1:
            raise InvalidInput("max_request_nodes must be >= 1")


class SuffixState:
    """One request: its own trie, and its output's sequence in its tenant's trie (until evicted)."""

    def __init__(self, proposer: SuffixProposer, prompt: Sequence[int], tenant_trie: SuffixTrie) -> None:
        self._proposer = proposer
        self._config = proposer.config
        self._own = SuffixTrie(self._config.max_tree_depth)
        self._own.add(_OWN)
        self._prompt_len = len(prompt)
        self._tenant = tenant_trie
        self._seq = next(proposer._seq_ids)
        self._tenant.add(self._seq)
        self._closed = False
        self._extend_own(prompt)

    @property
    def num_tokens(self) -> int:
        return len(self._own.tokens(_OWN))

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._own.tokens(_OWN))

    @property
    def own_nodes(self) -> int:
        return self._own.size

    def _extend_own(self, tokens: Sequence[int]) -> None:
        self._own.extend(_OWN, tokens)
        cap = self._config.max_request_nodes
        if cap is not None and self._own.size > cap:
            # forget in chunks: each call walks max_tree_depth nodes per position
            while self._own.size > cap and self._own.indexed(_OWN) > 0:
                self._own.forget_front(_OWN, max(1, self._own.indexed(_OWN) // 8))

    def append(self, tokens: Sequence[int]) -> None:
        if self._closed:
            raise InvalidInput("the request's drafting state is closed")
        tokens = [int(t) for t in tokens]
        self._extend_own(tokens)
        if self._seq in self._tenant:
            self._tenant.extend(self._seq, tokens)
            self._proposer._bound(self._tenant)

    def truncate(self, length: int) -> None:
        check_length(length, self.num_tokens)
        self._own.truncate(_OWN, length)
        if self._seq in self._tenant:
            out = max(0, length - self._prompt_len)
            if out < len(self._tenant.tokens(self._seq)):
                self._tenant.truncate(self._seq, out)
        self._prompt_len = min(self._prompt_len, length)

    def draft(self, k: int) -> Draft:
        """The proposal with its probabilities and score (what `propose` returns the tokens of)."""
        check_k(k)
        if k == 0 or self._closed:
            return Draft()
        c = self._config
        ctx = self._own.tokens(_OWN)
        args = {"max_spec_factor": c.max_spec_factor, "max_spec_offset": c.max_spec_offset}
        best = self._own.speculate(ctx, k, min_token_prob=c.min_token_prob, seq=_OWN, **args)
        mine = self._seq if self._seq in self._tenant else None
        shared = self._tenant.speculate(ctx, k, min_token_prob=c.min_token_prob, seq=mine, **args)
        return shared if shared.score > best.score else best

    def propose(self, k: int) -> list[int]:
        return list(self.draft(k).tokens)

    def close(self) -> None:
        """Free the request's own trie; its output stays in the tenant's trie for later requests."""
        if self._closed:
            return
        self._closed = True
        self._own = SuffixTrie(self._config.max_tree_depth)
        self._own.add(_OWN)
        if self._seq in self._tenant:
            self._tenant.close(self._seq)


class SuffixProposer:
    """The method, its settings and the tenants' tries (`start` makes each request's state)."""

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self._tenants: OrderedDict[str, SuffixTrie] = OrderedDict()  # least recently started first
        self._seq_ids = itertools.count()

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def start(self, prompt: Sequence[int], *, tenant: str = "") -> SuffixState:
        trie = self._tenants.get(tenant)
        if trie is None:
            trie = self._tenants[tenant] = SuffixTrie(self.config.max_tree_depth)
            while len(self._tenants) > self.config.max_tenants:
                # running requests of an evicted tenant keep (and bound) their trie until they end;
                # the tenant's next request starts a new one
                self._tenants.popitem(last=False)
        self._tenants.move_to_end(tenant)
        return SuffixState(self, prompt, trie)

    def tenant_nodes(self, tenant: str) -> int:
        """The size of a tenant's trie (0 when it has none): for metrics and tests."""
        trie = self._tenants.get(tenant)
        return 0 if trie is None else trie.size

    def _bound(self, trie: SuffixTrie) -> None:
        # FIFO by request start, as Arctic's global cache; a running request's output may go too
        # (it then stops feeding the trie)
        while trie.size > self.config.max_tenant_nodes and len(trie):
            trie.remove(next(trie.sequences()))
