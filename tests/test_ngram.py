"""Prompt-lookup drafting."""

import random

import torch

from specdec.drafters import DraftConfig, NgramDrafter
from specdec.lookup import LookupIndex, lookup_continuation
from specdec.sampling import SamplingParams


def test_longest_tail_most_recent_match() -> None:
    assert lookup_continuation([1, 2, 3, 9, 1, 2], 3, 1, 2) == [3, 9]
    # The 2-gram "4 5" beats the more recent 1-gram "5".
    assert lookup_continuation([4, 5, 6, 5, 7, 4, 5], 3, 1, 3) == [6, 5, 7]
    assert lookup_continuation([1, 2, 3], 3, 1, 4) == []
    assert lookup_continuation([7], 3, 1, 4) == []


def lookup_by_definition(tokens: list[int], max_ngram: int, min_ngram: int, max_tokens: int) -> list[int]:
    """Every tail size from the longest down, every earlier start from the most recent back."""
    for size in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - size - 1, -1, -1):
            if tokens[start : start + size] == tokens[-size:]:
                return tokens[start + size : start + size + max_tokens]
    return []


def test_the_one_pass_lookup_finds_what_the_definition_does() -> None:
    """The lookup scans once for the last token and extends matches backwards; on 20 000 seeded random texts over
    small vocabularies (many matches, many ties) it returns what trying every size and start returns."""
    rng = random.Random(0)
    for _ in range(20_000):
        tokens = [rng.randrange(rng.randint(1, 5)) for _ in range(rng.randint(0, 30))]
        max_ngram = rng.randint(1, 6)
        min_ngram, max_tokens = rng.randint(1, max_ngram), rng.randint(0, 5)
        expected = lookup_by_definition(tokens, max_ngram, min_ngram, max_tokens)
        assert lookup_continuation(tokens, max_ngram, min_ngram, max_tokens) == expected, (tokens, max_ngram, min_ngram)


def test_an_indexed_text_finds_what_the_definition_does_on_it_and_what_follows() -> None:
    """A LookupIndex grown (and cut back) in random steps, asked on its text followed by a random ``extra`` (a
    proposal assumed accepted) or by nothing, answers what the definition answers on the whole text, on 20 000
    seeded random cases."""
    rng = random.Random(1)
    for _ in range(20_000):
        vocabulary = rng.randint(1, 5)
        index, text = LookupIndex(), []
        for _ in range(rng.randint(0, 3)):
            step = [rng.randrange(vocabulary) for _ in range(rng.randint(0, 12))]
            index.extend(step)
            text += step
            cut = rng.randint(0, len(text))  # a rollback, now and then
            if rng.random() < 0.3:
                index.truncate(cut)
                del text[cut:]
        extra = [rng.randrange(vocabulary) for _ in range(rng.choice([0, 0, rng.randint(1, 5)]))]
        max_ngram = rng.randint(1, 6)
        min_ngram, max_tokens = rng.randint(1, max_ngram), rng.randint(0, 5)
        expected = lookup_by_definition(text + extra, max_ngram, min_ngram, max_tokens)
        assert index.continuation(max_ngram, min_ngram, max_tokens, extra) == expected, (text, extra, max_ngram)
    assert len(index) == len(text)


def test_drafter_proposes_deterministic_chains_and_follows_commits() -> None:
    drafter = NgramDrafter(DraftConfig(num_draft_tokens=2))
    handle = drafter.open([1, 2, 3, 1], SamplingParams(), torch.Generator())
    [proposal] = drafter.propose([handle], [5])
    assert proposal.tree.tokens == (2, 3)
    assert proposal.tree.is_chain
    assert proposal.draft_probs is None
    drafter.commit(handle, [0], [2, 9])
    [proposal] = drafter.propose([handle], [1])
    assert proposal.tree.tokens == ()  # tail "9" never occurred before
    assert drafter.propose([handle], [0])[0].tree.tokens == ()
    drafter.close(handle)
    assert drafter.num_open == 0
