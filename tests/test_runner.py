"""KVRunner: its logits equal a fresh full Hugging Face forward of the committed text, whatever was drafted,
rejected or committed on the way (DESIGN.md §3 "State follows the committed path")."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from specdec.errors import CapacityError, InvalidArgumentError
from specdec.models import LoadedModel
from specdec.runner import ForwardItem, KVRunner
from specdec.tree import TokenTree
from tests.tiny_models import smollm2, tiny_llama


def hf_logits(loaded: LoadedModel, sequences: list[list[int]]) -> torch.Tensor:
    """Plain HF forwards without cache, right-padded into one batch (causal: padding changes no real row).

    Returns: [len(sequences), max length, V].
    """
    width = max(map(len, sequences))
    with torch.inference_mode():
        return loaded.model(torch.tensor([ids + [0] * (width - len(ids)) for ids in sequences])).logits.float()


def random_tree(rng: random.Random, vocab_size: int, max_size: int = 5) -> TokenTree:
    """Empty, a chain, or a branching tree with random parents."""
    kind, size = rng.choice(["empty", "chain", "tree", "tree"]), rng.randint(1, max_size)
    tokens = [rng.randrange(vocab_size) for _ in range(size)]
    if kind == "empty":
        return TokenTree.empty()
    if kind == "chain":
        return TokenTree.chain(tokens)
    return TokenTree(tuple(tokens), tuple(rng.randrange(-1, index) for index in range(size)))


def check_tree_logits(loaded: LoadedModel, prefix: list[int], tree: TokenTree, out: torch.Tensor, atol: float) -> None:
    """Row 0 = HF at the last prefix token; row 1 + i = HF at node i after prefix + path_to(i)."""
    assert out.shape == (1 + len(tree), loaded.vocab_size)
    paths = [tree.path_to(node) for node in range(len(tree)) if not tree.children(node)] or [[]]
    refs = hf_logits(loaded, [prefix + [tree.tokens[node] for node in path] for path in paths])
    for path, ref in zip(paths, refs, strict=True):
        torch.testing.assert_close(out[0], ref[len(prefix) - 1], atol=atol, rtol=0)
        for depth, node in enumerate(path):
            torch.testing.assert_close(out[1 + node], ref[len(prefix) + depth], atol=atol, rtol=0)


def simulate(loaded: LoadedModel, prompts: list[list[int]], rounds: int, seed: int, atol: float) -> None:
    """Random rounds of forward(pending + tree) then commit/reject/truncate, checked against HF throughout."""
    rng = random.Random(seed)
    vocab = loaded.vocab_size
    runner = KVRunner(loaded.model)
    seqs = [runner.open() for _ in prompts]
    committed: dict[int, list[int]] = {seq: [] for seq in seqs}
    pending = {seq: list(prompt) for seq, prompt in zip(seqs, prompts, strict=True)}
    for _ in range(rounds):
        active = rng.sample(seqs, rng.randint(1, len(seqs)))
        trees = {seq: random_tree(rng, vocab) for seq in active}
        outs = runner.forward([ForwardItem(seq, pending[seq], trees[seq]) for seq in active])
        for seq, out in zip(active, outs, strict=True):
            tree, choice = trees[seq], rng.random()
            check_tree_logits(loaded, committed[seq] + pending[seq], tree, out, atol)
            if choice < 0.1:  # decide nothing: the same pending tokens come again next round
                continue
            if choice < 0.2:  # commit only part of the pending tokens; the rest stay pending
                count = rng.randrange(len(pending[seq]))
                runner.commit(seq, count)
                committed[seq] += pending[seq][:count]
                pending[seq] = pending[seq][count:]
                continue
            path = tree.path_to(rng.randrange(len(tree))) if tree and choice > 0.35 else []  # else reject all
            runner.commit(seq, len(pending[seq]), path)
            committed[seq] += pending[seq] + [tree.tokens[node] for node in path]
            if choice > 0.9 and committed[seq]:  # a drafter rolling back committed positions
                new_length = rng.randrange(len(committed[seq]))
                runner.truncate(seq, new_length)
                committed[seq] = committed[seq][:new_length]
            pending[seq] = [rng.randrange(vocab)]  # the correction / bonus token, no KV yet
            assert runner.length(seq) == len(committed[seq])
    outs = runner.forward([ForwardItem(seq, pending[seq]) for seq in seqs], all_logits=True)
    for seq, out in zip(seqs, outs, strict=True):
        ref = hf_logits(loaded, [committed[seq] + pending[seq]])[0]
        torch.testing.assert_close(out, ref[len(committed[seq]) :], atol=atol, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_follows_committed_path_tiny(seed: int) -> None:
    simulate(tiny_llama(seed), [[1, 2, 3], [4, 5, 6, 7, 0, 1, 2], [3]], rounds=30, seed=seed, atol=1e-4)


@pytest.mark.parametrize("config_class", [MistralConfig, Qwen2Config, Qwen3Config])
def test_other_llama_family_architectures(config_class: type) -> None:
    """Mistral (sliding window caps max_seq_len), Qwen2 (q/k/v bias), Qwen3 (q_norm / k_norm)."""
    torch.manual_seed(0)
    config = config_class(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        initializer_range=0.3,
        sliding_window=128,
        use_sliding_window=False,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    assert KVRunner(model).max_seq_len == (128 if config_class is MistralConfig else 512)
    loaded = LoadedModel(model, None, config.model_type, 8, frozenset())
    simulate(loaded, [[1, 2, 3], [4, 5]], rounds=8, seed=1, atol=1e-4)


@pytest.mark.slow
def test_kv_follows_committed_path_smollm2() -> None:
    # 30 float32 layers: a plain prefill already differs from HF's by up to ~1.1e-4 (summation order of
    # SDPA with an explicit mask vs is_causal, and of the runner's oneDNN matrix multiplies vs HF's MKL ones,
    # ~1 ulp per layer, accumulated), hence atol 3e-4 here.
    rng = random.Random(7)
    prompts = [[rng.randrange(49152) for _ in range(length)] for length in (9, 4, 1)]
    simulate(smollm2(), prompts, rounds=4, seed=7, atol=3e-4)


def run_history(runner: KVRunner, seqs: list[int], rounds: list[list[tuple[list[int], TokenTree, list[int]]]]):
    """Forward each round's (pending, tree) for all ``seqs`` at once, commit the given paths; returns logits."""
    outputs = []
    for round_items in rounds:
        outs = runner.forward(
            [ForwardItem(seq, pending, tree) for seq, (pending, tree, _) in zip(seqs, round_items, strict=True)]
        )
        for seq, (pending, _, path) in zip(seqs, round_items, strict=True):
            runner.commit(seq, len(pending), path)
        outputs.append(outs)
    return outputs


