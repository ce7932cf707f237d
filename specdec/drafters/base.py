"""What every drafter promises: per-sequence state, batched proposals, commit, pipelining and rollback.

A sequence's **text** is its prompt plus everything committed or assumed so far. A drafter proposes
candidates that hang off the end of the text; the last proposal stays *outstanding* until one of three
calls resolves it:

- ``commit(handle, accepted_path, emitted)``: the verifier accepted ``accepted_path`` of the outstanding
  proposal and emitted ``emitted`` (accepted tokens, then the recovered or bonus token); the text grows by
  ``emitted``. State the last draft forward computed for accepted nodes is kept.
- ``assume_accepted(handle)``: pipelining (DESIGN §4). While the verifier checks the outstanding proposal,
  its assumed path (a chain: every node; a tree: its most probable root-to-leaf path, see
  :func:`most_probable_leaf_path`) is appended to the text as if accepted, with no final token yet, so the
  next ``propose`` drafts on top of it.
- ``sync(handle, base_length, emitted)``: the committed text is now ``text[:base_length] + emitted``. One
  call for every outcome: a normal commit, the confirmation of an assumed chain (the new text equals the
  text: nothing to do, and a proposal drafted on top stays outstanding), or a rollback after a rejection
  (state is cut back to the common prefix by pointer arithmetic and the rest becomes pending input).

After any of them the drafter proposes exactly what a drafter opened fresh on the new text would.

**Multi-outcome pre-drafting** (Saguaro, "speculative speculative decoding"): with ``predraft_outcomes`` > 1 a
proposal also names the most likely *rejection* verdicts of its assumed path (:class:`Rejection`: the first ``j``
nodes accepted, then the draft's most probable other token as the correction). Before ``assume_accepted``,
``pre_draft`` drafts one proposal on each such text; a later ``sync`` to one of them makes that proposal the
outstanding one, as if it had been drafted after the sync. Why this is lossless: a pre-draft is only a proposal.
The verifier still draws every correction itself from the residual ``norm(max(0, p - q))``, with its own random
numbers, and commits that token whatever was guessed; the guess only decides which proposal, if any, can be
sent next. The proposal sent was drawn from the ``q`` it carries, given the committed text, with the drafter's own
random numbers, independent of the verifier's, so the acceptance rule applies to it exactly as to a fresh draft.

A pre-draft can be stopped (``stop``, checked between forwards): the sequence then proposes nothing and has no
outstanding proposal, and the next ``sync`` rolls its state back like any other. So that a seeded request draws the
same random numbers however far a discarded pre-draft got, a ``sync`` that rolls back an assumption (no pre-drafted
proposal selected) also puts the sequence's generator back where it was before that pre-draft drew anything. This
reuse is exact: the discarded draws never reached the verifier, so they are independent of everything committed.

Worked example of a pipelined round::

    open (5, 6)                       text (5, 6)
    propose → chain (7, 8)            outstanding (7, 8)
    assume_accepted                   text (5, 6, 7, 8)
    propose → chain (9,)              drafted while (7, 8) is verified; outstanding (9,)
    then one of:
      sync(2, [7, 8])                 all accepted, bonus deferred: text unchanged, (9,) still outstanding
      sync(2, [7, 8, 9])              all accepted, bonus 9: text (5, 6, 7, 8, 9); node 9's state is kept
      sync(2, [7, 3])                 8 rejected, correction 3: text (5, 6, 7, 3); (9,) discarded
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, Literal, NamedTuple, Protocol, TypeVar

import torch

from specdec.errors import InvalidArgumentError
from specdec.sampling import SamplingParams
from specdec.tree import ROOT, TokenTree

TreeSampling = Literal["iid", "without_replacement"]
StopCheck = Callable[[int], bool]  # handle -> whether to stop drafting for it now


@dataclass(frozen=True)
class DraftConfig:
    """Shape of the candidates a drafter proposes each round.

    ``num_draft_tokens`` is the chain length γ, and the tree depth when ``tree_width > 1``.
    ``tree_budget`` caps the number of tree nodes (0: ``tree_width * num_draft_tokens``).
    ``draft_top_k`` truncates the draft distribution so ``q`` has small, exact support (DESIGN §5).
    ``predraft_outcomes`` is the pre-drafting compute budget: proposals one pre-draft prepares (1: for full
    acceptance only; each more: one rejection outcome, see the module docstring).
    """

    num_draft_tokens: int = 4
    tree_width: int = 1
    tree_budget: int = 0
    draft_top_k: int = 20
    tree_sampling: TreeSampling = "without_replacement"
    predraft_outcomes: int = 1

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise InvalidArgumentError("num_draft_tokens", f"must be >= 1, got {self.num_draft_tokens}")
        if self.tree_width < 1:
            raise InvalidArgumentError("tree_width", f"must be >= 1, got {self.tree_width}")
        if self.tree_budget < 0:
            raise InvalidArgumentError("tree_budget", f"must be >= 0, got {self.tree_budget}")
        if self.draft_top_k < 0:
            raise InvalidArgumentError("draft_top_k", f"must be >= 0 (0: untruncated), got {self.draft_top_k}")
        if self.tree_sampling not in ("iid", "without_replacement"):
            raise InvalidArgumentError("tree_sampling", f"must be iid or without_replacement, got {self.tree_sampling}")
        if self.predraft_outcomes < 1:
            raise InvalidArgumentError("predraft_outcomes", f"must be >= 1, got {self.predraft_outcomes}")

    @property
    def max_nodes(self) -> int:
        return self.tree_budget or self.tree_width * self.num_draft_tokens

    def with_shape(
        self, num_draft_tokens: int, tree_width: int, tree_budget: int, tree_sampling: TreeSampling | None
    ) -> DraftConfig:
        """This config with a per-sequence shape (validated); 0 or ``None`` keeps this config's value.

        ``with_shape(0, 2, 6, None)`` on the defaults: depth 4, width 2, at most 6 nodes, without replacement.
        """
        return replace(
            self,
            num_draft_tokens=num_draft_tokens or self.num_draft_tokens,
            tree_width=tree_width or self.tree_width,
            tree_budget=tree_budget or self.tree_budget,
            tree_sampling=tree_sampling or self.tree_sampling,
        )


class Rejection(NamedTuple):
    """A guessed verdict of a proposal: ``accepted_path`` (root-to-node indices on the assumed path) accepted, then
    a correction; ``emitted`` is their tokens followed by the guessed correction."""

    accepted_path: tuple[int, ...]
    emitted: tuple[int, ...]


@dataclass(frozen=True)
class Proposal:
    """Candidates for one sequence.

    ``draft_probs`` [N, V]: row i is the distribution node i was sampled from; ``None`` means the
    proposal is deterministic (model-free lookup, or greedy drafting) and ``q`` is one-hot per node.
    ``scheme`` says how siblings were drawn, which decides the tree acceptance rule. ``assumed_path`` is what
    a pre-draft after it assumes accepted, ``rejections`` the rejection verdicts it also prepares for, most likely
    first (see :class:`Outstanding`). ``model_free``: drafted without running a model (prompt lookup), so the time
    it took is no draft level's cost (the adaptive controller learns level costs from the others).
    """

    tree: TokenTree
    draft_probs: torch.Tensor | None
    scheme: TreeSampling = "iid"
    assumed_path: tuple[int, ...] = ()
    rejections: tuple[Rejection, ...] = ()
    model_free: bool = False


class Drafter(Protocol):
    """Per-sequence drafting state; all calls for many sequences are batched where the drafter can."""

    config: DraftConfig  # the candidate shape of sequences opened without their own

    def open(
        self, prompt: list[int], params: SamplingParams, generator: torch.Generator, config: DraftConfig | None = None
    ) -> int:
        """Start a sequence on ``prompt`` (its own candidate shape: ``config``) and return its handle."""
        ...

    def propose(self, handles: list[int], max_tokens: list[int], stop: StopCheck | None = None) -> list[Proposal]:
        """Draft for each handle at most ``max_tokens[i]`` nodes (0: propose nothing); a handle ``stop`` names
        between forwards stops (empty proposal, nothing outstanding)."""
        ...

    def pre_draft(
        self, handles: list[int], max_tokens: list[int], stop: StopCheck | None = None
    ) -> list[list[Proposal]]:
        """Multi-outcome pre-drafting, before ``assume_accepted``: per handle, a proposal for each (leading) entry of
        its outstanding proposal's ``rejections``."""
        ...

    def commit(self, handle: int, accepted_path: list[int], emitted: list[int]) -> None:
        """The verifier accepted ``accepted_path`` of the last proposal and emitted ``emitted``."""
        ...

    def assume_accepted(self, handle: int) -> None:
        """Pipelining: treat the last proposal's assumed path as accepted, with no final token yet."""
        ...

    def sync(self, handle: int, base_length: int, emitted: list[int]) -> None:
        """The committed text is now ``text[:base_length] + emitted``."""
        ...

    def close(self, handle: int) -> None:
        """Free everything the sequence holds."""
        ...

    @property
    def num_open(self) -> int:
        """Open sequences."""
        ...

    @property
    def runner_sequences(self) -> int:
        """Sequences holding KV in a model runner (0 for model-free drafters); for leak checks."""
        ...

    @property
    def feature_width(self) -> int:
        """Width of the target feature rows this drafter drafts from (EAGLE); 0 when it takes none."""
        ...

    @property
    def lookup_min_match(self) -> int:
        """The shortest text tail whose earlier occurrence makes a round a prompt-lookup chain
        (:meth:`specdec.lookup.LookupIndex.prompt_lookup`) instead of the model's draft; 0: its rounds are all of
        one kind."""
        ...

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose rows those are (:meth:`~specdec.runner.KVRunner.forward_features`); empty: the
        final norm's output, the default."""
        ...

    @property
    def feature_context(self) -> int:
        """How many of the latest positions of its text the drafter reads feature rows of (0: all): older rows
        need not be sent (an EAGLE head's context)."""
        ...

    def add_features(self, handle: int, start: int, rows: torch.Tensor) -> None:
        """The target's feature rows [R, feature_width] of text positions ``start .. start + R - 1``, as the
        verifier's outcomes carry them (:class:`~specdec.verification.VerifyOutcome`); given before the
        ``commit`` / ``sync`` of the same round."""
        ...


