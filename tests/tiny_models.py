"""Tiny random Llama models (vocab <= 8) so distributions can be enumerated exactly, plus the real SmolLM2.

``tiny_llama(seed)`` is a target; ``tiny_draft(target, seed)`` a related draft (a perturbed copy: total
variation to the target ~0.2, same argmax ~70% of the time), so chains see both acceptances and
rejections. Both are float32, deterministic for a given seed, and have no tokenizer. The EOS id
is ``vocab_size - 1``. They live on ``SPECDEC_TEST_DEVICE`` (default ``cpu``; ``cuda`` runs the
distribution tests that support it on a GPU).
"""

from __future__ import annotations

import functools
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.models import LoadedModel, load_model

SMOLLM2 = "smollm2-135m"
TEST_DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")


def tiny_config(
    vocab_size: int = 8, num_layers: int = 2, hidden_size: int = 32, max_positions: int = 256
) -> LlamaConfig:
    """Hidden 32 (default), 4 query heads over 2 KV heads (grouped-query attention), 256 positions (default)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=0.3,  # large enough that next-token distributions are far from uniform
        bos_token_id=0,
        eos_token_id=vocab_size - 1,
        pad_token_id=None,
        tie_word_embeddings=False,
    )


def _loaded(model: LlamaForCausalLM, name: str) -> LoadedModel:
    model = model.to(TEST_DEVICE).eval().requires_grad_(False)
    eos = frozenset({model.config.eos_token_id})
    return LoadedModel(model, None, name, model.config.vocab_size, eos)


def tiny_llama(
    seed: int, vocab_size: int = 8, num_layers: int = 2, hidden_size: int = 32, max_positions: int = 256
) -> LoadedModel:
    """A seeded random float32 Llama target (:func:`tiny_config`)."""
    torch.manual_seed(seed)
    config = tiny_config(vocab_size, num_layers, hidden_size, max_positions)
    return _loaded(LlamaForCausalLM(config), f"tiny-llama-{seed}")


def tiny_draft(target: LoadedModel, seed: int, num_layers: int | None = None, noise: float = 0.02) -> LoadedModel:
    """A draft related to ``target``: its first ``num_layers`` (default all) layers, each weight + noise * N(0, 1)."""
    config = tiny_config(target.vocab_size, num_layers or target.model.config.num_hidden_layers)
    draft = LlamaForCausalLM(config)
    draft.load_state_dict(target.model.state_dict(), strict=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(noise * torch.randn(parameter.shape, generator=generator))
    return _loaded(draft, f"{target.name}-draft-{seed}")


@functools.cache
def smollm2() -> LoadedModel:
    """The real SmolLM2-135M in float32, loaded once per test process."""
    return load_model(SMOLLM2)