def test_batched_equals_alone() -> None:
    loaded, rng = tiny_llama(3), random.Random(3)
    rounds = []
    for index in range(6):
        round_items = []
        for length in (5, 2, 8):
            tree = random_tree(rng, 8)
            path = tree.path_to(rng.randrange(len(tree))) if tree else []
            round_items.append(([rng.randrange(8) for _ in range(length if index == 0 else 1)], tree, path))
        rounds.append(round_items)
    batched = KVRunner(loaded.model)
    together = run_history(batched, [batched.open() for _ in range(3)], rounds)
    for column in range(3):
        alone_runner = KVRunner(loaded.model)
        alone = run_history(alone_runner, [alone_runner.open()], [[items[column]] for items in rounds])
        for both, single in zip(together, alone, strict=True):
            torch.testing.assert_close(both[column], single[0], atol=1e-5, rtol=0)
            assert torch.equal(both[column].argmax(-1), single[0].argmax(-1))


def test_sequences_far_apart_in_the_kv_pool_and_reused_slots() -> None:
    """A forward over sequences spread over the pool (read gathered, not as one view) and over a slot a closed
    sequence left behind (its stale K/V and the never-written positions past it must stay invisible)."""
    loaded = tiny_llama(7)
    runner = KVRunner(loaded.model)
    seqs = [runner.open() for _ in range(9)]
    runner.forward([ForwardItem(seq, [seq % 8] * (1 + seq)) for seq in seqs])  # scratch K/V in every slot
    for seq in seqs[1:8]:
        runner.close(seq)
    first, last, reused = seqs[0], seqs[8], runner.open()  # slots 0, 8 and 1 (the lowest free)
    prompts = {first: [1, 2, 3], last: [4, 5], reused: [6]}
    trees = {first: TokenTree((2, 7, 3), (-1, -1, 0)), last: TokenTree.chain([1, 1]), reused: TokenTree.empty()}
    for order in ([first, last], [reused, first], [last, reused, first]):  # gathered, a view, gathered
        outs = runner.forward([ForwardItem(seq, prompts[seq], trees[seq]) for seq in order])
        for seq, out in zip(order, outs, strict=True):
            check_tree_logits(loaded, prompts[seq], trees[seq], out, atol=1e-5)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_early_exit_equals_truncated_model(num_layers: int) -> None:
    loaded = tiny_llama(4, num_layers=3)
    model, prompt = loaded.model, [1, 5, 2, 7, 3, 3]
    runner = KVRunner(model, num_layers=num_layers)
    seq = runner.open()
    runner.forward([ForwardItem(seq, prompt[:4])])
    runner.commit(seq, 4)
    out = runner.forward([ForwardItem(seq, prompt[4:])], all_logits=True)[0]
    with torch.inference_mode():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[num_layers][0]
        ref = model.lm_head(model.model.norm(hidden))
    torch.testing.assert_close(out, ref[4:], atol=1e-5, rtol=0)


