"""Text on the router: incremental detokenization equals a full decode and never emits a broken character;
stop strings cut the text exactly, even when they arrive split over several rounds."""

from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerBase

from router.text import IncrementalDetokenizer, StopMatcher, TextStream, decoder
from specdec.errors import ModelNotFoundError
from specdec.model_files import load_tokenizer
from tests.tiny_models import SMOLLM2

TEXTS = ["Héllo wörld 🎉🎉 日本語 ok  spaces\n\nnew 🤖 end", "def f(x):\n    return x ** 2  # ✓", "a" * 30]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(SMOLLM2)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tokenizer, text: str) -> None:
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:", add_special_tokens=False))
    deltas = [detokenizer.push(token) for token in ids] + [detokenizer.flush()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in delta for delta in deltas), "an incomplete character was sent"


def test_random_ids_concatenate_to_the_full_decode(tokenizer) -> None:
    generator = random.Random(0)
    for length in [30] * 19 + [100]:  # 100: the window slides several times
        ids = [generator.randrange(len(tokenizer)) for _ in range(length)]
        detokenizer = IncrementalDetokenizer(tokenizer, [])
        text = "".join(detokenizer.push(token) for token in ids) + detokenizer.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_direct_decoder_is_transformers_decode(tokenizer) -> None:
    generator = random.Random(1)
    decode = decoder(tokenizer)
    for _ in range(50):
        ids = [generator.randrange(len(tokenizer)) for _ in range(generator.randrange(1, 12))]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("pieces", "stops", "released", "stopped"),
    [
        (["Hello </", "s> world"], ["</s>"], "Hello ", True),
        (["xab", "c", "abd"], ["abc"], "x", True),  # "ab" is held, then "c" completes the stop
        (["aab", "x"], ["abc"], "aabx", False),  # a held prefix that did not become a stop
        (["xyz"], ["y", "xy"], "", True),  # the earliest match wins
        (["no stop here"], ["STOP"], "no stop here", False),
        (["S", "T", "O", "P!"], ["STOP"], "", True),
    ],
)
def test_stop_matcher(pieces: list[str], stops: list[str], released: str, stopped: bool) -> None:
    matcher = StopMatcher(stops)
    text = "".join(matcher.push(piece) for piece in pieces) + matcher.flush()
    assert (text, matcher.stopped) == (released, stopped)


def test_stop_matcher_holds_back_only_possible_prefixes() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("go ST") == "go "
    assert matcher.push("X") == "STX"


def test_text_stream_stops_inside_a_token(tokenizer) -> None:
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    stream = TextStream(tokenizer, [], ["hre"])
    text = ""
    for token in ids:
        text += stream.push(token)
        if stream.stopped:
            break
    assert (text, stream.stopped) == ("one two t", True)


def test_unknown_tokenizer() -> None:
    with pytest.raises(ModelNotFoundError, match="no-such-dir"):
        load_tokenizer("./no-such-dir")
