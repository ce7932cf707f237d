"""The verifier's domain logic: per-sequence state around a :class:`~specdec.runner.KVRunner`, batched rounds.

:class:`BatchVerifier` serves many sequences. One :meth:`BatchVerifier.verify` call takes one proposal per
sequence, runs every ``pending + tree`` in ONE target forward, applies the acceptance rule of
:mod:`specdec.acceptance` per sequence (DESIGN §3), and commits each accepted path to the KV cache. It is the
verification side of the co-located :class:`~specdec.engine.Engine` and the core of ``verifier_service``.

Randomness. Each sequence owns a seeded ``torch.Generator``. A sampled round with ``N`` draft nodes consumes,
in this order, ``accept_uniforms = torch.rand(N, float64)`` then one ``draw_uniform`` (the order of
:class:`~specdec.engine.Engine` before this module existed); greedy rounds consume nothing. Every round draws
fresh uniforms, whatever happened before, so each acceptance test and each final draw is independent of the
draft and of all earlier decisions: that independence is all the rule needs to be exact.

Deferred bonus (DESIGN §4 pipelining). With ``defer_bonus`` the router has already drafted the next chain as
if this one were accepted in full (a tree: along its ``assumed_path``). When the verdict accepts that whole
root-to-leaf path and would end with a bonus token, the bonus is not drawn: the path is committed (its leaf has
KV, nothing is pending) and the row ``p(γ+1)`` at the leaf is kept. (Whether it is deferred depends on the
accepted path alone, never on the bonus.) The next call's tree hangs off that leaf and uses the kept row as its root
row, so the pre-drafted chain's first token is verified against ``p(γ+1)`` exactly as the first token of a
fresh round would be; if the next proposal is empty the bonus is drawn from the kept row. The round that
deferred discards its ``draw_uniform`` unused and the next round draws its own, so no uniform is used twice.
A bonus that would be the sequence's last token (budget) is never deferred: there is nothing to pipeline.

Chunked prefill (vLLM's chunked prefill under ``max_num_batched_tokens``). A sequence's prompt waits in
``pending`` until its first verification forwards it. A :class:`PrefillChunk` passed to :meth:`BatchVerifier.verify`
forwards the next part of it in the same runner forward as the calls (the runner item has an empty tree) and
commits it; the last pending token always stays, because the forward that verifies the first proposal must
produce the root row at it. The chunk's logits are dropped and no random number is drawn, so chunking changes
which forward computes a prompt position's KV and nothing the acceptance rule reads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

import torch

from specdec.acceptance import SCHEMES, SampledRule, Verdict, verify_batched, verify_greedy
from specdec.drafters.base import Proposal
from specdec.errors import CapacityError, InvalidArgumentError, SpecdecError
from specdec.runner import ForwardItem, resolve_feature_layers
from specdec.sampling import logits_to_probs, make_generator, top_logprobs
from specdec.sampling_params import MAX_TOP_LOGPROBS, SamplingParams, TopLogprobs
from specdec.tree import ROOT, TokenTree

FinishReason = Literal["stop", "length"]
_DRAFT_SUM_TOLERANCE = 1e-3  # |sum(q) - 1| allowed for a draft row (float32 rounding of a normalised row)

MAX_FEATURE_LAYERS = 8  # target layers one feature row may fuse (EAGLE-3 fuses 3)


class SequenceNotFoundError(SpecdecError, KeyError):
    """No open sequence has this id (mapped to NOT_FOUND)."""

    def __init__(self, sequence_id: str) -> None:
        super().__init__(f"sequence_id: no open sequence {sequence_id!r}")
        self.sequence_id = sequence_id


class Runner(Protocol):
    """What :class:`BatchVerifier` uses of a :class:`~specdec.runner.KVRunner` (a tensor-parallel rank 0 wraps one)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_open(self) -> int: ...

    @property
    def kv_bytes(self) -> int: ...

    def open(self) -> int: ...

    def close(self, seq: int) -> None: ...

    def length(self, seq: int) -> int: ...

    def forward(self, items: Sequence[ForwardItem], *, all_logits: bool = False) -> list[torch.Tensor]: ...

    def forward_features(
        self, items: Sequence[ForwardItem], layers: Sequence[int] | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...

    def commit(self, seq: int, num_pending: int, path: Sequence[int] = ()) -> None: ...


@dataclass(frozen=True)
class VerifyCall:
    """One sequence's part of a batched round; ``defer_bonus`` asks to keep the bonus row (pipelining) when the
    verdict accepts the whole ``assumed_path`` (empty: any whole path), the one the next proposal was drafted from."""

    sequence_id: str
    proposal: Proposal
    defer_bonus: bool = False
    assumed_path: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefillChunk:
    """The next ``num_tokens`` pending prompt tokens of a sequence, forwarded into its KV cache, verifying nothing."""

    sequence_id: str
    num_tokens: int


@dataclass(frozen=True)
class VerifyOutcome:
    """What one call committed.

    ``verdict`` is the acceptance verdict after the stop rules; when ``bonus_deferred`` its ``emitted`` holds
    only the accepted tokens (no final token) and ``finished`` is False. ``logprobs`` (when the sequence asked
    for them) is ``log p(token)`` of each emitted token under the processed ``p`` row it was accepted or drawn
    at; under greedy, where that ``p`` is one-hot, the log-softmax of the raw logits of the row (vLLM's default
    for logprobs). ``top_logprobs`` (when the sequence asked for ``top_logprobs > 0``) holds, per emitted token,
    the most probable tokens of that same row. ``verify_s`` is the batch's target forward plus acceptance
    rule, ``commit_s`` its KV commits; ``batch_size`` counts the calls verified together and
    ``forward_positions`` the positions their forward ran (prefill chunks included): the cost curve's abscissa.
    ``queued_s`` is how long the call waited for that forward to start (set by a serving scheduler; 0 in-process).

    ``features`` (when the sequence was opened with ``features``) [R, len(feature_layers) * hidden] float32: the
    target's feature rows (:meth:`~specdec.runner.KVRunner.forward_features`) of the positions
    ``feature_start .. feature_start + R - 1`` that got KV since the last outcome: prompt chunks, the pending
    token, the accepted nodes. After every outcome the rows sent cover every position with KV: all committed text
    but its last token (or all of it, when the bonus was deferred), or, with a ``feature_context``, at least its
    last ``feature_context`` positions (an outcome then starts past where the last one ended).
    """

    verdict: Verdict
    bonus_deferred: bool
    finish_reason: FinishReason | None
    logprobs: list[float] | None
    verify_s: float
    commit_s: float
    batch_size: int
    forward_positions: int = 0
    features: torch.Tensor | None = None
    feature_start: int = 0
    top_logprobs: list[TopLogprobs] | None = None
    queued_s: float = 0.0


@dataclass
class _Sequence:
    """Verifier-side state of one sequence.

    Invariant: ``root_row`` is set only while ``pending`` is empty (a deferred bonus); otherwise ``pending``
    holds the committed tokens without KV (the prompt, then each round's final token).
    """

    runner_seq: int | None  # None once finished: the KV is freed at once, the record stays until close
    params: SamplingParams
    generator: torch.Generator
    eos_token_ids: frozenset[int]  # empty when EOS is ignored
    want_logprobs: bool
    top_logprobs: int  # alternatives per emitted token (0: none)
    remaining: int
    pending: list[int]
    root_row: torch.Tensor | None = None  # [V] kept row at the last committed token: logits (greedy) or p
    finish_reason: FinishReason | None = None
    feature_layers: tuple[int, ...] = ()  # the runner's feature layers of each row; empty: no features
    unsent_features: list[torch.Tensor] = field(default_factory=list)  # rows with KV not yet in an outcome
    features_sent: int = 0  # position of the next feature row an outcome carries
    feature_context: int = 0  # an outcome carries the rows of at most this many last positions (0: all)


@dataclass
class _Job:
    """One call inside :meth:`BatchVerifier.verify`; ``rows`` [N + 1, V] is what the rule reads."""

    call: VerifyCall
    sequence: _Sequence
    forwarded: bool  # took part in the forward (False: an empty proposal resolving a deferred bonus)
    runner_seq: int
    num_pending: int
    rows: torch.Tensor | None = None  # greedy: logits on the runner's device; sampled: processed p on CPU
    features: torch.Tensor | None = None  # [m + N, hidden] when the sequence wants features
    verdict: Verdict | None = None
    deferred: bool = False
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None


class BatchVerifier:
    """Sequences keyed by caller-chosen string ids, verified in batches on ``runner``.

    Not thread-safe: one thread owns the verifier (and its runner) at a time. ``rule`` decides sampled rounds
    (always :func:`~specdec.acceptance.verify_batched` in production; a test can pass a wrong one).
    """

    def __init__(self, runner: Runner, *, max_sequences: int | None = None, rule: SampledRule = verify_batched) -> None:
        if max_sequences is not None and max_sequences < 1:
            raise InvalidArgumentError("max_sequences", f"must be >= 1, got {max_sequences}")
        self.runner = runner
        self.max_sequences = max_sequences
        self.rule = rule
        self._sequences: dict[str, _Sequence] = {}

    @property
    def num_open(self) -> int:
        """Sequences opened and not yet closed (finished ones included)."""
        return len(self._sequences)

    def sequence_ids(self) -> list[str]:
        """Ids of the open sequences."""
        return list(self._sequences)

    def validate(self, prompt_ids: Sequence[int], max_tokens: int) -> None:
        """Raise :class:`InvalidArgumentError` naming the first bad field of a request."""
        vocab = self.runner.vocab_size
        if not prompt_ids:
            raise InvalidArgumentError("prompt", "must not be empty")
        if any(not 0 <= token < vocab for token in prompt_ids):
            raise InvalidArgumentError("prompt", f"token ids must be in [0, {vocab})")
        if max_tokens <= 0:
            raise InvalidArgumentError("max_tokens", f"must be >= 1, got {max_tokens}")
        context = self.runner.max_seq_len
        if len(prompt_ids) >= context:  # leaves no room for one token, whatever max_tokens says
            raise InvalidArgumentError("prompt", f"{len(prompt_ids)} tokens; the context length is {context}")
        if len(prompt_ids) + max_tokens > context:
            raise InvalidArgumentError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context length {context}",
            )

    def open(
        self,
        sequence_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        seed: int | None,
        max_tokens: int,
        eos_token_ids: Collection[int],
        ignore_eos: bool = False,
        logprobs: bool = False,
        features: bool = False,
        top_logprobs: int = 0,
        feature_layers: Sequence[int] | None = None,
        feature_context: int = 0,
    ) -> None:
        """Open a sequence; the prompt is prefilled with its first :meth:`verify` (or chunk by chunk before it).

        ``features``: every outcome carries the target's feature rows of the positions it gave KV (an EAGLE
        drafter drafts from them); ``feature_layers`` says which (:meth:`~specdec.runner.KVRunner.forward_features`;
        default: the final norm's output); ``feature_context`` > 0 keeps an outcome's rows to those of its last
        ``feature_context`` positions (a drafter that reads no older ones: an EAGLE head's context).
        ``top_logprobs`` (with ``logprobs``): every outcome carries that many most
        probable tokens of each emitted token's row.

        Raises InvalidArgumentError (bad or duplicate id, bad request fields) or CapacityError (``max_sequences``).
        """
        if not sequence_id:
            raise InvalidArgumentError("sequence_id", "must not be empty")
        if sequence_id in self._sequences:
            raise InvalidArgumentError("sequence_id", f"{sequence_id!r} is already open")
        self.validate(prompt_ids, max_tokens)
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgumentError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
        if top_logprobs and not logprobs:
            raise InvalidArgumentError("top_logprobs", "needs logprobs")
        count = 1 if feature_layers is None else len(feature_layers)  # bounded before anything is built from it
        if features and not 1 <= count <= MAX_FEATURE_LAYERS:
            raise InvalidArgumentError("feature_layers", f"must name 1 to {MAX_FEATURE_LAYERS} layers, got {count}")
        layers = resolve_feature_layers(feature_layers, self.runner.num_layers) if features else ()
        if feature_context < 0:
            raise InvalidArgumentError("feature_context", f"must be >= 0, got {feature_context}")
        if self.max_sequences is not None and len(self._sequences) >= self.max_sequences:
            raise CapacityError(f"{self.max_sequences} sequences are open; retry after some finish")
        self._sequences[sequence_id] = _Sequence(
            runner_seq=self.runner.open(),
            params=params,
            generator=make_generator(seed),
            eos_token_ids=frozenset() if ignore_eos else frozenset(int(token) for token in eos_token_ids),
            want_logprobs=logprobs,
            top_logprobs=top_logprobs,
            remaining=max_tokens,
            pending=[int(token) for token in prompt_ids],
            feature_layers=layers,
            feature_context=feature_context,
        )

    def generator(self, sequence_id: str) -> torch.Generator:
        """The sequence's random stream (the co-located engine lets its drafter draw from it too)."""
        return self._get(sequence_id).generator

    def close(self, sequence_id: str) -> None:
        """Free everything the sequence holds; closing an unknown or closed id does nothing."""
        sequence = self._sequences.pop(sequence_id, None)
        if sequence is not None:
            self._release(sequence)

    def forward_tokens(self, call: VerifyCall) -> int:
        """Positions ``call`` adds to a forward: the sequence's pending tokens (the rest of the prompt before its
        first verification) plus the proposal's nodes; 0 for an unknown sequence, which :meth:`check` fails alone."""
        sequence = self._sequences.get(call.sequence_id)
        return 0 if sequence is None else len(sequence.pending) + len(call.proposal.tree)

    def prefillable(self, sequence_id: str) -> int:
        """Pending tokens a :class:`PrefillChunk` may take now: all but the last; 0 for an unknown sequence."""
        sequence = self._sequences.get(sequence_id)
        return 0 if sequence is None else max(len(sequence.pending) - 1, 0)

    def prefill_backlog(self) -> int:
        """Prompt tokens the open sequences have yet to prefill (each one's :meth:`prefillable`)."""
        return sum(self.prefillable(sequence_id) for sequence_id in self._sequences)

    def check(self, call: VerifyCall) -> None:
        """Raise the error :meth:`verify` would raise for ``call`` alone, touching nothing.

        SequenceNotFoundError for an unknown id; InvalidArgumentError naming the field for a finished sequence,
        out-of-vocabulary tokens, a tree past the context, or draft rows that are not the distribution each
        node could have been sampled from (shape, negative or non-finite entries, sum != 1, ``q(token) = 0``,
        a repeated sibling under sampling without replacement).
        """
        sequence = self._get(call.sequence_id)
        if sequence.finish_reason is not None:
            raise InvalidArgumentError("sequence_id", f"{call.sequence_id!r} has finished; close it")
        proposal, vocab = call.proposal, self.runner.vocab_size
        tree = proposal.tree
        if proposal.scheme not in SCHEMES:
            raise InvalidArgumentError("proposal.sibling_sampling", f"must be one of {SCHEMES}")
        if any(not 0 <= token < vocab for token in tree.tokens):
            raise InvalidArgumentError("proposal.tree.tokens", f"token ids must be in [0, {vocab})")
        end = self.runner.length(sequence.runner_seq) + len(sequence.pending) + tree.max_depth()
        if end > self.runner.max_seq_len:
            raise InvalidArgumentError(
                "proposal.tree", f"depth {tree.max_depth()} reaches position {end}, past the context"
            )
        if proposal.scheme == "without_replacement":
            for node in (ROOT, *range(len(tree))):
                siblings = [tree.tokens[child] for child in tree.children(node)]
                if len(set(siblings)) != len(siblings):
                    raise InvalidArgumentError("proposal.tree.tokens", "siblings drawn without replacement repeat")
        if proposal.draft_probs is not None:
            _check_draft_rows(tree, proposal.draft_probs, vocab)

    def verify(self, calls: Sequence[VerifyCall], prefills: Sequence[PrefillChunk] = ()) -> list[VerifyOutcome]:
        """Verify one proposal per sequence in one target forward and commit the accepted paths; the same forward
        prefills ``prefills`` (each ``num_tokens`` in ``[1, prefillable]``). Returns one outcome per call.

        Every call is checked (:meth:`check`) and every chunk sized before any state changes; a sequence may
        appear once among calls and chunks together.
        """
        sequence_ids = [call.sequence_id for call in calls] + [chunk.sequence_id for chunk in prefills]
        if len(set(sequence_ids)) != len(sequence_ids):
            raise InvalidArgumentError("sequence_id", "a sequence appears twice in one batch")
        for call in calls:
            self.check(call)
        for chunk in prefills:
            self._get(chunk.sequence_id)
            limit = self.prefillable(chunk.sequence_id)
            if not 1 <= chunk.num_tokens <= limit:
                raise InvalidArgumentError("num_tokens", f"must be in [1, {limit}], got {chunk.num_tokens}")
        started = time.perf_counter()
        jobs = [self._job(call) for call in calls]
        chunks = [(self._sequences[chunk.sequence_id], chunk.num_tokens) for chunk in prefills]
        positions = self._forward(jobs, chunks)
        self._decide(jobs)
        verified = time.perf_counter()
        for job in jobs:
            self._commit(job)
        for sequence, count in chunks:  # the prompt's head now has KV; the rest stays pending
            self.runner.commit(sequence.runner_seq, count)
            sequence.pending = sequence.pending[count:]
        committed = time.perf_counter()
        return [
            VerifyOutcome(
                verdict=job.verdict,
                bonus_deferred=job.deferred,
                finish_reason=job.sequence.finish_reason,
                logprobs=job.logprobs,
                top_logprobs=job.top_logprobs,
                verify_s=verified - started,
                commit_s=committed - verified,
                batch_size=len(calls),
                forward_positions=positions,
                **_take_features(job.sequence, self.runner.hidden_size),
            )
            for job in jobs
        ]

    def _get(self, sequence_id: str) -> _Sequence:
        sequence = self._sequences.get(sequence_id)
        if sequence is None:
            raise SequenceNotFoundError(sequence_id)
        return sequence

    def _release(self, sequence: _Sequence) -> None:
        """Free the runner's KV of ``sequence`` (once)."""
        if sequence.runner_seq is not None:
            self.runner.close(sequence.runner_seq)
            sequence.runner_seq = None
        sequence.root_row = None

    def _job(self, call: VerifyCall) -> _Job:
        sequence = self._get(call.sequence_id)
        forwarded = sequence.root_row is None or len(call.proposal.tree) > 0
        return _Job(call, sequence, forwarded, sequence.runner_seq, len(sequence.pending))

    def _forward(self, jobs: list[_Job], chunks: list[tuple[_Sequence, int]]) -> int:
        """One runner forward for every job that needs it and every prefill chunk (the first ``count`` pending
        tokens, no tree); fill ``job.rows`` [N + 1, V] for the rule. Returns the positions forwarded."""
        forwarded = [job for job in jobs if job.forwarded]
        items = [ForwardItem(job.runner_seq, job.sequence.pending, job.call.proposal.tree) for job in forwarded]
        items += [ForwardItem(sequence.runner_seq, sequence.pending[:count]) for sequence, count in chunks]
        wanting = [job.sequence for job in forwarded] + [sequence for sequence, _ in chunks]
        layers = sorted({layer for sequence in wanting for layer in sequence.feature_layers})
        if layers:  # one forward captures every layer any sequence wants; each keeps its own blocks, in its order
            outputs, features = self.runner.forward_features(items, layers)
            picks = {
                sequence.feature_layers: _feature_columns(layers, sequence.feature_layers, self.runner.hidden_size)
                for sequence in wanting
                if sequence.feature_layers
            }
            for job, rows in zip(forwarded, features, strict=False):
                wanted = job.sequence.feature_layers
                job.features = rows[:, picks[wanted]] if wanted else None
            for (sequence, count), rows in zip(chunks, features[len(forwarded) :], strict=True):
                if sequence.feature_layers:
                    sequence.unsent_features.append(rows[:count, picks[sequence.feature_layers]])
        else:
            outputs = self.runner.forward(items) if items else []
        # logits [1 + N, V], or [N, V] off a kept row; the chunks' rows (after the jobs') are not needed
        for job, logits in zip(forwarded, outputs[: len(forwarded)], strict=True):
            params = job.sequence.params
            job.rows = logits if params.greedy else logits_to_probs(logits, params).cpu()
        for job in jobs:
            root = job.sequence.root_row
            if root is not None:  # the kept row at the last committed token is row 0
                job.rows = root[None] if job.rows is None else torch.cat([root[None], job.rows])
        return sum(len(item.pending) + len(item.tree) for item in items)

    def _decide(self, jobs: list[_Job]) -> None:
        """The acceptance rule per job (greedy alone; sampled batched per sibling scheme), then deferral."""
        by_scheme: dict[str, list[_Job]] = {}
        for job in jobs:
            sequence, tree = job.sequence, job.call.proposal.tree
            if sequence.params.greedy:
                job.verdict = verify_greedy(
                    tree, job.rows, max_new_tokens=sequence.remaining, eos_token_ids=sequence.eos_token_ids
                )
            else:
                by_scheme.setdefault(job.call.proposal.scheme, []).append(job)
        for scheme, group in by_scheme.items():
            for job, verdict in zip(group, _verify_sampled(group, scheme, self.rule), strict=True):
                job.verdict = verdict
        for job in jobs:
            verdict, sequence = job.verdict, job.sequence
            job.deferred = (
                job.call.defer_bonus
                and verdict.final_token_kind == "bonus"
                and bool(verdict.accepted_path)
                and job.call.assumed_path in ((), tuple(verdict.accepted_path))
                and sequence.remaining - len(verdict.accepted_path) > 1
            )
            if job.deferred:  # the bonus is not drawn: emit the accepted tokens only
                job.verdict = replace(
                    verdict, emitted=verdict.emitted[:-1], final_token_kind=None, final_row=None, finished=False
                )
            if sequence.want_logprobs:
                job.logprobs, job.top_logprobs = _logprobs(job, job.verdict)

    def _commit(self, job: _Job) -> None:
        """Keep the accepted path's KV (pointer arithmetic for chains) and advance the sequence."""
        sequence, verdict = job.sequence, job.verdict
        if job.forwarded:
            self.runner.commit(job.runner_seq, job.num_pending, verdict.accepted_path)
            if job.features is not None:  # the rows of exactly what now has KV: pending tokens, then the path
                kept = list(range(job.num_pending)) + [job.num_pending + node for node in verdict.accepted_path]
                sequence.unsent_features.append(job.features[kept])
        sequence.remaining -= len(verdict.emitted)
        if job.deferred:
            sequence.pending, sequence.root_row = [], job.rows[verdict.accepted_path[-1] + 1]
        else:
            sequence.pending, sequence.root_row = verdict.emitted[-1:], None
        if verdict.finished:
            sequence.finish_reason = "stop" if verdict.emitted[-1] in sequence.eos_token_ids else "length"
            self._release(sequence)


