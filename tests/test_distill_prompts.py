"""The shipped distillation prompt set: size, balance, splits, disjointness from the benchmarks, reproducibility."""

from collections import Counter

import pytest

from specdec.distill import make_prompts
from specdec.distill.prompts import (
    CATEGORIES,
    LONG_CONTEXT,
    PROMPT_SET_PATH,
    PromptRecord,
    interleave_categories,
    load_prompt_set,
)
from specdec.errors import InvalidArgumentError


@pytest.fixture(scope="module")
def records() -> list[PromptRecord]:
    return load_prompt_set()


def _user_text(record: PromptRecord) -> str:
    return make_prompts.normalise(make_prompts.user_text(record.messages))


def test_size_and_balance(records: list[PromptRecord]) -> None:
    assert len(records) >= 4000
    counts = Counter(r.category for r in records)
    assert set(counts) == set(make_prompts.CATEGORIES)
    assert min(counts.values()) >= 400


def test_ids_unique_and_named_by_category(records: list[PromptRecord]) -> None:
    ids = [r.id for r in records]
    assert len(set(ids)) == len(ids)
    assert all(r.id.rsplit("-", 1)[0] == r.category for r in records)


def test_heldout_split(records: list[PromptRecord]) -> None:
    heldout = load_prompt_set("heldout")
    train = load_prompt_set("train")
    assert len(heldout) + len(train) == len(records)
    assert Counter(r.category for r in heldout) == dict.fromkeys(make_prompts.CATEGORIES, 30)
    train_texts = {_user_text(r) for r in train}
    assert not [r.id for r in heldout if _user_text(r) in train_texts]


def test_unknown_split_rejected() -> None:
    with pytest.raises(InvalidArgumentError) as excinfo:
        load_prompt_set("validation")
    assert excinfo.value.field == "split"


def test_disjoint_from_bench_prompts(records: list[PromptRecord]) -> None:
    bench = {make_prompts.normalise(p) for p in make_prompts.load_bench_prompts()}
    assert len(bench) > 200
    clashes = [
        r.id
        for r in records
        if _user_text(r) in bench or any(make_prompts.normalise(m["content"]) in bench for m in r.messages)
    ]
    assert not clashes


def test_no_bench_sentence_reused(records: list[PromptRecord]) -> None:
    # Same rule as the generator: sentences of three words or more ("Thanks." is too generic to count).
    bench = {s for p in make_prompts.load_bench_prompts() for s in make_prompts.sentences(p) if len(s.split()) >= 3}
    reused = [r.id for r in records for m in r.messages if bench.intersection(make_prompts.sentences(m["content"]))]
    assert not reused


def test_roles_alternate_and_end_with_user(records: list[PromptRecord]) -> None:
    for r in records:
        roles = [m["role"] for m in r.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"], r.id
        assert all(m["content"].strip() for m in r.messages), r.id
    assert any(len(r.messages) >= 5 for r in records if r.category == "multi-turn")


def test_file_matches_generator() -> None:
    assert PROMPT_SET_PATH.read_text(encoding="utf-8") == "".join(make_prompts.render_lines())


def test_long_context_rows_are_documents_of_hundreds_of_words_and_the_rest_are_short(
    records: list[PromptRecord],
) -> None:
    low, high = make_prompts.LONG_CONTEXT_WORDS
    for r in records:
        words = len(_user_text(r).split())
        assert (low <= words <= high) if r.category == LONG_CONTEXT else words <= make_prompts.MAX_USER_WORDS, r.id
    long_rows = [r for r in records if r.category == LONG_CONTEXT]
    assert any(len(r.messages) >= 3 for r in long_rows)  # conversations that go on after a document
    assert any("```" in r.messages[0]["content"] for r in long_rows)  # source files as well as reports


def test_a_selection_takes_categories_in_turn() -> None:
    rows = [{"category": c} for c in ("code", "code", "chat", "rewrite", "chat")]
    assert [index for index, _ in interleave_categories(rows, None)] == [0, 2, 3, 1, 4]
    assert [index for index, _ in interleave_categories(rows, 2)] == [0, 2]
    records = load_prompt_set("heldout")
    first = [record.category for _, record in interleave_categories(records, 2 * len(CATEGORIES), lambda r: r.category)]
    assert Counter(first) == {category: 2 for category in CATEGORIES}
