"""The statistics of ``specdec check`` against hand-computed examples and scipy (a test-only dependency).

Hand computations: Pearson's χ² of a 2 × 2 table from its expected counts; Fisher's exact law of a 2 × 2 table
(the hypergeometric with margins (3, 5) and (4, 4)); Holm's step-down on four p-values. Then the whole
sequence test on simulated two-token laws: its false-rejection rate under the null stays at its level, and it
rejects a distorted law.
"""

from __future__ import annotations

import doctest
import itertools
import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

import specdec.check.stats as check_stats
from specdec.check.stats import (
    END,
    chi2_sf,
    chi2_statistic,
    holm,
    homogeneity_test,
    outcome,
    pool_tail,
    prefix_tables,
    sequence_test,
)


def test_docstring_examples() -> None:
    failures, _ = doctest.testmod(check_stats, optionflags=doctest.ELLIPSIS)
    assert failures == 0


@pytest.mark.parametrize("df", [1, 2, 3, 7, 40, 500])
def test_chi2_survival_function_matches_scipy(df: int) -> None:
    for x in [0.01, 0.5, 1.0, df * 0.5, float(df), df + 3 * math.sqrt(2 * df), 5.0 * df + 50]:
        assert chi2_sf(x, df) == pytest.approx(scipy_stats.chi2.sf(x, df), rel=1e-9, abs=1e-300)
    assert chi2_sf(0.0, df) == 1.0


def test_chi2_of_a_two_by_two_table_by_hand() -> None:
    # rows 40/40, columns 50/30, N 80: expected 25, 15 in both rows; every |observed - expected| is 5
    table = np.array([[30, 10], [20, 20]])
    by_hand = 2 * (25 / 25 + 25 / 15)  # 16/3
    assert chi2_statistic(table) == pytest.approx(by_hand)
    test = homogeneity_test(table)
    assert test is not None and test.method == "chi2" and test.df == 1
    assert test.p_value == pytest.approx(math.erfc(math.sqrt(by_hand / 2)))  # χ²(1) tail: erfc(sqrt(x / 2))
    statistic, p_value, dof, _ = scipy_stats.chi2_contingency(table, correction=False)
    assert (test.statistic, test.p_value, test.df) == pytest.approx((statistic, p_value, dof))


def test_exact_test_of_a_small_two_by_two_table_by_hand() -> None:
    # columns 3/5, rows 4/4: the top-left count a has P(a) = C(3, a) C(5, 4 - a) / C(8, 4) = (5, 30, 30, 5) / 70;
    # a = 3 is observed, and the tables at least as extreme are a = 0 and a = 3: p = 10 / 70
    table = np.array([[3, 1], [0, 4]])
    test = homogeneity_test(table, tail_min=1)
    assert test is not None and test.method == "exact"
    assert test.p_value == pytest.approx(1 / 7)
    assert test.p_value == pytest.approx(scipy_stats.fisher_exact(table).pvalue)


def _brute_force_exact(table: np.ndarray) -> float:
    """Sum of the multivariate hypergeometric probabilities of every table at least as extreme (by χ²)."""
    columns, n = table.sum(axis=0), int(table[0].sum())
    observed, total = chi2_statistic(table), 0.0
    for row in itertools.product(*(range(int(c) + 1) for c in columns)):
        if sum(row) != n:
            continue
        candidate = np.array([row, columns - np.array(row)])
        if chi2_statistic(candidate) >= observed - 1e-9:
            total += math.prod(math.comb(int(c), int(x)) for c, x in zip(columns, row, strict=True))
    return total / math.comb(int(columns.sum()), n)


