"""Prompt lookup: the tokens that followed the most recent earlier occurrence of a text's tail (no model, no torch).

The ``ngram`` drafter proposes nothing else; an ``eagle`` drafter proposes such a chain instead of its head's when
the matched tail is at least ``lookup_min_match`` tokens long (:meth:`LookupIndex.prompt_lookup`), and a router or
engine that plans that drafter's rounds (``auto``) computes the same chain to know the round will be one, since the
choice depends on the text alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

LOOKUP_MAX_MATCH = 8  # the longest tail prompt lookup matches: a longer match names its context more surely
# 5: a chance match of 3 or 4 tokens in chat, lists or QA proposed chains the head would have beaten (measured per
# prompt, bench/results/eagle-lookup.md), while copying (rewrite, summarise) matches longer anyway
DEFAULT_LOOKUP_MIN_MATCH = 5


def lookup_continuation(tokens: list[int], max_ngram: int, min_ngram: int, max_tokens: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest matching tail (at most ``max_ngram``
    tokens, at least ``min_ngram``).

    ``lookup_continuation([1, 2, 3, 9, 1, 2], 3, 1, 2) == [3, 9]``: the tail ``1 2`` occurred at
    position 0 and was followed by ``3 9``. One pass over the text finds the places the last token occurred, and
    only those are extended backwards: a long text costs one comparison per token, not one per token and tail size.
    """
    size = len(tokens)
    if min_ngram < 1 or size < min_ngram + 1:
        return []
    last = tokens[-1]
    ends = (end for end in range(size - 1, min_ngram - 1, -1) if tokens[end - 1] == last)
    start = _match_end(ends, tokens.__getitem__, size, max_ngram, min_ngram)
    return tokens[start : start + max_tokens] if start >= 0 else []


def _match_end(ends: Iterable[int], at: Callable[[int], int], size: int, max_ngram: int, min_ngram: int) -> int:
    """Of ``ends`` (where earlier occurrences of the last of ``size`` tokens end, exclusive; most recent first), the
    one the longest match of the tail ends at, the most recent of equals; -1 when none is ``min_ngram`` long."""
    best_length, best_end = 0, -1
    for end in ends:
        if end < min_ngram:
            break
        length = 1
        limit = min(max_ngram, end)
        while length < limit and at(end - 1 - length) == at(size - 1 - length):
            length += 1
        if length > best_length:
            best_length, best_end = length, end
            if length == max_ngram:
                break
    return best_end if best_length >= min_ngram else -1


class LookupIndex:
    """A growing text and where each token occurs in it, so that a prompt lookup costs the earlier occurrences of
    the text's last token rather than a pass over the whole text (on a 4 000-token text the pass cost 92 µs a round,
    next to ~250 µs of everything else a round costs a router that plans every ``auto`` round of an eagle drafter,
    and an eagle drafter looks up every round of every sequence). Its lookups equal :func:`lookup_continuation` on
    the text followed by what they are given as ``extra``."""

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self._positions: dict[int, list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self._positions.setdefault(token, []).append(len(self.tokens))
            self.tokens.append(token)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (a drafter's text rolled back)."""
        while len(self.tokens) > length:
            self._positions[self.tokens.pop()].pop()

    def prompt_lookup(self, min_match: int, limit: int, extra: Sequence[int] = ()) -> list[int]:
        """An eagle drafter's prompt-lookup chain on the text followed by ``extra`` (e.g. a proposal assumed accepted):
        at most ``limit`` tokens, from a tail of at least ``min_match`` tokens (0: never) and at most
        :data:`LOOKUP_MAX_MATCH`; empty when there is none."""
        if min_match <= 0 or limit <= 0:
            return []
        return self.continuation(LOOKUP_MAX_MATCH, min_match, limit, extra)

    def continuation(self, max_ngram: int, min_ngram: int, max_tokens: int, extra: Sequence[int] = ()) -> list[int]:
        """:func:`lookup_continuation` of the text followed by ``extra``."""
        text, base = self.tokens, len(self.tokens)
        size = base + len(extra)
        if min_ngram < 1 or size < min_ngram + 1:
            return []

        def at(index: int) -> int:
            return text[index] if index < base else extra[index - base]

        last = at(size - 1)
        # where an earlier occurrence of the last token ends (exclusive), most recent first: in ``extra`` before its
        # own last token, then in the text (all of it when ``extra`` follows, else before its last token)
        ends = [base + offset + 1 for offset in range(len(extra) - 2, -1, -1) if extra[offset] == last]
        ends += [position + 1 for position in reversed(self._positions.get(last, ())) if position + 1 < size]
        start = _match_end(ends, at, size, max_ngram, min_ngram)
        return [at(index) for index in range(start, min(start + max_tokens, size))] if start >= 0 else []
