"""Exact law of what one verification round emits, in ``fractions.Fraction`` arithmetic (test helper).

A toy model maps a context (the tokens after the committed prefix) to a distribution over a small
vocabulary. :func:`round_law` enumerates every draft a drafter model can propose for a tree shape (siblings
drawn i.i.d. or without replacement, each node from the draft model given its own ancestors) and every
branch of the acceptance rule of ``specdec.acceptance``, and returns the law of the emitted sequence.

Lossless means: a round followed by plain target sampling is plain target sampling. The emitted length is
random, so the criterion compares fixed-length laws: ``continue_with_target(round law, L)`` (each emitted
sequence extended by the target up to ``L`` tokens, or to EOS / the budget) must equal ``target_law(L)``,
the target's own law of its first ``L`` tokens, with Fraction ``==``. With ``L`` at least the longest
round, this holds iff the law of the round output is that of the target stopped at the round's end.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator
from fractions import Fraction

from specdec.tree import ROOT, TokenTree

Dist = tuple[Fraction, ...]
Model = Callable[[tuple[int, ...]], Dist]
Law = dict[tuple[int, ...], Fraction]


def random_model(seed: int, vocab: int, *, zeros: bool = True) -> Model:
    """A context-dependent rational distribution (integer weights 0..6, or 1..6 without zeros)."""
    cache: dict[tuple[int, ...], Dist] = {}

    def model(context: tuple[int, ...]) -> Dist:
        if context not in cache:
            rng = random.Random(f"{seed}/{context}")
            weights = [0] * vocab
            while not any(weights):
                weights = [rng.randint(0 if zeros else 1, 6) for _ in range(vocab)]
            cache[context] = tuple(Fraction(w, sum(weights)) for w in weights)
        return cache[context]

    return model


def greedy_model(seed: int, vocab: int) -> Model:
    """A temperature-0 target: a one-hot distribution at a context-dependent token."""

    def model(context: tuple[int, ...]) -> Dist:
        best = random.Random(f"{seed}/{context}").randrange(vocab)
        return tuple(Fraction(int(token == best)) for token in range(vocab))

    return model


def acceptance_probs(p: Dist, q: Dist) -> Dist:
    """``min(1, p/q)``; 0 where ``q = 0`` (such tokens are never proposed)."""
    return tuple(min(Fraction(1), pi / qi) if qi else Fraction(0) for pi, qi in zip(p, q, strict=True))


def accepted_mass(p: Dist, q: Dist) -> Dist:
    """``q(x) * min(1, p(x)/q(x)) = min(p(x), q(x))``: probability of proposing ``x`` and accepting it."""
    return tuple(min(pi, qi) for pi, qi in zip(p, q, strict=True))


def normalise(weights: Collection[Fraction]) -> Dist:
    total = sum(weights, Fraction(0))
    assert total > 0, "normalising a zero vector (0/0)"
    return tuple(w / total for w in weights)


def residual(p: Dist, q: Dist) -> Dist:
    """``norm(max(0, p - q))``: the recovered-token distribution after a rejection."""
    return normalise([max(Fraction(0), pi - qi) for pi, qi in zip(p, q, strict=True)])


def without(q: Dist, tokens: Collection[int]) -> Dist:
    """``q`` with ``tokens`` removed and renormalised."""
    return normalise([Fraction(0) if token in tokens else qx for token, qx in enumerate(q)])


def context(tree: TokenTree, tokens: tuple[int, ...], node: int) -> tuple[int, ...]:
    """Tokens on the path to ``node`` (empty for ROOT)."""
    return tuple(tokens[n] for n in tree.path_to(node))


def draft_outcomes(shape: TokenTree, draft: Model, scheme: str) -> Iterator[tuple[tuple[int, ...], Fraction]]:
    """Every token assignment of ``shape`` (its tokens are ignored) with its probability under ``draft``."""

    def extend(tokens: tuple[int, ...], prob: Fraction) -> Iterator[tuple[tuple[int, ...], Fraction]]:
        node = len(tokens)
        if node == len(shape):
            yield tokens, prob
            return
        parent = shape.parents[node]
        q = draft(context(shape, tokens, parent))
        if scheme == "without_replacement":
            q = without(q, [tokens[n] for n in shape.children(parent) if n < node])
        for token, qx in enumerate(q):
            if qx:
                yield from extend((*tokens, token), prob * qx)

    yield from extend((), Fraction(1))


def rule_law(tree: TokenTree, target: Model, q_rows: list[Dist], scheme: str, *, naive: bool = False) -> Law:
    """Law of the (untruncated) emitted sequence for one fixed draft; ``q_rows[i]`` is node i's ``q``.

    ``naive=True`` is the wrong rule DESIGN §3 warns about: after rejections, draw from ``p`` itself.
    """

    def from_node(node: int, prefix: tuple[int, ...]) -> Law:
        law: Law = defaultdict(Fraction)
        p = p_prime = target(prefix)
        reach = Fraction(1)
        rejected: list[int] = []
        for child in tree.children(node):
            token = tree.tokens[child]
            q = without(q_rows[child], rejected) if scheme == "without_replacement" and rejected else q_rows[child]
            accept = acceptance_probs(p_prime, q)[token]
            for suffix, prob in from_node(child, (*prefix, token)).items():
                law[(token, *suffix)] += reach * accept * prob
            reach *= 1 - accept
            if reach == 0:
                return law
            p_prime = residual(p_prime, q)
            rejected.append(token)
        for token, px in enumerate(p if naive else p_prime):
            law[(token,)] += reach * px
        return law

    return positive(from_node(ROOT, ()))


def positive(law: Law) -> Law:
    """The sequences of positive probability (laws are compared as dicts)."""
    return {sequence: prob for sequence, prob in law.items() if prob}


def truncate(sequence: tuple[int, ...], eos: Collection[int], max_new_tokens: int) -> tuple[int, ...]:
    stop = next((i + 1 for i, token in enumerate(sequence) if token in eos), len(sequence))
    return sequence[: min(stop, max_new_tokens)]


def round_law(
    shape: TokenTree,
    target: Model,
    draft: Model | None,
    scheme: str = "iid",
    *,
    eos: Collection[int] = frozenset(),
    max_new_tokens: int = 1 << 30,
    naive: bool = False,
    rule_scheme: str | None = None,
) -> Law:
    """Law of one round's emitted sequence after the stop rules.

    ``draft=None`` is a model-free drafter: the tokens of ``shape`` are the (deterministic) draft and ``q``
    is one-hot at them. Otherwise every draft ``draft`` can sample for ``shape`` under ``scheme`` is
    enumerated. Wrong rules, for negative controls: ``naive`` (see :func:`rule_law`) and ``rule_scheme``
    (verify with another scheme's rule than the one the siblings were drawn with).
    """
    if draft is None:
        outcomes: Iterator[tuple[tuple[int, ...], Fraction]] = iter([(shape.tokens, Fraction(1))])
    else:
        outcomes = draft_outcomes(shape, draft, scheme)
    law: Law = defaultdict(Fraction)
    for tokens, prob in outcomes:
        tree = TokenTree(tokens, shape.parents)
        vocab = len(target(()))
        if draft is None:
            q_rows = [tuple(Fraction(int(x == token)) for x in range(vocab)) for token in tokens]
        else:
            q_rows = [draft(context(tree, tokens, parent)) for parent in tree.parents]
        for sequence, branch in rule_law(tree, target, q_rows, rule_scheme or scheme, naive=naive).items():
            law[truncate(sequence, eos, max_new_tokens)] += prob * branch
    return positive(law)


def continue_with_target(
    law: Law, target: Model, length: int, *, eos: Collection[int] = frozenset(), max_new_tokens: int = 1 << 30
) -> Law:
    """Extend every sequence of ``law`` by target sampling up to ``min(length, max_new_tokens)`` or EOS."""
    limit = min(length, max_new_tokens)
    done: Law = defaultdict(Fraction)
    pending = list(law.items())
    while pending:
        sequence, prob = pending.pop()
        if len(sequence) >= limit or (sequence and sequence[-1] in eos):
            done[sequence[:limit]] += prob
            continue
        pending.extend(((*sequence, token), prob * px) for token, px in enumerate(target(sequence)))
    return positive(done)


def target_law(
    target: Model, vocab: int, length: int, *, eos: Collection[int] = frozenset(), max_new_tokens: int = 1 << 30
) -> Law:
    """The target's own law of its first ``min(length, max_new_tokens)`` tokens, stopped at EOS.

    Written independently of :func:`continue_with_target`: every full sequence by ``itertools.product``,
    weighted by the chain rule, then cut at EOS (what follows an EOS marginalises out).
    """
    law: Law = defaultdict(Fraction)
    for sequence in itertools.product(range(vocab), repeat=min(length, max_new_tokens)):
        prob = Fraction(1)
        for i, token in enumerate(sequence):
            prob *= target(sequence[:i])[token]
        law[truncate(sequence, eos, max_new_tokens)] += prob
    return positive(law)
