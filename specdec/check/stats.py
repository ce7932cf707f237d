"""The statistics of ``specdec check``: is a sample of generations drawn from the same law as a reference sample?

A generation of ``k`` tokens is an *outcome*: a tuple of its first ``k`` tokens, followed by :data:`END` when it
finished (EOS) before ``k``. Its law factorises by the chain rule into next-token laws, one per (position ``j``,
prefix ``s``): ``P(x_1..x_k) = Π_j P(x_j | s = x_1..x_{j-1})``, so two sequence laws are equal iff every
next-token law reachable under them is. The test follows that factorisation:

1. **tables** (:func:`prefix_tables`): for every position ``j < k`` and every prefix ``s`` seen at least
   ``min_count`` times in *both* samples, the 2 × K contingency table of the token at ``j`` (sample vs
   reference). A prefix seen less often is not tested itself; its mass is still tested in its parent's table.
2. **tail pooling** (:func:`pool_tail`): the tokens whose two-sample total count is below ``tail_min`` are
   merged into one "tail" column (the rare tokens of a 49k vocabulary would otherwise each be a near-empty
   column). Pooling is a function of the column totals only, so under the null it keeps the test exact.
3. **one p-value per table** (:func:`homogeneity_test`): Pearson's χ² test of homogeneity with ``K - 1``
   degrees of freedom when every expected count is at least 5 (Cochran's rule); otherwise the *exact*
   conditional test (the χ² statistic's law given both margins, the multivariate hypergeometric law of the
   table: Fisher–Freeman–Halton ordered by χ²) by enumeration, or by a seeded Monte-Carlo of that same law
   (Hope 1968; ``p = (1 + hits) / (1 + draws)``, itself a valid p-value) when the tables are too many to list.
4. **correction** (:func:`holm`): Holm–Bonferroni over the tables of one configuration, whose adjusted minimum
   (``m · min p``) is the configuration's p-value. Holm is valid under *any* dependence between the tables
   (tables at different depths share generations, and which prefixes are tested depends on the data), which
   Fisher's or Stouffer's combination would need independence for, and it names the (position, prefix)
   tables that deviate. Its price is power against a distortion spread thinly over many tables; the check
   shows that price by running the same procedure against a deliberately wrong law.

Under the null, conditional on the prefix counts the tokens at position ``j`` of both samples are i.i.d. draws
of one next-token law (each generation samples its next token from ``p(· | prefix)`` whatever came before), so
each table's test is exact or asymptotically exact and Holm controls the family-wise error of the configuration.

Only numpy and torch (``torch.special.gammaincc`` for the χ² tail, imported there: ``specdec``'s command line
builds its parser from this package without paying for torch) are used at run time; tests check every function
against scipy.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

END = "<end>"
"""The symbol after the last token of a generation that finished before ``k`` tokens."""
TAIL = "<tail>"
"""The pooled column of rare tokens."""

Token = Hashable
Outcome = tuple[Token, ...]
Method = Literal["chi2", "exact", "monte-carlo"]

COCHRAN_MIN_EXPECTED = 5.0
MAX_EXACT_TABLES = 200_000
MONTE_CARLO_DRAWS = 20_000


def outcome(tokens: Sequence[Token], k: int, finished: bool) -> Outcome:
    """The outcome of a generation: its first ``k`` tokens, plus :data:`END` if it finished before ``k``.

    >>> outcome([5, 6, 7, 8], 3, finished=False), outcome([5, 9], 3, finished=True)
    ((5, 6, 7), (5, 9, '<end>'))
    """
    head = tuple(tokens[:k])
    return (*head, END) if finished and len(head) < k else head


# --- the χ² distribution --------------------------------------------------------------------------------------


def chi2_sf(statistic: float, df: int) -> float:
    """``P(X >= statistic)`` for ``X ~ χ²(df)``: the regularised upper incomplete gamma ``Q(df/2, statistic/2)``.

    >>> round(chi2_sf(3.841458820694124, 1), 6), chi2_sf(0.0, 3)
    (0.05, 1.0)
    """
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if statistic <= 0:
        return 1.0
    import torch

    a = torch.tensor(df / 2, dtype=torch.float64)
    x = torch.tensor(statistic / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, x))


# --- one table ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TableTest:
    """The homogeneity test of one 2 × K table (row 0: the sample, row 1: the reference)."""

    statistic: float  # Pearson's χ²
    df: int  # K - 1 after pooling
    p_value: float
    method: Method


def chi2_statistic(table: np.ndarray) -> float:
    """Pearson's χ² of a 2 × K table of counts [2, K] (columns with a zero total contribute nothing)."""
    table = np.asarray(table, dtype=np.float64)
    rows, columns, total = table.sum(axis=1), table.sum(axis=0), table.sum()
    expected = np.outer(rows, columns) / total
    keep = expected > 0
    return float((((table - expected) ** 2)[keep] / expected[keep]).sum())


