"""Logits → the normalised distribution a token is sampled from.

One function, :func:`logits_to_probs`, is used identically for the target (its ``p``) and the
drafter (its ``q``), so the acceptance rule always compares the distributions that were really
used. Order of transforms: temperature, top-k, top-p, min-p, each followed by renormalisation.
Temperature 0 is greedy: the one-hot of the :func:`argmax` (lowest id on ties); so is any temperature below
:data:`GREEDY_BELOW` (vLLM's ``_SAMPLING_EPS``): there ``logits / temperature`` can overflow float32 into NaN
probabilities, and such a temperature is the greedy limit but for near-exact ties. :func:`top_logprobs` reads the
most probable alternatives off a row of log-probabilities (what a request's ``top_logprobs`` returns). The settings
themselves (:class:`SamplingParams`) live in :mod:`specdec.sampling_params`, which needs no torch.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specdec.sampling_params import SamplingParams, TopLogprobs

_ID_BITS = 20  # a token id below 2**20 fits beside a float32's bits in one int64 sort key (top_p_kept)
TOP_P_CANDIDATES = 1024  # the first tokens of a row's order that top-p sorts before it sorts the whole row
_ID_MASK = (1 << _ID_BITS) - 1


def argmax(values: torch.Tensor) -> torch.Tensor:
    """``values.argmax(dim=-1)``: the index of the largest value along the last dimension, the lowest on ties (and
    the first NaN, if any), as int64.

    On the CPU, float32 and float64 go through NumPy, whose argmax is vectorised: on a [5, 49 152] row block (a
    γ = 4 verification of SmolLM2) it takes ~30 µs where torch's takes ~660 µs, which every greedy verification and
    every greedy draft level pays. Both return the first maximum, so the result is the same. Elsewhere, torch's.
    """
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64) and values.numel():
        return torch.from_numpy(np.asarray(np.argmax(values.detach().numpy(), axis=-1), dtype=np.int64))
    return values.argmax(dim=-1)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply ``params`` to ``logits`` [..., V] and return float32 probabilities [..., V] summing to 1."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        probs = probs.masked_fill(~top_p_kept(probs, params.top_p), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if params.min_p > 0:
        floor = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def top_p_kept(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens of ``probs`` [..., V] top-p keeps, as a bool mask: in order of falling probability (ties: lower id
    first), a token is kept while the mass before it is below ``top_p``.

    On the CPU that order comes from one int64 key per token, the probability's float32 bits (non-negative floats
    order as their bits do) above the complement of its id, all distinct: NumPy picks a row's first
    ``TOP_P_CANDIDATES`` of the order in linear time and sorts only them, which settles the row whenever the mass
    before the last of them reaches ``top_p`` (or it has probability 0), and otherwise sorts every key (~0.5 ms for
    49 152). torch sorts such a row's floats in ~5 ms there, which a γ = 4 verification at top-p paid five times
    per request per round.
    """
    vocab = probs.shape[-1]
    if probs.device.type != "cpu" or probs.dtype != torch.float32 or vocab > _ID_MASK + 1:
        values, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(values, dim=-1) - values
        return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, mass_before < top_p)
    rows = probs.detach().reshape(-1, vocab).contiguous()
    keys = ((rows.view(torch.int32).to(torch.int64) << _ID_BITS) | (_ID_MASK - torch.arange(vocab))).numpy()
    kept = torch.zeros(rows.shape, dtype=torch.bool)
    for row, row_keys, row_kept in zip(rows, keys, kept, strict=True):
        if vocab > TOP_P_CANDIDATES:
            first = row_keys[np.argpartition(row_keys, vocab - TOP_P_CANDIDATES)[vocab - TOP_P_CANDIDATES :]]
            ids, mass_before = _in_order(row, first)
            if mass_before[-1] >= top_p or row[ids[-1]] == 0:
                row_kept[ids[mass_before < top_p]] = True
                continue
        ids, mass_before = _in_order(row, row_keys)
        row_kept[ids[mass_before < top_p]] = True
    return kept.reshape(probs.shape)


def _in_order(row: torch.Tensor, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids of ``keys`` (:func:`top_p_kept`'s) by falling probability, and the mass of ``row`` before each."""
    ids = torch.from_numpy(_ID_MASK - (-np.sort(-keys) & _ID_MASK))
    values = row[ids]
    return ids, torch.cumsum(values, dim=0) - values


def make_generator(seed: int | None) -> torch.Generator:
    """A private RNG for one request; ``None`` draws a fresh seed from the OS."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from ``probs`` [V] with ``generator`` (inverse CDF of one uniform)."""
    uniform = torch.rand((), generator=generator).item()
    return sample_with_uniform(probs, uniform)


def sample_with_uniform(probs: torch.Tensor, uniform: float) -> int:
    """Inverse-CDF draw from ``probs`` [V] given ``uniform`` in [0, 1); never returns a zero-mass id."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    index = int(torch.searchsorted(cdf, torch.tensor([uniform * float(cdf[-1])], dtype=torch.float64), right=True))
    index = min(index, probs.shape[-1] - 1)
    while probs[index] <= 0:  # float rounding at the top end of the cdf can land on a zero tail
        index -= 1
    return index


def top_logprobs(logprobs: torch.Tensor, count: int) -> TopLogprobs:
    """The ``count`` most probable tokens of ``logprobs`` [V] (log-probabilities), most probable first, lower id first
    on ties; tokens of probability 0 (``-inf``) are left out, so fewer than ``count`` come back when ``p`` has
    smaller support.

    >>> top_logprobs(torch.tensor([-1.0, -float("inf"), -0.5, -1.0]), 3)
    TopLogprobs(token_ids=(2, 0, 3), logprobs=(-0.5, -1.0, -1.0))
    """
    row = logprobs.float().cpu()
    if count < 1:
        return TopLogprobs((), ())
    # Sorted are only the tokens at least as probable as the count-th (ties included, in id order, so the stable
    # sort puts lower ids first): a CPU sorts a whole 49 152-token row in ~5 ms, once per emitted token.
    kth = torch.topk(row, min(count, row.shape[-1])).values[-1]
    ids = torch.nonzero(row >= kth if torch.isfinite(kth) else torch.isfinite(row)).squeeze(1)
    values, order = torch.sort(row[ids], descending=True, stable=True)
    values, ids = values[:count], ids[order[:count]]
    return TopLogprobs(tuple(ids.tolist()), tuple(values.tolist()))
