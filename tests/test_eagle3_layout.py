"""EAGLE-3 checkpoints are vLLM's: what ``specdec distill`` saves is what vLLM's ``Eagle3LlamaForCausalLM`` loads
and computes, and EAGLE-3 heads in that layout from elsewhere (other options, SpecForge's ``midlayer.`` names)
load and draft here.

:func:`vllm_eagle3_logits` reads the saved ``config.json`` and ``model.safetensors`` by name and shape and computes
the draft logits as vLLM 0.33's ``llama_eagle3.py`` does (``combine_hidden_states``, the first layer over
``[input_layernorm(embed), hidden_norm(x)]``, the final norm, ``d2t``), written here from that description with
plain tensor operations; it shares no code with :mod:`specdec.drafters.eagle_head`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.drafters import DraftConfig, EagleDrafter
from specdec.drafters.eagle_head import Eagle3Options, EagleHead, HeadInfo, load_head, save_head
from specdec.errors import InvalidArgumentError
from specdec.models import LoadedModel
from specdec.runner import ForwardItem, KVRunner
from specdec.sampling import SamplingParams, make_generator
from tests.tiny_models import tiny_llama

VOCAB = 16
FUSED = (0, 1)
TEXT = [1, 5, 3, 9, 2, 7, 7, 4, 11, 6, 3, 8]
DRAFT_VOCAB = torch.tensor([0, 2, 3, 5, 8, 9, 13, 15])


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=7, vocab_size=VOCAB, num_layers=2)


def trained_looking_head(target: LoadedModel, options: Eagle3Options, seed: int = 0) -> EagleHead:
    """A fused head with every weight perturbed (norm weights away from 1 too), so no option is a no-op."""
    head = EagleHead(
        EagleHead.from_target(target.model, DRAFT_VOCAB, feature_layers=FUSED).layer_config,
        DRAFT_VOCAB,
        VOCAB,
        FUSED,
        options,
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            noise = 0.3 * torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1.0 + noise if "norm" in name else parameter + noise / parameter.shape[-1] ** 0.5)
    return head.eval().requires_grad_(False)


def raw_layer_rows(target: LoadedModel, layers: list[int]) -> torch.Tensor:
    """vLLM's auxiliary hidden states ``layers`` of TEXT: Hugging Face's ``hidden_states[k]`` (raw, before any
    norm; the last decoder layer's output is taken before the final norm), side by side [T, len * H]."""
    captured = []
    hooks = [
        layer.register_forward_hook(lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out))
        for layer in target.model.model.layers
    ]
    try:
        with torch.no_grad():
            target.model(torch.tensor([TEXT]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat([captured[k - 1][0] for k in layers], dim=-1)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def vllm_eagle3_logits(directory: Path, tokens: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Target-vocabulary logits [T, V] (-inf off the draft vocabulary) that vLLM's EAGLE-3 drafter computes from
    the checkpoint in ``directory`` for ``tokens`` [T] at positions ``1 .. T``, each row reading ``aux`` [T, n * H],
    the auxiliary rows of the position before; causal attention over the rows (one head layer)."""
    config = json.loads((directory / "config.json").read_text())
    w = load_file(str(directory / "model.safetensors"))
    layer = config["transformer_layer_config"]
    eps, hidden = layer["rms_norm_eps"], layer["hidden_size"]
    heads, kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
    head_dim = layer.get("head_dim") or hidden // heads
    if config.get("norm_before_fc", False):
        aux = _rms(aux, w["input_norm.weight"], eps)
    if config.get("fc_norm", False):
        blocks = aux.split(hidden, dim=-1)
        aux = torch.cat([_rms(b, w[f"fc_norm.{i}.weight"], eps) for i, b in enumerate(blocks)], dim=-1)
    x = aux @ w["fc.weight"].T
    embeds = w["embed_tokens.weight"][tokens]
    normed = _rms(x, w["layers.0.hidden_norm.weight"], eps)
    residual = normed if config.get("norm_before_residual", True) else x
    attention_input = torch.cat([_rms(embeds, w["layers.0.input_layernorm.weight"], eps), normed], dim=-1)
    length = len(tokens)
    q = (attention_input @ w["layers.0.self_attn.q_proj.weight"].T).view(length, heads, head_dim)
    k = (attention_input @ w["layers.0.self_attn.k_proj.weight"].T).view(length, kv_heads, head_dim)
    v = (attention_input @ w["layers.0.self_attn.v_proj.weight"].T).view(length, kv_heads, head_dim)
    inv_freq = 1.0 / layer.get("rope_theta", 10000.0) ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(1, length + 1).float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]

    def rope(t: torch.Tensor) -> torch.Tensor:
        half = head_dim // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim**0.5
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(length, heads * head_dim)
    residual = residual + attended @ w["layers.0.self_attn.o_proj.weight"].T
    mlp_in = _rms(residual, w["layers.0.post_attention_layernorm.weight"], eps)
    gate = torch.nn.functional.silu(mlp_in @ w["layers.0.mlp.gate_proj.weight"].T)
    residual = residual + (gate * (mlp_in @ w["layers.0.mlp.up_proj.weight"].T)) @ w["layers.0.mlp.down_proj.weight"].T
    draft_logits = _rms(residual, w["norm.weight"], eps) @ w["lm_head.weight"].T
    full = torch.full((length, layer["vocab_size"]), float("-inf"))
    full[:, torch.arange(config["draft_vocab_size"]) + w["d2t"]] = draft_logits
    return full


OPTIONS = {
    "specdec": Eagle3Options(),
    "plain": Eagle3Options(fc_norm=False, norm_before_residual=False),
    "norm-before-fc": Eagle3Options(fc_norm=False, norm_before_fc=True),
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_a_saved_eagle3_head_computes_what_vllm_computes_from_it(
    target: LoadedModel, tmp_path: Path, options: Eagle3Options
) -> None:
    head = trained_looking_head(target, options)
    save_head(head, tmp_path, HeadInfo(verifier=target.name, num_draft_tokens=3))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2]  # vLLM counts the embedding output as 0
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert (config["draft_vocab_size"], config["target_hidden_size"]) == (len(DRAFT_VOCAB), 32)
    aux = raw_layer_rows(target, config["eagle_aux_hidden_state_layer_ids"])
    runner = KVRunner(target.model)
    _, (rows,) = runner.forward_features([ForwardItem(runner.open(), TEXT)], FUSED)
    torch.testing.assert_close(rows, aux, atol=1e-5, rtol=1e-5)  # the verifier sends vLLM's rows
    tokens = torch.tensor(TEXT[1:])
    expected = vllm_eagle3_logits(tmp_path, tokens, aux[:-1])
    loaded, _ = load_head(tmp_path, hidden_size=32, vocab_size=VOCAB)
    causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
    with torch.no_grad():
        states = loaded.forward_rows(
            tokens[None],
            loaded.project(rows[:-1])[None],
            torch.arange(1, len(TEXT))[None],
            lambda _i, q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, causal, enable_gqa=True),
        )
        ours = torch.full_like(expected, float("-inf"))
        ours[:, loaded.draft_to_target] = loaded.logits(states[0])
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_a_speculators_head_with_specforge_names_and_vllm_defaults_drafts_as_saved(
    target: LoadedModel, tmp_path: Path
) -> None:
    """``midlayer.*`` weights and a config without the option fields (vLLM's defaults: only
    ``norm_before_residual``) load as the head that was saved; proposals are identical."""
    head = trained_looking_head(target, Eagle3Options(fc_norm=False), seed=1)
    save_head(head, tmp_path / "ours", HeadInfo(verifier=target.name, num_draft_tokens=3))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    for name in ("fc_norm", "norm_before_fc", "norm_before_residual", "norm_output"):
        config.pop(name)
    (foreign / "config.json").write_text(json.dumps(config))
    weights = load_file(str(tmp_path / "ours" / "model.safetensors"))
    save_file({name.replace("layers.0.", "midlayer."): t for name, t in weights.items()}, foreign / "model.safetensors")
    runner = KVRunner(target.model)
    _, (rows,) = runner.forward_features([ForwardItem(runner.open(), TEXT)], FUSED)
    proposals = []
    for directory in (tmp_path / "ours", foreign):
        drafter = EagleDrafter.load(
            directory, DraftConfig(num_draft_tokens=3, draft_top_k=0), hidden_size=32, vocab_size=VOCAB
        )
        handle = drafter.open(TEXT[:9], SamplingParams(temperature=1.0), make_generator(5))
        drafter.add_features(handle, 0, rows[:8])
        proposals.append(drafter.propose([handle], [8])[0])
    assert proposals[0].tree == proposals[1].tree and len(proposals[0].tree) == 3
    assert torch.equal(proposals[0].draft_probs, proposals[1].draft_probs)


def test_an_eagle3_head_that_reads_the_embedding_output_is_refused_in_one_line(
    target: LoadedModel, tmp_path: Path
) -> None:
    save_head(trained_looking_head(target, Eagle3Options()), tmp_path, HeadInfo(target.name, 3))
    config = json.loads((tmp_path / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 2]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgumentError, match=r"^draft_model: .*eagle_aux_hidden_state_layer_ids"):
        load_head(tmp_path)
