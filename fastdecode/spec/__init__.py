"""Speculative decoding's building blocks: drafting without a draft model, and exact verification.

Drafting (torch-free; one `Proposer` per method, one `DraftState` per request, `base.py`):
- `ngram.py`: prompt lookup, vLLM's `ngram` (`num_speculative_tokens`, `prompt_lookup_min`,
  `prompt_lookup_max`): the longest n-gram ending the request's tokens that occurs earlier in them,
  its earliest occurrence, and up to k tokens that followed it; an incremental index per request
  (n-gram -> earliest start), plus `propose_ngram`, the stateless reference.
- `suffix.py` over `suffix_tree.py`: suffix decoding, vLLM's `suffix` (Arctic Inference): count-
  weighted suffix tries, depth-bounded, over the request's own tokens and over its tenant's recent
  outputs (a trie per tenant, never shared across tenants, bounded in nodes and in tenants); the
  most frequent continuation of the best-scoring suffix match, cut at a minimum path probability.

A state is fed the tokens a step emitted (accepted drafts and the target's token), never unverified
drafts, so a rejection needs no rollback of drafting state; `truncate(length)` exists for a history
that shrinks.

Verification (`rejection.py`, torch; imported on its own, so the proposers load no torch):
- `accept_greedy`: lossless. The tokens equal those of greedy decoding without speculation.
- `accept_sampled`: distribution-preserving rejection sampling (Leviathan et al. 2023; Chen et al.
  2023): every emitted token is distributed as the target's processed distribution p, whatever the
  drafter proposed; per-sequence generators make a seeded request reproducible.
Either yields 1 to k + 1 tokens per sequence: the KV of the positions past the last accepted draft
must be rolled back before anything reads it.

Imports no gRPC.
"""

from fastdecode.spec.base import DraftState, Proposer
from fastdecode.spec.ngram import NgramConfig, NgramProposer, NgramState, propose_ngram
from fastdecode.spec.suffix import SuffixConfig, SuffixProposer, SuffixState
from fastdecode.spec.suffix_tree import Draft, SuffixTrie


def proposer_for(method: str, k: int, lookup_min: int = 1, lookup_max: int = 4) -> Proposer | None:
    """The drafting method a setting names ("off", "ngram", "suffix"), drafting up to k tokens."""
    if method == "ngram":
        return NgramProposer(NgramConfig(k, lookup_min, lookup_max))
    if method == "suffix":
        return SuffixProposer(SuffixConfig(k))
    return None


__all__ = [
    "Draft",
    "DraftState",
    "NgramConfig",
    "NgramProposer",
    "NgramState",
    "Proposer",
    "SuffixConfig",
    "SuffixProposer",
    "SuffixState",
    "SuffixTrie",
    "propose_ngram",
    "proposer_for",
]