def test_forward_leaves_length_and_uncommitted_scratch_is_overwritten() -> None:
    loaded = tiny_llama(5)
    runner = KVRunner(loaded.model)
    seq = runner.open()
    runner.forward([ForwardItem(seq, [1, 2, 3], TokenTree.chain([4, 4, 4]))])
    assert runner.length(seq) == 0
    runner.forward([ForwardItem(seq, [1, 2, 3], TokenTree((5, 6), (-1, -1)))])  # first forward never committed
    runner.commit(seq, 3, [1])
    out = runner.forward([ForwardItem(seq, [0])], all_logits=True)[0]
    torch.testing.assert_close(out, hf_logits(loaded, [[1, 2, 3, 6, 0]])[0, 4:], atol=1e-5, rtol=0)


def test_tree_off_the_last_committed_token_without_pending() -> None:
    """Pipelined rounds: no pending token, the tree hangs off the last committed one; only node rows come back."""
    loaded = tiny_llama(6)
    runner = KVRunner(loaded.model)
    seq, other = runner.open(), runner.open()
    runner.forward([ForwardItem(seq, [1, 2, 3], TokenTree.chain([4, 5])), ForwardItem(other, [6, 0])])
    runner.commit(seq, 3, [0, 1])  # the whole chain: its leaf 5 has KV, nothing is pending
    runner.commit(other, 2)
    tree = TokenTree((2, 7, 3, 1), (-1, -1, 0, 2))
    out, other_out = runner.forward([ForwardItem(seq, [], tree), ForwardItem(other, [3], TokenTree.chain([1]))])
    assert out.shape == (len(tree), loaded.vocab_size) and other_out.shape == (2, loaded.vocab_size)
    committed = [1, 2, 3, 4, 5]
    full = torch.cat([hf_logits(loaded, [committed])[0, -1:], out])  # the caller holds the root row
    check_tree_logits(loaded, committed, tree, full, atol=1e-5)
    check_tree_logits(loaded, [6, 0, 3], TokenTree.chain([1]), other_out, atol=1e-5)
    runner.commit(seq, 0, [0, 2])  # a branch: nodes 0 and 2 (tokens 2, 3) are kept
    runner.commit(other, 1, [0])
    assert runner.length(seq) == 7
    outs = runner.forward([ForwardItem(seq, [4]), ForwardItem(other, [2])], all_logits=True)
    torch.testing.assert_close(outs[0], hf_logits(loaded, [[1, 2, 3, 4, 5, 2, 3, 4]])[0, 7:], atol=1e-5, rtol=0)
    torch.testing.assert_close(outs[1], hf_logits(loaded, [[6, 0, 3, 1, 2]])[0, 4:], atol=1e-5, rtol=0)
    fresh = runner.open()
    with pytest.raises(InvalidArgumentError, match="pending"):
        runner.forward([ForwardItem(fresh, [], tree)])  # nothing committed to hang off
    with pytest.raises(InvalidArgumentError, match="pending"):
        runner.forward([ForwardItem(seq, [])])  # nothing to run