@pytest.mark.parametrize("table", [[[3, 1, 0], [0, 2, 3]], [[6, 0, 2, 1], [2, 5, 1, 3]], [[9, 1], [4, 2]]])
def test_exact_test_matches_enumeration_and_monte_carlo(table: list[list[int]]) -> None:
    array = np.array(table)
    test = homogeneity_test(array, tail_min=1)
    assert test is not None and test.method == "exact"
    assert test.p_value == pytest.approx(_brute_force_exact(array), rel=1e-9)
    monte_carlo = check_stats._monte_carlo_p(array, chi2_statistic(array), draws=20_000, seed=3)
    assert monte_carlo == pytest.approx(test.p_value, abs=0.015)


def test_tail_pooling_and_degenerate_tables() -> None:
    table = np.array([[40, 30, 2, 1, 0], [35, 38, 1, 0, 2]])
    assert pool_tail(table, tail_min=5).tolist() == [[40, 30, 3], [35, 38, 3]]
    assert homogeneity_test(np.array([[10, 0], [12, 0]])) is None  # one token: nothing to test
    assert homogeneity_test(np.array([[0, 0], [5, 7]])) is None  # an empty row


def test_holm_by_hand() -> None:
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == [1.0, 1.0]
    assert holm([]) == []


def test_outcomes_and_prefix_tables() -> None:
    assert outcome([1, 2, 3], 2, finished=False) == (1, 2)
    assert outcome([1], 2, finished=True) == (1, END)
    sample = [(0, 1)] * 6 + [(0, 2)] * 4 + [(1, END)] * 5 + [(2, 0)] * 2
    reference = [(0, 1)] * 5 + [(0, 2)] * 5 + [(1, END)] * 6 + [(2, 0)] * 6
    tables = prefix_tables(sample, reference, 2, min_count=5)
    # position 0 (all 17 / 22), prefix (0,) (10 / 10), prefix (1,) (5 / 6); prefix (2,) has only 2 in the sample
    assert [(t.position, t.prefix) for t in tables] == [(0, ()), (1, (0,)), (1, (1,))]
    first = tables[0]
    assert dict(zip(first.tokens, first.sample, strict=True)) == {0: 10, 1: 5, 2: 2}
    assert dict(zip(first.tokens, first.reference, strict=True)) == {0: 10, 1: 6, 2: 6}
    result = sequence_test(sample, reference, 2, min_count=5, tail_min=1)
    # the (1,) table holds one token (END) on both sides: untestable; Holm over the other two
    assert result.untested_tables == 1 and result.num_tables == 2
    p_values = sorted(item.test.p_value for item in result.tables)
    assert result.p_value == pytest.approx(min(1.0, 2 * p_values[0]))


def _draw(rng: np.random.Generator, first: np.ndarray, second: np.ndarray, n: int) -> list[tuple[int, ...]]:
    """n two-token outcomes: token 0 from ``first``, token 1 from row ``second[token 0]``."""
    a = rng.choice(len(first), size=n, p=first)
    b = (rng.random(n)[:, None] > np.cumsum(second[a], axis=1)).sum(axis=1).clip(max=second.shape[1] - 1)
    return list(zip(a.tolist(), b.tolist(), strict=True))


def test_the_sequence_test_keeps_its_level_and_has_power() -> None:
    rng = np.random.default_rng(0)
    first = np.array([0.5, 0.25, 0.15, 0.07, 0.03])
    second = rng.dirichlet(np.ones(5), size=5)
    distorted = first ** (1 / 0.5)
    distorted /= distorted.sum()  # the first token's law at temperature 0.5 instead of 1 (TV ≈ 0.23)
    null = [sequence_test(_draw(rng, first, second, 300), _draw(rng, first, second, 300), 2).p_value for _ in range(40)]
    alternative = [
        sequence_test(_draw(rng, distorted, second, 300), _draw(rng, first, second, 300), 2).p_value for _ in range(10)
    ]
    assert np.mean(np.array(null) < 0.1) <= 0.2  # level 0.1 (Holm is conservative): generous slack for 40 draws
    assert np.mean(np.array(alternative) < 0.01) >= 0.8