def pool_tail(table: np.ndarray, tail_min: int) -> np.ndarray:
    """Merge the columns whose total is below ``tail_min`` into one last column (dropped if empty).

    >>> pool_tail(np.array([[10, 1, 0, 7], [12, 2, 1, 9]]), tail_min=5).tolist()
    [[10, 7, 1], [12, 9, 3]]
    """
    table = np.asarray(table, dtype=np.int64)
    totals = table.sum(axis=0)
    common, rare = table[:, totals >= tail_min], table[:, totals < tail_min]
    tail = rare.sum(axis=1, keepdims=True)
    return np.concatenate([common, tail], axis=1) if tail.sum() > 0 else common


def _exact_p(table: np.ndarray, observed: float) -> float | None:
    """Exact conditional p-value of the χ² statistic given both margins, or None when there are too many tables.

    Under the null the sample row ``a`` of a 2 × K table with column totals ``c`` and sample size ``n`` has the
    multivariate hypergeometric law ``P(a) = Π C(c_k, a_k) / C(N, n)``. With both margins fixed the statistic is
    a sum over columns, ``χ² = N² / (n (N - n)) · Σ_k (a_k - c_k n / N)² / c_k``, so the tables are enumerated
    column by column (a dynamic programme over the running sum of ``a``).
    """
    columns = table.sum(axis=0).astype(np.int64)
    n, total = int(table[0].sum()), int(columns.sum())
    count = 1
    for c in columns:
        count *= int(c) + 1
        if count > MAX_EXACT_TABLES * 8:
            break
    if count > MAX_EXACT_TABLES * 8:
        return None
    scale = total * total / (n * (total - n))
    log_norm = math.lgamma(total + 1) - math.lgamma(n + 1) - math.lgamma(total - n + 1)
    # partial tables: running sample count -> (statistics [T], log-probabilities [T])
    states: dict[int, tuple[np.ndarray, np.ndarray]] = {0: (np.zeros(1), np.zeros(1))}
    for c in columns:
        c = int(c)
        a = np.arange(c + 1)
        terms = scale * (a - c * n / total) ** 2 / c
        log_choose = np.array([math.lgamma(c + 1) - math.lgamma(x + 1) - math.lgamma(c - x + 1) for x in a])
        grown: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for used, (stats, logs) in states.items():
            for x in range(min(c, n - used) + 1):
                grown.setdefault(used + x, []).append((stats + terms[x], logs + log_choose[x]))
        states = {
            used: (np.concatenate([s for s, _ in parts]), np.concatenate([lp for _, lp in parts]))
            for used, parts in grown.items()
        }
        if sum(len(s) for s, _ in states.values()) > MAX_EXACT_TABLES:
            return None
    stats, logs = states[n]
    at_least = stats >= observed * (1 - 1e-9) - 1e-12
    return float(min(1.0, np.exp(logs[at_least] - log_norm).sum()))


def _monte_carlo_p(table: np.ndarray, observed: float, draws: int, seed: int) -> float:
    """``(1 + #{χ²(T) >= observed}) / (1 + draws)`` over tables ``T`` drawn from the null law given both margins."""
    columns = table.sum(axis=0).astype(np.int64)
    n = int(table[0].sum())
    sample_rows = np.random.default_rng(seed).multivariate_hypergeometric(columns, n, size=draws)  # [draws, K]
    rows = np.stack([sample_rows, columns[None, :] - sample_rows], axis=1).astype(np.float64)  # [draws, 2, K]
    row_totals = rows.sum(axis=2, keepdims=True)
    expected = row_totals * columns[None, None, :] / columns.sum()
    keep = expected > 0
    stats = np.where(keep, (rows - expected) ** 2 / np.where(keep, expected, 1.0), 0.0).sum(axis=(1, 2))
    hits = int((stats >= observed * (1 - 1e-9) - 1e-12).sum())
    return (1 + hits) / (1 + draws)


def homogeneity_test(
    table: np.ndarray, *, tail_min: int = 5, draws: int = MONTE_CARLO_DRAWS, seed: int = 0
) -> TableTest | None:
    """Test that both rows of a 2 × K count table [2, K] are draws of one law (None: nothing to test).

    Columns with a total below ``tail_min`` are pooled (:func:`pool_tail`); with one column left there is
    nothing to test. Pearson's χ² with ``K - 1`` degrees of freedom when every expected count is at least 5,
    otherwise the exact conditional test (enumerated, or a seeded Monte-Carlo of ``draws`` tables).

    >>> homogeneity_test(np.array([[30, 10], [20, 20]]))
    TableTest(statistic=5.333..., df=1, p_value=0.0209..., method='chi2')
    """
    pooled = pool_tail(table, tail_min)
    pooled = pooled[:, pooled.sum(axis=0) > 0]
    if pooled.shape[1] < 2 or (pooled.sum(axis=1) == 0).any():
        return None
    statistic = chi2_statistic(pooled)
    df = pooled.shape[1] - 1
    rows, columns = pooled.sum(axis=1), pooled.sum(axis=0)
    if (np.outer(rows, columns) / pooled.sum()).min() >= COCHRAN_MIN_EXPECTED:
        return TableTest(statistic, df, chi2_sf(statistic, df), "chi2")
    exact = _exact_p(pooled, statistic)
    if exact is not None:
        return TableTest(statistic, df, exact, "exact")
    return TableTest(statistic, df, _monte_carlo_p(pooled, statistic, draws, seed), "monte-carlo")