def _take_features(sequence: _Sequence, hidden_size: int) -> dict[str, torch.Tensor | int]:
    """The outcome fields carrying ``sequence``'s unsent feature rows (none unless it wants features); clears them."""
    if not sequence.feature_layers:
        return {}
    rows, sequence.unsent_features = sequence.unsent_features, []
    features = torch.cat(rows) if rows else torch.empty(0, hidden_size * len(sequence.feature_layers))
    start = sequence.features_sent
    sequence.features_sent += len(features)
    dropped = max(len(features) - sequence.feature_context, 0) if sequence.feature_context else 0
    return {"features": features[dropped:], "feature_start": start + dropped}


def _feature_columns(captured: Sequence[int], wanted: Sequence[int], hidden_size: int) -> torch.Tensor | slice:
    """Columns of rows holding the blocks of ``captured`` layers that give the blocks of ``wanted``, in order."""
    if list(captured) == list(wanted):
        return slice(None)
    blocks = [captured.index(layer) for layer in wanted]
    return torch.cat([torch.arange(b * hidden_size, (b + 1) * hidden_size) for b in blocks])


def _verify_sampled(jobs: list[_Job], scheme: str, rule: SampledRule) -> list[Verdict]:
    """``rule`` (:func:`verify_batched`) over sampled jobs of one sibling scheme; ragged trees are padded.

    Uniforms are drawn per sequence from its own generator: ``rand(N)`` then one draw uniform.
    """
    trees = [job.call.proposal.tree for job in jobs]
    width, vocab = max(len(tree) for tree in trees), jobs[0].rows.shape[-1]
    target = torch.zeros(len(jobs), width + 1, vocab)  # [B, N + 1, V]
    has_draft = any(job.call.proposal.draft_probs is not None for job in jobs)
    draft = torch.zeros(len(jobs), width, vocab) if has_draft else None  # [B, N, V]
    accept = torch.zeros(len(jobs), width, dtype=torch.float64)  # [B, N]
    draw = torch.zeros(len(jobs), dtype=torch.float64)  # [B]
    for index, (job, tree) in enumerate(zip(jobs, trees, strict=True)):
        size, generator = len(tree), job.sequence.generator
        target[index, : size + 1] = job.rows
        if draft is not None and size:
            q = job.call.proposal.draft_probs
            draft[index, :size] = q if q is not None else torch.nn.functional.one_hot(torch.tensor(tree.tokens), vocab)
        accept[index, :size] = torch.rand(size, generator=generator, dtype=torch.float64)
        draw[index] = torch.rand((), generator=generator, dtype=torch.float64)
    return rule(
        trees,
        target,
        draft,
        accept,
        draw,
        max_new_tokens=[job.sequence.remaining for job in jobs],
        eos_token_ids=[job.sequence.eos_token_ids for job in jobs],
        scheme=scheme,
    )


