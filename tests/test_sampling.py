"""Sampling transforms: exact small cases for each filter and for their validation."""

import pytest
import torch

from specdec.errors import InvalidArgumentError
from specdec.sampling import (
    SamplingParams,
    TopLogprobs,
    argmax,
    logits_to_probs,
    make_generator,
    sample,
    sample_with_uniform,
    top_logprobs,
    top_p_kept,
)

LOGITS = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))


def test_temperature_one_is_softmax() -> None:
    assert torch.allclose(logits_to_probs(LOGITS, SamplingParams()), torch.tensor([0.1, 0.2, 0.3, 0.4]))


def test_temperature_zero_is_one_hot_argmax() -> None:
    assert logits_to_probs(LOGITS, SamplingParams(temperature=0)).tolist() == [0, 0, 0, 1]


def full_sort_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by its definition: the whole row in order of falling probability (ties: lower id first), each token kept
    while the mass before it is below ``top_p``."""
    values, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(values, dim=-1) - values
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, mass_before < top_p)


@pytest.mark.parametrize("vocab", [100, 5000, 49152])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999])
def test_top_p_over_the_candidates_keeps_what_the_full_sort_keeps(vocab: int, top_p: float) -> None:
    """Peaked and flat rows (a flat one needs more than the first candidates), tied logits, rows already cut by
    top-k (zeros), and a row block as a verification passes it."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=generator) * torch.tensor([[8.0], [3.0], [1.0], [0.3], [0.0], [1.0]])
    logits[5] = torch.round(logits[5] * 2) / 2  # a few distinct values: large tie groups
    rows = [torch.softmax(logits, dim=-1)]
    cut = logits.masked_fill(logits < torch.topk(logits, 20, dim=-1).values[:, -1:], -torch.inf)
    rows.append(torch.softmax(cut, dim=-1))
    for probs in rows:
        assert torch.equal(top_p_kept(probs, top_p), full_sort_top_p(probs, top_p))
        for row in probs:  # alone, each row takes its own number of candidates
            assert torch.equal(top_p_kept(row, top_p), full_sort_top_p(row, top_p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9,), (4, 9), (2, 3, 9)])
def test_argmax_is_torchs_first_maximum(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """The NumPy route (CPU float32 / float64) and torch's agree: lowest index on ties, the first NaN wins, any
    strides, int64 out (a 0-d tensor for one row)."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(0, 3, shape, generator=generator).to(dtype)  # values 0..2 over 9 columns: many ties
    assert argmax(values).dtype == torch.int64
    assert torch.equal(argmax(values), values.argmax(dim=-1))
    values[..., 4] = float("nan")
    values[..., 7] = float("nan")
    assert torch.equal(argmax(values), values.argmax(dim=-1)) and (argmax(values) == 4).all()
    strided = torch.randint(0, 3, (9, *shape[:-1]), generator=generator).to(dtype).movedim(0, -1)
    assert torch.equal(argmax(strided), strided.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 9e-6])
def test_a_vanishing_temperature_is_greedy_not_nan(temperature: float) -> None:
    """1e-45 used to give NaN probabilities (logits / T overflows), which made the verifier fail the request as
    INTERNAL and the router take the verifier out of rotation."""
    params = SamplingParams(temperature=temperature)
    assert params.greedy and logits_to_probs(LOGITS, params).tolist() == [0, 0, 0, 1]
    assert not SamplingParams(temperature=1e-5).greedy


def test_temperature_sharpens() -> None:
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=0.5))
    expected = torch.tensor([0.01, 0.04, 0.09, 0.16]) / 0.30
    assert torch.allclose(probs, expected)


def test_top_k_keeps_the_k_largest() -> None:
    probs = logits_to_probs(LOGITS, SamplingParams(top_k=2))
    assert torch.allclose(probs, torch.tensor([0, 0, 3 / 7, 4 / 7]))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # 0.4 < 0.5, 0.4 + 0.3 >= 0.5: keep the top two.
    probs = logits_to_probs(LOGITS, SamplingParams(top_p=0.5))
    assert torch.allclose(probs, torch.tensor([0, 0, 3 / 7, 4 / 7]))
    assert torch.allclose(logits_to_probs(LOGITS, SamplingParams(top_p=0.4)), torch.tensor([0.0, 0, 0, 1]))


def test_min_p_drops_below_fraction_of_max() -> None:
    # floor = 0.4 * 0.4 = 0.16: keep 0.2, 0.3, 0.4.
    probs = logits_to_probs(LOGITS, SamplingParams(min_p=0.4))
    assert torch.allclose(probs, torch.tensor([0, 2 / 9, 3 / 9, 4 / 9]))


def test_batched_rows_are_independent() -> None:
    rows = torch.stack([LOGITS, LOGITS.flip(0)])
    probs = logits_to_probs(rows, SamplingParams(top_k=1))
    assert probs.tolist() == [[0, 0, 0, 1], [1, 0, 0, 0]]


def test_top_k_cap_for_drafters() -> None:
    assert SamplingParams().with_top_k_cap(5).top_k == 5
    assert SamplingParams(top_k=3).with_top_k_cap(5).top_k == 3
    assert SamplingParams(top_k=3).with_top_k_cap(0).top_k == 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.2}, "min_p"),
    ],
)
def test_invalid_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        SamplingParams(**kwargs)
    assert caught.value.field == field


def test_inverse_cdf_draw_skips_zero_mass() -> None:
    probs = torch.tensor([0.0, 1.0, 0.0])
    assert [sample_with_uniform(probs, u) for u in (0.0, 0.2, 0.999999)] == [1, 1, 1]
    probs = torch.tensor([0.25, 0.0, 0.75])
    assert [sample_with_uniform(probs, u) for u in (0.0, 0.2499, 0.25, 0.99)] == [0, 0, 2, 2]


def test_seeded_generators_repeat() -> None:
    probs = torch.tensor([0.2, 0.3, 0.5])
    first = [sample(probs, make_generator(7)) for _ in range(3)]
    assert first == [sample(probs, make_generator(7)) for _ in range(3)]


@pytest.mark.parametrize("count", [1, 3, 20, 200])
def test_top_logprobs_are_the_head_of_the_full_stable_sort(count: int) -> None:
    """Only the tokens at least as probable as the count-th are sorted: the same tokens and order as sorting the
    whole row (lower id first on ties), with large tie groups, -inf tails and fewer finite tokens than asked for."""
    generator = torch.Generator().manual_seed(count)
    peaked = torch.log_softmax(torch.randn(49152, generator=generator) * 3, dim=-1)
    tied = torch.log_softmax(torch.round(torch.randn(1000, generator=generator)), dim=-1)
    short = peaked.clone()
    short[100:] = -torch.inf
    for row in (peaked, tied, short, torch.tensor([-1.0, -torch.inf, -0.5, -1.0])):
        values, ids = torch.sort(row, descending=True, stable=True)
        kept = torch.isfinite(values[:count])
        expected = TopLogprobs(tuple(ids[:count][kept].tolist()), tuple(values[:count][kept].tolist()))
        assert top_logprobs(row, count) == expected
