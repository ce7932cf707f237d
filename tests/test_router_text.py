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
    deltas = [detokenizer.push([token]) for token in ids] + [detokenizer.flush()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in delta for delta in deltas), "an incomplete character was sent"


def test_random_ids_concatenate_to_the_full_decode(tokenizer) -> None:
    generator = random.Random(0)
    for length in [30] * 19 + [100]:  # 100: the window slides several times
        ids = [generator.randrange(len(tokenizer)) for _ in range(length)]
        detokenizer = IncrementalDetokenizer(tokenizer, [])
        text = "".join(detokenizer.push([token]) for token in ids) + detokenizer.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(3))
def test_rounds_of_several_tokens_concatenate_to_the_full_decode(tokenizer, seed: int) -> None:
    generator = random.Random(seed)
    texts = [*TEXTS, "".join(generator.choice("aé 日🎉\n") for _ in range(120))]
    for text in texts:
        ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:", add_special_tokens=False))
        deltas, start = [], 0
        while start < len(ids):  # rounds of 1-6 tokens, as verdicts commit them
            size = generator.randint(1, 6)
            deltas.append(detokenizer.push(ids[start : start + size]))
            start += size
        deltas.append(detokenizer.flush())
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
        assert not any("\ufffd" in delta for delta in deltas), "an incomplete character was sent"


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
    text, kept = stream.push(ids)  # one round holding every token: the stop ends it inside the third
    assert (text, kept, stream.stopped) == ("one two t", 3, True)
    assert tokenizer.decode(ids[:kept]) == "one two three"  # the tokens kept end with the one holding the stop


def test_text_stream_keeps_a_whole_round_without_stop_strings(tokenizer) -> None:
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    stream = TextStream(tokenizer, [], [])
    assert stream.push(ids[:2]) == ("one two", 2)
    assert stream.push(ids[2:]) == (" three four", len(ids) - 2)
    assert stream.flush() == "" and not stream.stopped


def test_unknown_tokenizer() -> None:
    with pytest.raises(ModelNotFoundError, match="no-such-dir"):
        load_tokenizer("./no-such-dir")