def test_open_close_and_sizes() -> None:
    runner = KVRunner(tiny_llama(0).model)
    first, second = runner.open(), runner.open()
    assert first != second and runner.num_open == 2 and runner.vocab_size == 8
    runner.close(first)
    assert runner.num_open == 1
    with pytest.raises(InvalidArgumentError, match="not open"):
        runner.length(first)


def test_kv_memory_follows_each_sequences_own_length() -> None:
    """KV lives in capacity classes (powers of two from 16): a long sequence beside short ones does not make theirs
    long; one that outgrows its class moves up with its KV intact; a class is freed with its last sequence."""
    loaded = tiny_llama(8, max_positions=1024)
    runner = KVRunner(loaded.model)
    position = 2 * 2 * 8 * 4 * 2  # bytes of one position: layers x KV heads x head_dim x float32 x (K, V)
    short = [runner.open() for _ in range(5)]
    long = runner.open()
    prompts = {seq: [(seq + i) % 8 for i in range(10)] for seq in short} | {long: [i % 7 for i in range(600)]}
    runner.forward([ForwardItem(seq, prompt) for seq, prompt in prompts.items()])
    for seq, prompt in prompts.items():
        runner.commit(seq, len(prompt))
    assert runner.kv_bytes == (8 * 16 + 4 * 1024) * position  # slots double from 4: 8 of 16 positions, 4 of 1024
    grown = [3, 1, 4, 1, 5, 1, 2, 6, 5, 3]
    out = runner.forward([ForwardItem(short[0], grown), ForwardItem(short[1], [2])], all_logits=True)
    assert runner.kv_bytes == (8 * 16 + 4 * 32 + 4 * 1024) * position  # short[0] moved up to a class of 32
    reference = hf_logits(loaded, [prompts[short[0]] + grown, prompts[short[1]] + [2]])
    torch.testing.assert_close(out[0], reference[0, 10:20], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[1], reference[1, 10:11], atol=1e-5, rtol=0)
    runner.close(long)
    assert runner.kv_bytes == (8 * 16 + 4 * 32) * position
    for seq in short:
        runner.close(seq)
    assert runner.kv_bytes == 0


