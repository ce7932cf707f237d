"""Distill's choice of a head's prompt-lookup tail: the accepted lengths it measures per held-out row are the ones the
served drafter's greedy chains get, the choice follows them (worked examples), and a drafter serving the head uses it
unless told otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.distill.lookup_choice import RowChains, choose_min_match, row_chains
from specdec.distill.train import make_batches, with_target_argmax
from specdec.drafters import DEFAULT_LOOKUP_MIN_MATCH, DraftConfig, EagleDrafter
from specdec.drafters.eagle_head import LOOKUP_KEY, HeadInfo, save_head
from specdec.errors import InvalidArgumentError
from specdec.lookup import LookupIndex
from specdec.models import LoadedModel
from specdec.sampling import make_generator
from tests.test_eagle import FUSED, GREEDY, VOCAB, examples_of, random_head, true_features
from tests.tiny_models import tiny_llama

DEPTH = 3


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=7, vocab_size=VOCAB, num_layers=2)


@pytest.mark.parametrize("feature_layers", [(), FUSED], ids=["final-norm", "fused"])
def test_row_lengths_are_what_the_served_drafter_gets_accepted(
    target: LoadedModel, feature_layers: tuple[int, ...]
) -> None:
    """At every response row of greedy held-out text: the head's length is how many tokens of the eagle drafter's
    greedy chain (no lookup) the text continues with, lookup's how many of the lookup chain's, and the match the
    longest tail lookup finds (a tiny random target repeats itself, so both kinds of chain get accepted)."""
    examples = examples_of(
        target, [[1, 2, 3], [4, 5, 6, 7]], max_tokens=20, temperature=0.0, fused_layers=feature_layers
    )
    head = random_head(target, seed=3, vocab=torch.tensor([0, 1, 2, 3, 5, 6, 7, 9, 11, 12, 14]),
                       feature_layers=feature_layers)  # fmt: skip
    batches = make_batches(examples, 3072, 640, fused=bool(feature_layers))
    batches = with_target_argmax(batches, target.model.get_output_embeddings().weight, head.draft_to_target)
    measured = RowChains.cat([row_chains(head, batch, DEPTH) for batch in batches])
    drafter = EagleDrafter(head, DraftConfig(num_draft_tokens=DEPTH, draft_top_k=0), lookup_min_match=0)
    expected_head, expected_lookup, expected_match = [], [], []
    ordered = sorted(examples, key=lambda example: len(example.token_ids))  # make_batches' order
    for example in ordered:
        text = example.token_ids.tolist()
        features = true_features(target, text, feature_layers)
        last_row = len(text) - 3  # batch row j holds token j + 1; the last row's next token is outside the batch
        for row in range(example.prompt_length - 2, last_row + 1):
            known = text[: row + 2]
            handle = drafter.open(known, GREEDY, make_generator(0))
            drafter.add_features(handle, 0, features[: len(known) - 1])
            (proposal,) = drafter.propose([handle], [DEPTH])
            drafter.close(handle)
            chain = [proposal.tree.tokens[node] for node in range(len(proposal.tree))]
            expected_head.append(_accepted(chain, text, len(known), last_row - row))
            index = LookupIndex(known)  # the whole text, as served
            sizes = [size for size in range(1, 9) if index.prompt_lookup(size, DEPTH)]
            lookup = index.prompt_lookup(1, DEPTH)
            expected_lookup.append(_accepted(lookup, text, len(known), last_row - row))
            expected_match.append(max(sizes, default=0))
    assert measured.head.tolist() == expected_head
    assert measured.lookup.tolist() == expected_lookup
    assert measured.match.tolist() == expected_match
    assert sum(expected_head) > 0 and sum(expected_lookup) > 0  # both kinds of chain are accepted somewhere


def test_lookup_reads_a_long_texts_start_that_the_window_leaves_out(target: LoadedModel) -> None:
    """A text longer than the training window: its rows' lookup chains and matches are those of serving, whose
    lookup reads the whole text. The prompt ends in a tail (1, 2, 3) that only its start, outside the window, holds."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3]
    (example,) = examples_of(target, [prompt], max_tokens=12, temperature=0.0)
    text = example.token_ids.tolist()
    first = len(prompt) - 1  # the window's first head position: the prompt's last token
    head = random_head(target, seed=3)
    lm_head = target.model.get_output_embeddings().weight
    [batch] = with_target_argmax(make_batches([example], 3072, len(text) - 1 - first), lm_head, head.draft_to_target)
    measured = row_chains(head, batch, DEPTH)
    expected_lookup, expected_match, window_only_match = [], [], []
    for position in range(first, len(text) - 1):  # every row of the window predicts a response token
        known = text[: position + 1]
        sizes = [size for size in range(1, 9) if LookupIndex(known).prompt_lookup(size, DEPTH)]
        lookup = LookupIndex(known).prompt_lookup(1, DEPTH)
        expected_lookup.append(_accepted(lookup, text, position + 1, len(text) - 2 - position))
        expected_match.append(max(sizes, default=0))
        window_only = LookupIndex(known[first:])
        window_only_match.append(max((s for s in range(1, 9) if window_only.prompt_lookup(s, DEPTH)), default=0))
    assert measured.lookup.tolist() == expected_lookup
    assert measured.match.tolist() == expected_match
    assert expected_match[0] == 3 and window_only_match[0] == 0  # the window alone would miss it