@dataclass(frozen=True)
class Outstanding:
    """The last proposal of a sequence, hanging off the end of its text, until a call resolves it.

    ``assumed_path`` is what :meth:`SequenceDrafter.assume_accepted` appends: root-to-leaf node indices.
    ``rejections`` are the verdicts :meth:`SequenceDrafter.pre_draft` prepares for.
    """

    tree: TokenTree
    assumed_path: tuple[int, ...]
    rejections: tuple[Rejection, ...] = ()


@dataclass(kw_only=True)
class SequenceState:
    """What every drafter keeps per sequence: the text, its candidate shape and the outstanding proposal.

    ``alternatives``: proposals pre-drafted for rejection verdicts (keyed by their ``emitted``) of the proposal
    that hung off the first ``alternatives_base`` tokens; the next ``sync`` takes one or drops them all.
    """

    text: list[int]
    config: DraftConfig
    outstanding: Outstanding | None = None
    alternatives: dict[tuple[int, ...], Outstanding] = field(default_factory=dict)
    alternatives_base: int = -1
    generator: torch.Generator | None = None  # the random stream proposals are drawn from (None: deterministic)
    rng_before_predraft: torch.Tensor | None = None  # the generator's state before the pending pre-draft drew


S = TypeVar("S", bound=SequenceState)