# --- many tables ----------------------------------------------------------------------------------------------


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values, in the input order: the i-th smallest is
    ``max_{j <= i} min(1, (m - j + 1) p_(j))``. Rejecting the adjusted ones below α controls the family-wise
    error at α under any dependence.

    >>> holm([0.01, 0.04, 0.03, 0.005])
    [0.03, 0.06, 0.06, 0.02]
    """
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


@dataclass(frozen=True)
class PrefixTable:
    """The token counts at ``position`` after ``prefix`` in the sample and in the reference."""

    position: int
    prefix: Outcome
    tokens: tuple[Token, ...]
    sample: tuple[int, ...]
    reference: tuple[int, ...]

    def array(self) -> np.ndarray:
        return np.array([self.sample, self.reference], dtype=np.int64)


def _next_tokens(outcomes: Sequence[Outcome], k: int) -> dict[tuple[int, Outcome], Counter]:
    counts: dict[tuple[int, Outcome], Counter] = {}
    for item in outcomes:
        for position in range(min(len(item), k)):
            counts.setdefault((position, item[:position]), Counter())[item[position]] += 1
    return counts


def prefix_tables(
    sample: Sequence[Outcome], reference: Sequence[Outcome], k: int, *, min_count: int = 5
) -> list[PrefixTable]:
    """The (position, prefix) tables seen at least ``min_count`` times in both samples, shortest prefix first."""
    ours, theirs = _next_tokens(sample, k), _next_tokens(reference, k)
    tables = []
    for key in sorted(set(ours) & set(theirs), key=lambda key: (key[0], repr(key[1]))):
        a, b = ours[key], theirs[key]
        if a.total() < min_count or b.total() < min_count:
            continue
        tokens = tuple(sorted(set(a) | set(b), key=lambda token: (-(a[token] + b[token]), repr(token))))
        tables.append(PrefixTable(key[0], key[1], tokens, tuple(a[t] for t in tokens), tuple(b[t] for t in tokens)))
    return tables


@dataclass(frozen=True)
class TestedTable:
    """One table's test and its Holm-adjusted p-value."""

    table: PrefixTable
    test: TableTest
    adjusted_p: float


@dataclass(frozen=True)
class SequenceTest:
    """Does ``sample`` follow the law of ``reference``? ``p_value`` is the smallest Holm-adjusted p (1.0 with no
    testable table); ``tables`` lists every tested table, the most significant first; ``tv_first`` is the
    empirical total-variation distance of the first token's law (a descriptive size, not a test)."""

    p_value: float
    tables: list[TestedTable]
    untested_tables: int
    samples: tuple[int, int]
    tv_first: float

    @property
    def num_tables(self) -> int:
        return len(self.tables)


def empirical_tv(sample: Sequence[Hashable], reference: Sequence[Hashable]) -> float:
    """``½ Σ_x |P̂(x) − Q̂(x)|`` of two samples (0.0 when either is empty)."""
    if not sample or not reference:
        return 0.0
    a, b = Counter(sample), Counter(reference)
    return 0.5 * sum(abs(a[x] / len(sample) - b[x] / len(reference)) for x in set(a) | set(b))


def sequence_test(
    sample: Sequence[Outcome],
    reference: Sequence[Outcome],
    k: int,
    *,
    min_count: int = 5,
    tail_min: int = 5,
    draws: int = MONTE_CARLO_DRAWS,
    seed: int = 0,
) -> SequenceTest:
    """The two-sample test of the laws of the first ``k`` tokens (module docstring: tables, pooling, Holm)."""
    tested: list[tuple[PrefixTable, TableTest]] = []
    untested = 0
    for index, table in enumerate(prefix_tables(sample, reference, k, min_count=min_count)):
        test = homogeneity_test(table.array(), tail_min=tail_min, draws=draws, seed=seed + index)
        if test is None:
            untested += 1
        else:
            tested.append((table, test))
    adjusted = holm([test.p_value for _, test in tested])
    tables = sorted(
        (TestedTable(table, test, p) for (table, test), p in zip(tested, adjusted, strict=True)),
        key=lambda item: (item.adjusted_p, item.test.p_value),
    )
    tv = empirical_tv([o[0] for o in sample if o], [o[0] for o in reference if o])
    return SequenceTest(tables[0].adjusted_p if tables else 1.0, tables, untested, (len(sample), len(reference)), tv)


def bonferroni(p_value: float, family: int) -> float:
    """``min(1, family · p)``: a configuration's p-value adjusted for the number of configurations checked."""
    return min(1.0, family * p_value)
