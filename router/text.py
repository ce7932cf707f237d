"""Text on the router: loading the served model's tokenizer, incremental detokenization, stop strings.

Tokens arrive a round at a time; text goes out as soon as it is safe to send:

* :class:`IncrementalDetokenizer` releases text only once its bytes form whole characters (a multi-byte
  character split over tokens is held until complete), decoding a short window of recent tokens each time
  rather than the whole output (vLLM's ``detokenize_incrementally`` scheme, simplified);
* :class:`StopMatcher` holds back any tail that could be the start of a stop string, and on a match cuts the
  text just before it.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"  # what decoding yields for an incomplete UTF-8 sequence
CONTEXT_TOKENS = 6  # prompt tokens decoded in front of the output, for tokenizers whose spacing depends on them


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas whose concatenation is the decoded output.

    ``push(id)`` returns the newly complete text (possibly ``""``); ``flush()`` returns whatever is still held
    at the end (an incomplete character decodes to U+FFFD, as a full decode would). Special tokens are skipped.
    The window starts with the prompt's last tokens so a tokenizer's leading-space rules see real context.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start: tokens decoded only as context
        self._read_offset = len(self._ids)  # tokens before this have been released as text

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes."""
        self._ids.append(token_id)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset)
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Text of tokens still held (an incomplete character at the very end)."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix) :] if text.startswith(prefix) else ""


class StopMatcher:
    """Releases text up to the first stop string, holding back a tail that may still become one.

    >>> matcher = StopMatcher(["</s>"])
    >>> matcher.push("Hello </"), matcher.push("s> world"), matcher.stopped
    ('Hello ', '', True)
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [stop for stop in stops if stop]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add ``text``; return what can be sent. After a stop string, ``stopped`` is set and nothing follows."""
        if self.stopped:
            return ""
        buffer = self._held + text
        cuts = [index for index in (buffer.find(stop) for stop in self._stops) if index >= 0]
        if cuts:
            self.stopped, self._held = True, ""
            return buffer[: min(cuts)]
        hold = max((_overlap(buffer, stop) for stop in self._stops), default=0)
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

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that can be sent now."""
        return self._matcher.push(self._detokenizer.push(token_id))

    def flush(self) -> str:
        """At the end of generation: everything still held back."""
        text = self._matcher.push(self._detokenizer.flush())
        return text + self._matcher.flush()