def _accepted(chain: list[int], text: list[int], start: int, room: int) -> int:
    """Leading tokens of ``chain`` the greedy text continues with from ``start`` (at most ``room``: the rows left)."""
    accepted = 0
    while accepted < min(len(chain), room) and chain[accepted] == text[start + accepted]:
        accepted += 1
    return accepted


def chains(head: list[int], lookup: list[int], match: list[int], text: list[int] | None = None) -> RowChains:
    columns = (head, lookup, match, text or [0] * len(head))
    return RowChains(*(torch.tensor(column, dtype=torch.long) for column in columns))


def test_the_choice_is_the_tail_whose_walk_commits_most_per_round() -> None:
    """One text of 6 rows. The head alone: a round at row 0 accepts 1 (2 tokens), then rows 2, 3, 4 and 5 accept
    nothing: 6 tokens in 5 rounds. Lookup matches a 2-token tail at row 2 and accepts 3 there: from a tail of 1 or 2
    the walk is row 0 (2 tokens), row 2 (the 4 rows left): 6 tokens in 2 rounds. 2 is kept (the longer of the two)."""
    choice = choose_min_match(chains([1, 0, 0, 0, 0, 0], [0, 0, 3, 0, 0, 0], [0, 0, 2, 0, 0, 0]))
    assert choice.tokens_per_round[0] == pytest.approx(6 / 5)
    assert choice.tokens_per_round[1] == choice.tokens_per_round[2] == pytest.approx(6 / 2)
    assert choice.tokens_per_round[3] == pytest.approx(6 / 5)
    assert choice.min_match == 2


def test_rows_a_round_steps_over_do_not_count() -> None:
    """The head accepts 3 at row 0, so the next round starts at row 4: lookup's good chains at rows 1 and 2 are
    never drafted, and lookup is kept off (a per-row average would have taken it)."""
    choice = choose_min_match(chains([3, 0, 0, 0, 0, 0, 0, 0], [0, 3, 3, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]))
    assert choice.tokens_per_round[0] == choice.tokens_per_round[1] == pytest.approx(8 / 5)
    assert choice.min_match == 0


def test_a_round_ends_with_its_text() -> None:
    """Two texts of 3 rows: a round accepting 3 at the first text's row 0 commits its 3 rows, not 4; the next round
    starts at the second text's first row."""
    choice = choose_min_match(chains([3, 0, 0, 3, 0, 0], [0] * 6, [0] * 6, [0, 0, 0, 1, 1, 1]))
    assert choice.tokens_per_round[0] == pytest.approx(6 / 2)


def test_a_head_that_lookup_never_beats_keeps_lookup_off() -> None:
    assert (
        choose_min_match(chains([3, 0, 0, 0, 3, 0, 0, 0], [1, 0, 0, 0, 2, 0, 0, 0], [1, 0, 0, 0, 4, 0, 0, 0])).min_match
        == 0
    )


def test_a_shorter_tail_must_beat_a_longer_one_by_more_than_the_tolerance() -> None:
    """400 rows, the head accepting nothing: from a tail of 2, lookup takes 100 rounds of 2 accepted tokens; from a
    tail of 1 one more row takes a round accepting 1 (0.5 % more tokens per round): 2 is kept."""
    size = 400
    head, lookup, match = [0] * size, [0] * size, [0] * size
    for row in range(0, 300, 3):
        lookup[row], match[row] = 2, 2
    lookup[300], match[300] = 1, 1
    choice = choose_min_match(chains(head, lookup, match))
    assert choice.tokens_per_round[1] > choice.tokens_per_round[2] > choice.tokens_per_round[3]
    assert choice.min_match == 2


def test_a_drafter_serves_the_heads_lookup_tail_unless_told_otherwise(target: LoadedModel, tmp_path: Path) -> None:
    head = random_head(target)
    chosen, unmeasured = tmp_path / "chosen", tmp_path / "unmeasured"
    save_head(head, chosen, HeadInfo(verifier=target.name, num_draft_tokens=4, lookup_min_match=2))
    save_head(head, unmeasured, HeadInfo(verifier=target.name, num_draft_tokens=4))

    def served(directory: Path, **options: int) -> int:
        return EagleDrafter.load(directory, DraftConfig(), hidden_size=32, vocab_size=VOCAB, **options).lookup_min_match

    assert served(chosen) == 2
    assert served(chosen, lookup_min_match=0) == 0  # the operator's flag wins
    assert served(unmeasured) == DEFAULT_LOOKUP_MIN_MATCH  # a head from before distill measured it
    config = json.loads((chosen / "config.json").read_text())
    (chosen / "config.json").write_text(json.dumps({**config, LOOKUP_KEY: -1}))
    with pytest.raises(InvalidArgumentError, match=rf"^draft_model: .*config.json: {LOOKUP_KEY} must be >= 0, got -1$"):
        served(chosen)
