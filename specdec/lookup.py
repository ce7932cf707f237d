"""Prompt lookup: the tokens that followed the most recent earlier occurrence of a text's tail (no model, no torch).

The ``ngram`` drafter proposes nothing else; an ``eagle`` drafter proposes such a chain instead of its head's when
the matched tail is at least ``lookup_min_match`` tokens long (:func:`prompt_lookup`), and a router or engine that
plans that drafter's rounds (``auto``) computes the same chain to know the round will be one, since the choice
depends on the text alone.
"""

from __future__ import annotations

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
    best_length, best_end = 0, -1
    for end in range(size - 1, min_ngram - 1, -1):  # a match ends at ``end`` (exclusive), most recent first
        if tokens[end - 1] != last:
            continue
        length = 1
        limit = min(max_ngram, end)
        while length < limit and tokens[end - 1 - length] == tokens[size - 1 - length]:
            length += 1
        if length > best_length:
            best_length, best_end = length, end
            if length == max_ngram:
                break
    if best_length < min_ngram:
        return []
    return tokens[best_end : best_end + max_tokens]


def prompt_lookup(text: list[int], min_match: int, limit: int) -> list[int]:
    """An eagle drafter's prompt-lookup chain on ``text``: at most ``limit`` tokens, from a tail of at least
    ``min_match`` tokens (0: never) and at most :data:`LOOKUP_MAX_MATCH`; empty when there is none."""
    if min_match <= 0 or limit <= 0:
        return []
    return lookup_continuation(text, LOOKUP_MAX_MATCH, min_match, limit)