class SequenceDrafter(ABC, Generic[S]):
    """Handles, validation and the commit / assume / sync bookkeeping shared by every drafter.

    Subclasses say how a sequence starts (:meth:`_start`), how its state follows a new text
    (:meth:`_resync`) and what closing frees (:meth:`_release`); ``propose`` must leave an
    :class:`Outstanding` on every sequence it drafted for.
    """

    lookup_min_match = 0  # (Drafter.lookup_min_match) an eagle drafter sets its own

    def __init__(self, config: DraftConfig, vocab_size: int | None) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self._sequences: dict[int, S] = {}
        self._handles = itertools.count()

    def open(
        self, prompt: list[int], params: SamplingParams, generator: torch.Generator, config: DraftConfig | None = None
    ) -> int:
        """Start a sequence on ``prompt``; ``config`` (default: the drafter's) shapes its candidates."""
        if not prompt:
            raise InvalidArgumentError("prompt", "must not be empty")
        check_tokens("prompt", prompt, self.vocab_size)
        state = self._start(list(prompt), params, generator, config or self.config)
        handle = next(self._handles)
        self._sequences[handle] = state
        return handle

    def close(self, handle: int) -> None:
        """Free the sequence (closing an unknown or closed handle does nothing)."""
        state = self._sequences.pop(handle, None)
        if state is not None:
            self._release(state)

    @property
    def num_open(self) -> int:
        return len(self._sequences)

    @property
    def runner_sequences(self) -> int:
        return 0

    @property
    def feature_width(self) -> int:
        return 0

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return ()

    @property
    def feature_context(self) -> int:
        return 0

    def add_features(self, handle: int, start: int, rows: torch.Tensor) -> None:
        """Drafters that take no target features refuse them."""
        raise InvalidArgumentError("features", "this drafter drafts without target features; send none")

    def text(self, handle: int) -> list[int]:
        """The sequence's prompt + committed + assumed tokens."""
        return list(self._sequence(handle).text)

    @abstractmethod
    def propose(self, handles: list[int], max_tokens: list[int], stop: StopCheck | None = None) -> list[Proposal]:
        """Draft for each handle at most ``max_tokens[i]`` nodes (0: none); ``stop``: see :class:`Drafter`."""

    def pre_draft(
        self, handles: list[int], max_tokens: list[int], stop: StopCheck | None = None
    ) -> list[list[Proposal]]:
        """Multi-outcome pre-drafting (module docstring): for every handle, one proposal per leading entry of its
        outstanding proposal's ``rejections``, each drafted on ``text + emitted`` as a commit of that verdict would
        leave it, batched across handles rank by rank; a handle ``stop`` names gets no more.

        Afterwards each sequence has its text back and its outstanding proposal (without any scratch state, see
        :meth:`_detached`), so ``assume_accepted`` and ``propose`` follow as for single-outcome pre-drafting.
        """
        states = [self._sequence(handle) for handle in handles]
        for state in states:
            _checkpoint_rng(state, overwrite=True)
        saved = [(list(state.text), state.outstanding) for state in states]
        drafted: list[list[Proposal]] = [[] for _ in handles]
        alternatives: list[dict[tuple[int, ...], Outstanding]] = [{} for _ in handles]
        try:
            for rank in itertools.count():
                batch = [
                    index
                    for index, (_, outstanding) in enumerate(saved)
                    if outstanding is not None
                    and rank < len(outstanding.rejections)
                    and len(drafted[index]) == rank
                    and not (stop is not None and stop(handles[index]))
                ]
                if not batch:
                    break
                for index in batch:
                    text, outstanding = saved[index]
                    assert outstanding is not None
                    path, emitted = outstanding.rejections[rank]
                    self._resync(states[index], text + list(emitted), list(path))
                proposals = self.propose([handles[i] for i in batch], [max_tokens[i] for i in batch], stop)
                for index, proposal in zip(batch, proposals, strict=True):
                    text, outstanding = saved[index]
                    state = states[index]
                    if state.outstanding is not None:  # not stopped
                        assert outstanding is not None
                        alternatives[index][outstanding.rejections[rank].emitted] = self._detached(state.outstanding)
                        drafted[index].append(proposal)
                    self._resync(state, text, None)
                    state.outstanding = self._detached(outstanding)
        finally:
            for state, (text, outstanding), found in zip(states, saved, alternatives, strict=True):
                if state.text != text:  # an error mid-way: back to where the sequence was
                    self._resync(state, text, None)
                    state.outstanding = None if outstanding is None else self._detached(outstanding)
                state.alternatives, state.alternatives_base = found, len(text)
        return drafted

    def commit(self, handle: int, accepted_path: list[int], emitted: list[int]) -> None:
        """The verifier accepted ``accepted_path`` (root to leaf) of the outstanding proposal and emitted ``emitted``.

        ``emitted`` starts with the accepted nodes' tokens (the stop rules may cut it, and the path with it).
        """
        state = self._sequence(handle)
        tree = state.outstanding.tree if state.outstanding else TokenTree.empty()
        path = list(accepted_path)
        if path and (not 0 <= path[-1] < len(tree) or tree.path_to(path[-1]) != path):
            raise InvalidArgumentError("accepted_path", f"{path} is not a root-to-node path of the last proposal")
        if [tree.tokens[node] for node in path] != list(emitted[: len(path)]):
            raise InvalidArgumentError("emitted", "must start with the tokens of accepted_path")
        check_tokens("emitted", emitted, self.vocab_size)
        state.alternatives, state.rng_before_predraft = {}, None
        self._resync(state, state.text + list(emitted), path)

    def assume_accepted(self, handle: int) -> None:
        """Append the outstanding proposal's assumed path to the text, as if accepted, with no final token."""
        state = self._sequence(handle)
        if state.outstanding is None:
            raise InvalidArgumentError(
                "assume_previous_accepted", "no outstanding proposal (it was committed, assumed or rolled back)"
            )
        tree, path = state.outstanding.tree, list(state.outstanding.assumed_path)
        _checkpoint_rng(state, overwrite=False)  # pre_draft may have taken it already
        self._resync(state, state.text + [tree.tokens[node] for node in path], path)

    def sync(self, handle: int, base_length: int, emitted: list[int]) -> None:
        """The committed text is now ``text[:base_length] + emitted`` (see the module docstring)."""
        state = self._sequence(handle)
        if not 0 <= base_length <= len(state.text):
            raise InvalidArgumentError("base_length", f"must be in [0, {len(state.text)}], got {base_length}")
        check_tokens("emitted", emitted, self.vocab_size)
        text = state.text[:base_length] + list(emitted)
        if not text:
            raise InvalidArgumentError("emitted", "the committed text must not become empty")
        alternative = state.alternatives.get(tuple(emitted)) if base_length == state.alternatives_base else None
        state.alternatives = {}
        rolled_back = text != state.text and alternative is None
        if rolled_back and state.rng_before_predraft is not None and state.generator is not None:
            state.generator.set_state(state.rng_before_predraft)  # the discarded pre-draft's draws are reused
        state.rng_before_predraft = None
        if text != state.text:  # equal: an assumed chain confirmed, nothing changes
            self._resync(state, text, None)
        if alternative is not None:  # a pre-drafted rejection verdict came true: its proposal is outstanding
            state.outstanding = alternative

    def _sequence(self, handle: int) -> S:
        state = self._sequences.get(handle)
        if state is None:
            raise KeyError(f"sequence handle {handle} is not open")
        return state

    def _sequences_for(self, handles: list[int], max_tokens: list[int]) -> list[S]:
        """Validate a ``propose`` batch and return its sequences, with their outstanding proposals cleared."""
        if len(handles) != len(max_tokens):
            raise InvalidArgumentError("max_tokens", "needs one budget per handle")
        if len(set(handles)) != len(handles):
            raise InvalidArgumentError("handles", "a sequence appears twice in one propose call")
        bad = next((budget for budget in max_tokens if budget < 0), None)
        if bad is not None:
            raise InvalidArgumentError("max_tokens", f"must be >= 0, got {bad}")
        states = [self._sequence(handle) for handle in handles]
        for state in states:
            state.outstanding = None
        return states

    @abstractmethod
    def _start(self, prompt: list[int], params: SamplingParams, generator: torch.Generator, config: DraftConfig) -> S:
        """The state of a new sequence on ``prompt`` (validated, not empty)."""

    @abstractmethod
    def _resync(self, state: S, text: list[int], path: list[int] | None) -> None:
        """Make ``state`` follow ``text`` and clear its outstanding proposal.

        ``path``, when known, is the outstanding proposal's root-to-node path whose tokens ``text`` appends
        right after the current text; ``None`` leaves it to the drafter to find (:func:`match_path`).
        """

    def _release(self, state: S) -> None:
        """Free what ``state`` holds outside this object (nothing by default)."""

    def _detached(self, outstanding: Outstanding) -> Outstanding:
        """``outstanding`` without references to scratch state a later forward overwrites (none by default)."""
        return outstanding