def test_a_prefill_beside_decodes_does_not_pad_them_to_its_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """Continuous batching puts a prompt's prefill beside one-token decodes: attention must not pad every decode's
    queries to the prompt's length (it once did: 16 x 40 query rows per KV head where 55 are real, 3.6x the time
    of the forward on SmolLM2 at 15 decodes)."""
    loaded = tiny_llama(9)
    runner = KVRunner(loaded.model)
    decoding, context = [runner.open() for _ in range(15)], [1, 2, 3] * 15
    runner.forward([ForwardItem(seq, context) for seq in decoding])
    for seq in decoding:
        runner.commit(seq, len(context))
    prompt, fresh = [seq % 8 for seq in range(40)], runner.open()  # the same capacity class (64) as the decodes
    query_rows = []
    attention = torch.nn.functional.scaled_dot_product_attention

    def counting(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        query_rows.append(query.shape[0] * query.shape[2])  # entries x rows per KV head
        return attention(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    outs = runner.forward([ForwardItem(fresh, prompt)] + [ForwardItem(seq, [4]) for seq in decoding])
    monkeypatch.undo()
    heads_per_kv = 2  # tiny_llama: 4 query heads over 2 KV heads
    assert sum(query_rows) == loaded.model.config.num_hidden_layers * (40 + 15) * heads_per_kv
    torch.testing.assert_close(outs[0], hf_logits(loaded, [prompt])[0, -1:], atol=1e-5, rtol=0)
    torch.testing.assert_close(outs[1], hf_logits(loaded, [[*context, 4]])[0, -1:], atol=1e-5, rtol=0)


def test_capacity_limit() -> None:
    runner = KVRunner(tiny_llama(0).model, max_seq_len=8)
    seq = runner.open()
    runner.forward([ForwardItem(seq, [1] * 6, TokenTree((1, 2, 3), (-1, 0, -1)))])  # deepest position 7
    with pytest.raises(CapacityError):
        runner.forward([ForwardItem(seq, [1] * 6, TokenTree.chain([1, 2, 3]))])
    assert KVRunner(tiny_llama(0).model).max_seq_len == 256


def test_invalid_calls() -> None:
    runner = KVRunner(tiny_llama(0).model)
    seq, other = runner.open(), runner.open()
    with pytest.raises(InvalidArgumentError, match="pending"):
        runner.forward([ForwardItem(seq, [])])
    with pytest.raises(InvalidArgumentError, match="tokens"):
        runner.forward([ForwardItem(seq, [8])])
    with pytest.raises(InvalidArgumentError, match="twice"):
        runner.forward([ForwardItem(seq, [1]), ForwardItem(seq, [2])])
    with pytest.raises(InvalidArgumentError, match="no forward"):
        runner.commit(seq, 1)
    runner.forward([ForwardItem(seq, [1, 2], TokenTree((3, 4, 5), (-1, -1, 0))), ForwardItem(other, [1])])
    with pytest.raises(InvalidArgumentError, match="path"):
        runner.commit(seq, 2, [2])  # node 2 is not a top-level node
    with pytest.raises(InvalidArgumentError, match="path"):
        runner.commit(seq, 1, [0])  # a path needs every pending token
    with pytest.raises(InvalidArgumentError, match="num_pending"):
        runner.commit(seq, 3)
    runner.commit(seq, 2, [0, 2])
    with pytest.raises(InvalidArgumentError, match="no forward"):
        runner.commit(seq, 1)  # a forward is committed at most once
    with pytest.raises(InvalidArgumentError, match="new_length"):
        runner.truncate(seq, 5)


def test_unsupported_architecture() -> None:
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=8))
    with pytest.raises(InvalidArgumentError, match="gpt2"):
        KVRunner(model)


def test_a_cpu_float32_runner_packs_its_weights_and_agrees_with_the_plain_layers() -> None:
    """Packed projections (:mod:`specdec.linear`, the CPU float32 default) against each layer run as torch runs
    it: the same logits up to summation order, over a prefill and a tree on top."""
    target = tiny_llama(seed=3, vocab_size=16)
    packed, plain = KVRunner(target.model), KVRunner(target.model, pack_weights=False)
    assert packed.packed_weights and not plain.packed_weights
    tree = TokenTree((5, 6, 7), (-1, 0, 0))
    outputs = []
    for runner in (packed, plain):
        seq = runner.open()
        runner.forward([ForwardItem(seq, [1, 2, 3, 4])])
        runner.commit(seq, 4)
        outputs.append(runner.forward([ForwardItem(seq, [9], tree)])[0])
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=0)


def test_packing_needs_float32_weights() -> None:
    model = tiny_llama(seed=3).model.to(torch.bfloat16)
    assert not KVRunner(model).packed_weights  # the default packs only where it can
    with pytest.raises(InvalidArgumentError, match="pack_weights"):
        KVRunner(model, pack_weights=True)
