"""Speculative drafts for decode rows (the scheduler's --speculative): the scheduler holds every
sequence's tokens, so it drafts (fastdecode/spec: n-gram prompt lookup or suffix tries, no draft
model, nothing new on the wire but the drafted ids) and plans a decode row as its last token followed
by up to k drafts. gpu_dense verifies them in the one step and answers 1 to k + 1 tokens; the shards
attend the k + 1 positions in one read of the sequence's KV, so KV bytes read and round trips per
generated token fall by the tokens a row yields.

A request is drafted for only where verification is exact and cheap: no penalties over its history
(their processors would need each draft in their state), no prompt logprobs, and no seed: a seeded
request's tokens would depend on the drafts it was offered (verification draws from the target
exactly, but which tokens a draw yields depends on the draft it weighs), so it keeps the tokens it
gets without speculation. A grammar is drafted for: gpu_dense advances its matcher through the
drafts and masks every draft position. Drafts never pass its max_tokens, so its KV never grows past
what it reserved.

How many drafts a row is offered, k in 0..K, is the controller's (fastdecode/spec/controller.py):
fed each step's costs (`stepped`, from the driver) and the counts kept here, it keeps the k that
yields the most tokens per second; `adaptive=False` (--speculative-k fixed) pins K. Pure Python, no
gRPC: a collaborator of the core's (fastdecode/scheduling/core.py).
"""

from __future__ import annotations

from typing import Any

from fastdecode.contract import SamplingParams, TokenLogprob
from fastdecode.scheduling.ports import StepTimes
from fastdecode.scheduling.runs import DecodeRuns, tokens_of
from fastdecode.scheduling.tables import SeqEntry
from fastdecode.scheduling.types import DenseAnswer, Step, TokenEvent
from fastdecode.spec import DraftState, Proposer
from fastdecode.spec.controller import Counts, KController, StepCost, at_least


def draftable(sampling: SamplingParams) -> bool:
    """Whether rows of a request with these settings may carry drafts."""
    return not (sampling.reads_history or sampling.prompt_logprobs or sampling.seed is not None)


class Drafting:
    """Each running sequence's drafting state, fed the sequence's tokens as they come, and what
    verification made of the drafts (the acceptance counters the metrics export)."""

    def __init__(self, proposer: Proposer, adaptive: bool = True) -> None:
        self.proposer = proposer
        self.k = proposer.num_speculative_tokens
        self.control = KController(self.k, adaptive)
        # rows asked for drafts, by the most they were offered, and by how many the drafter found
        # (histograms: O(1) a row; asked_at / found_at sum them per position)
        self._asked = [0] * (self.k + 1)
        self._found = [0] * (self.k + 1)
        self._rows = 0  # draftable decode rows planned since the last step ran
        self._states: dict[str, DraftState] = {}
        self.rows = 0  # verified rows that carried drafts
        self.proposed = 0  # drafts those rows carried
        self.accepted = 0  # of them, kept
        self.emitted = 0  # tokens those rows yielded (kept drafts and the target's own)
        # per draft position j: rows that offered a j-th draft, and those that kept it
        self.offered_at = [0] * self.k
        self.kept_at = [0] * self.k

    def drafts(
        self, seq_id: str, tokens: list[int], sampling: SamplingParams, room: int, tenant: str
    ) -> list[int]:
        """Up to k drafts to follow `tokens` (prompt and output so far); at most `room` (what the
        request may still generate after the row's own token); the controller's k at most."""
        if room <= 0 or not draftable(sampling):
            return []
        self._rows += 1
        k = min(self.control.cap, room)
        if k <= 0:
            return []
        st = self._states.get(seq_id)
        if st is None:
            st = self._states[seq_id] = self.proposer.start(tokens, tenant=tenant)
        elif st.num_tokens != len(tokens):  # the tokens applied since its last row
            if st.num_tokens > len(tokens):
                st.truncate(len(tokens))
            else:
                st.append(tokens[st.num_tokens :])
        out = st.propose(k)
        self._asked[k] += 1
        self._found[len(out)] += 1
        return out

    def stepped(self, step: Step, times: StepTimes | None, wall_s: float) -> None:
        """A step ran (applied): its costs go to the controller, which may choose another k for the
        steps after it. `times`: gpu_dense's (None: it sent none, and k stays)."""
        rows, self._rows = self._rows, 0
        if not self.control.adaptive or times is None:
            return
        positions = sum(len(p.token_ids) for p in step.seqs)
        cost = StepCost.of(positions, rows, sum(p.drafts for p in step.seqs), times, wall_s)
        self.control.observe(cost, Counts(self.asked_at, self.found_at, self.offered_at, self.kept_at))

    @property
    def asked_at(self) -> list[int]:
        """Per draft position j: rows offered a (j + 1)-th draft (asked for at least j + 1)."""
        return at_least(self._asked)

    @property
    def found_at(self) -> list[int]:
        """Per draft position j: rows the drafter found a (j + 1)-th draft for."""
        return at_least(self._found)

    def apply(
        self,
        seq: SeqEntry,
        drafts: int,
        res: DenseAnswer,
        scored: list[TokenLogprob],
        step_no: int,
        runs: DecodeRuns,
    ) -> TokenEvent:
        """A verified row's 1 to drafts + 1 tokens through the stop rules (runs.py). Going on, its KV
        holds the row's last token and the drafts kept: the positions past them hold rejected drafts
        on its shard until its next row writes over them (or a move rolls them back first)."""
        emitted = len(tokens_of(res)[0])
        ev = runs.apply(seq, drafts + 1, res, scored, step_no, exact=False)
        if ev.error is None:
            self.verified(drafts, emitted)
            if ev.finish_reason is None:
                seq.kv = len(seq.tokens) - 1
        return ev

    def verified(self, drafts: int, emitted: int) -> None:
        """A row with `drafts` drafts yielded `emitted` tokens."""
        self.rows += 1
        self.proposed += drafts
        self.accepted += emitted - 1
        self.emitted += emitted
        for j in range(min(drafts, self.k)):
            self.offered_at[j] += 1
            self.kept_at[j] += j < emitted - 1

    def forget(self, seq_id: str) -> None:
        """The sequence left: its state goes (a tenant's shared index keeps what it learnt)."""
        st = self._states.pop(seq_id, None)
        if st is not None:
            st.close()

    @property
    def counts(self) -> tuple[int, int, int, int]:
        """(rows with drafts, drafts they carried, drafts kept, tokens they yielded)."""
        return self.rows, self.proposed, self.accepted, self.emitted

    @property
    def acceptance_length(self) -> float:
        """Mean tokens a verified row yielded (tau); 0 before any."""
        return self.emitted / self.rows if self.rows else 0.0

    def stats(self) -> dict[str, Any]:
        """SchedulerStats' speculation fields: the counts, per position, and the k chosen now."""
        return {
            "spec": self.counts,
            "spec_at": (self.offered_at[:], self.kept_at[:]),
            "spec_k": self.control.k,
        }