def _checkpoint_rng(state: SequenceState, *, overwrite: bool) -> None:
    """Remember the generator's state before a pre-draft draws (see the module docstring)."""
    if state.generator is not None and (overwrite or state.rng_before_predraft is None):
        state.rng_before_predraft = state.generator.get_state()


def check_tokens(field: str, tokens: Sequence[int], vocab_size: int | None) -> None:
    """Raise InvalidArgumentError naming ``field`` unless every id is in ``[0, vocab_size)``."""
    limit = vocab_size if vocab_size is not None else 2**31
    if any(not 0 <= token < limit for token in tokens):
        raise InvalidArgumentError(field, f"token ids must be in [0, {limit})")


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix: ``common_prefix_length([5, 6, 7], [5, 6, 3, 4]) == 2``."""
    return next((index for index, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def match_path(tree: TokenTree, tokens: Sequence[int]) -> list[int]:
    """The longest root-to-node path whose tokens are a prefix of ``tokens``.

    With ``tokens = (5, 6, 7, 8)``, ``parents = (-1, -1, 0, 2)``: ``match_path(tree, [5, 7, 1]) == [0, 2]``,
    ``match_path(tree, [6, 9]) == [1]``, ``match_path(tree, [9]) == []``. Siblings with the same token (i.i.d.
    draws) hold the same state, so any longest match serves.
    """
    best: list[int] = []
    stack: list[tuple[int, list[int]]] = [(ROOT, [])]
    while stack:
        node, path = stack.pop()
        if len(path) > len(best):
            best = path
        if len(path) < len(tokens):
            stack.extend(
                (child, [*path, child]) for child in tree.children(node) if tree.tokens[child] == tokens[len(path)]
            )
    return best


def likely_rejections(
    tree: TokenTree,
    path: Sequence[int],
    path_probs: Sequence[float],
    corrections: dict[int, tuple[int, float]],
    count: int,
) -> tuple[Rejection, ...]:
    """The ``count`` most likely rejection verdicts along ``path`` by the draft's own estimate, most likely first.

    Rejection at depth ``j``: ``path[:j]`` accepted, every child of node ``path[j-1]`` (ROOT for j = 0) rejected and
    the correction ``corrections[node] = (token, rank)``, the draft's most probable token that is not such a child;
    estimated probability ``path_probs[path[j-1]] * rank`` (1 at ROOT). With path ``[0, 1]``, tokens ``(5, 6)``,
    path probabilities ``(0.9, 0.45)`` and corrections ``{ROOT: (7, 0.05), 0: (8, 0.3)}``, the verdicts are
    ``((0,), (5, 8))`` (0.27), then ``((), (7,))`` (0.05).
    """
    scored = []
    for depth in range(len(path)):
        parent = path[depth - 1] if depth else ROOT
        if parent in corrections:
            token, rank = corrections[parent]
            reach = path_probs[parent] if depth else 1.0
            emitted = (*(tree.tokens[node] for node in path[:depth]), token)
            scored.append((-reach * rank, depth, Rejection(tuple(path[:depth]), emitted)))
    return tuple(rejection for _, _, rejection in sorted(scored)[:count])


def most_probable_leaf_path(tree: TokenTree, path_probs: Sequence[float]) -> list[int]:
    """Root-to-leaf path of the leaf with the highest draft path probability (ties: the lower index).

    A chain's path is all of it. With parents ``(-1, -1, 0, 2)`` and path probabilities
    ``(0.6, 0.4, 0.3, 0.1)`` the leaves are 1 (0.4) and 3 (0.1): the path is ``[1]``.
    """
    if not len(tree):
        return []
    leaves = set(range(len(tree))) - set(tree.parents)
    leaf = max(sorted(leaves), key=lambda node: path_probs[node])
    return tree.path_to(leaf)
