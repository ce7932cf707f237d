"""Text on the router: loading the served model's tokenizer, incremental detokenization, stop strings.

Tokens arrive a round at a time; text goes out as soon as it is safe to send:

* :class:`IncrementalDetokenizer` releases text only once its bytes form whole characters (a multi-byte
  character split over tokens is held until complete), decoding a short window of recent tokens each time
  rather than the whole output (vLLM's ``detokenize_incrementally`` scheme, simplified). It runs for every round
  of every stream, so it costs one decode per round (the released part of the window is the text of the previous
  decode, decoded anew only when the window slides, every few rounds), through the Rust tokenizer itself where
  transformers' ``decode`` would only add Python around the same call (:func:`decoder`);
* :class:`StopMatcher` holds back any tail that could be the start of a stop string, and on a match cuts the
  text just before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"  # what decoding yields for an incomplete UTF-8 sequence
CONTEXT_TOKENS = 6  # prompt tokens decoded in front of the output, for tokenizers whose spacing depends on them
WINDOW_TOKENS = 16  # tokens a decoded window grows to before it slides (then one more decode, of its new prefix)


def decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=True)``, the same text, by the shortest route: a
    transformers fast tokenizer that cleans up no spaces decodes with its Rust tokenizer and nothing else."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas whose concatenation is the decoded output.

    ``push(ids)`` returns the newly complete text (possibly ``""``); ``flush()`` returns whatever is still held
    at the end (an incomplete character decodes to U+FFFD, as a full decode would). Special tokens are skipped.
    The window starts with the prompt's last tokens so a tokenizer's leading-space rules see real context.
    ``decode`` (default :func:`decoder` of ``tokenizer``) turns a list of ids into text.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self._decode_ids = decoder(tokenizer) if decode is None else decode
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start: tokens decoded only as context
        self._read_offset = len(self._ids)  # tokens before this have been released as text
        self._prefix = self._decode(0, self._read_offset)  # the text of the window's released part

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._decode_ids(self._ids[start:stop])

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens (a round's: one decode for all of them); return the text they complete."""
        self._ids.extend(token_ids)
        text = self._decode(self._prefix_offset)
        if len(text) <= len(self._prefix) or text.endswith(REPLACEMENT):
            return ""
        released, released_from = text[len(self._prefix) :], self._read_offset
        self._read_offset = len(self._ids)
        if self._read_offset - self._prefix_offset > WINDOW_TOKENS:  # slide: start at the last release's boundary
            self._prefix_offset = released_from
            self._prefix = self._decode(self._prefix_offset, self._read_offset)
        else:  # the window's whole text is now released: it is the next push's prefix
            self._prefix = text
        return released

    def flush(self) -> str:
        """Text of tokens still held (an incomplete character at the very end)."""
        text = self._decode(self._prefix_offset)
        prefix, self._prefix = self._prefix, ""
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix) :] if text.startswith(prefix) else ""


class StopMatcher:
    """Releases text up to the first stop string, holding back a tail that may still become one.

    >>> matcher = StopMatcher(["</s>"])
    >>> matcher.push("Hello </"), matcher.push("s> world"), matcher.stopped
    ('Hello ', '', True)
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add ``text``; return what can be sent. After a stop string, ``stopped`` is set and nothing follows."""
        if self.stopped:
            return ""
        buffer = self._held + text
        cuts = [index for index in (buffer.find(stop) for stop in self.stops) if index >= 0]
        if cuts:
            self.stopped, self._held = True, ""
            return buffer[: min(cuts)]
        hold = max((_overlap(buffer, stop) for stop in self.stops), default=0)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        """At the end of generation: the held tail was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``: ``_overlap("ab<", "<x>") == 1``."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0


class TextStream:
    """A request's output text: :class:`IncrementalDetokenizer` followed by :class:`StopMatcher`."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int], stops: Sequence[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._matcher = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        """True once a stop string has appeared; no text follows it."""
        return self._matcher.stopped

    def push(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """Add a round's generated tokens; return the text that can be sent now and how many of the tokens it keeps:
        all of them, unless a stop string ends the text inside the token at that count (the rest are dropped).

        Without stop strings the round is decoded at once; with them token by token, as a stop string may end
        inside any of them."""
        if not self._matcher.stops:
            return self._detokenizer.push(token_ids), len(token_ids)
        pieces = []
        for kept, token_id in enumerate(token_ids, start=1):
            pieces.append(self._matcher.push(self._detokenizer.push((token_id,))))
            if self._matcher.stopped:
                return "".join(pieces), kept
        return "".join(pieces), len(token_ids)

    def flush(self) -> str:
        """At the end of generation: everything still held back."""
        text = self._matcher.push(self._detokenizer.flush())
        return text + self._matcher.flush()
