"""Model loading (alias, local directory, unknown names) and the draft/target vocabulary check."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from specdec.errors import IncompatibleDraftError, ModelNotFoundError
from specdec.models import LoadedModel, check_same_vocabulary, load_model
from tests.tiny_models import smollm2, tiny_draft, tiny_llama


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer mapping ``words[i]`` to id ``i``."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({word: index for index, word in enumerate(words)}, unk_token=words[0]))
    )


@pytest.mark.slow
def test_alias_loads_smollm2() -> None:
    loaded = smollm2()
    assert loaded.name == "smollm2-135m" and loaded.vocab_size == 49152
    assert loaded.model.config.num_hidden_layers == 30 and loaded.model.dtype == torch.float32
    assert not loaded.model.training and not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.tokenizer is not None and len(loaded.tokenizer) == 49152
    assert loaded.tokenizer.eos_token_id in loaded.eos_token_ids
    ids = loaded.tokenizer("The capital of France is")["input_ids"]
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids])).logits[0, -1]
    assert loaded.tokenizer.decode(logits.argmax()).strip() == "Paris"
    check_same_vocabulary(loaded, loaded)


def test_local_directory_loads(tmp_path: Path) -> None:
    tiny = tiny_llama(0)
    tiny.model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.vocab_size == 8 and loaded.tokenizer is None and loaded.eos_token_ids == frozenset({7})
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded.model(ids).logits, tiny.model(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["no-such-org/no-such-model-xyz", "no-such-model-xyz", "/nonexistent/dir/m.gguf"])
def test_unknown_name_fails_fast(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    with pytest.raises(ModelNotFoundError, match=name):
        load_model(name)
    assert time.monotonic() - started < 5


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf"):
        load_model(str(path))


def test_vocabulary_check() -> None:
    target = tiny_llama(0)
    check_same_vocabulary(target, tiny_draft(target, seed=1))
    with pytest.raises(IncompatibleDraftError, match="vocabulary size 16"):
        check_same_vocabulary(target, tiny_llama(1, vocab_size=16))


def test_vocabulary_check_compares_tokenizers() -> None:
    words = [f"w{index}" for index in range(8)]
    target = dataclasses.replace(tiny_llama(0), tokenizer=word_tokenizer(words))
    same = dataclasses.replace(tiny_llama(1), tokenizer=word_tokenizer(words))
    swapped = dataclasses.replace(tiny_llama(1), tokenizer=word_tokenizer([words[1], words[0], *words[2:]]))
    check_same_vocabulary(target, same)
    with pytest.raises(IncompatibleDraftError, match="map tokens to ids differently"):
        check_same_vocabulary(target, swapped)


def test_loaded_model_is_frozen() -> None:
    loaded: LoadedModel = tiny_llama(0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.name = "other"  # type: ignore[misc]
