"""Model loading (alias, local directory, unknown names) and the draft/target vocabulary check."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specdec.errors import IncompatibleDraftError, ModelNotFoundError
from specdec.model_files import load_tokenizer
from specdec.models import LoadedModel, ModelShape, check_same_vocabulary, load_model, load_shape
from tests.tiny_models import SMOLLM2, smollm2, tiny_draft, tiny_llama


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


@pytest.mark.slow
def test_a_gguf_model_loads_from_its_float32_copy_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    chat = [{"role": "user", "content": "Write a haiku about the sea."}]
    ids = torch.tensor([[1, 520, 3332, 314, 4484, 28, 2, 17, 88, 999]])
    not_a_directory = tmp_path / "cache-file"
    not_a_directory.write_text("")
    monkeypatch.setenv("SPECDEC_CACHE", str(not_a_directory))  # no copy can be made: the GGUF file itself loads
    with caplog.at_level(logging.WARNING, logger="specdec.models"):
        from_gguf = load_model(SMOLLM2)
    assert "cannot cache a float32 copy" in caplog.text

    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    load_model(SMOLLM2)  # the first load makes the copy
    [copy_dir] = (cache / "models").iterdir()
    assert copy_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-") and (copy_dir / "model.safetensors").is_file()
    from_copy = load_model(SMOLLM2)
    with torch.inference_mode():
        torch.testing.assert_close(from_copy.model(ids).logits, from_gguf.model(ids).logits, atol=0, rtol=0)
    assert from_copy.model.lm_head.weight.data_ptr() == from_copy.model.model.embed_tokens.weight.data_ptr()
    assert from_copy.eos_token_ids == from_gguf.eos_token_ids
    for tokenizer in (from_copy.tokenizer, load_tokenizer(SMOLLM2)):
        assert type(tokenizer) is type(AutoTokenizer.from_pretrained(copy_dir)) is type(from_gguf.tokenizer)
        assert tokenizer.get_vocab() == from_gguf.tokenizer.get_vocab()
        assert tokenizer.all_special_ids == from_gguf.tokenizer.all_special_ids
        assert tokenizer.apply_chat_template(
            chat, add_generation_prompt=True
        ) == from_gguf.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert load_shape(SMOLLM2) == ModelShape.of(from_gguf)
    halved = load_model(SMOLLM2, dtype=torch.bfloat16)
    for name, tensor in halved.model.state_dict().items():
        assert torch.equal(tensor, from_gguf.model.state_dict()[name].to(torch.bfloat16)), name


def save_tiny_llama_with_tokenizer(directory: Path, chat_template: str | None) -> None:
    tiny_llama(0).model.save_pretrained(directory)  # model_type llama
    tokenizer = word_tokenizer(["<unk>", "hello", "world"])  # saved as tokenizer_class TokenizersBackend
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)


def test_a_generic_llama_tokenizer_loads_as_auto_tokenizer_would_without_torch(tmp_path: Path) -> None:
    template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    save_tiny_llama_with_tokenizer(tmp_path / "local", template)
    expected, loaded = AutoTokenizer.from_pretrained(tmp_path / "local"), load_tokenizer(str(tmp_path / "local"))
    assert type(loaded) is type(expected) and loaded.get_vocab() == expected.get_vocab()
    assert loaded("hello world hello")["input_ids"] == expected("hello world hello")["input_ids"]
    # hub ids, from their snapshots in a Hugging Face cache: one with a chat template (the fast path), one without
    # (its template may only be missing from the snapshot, so AutoTokenizer loads it)
    for repo, with_template in (("acme--tiny", template), ("acme--base", None)):
        (tmp_path / "hub" / f"models--{repo}" / "refs").mkdir(parents=True)
        (tmp_path / "hub" / f"models--{repo}" / "refs" / "main").write_text("0123abcd")
        save_tiny_llama_with_tokenizer(tmp_path / "hub" / f"models--{repo}" / "snapshots" / "0123abcd", with_template)
    # the router's process: its modules and its tokenizer, and no torch (8.6 s and 445 MB to serve with it)
    code = """
import sys, router.server
from specdec.model_files import load_tokenizer
chat = [{"role": "user", "content": "hello world"}]
fast = load_tokenizer("acme/tiny")
print(type(fast).__name__, "torch" in sys.modules)
base = load_tokenizer("acme/base")
print(type(base).__name__, "torch" in sys.modules)
from transformers import AutoTokenizer
auto = AutoTokenizer.from_pretrained("acme/tiny")
print(fast.apply_chat_template(chat) == auto.apply_chat_template(chat), fast.get_vocab() == auto.get_vocab())
"""
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120, env=env
    )
    name = type(expected).__name__
    assert result.stdout.split("\n")[:3] == [f"{name} False", f"{name} True", "True True"]


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