def _logprobs(job: _Job, verdict: Verdict) -> tuple[list[float], list[TopLogprobs] | None]:
    """``log p`` of each emitted token at the row it was accepted or drawn at (the parent's row), and that row's most
    probable tokens when the sequence asks for them. The row is the processed ``p`` the rule read; greedy rows are
    raw logits (the rule's ``p`` is their one-hot), reported as their log-softmax."""
    rows = ([0] + [node + 1 for node in verdict.accepted_path])[: len(verdict.emitted)]
    selected = job.rows[rows].float().cpu()  # [E, V]
    log_p = torch.log_softmax(selected, dim=-1) if job.sequence.params.greedy else torch.log(selected)
    emitted = torch.tensor(verdict.emitted, dtype=torch.long)
    logprobs = log_p.gather(1, emitted[:, None]).squeeze(1).tolist()
    count = job.sequence.top_logprobs
    return logprobs, ([top_logprobs(row, count) for row in log_p] if count else None)


def _check_draft_rows(tree: TokenTree, draft_probs: torch.Tensor, vocab: int) -> None:
    """``draft_probs`` [N, V]: one normalised, finite, non-negative row per node with ``q(node token) > 0``."""
    if tuple(draft_probs.shape) != (len(tree), vocab):
        raise InvalidArgumentError(
            "proposal.draft", f"needs one row of {vocab} per node ({len(tree)}), got shape {tuple(draft_probs.shape)}"
        )
    if not len(tree):
        return
    low, high = torch.aminmax(draft_probs)  # one pass (NaN fails both tests); isfinite().all() took ~0.7 ms a round
    if not (float(low) >= 0 and math.isfinite(float(high))):
        raise InvalidArgumentError("proposal.draft.rows", "probabilities must be finite and >= 0")
    sums = draft_probs.double().sum(dim=-1)
    off = ((sums - 1).abs() > _DRAFT_SUM_TOLERANCE).nonzero().flatten().tolist()
    if off:
        raise InvalidArgumentError(
            "proposal.draft.rows", f"each row must sum to 1; node {off[0]}'s sums to {sums[off[0]]}"
        )
    tokens = torch.tensor(tree.tokens, dtype=torch.long, device=draft_probs.device)
    if not bool((draft_probs.gather(1, tokens[:, None]) > 0).all()):
        raise InvalidArgumentError("proposal.draft.rows", "a node's token has draft probability 0 in its own row")
