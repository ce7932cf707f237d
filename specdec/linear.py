"""Linear layers for inference: the layers that read the same input as one matrix multiply, prepacked for
oneDNN on CPU.

Why: in float32 on CPU, torch's default BLAS (MKL) multiplies a few rows slowly and unevenly. On this project's
2-core machine SmolLM2's 49 152-row LM head took 12 ms for one row, 25-38 ms for two or three and 20 ms for five,
so verifying a draft cost up to 1.7x a plain decoding step. oneDNN over a weight reordered once into its blocked
layout took 4-5 ms for one to nine rows alike; there, each row's result was also bit for bit the same whatever
other rows shared the call (MKL's was not).
(``python -m bench.forward_cost --kernels packed,plain`` measures the whole forward.)

Elsewhere (GPUs, other dtypes) the modules run as they are: no copy of their weights is made.

A draft may go further: :class:`Int8Linear` runs a layer over int8 weights with its input quantized per call
(dynamic quantization). Only a drafter's layers may: a draft's ``q`` is whatever distribution it computed and
sampled from, so a coarser draft changes acceptance, never the output law (DESIGN §3). The target's never are: its
``p`` is the law itself.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Collection, Sequence
from typing import TypeVar

import torch
from torch import nn

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def _plain_cpu_float32(module: nn.Linear) -> bool:
    """Float32 weights in a plain CPU tensor (not a tensor-parallel shard) and no hooks on the module (tensor
    parallelism's all-reduce is one): what a copy of its weights for another kernel may stand in for."""
    weight = module.weight
    return (
        type(weight.data) is torch.Tensor
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and not (module._forward_hooks or module._forward_pre_hooks)
    )


def can_pack(module: nn.Linear) -> bool:
    """Whether ``module`` can run as a packed :class:`Projection`: :func:`_plain_cpu_float32`, and oneDNN in this
    torch."""
    return (
        _plain_cpu_float32(module)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def can_quantize(module: nn.Linear) -> bool:
    """Whether ``module`` can run as an :class:`Int8Linear`: :func:`_plain_cpu_float32`, and torch's quantized engine
    for x86 CPUs (fbgemm / oneDNN) with its dynamic linear kernel in this torch."""
    return (
        _plain_cpu_float32(module)
        and torch.backends.quantized.engine in ("x86", "fbgemm")
        and hasattr(torch.ops.quantized, "linear_dynamic")
    )


class Projection:
    """The outputs of ``modules`` (linear layers reading the same input), as a tuple in their order.

    Packed, their weights are copied once, concatenated and reordered, when the projection is made: later
    changes to the modules' weights do not reach it. Unpacked, each module runs itself.
    """

    def __init__(self, modules: Sequence[nn.Linear], *, pack: bool) -> None:
        if not modules or len({module.in_features for module in modules}) != 1:
            raise ValueError("a projection needs linear layers of one input width")
        self._modules = tuple(modules)
        self._sizes = [module.out_features for module in modules]
        self.packed = pack
        if not pack:
            return
        with torch.no_grad():
            weight = torch.cat([module.weight for module in modules]).detach()
            self._weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            biases = [
                weight.new_zeros(module.out_features) if module.bias is None else module.bias.detach()
                for module in modules
            ]
            self._bias = None if all(module.bias is None for module in modules) else torch.cat(biases)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.packed:
            return tuple(module(x) for module in self._modules)
        out = torch.ops.mkldnn._linear_pointwise(x, self._weight, self._bias, "none", [], "")
        return out.split(self._sizes, dim=-1) if len(self._sizes) > 1 else (out,)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` for inference over a packed copy of its weight (``weight`` still names the original)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features, self.weight = linear.in_features, linear.out_features, linear.weight
        self._projection = Projection([linear], pack=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._projection(x)[0]


class Int8Linear(nn.Module):
    """An ``nn.Linear`` for inference over an int8 copy of its weight (symmetric, one scale per output row), its
    input quantized to 8 bits per call with the range of that call's rows (``weight`` still names the original).

    Why: a draft head's layers read one or a few rows per call, so they cost what reading their weights costs; int8
    weights are a quarter of float32's. On this project's 2-core CPU the EAGLE head's 8 192-row LM head took 0.07 ms
    for one row against 0.34 ms packed in float32. What it costs: on SmolLM2's own final-norm rows, whose largest
    value is ~12x their RMS, the LM head's argmax agreed with float32's on 97 % of rows.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features, self.weight = linear.in_features, linear.out_features, linear.weight
        with torch.no_grad():
            weight = linear.weight.detach()
            scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).double()
            zero_points = torch.zeros(self.out_features, dtype=torch.long)
            with warnings.catch_warnings():  # torch 2.13 warns that quantized tensors will go: can_quantize checks
                warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
                quantized = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
            bias = None if linear.bias is None else linear.bias.detach()
            self._packed = torch.ops.quantized.linear_prepack(quantized, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the full 8-bit input range (reduce_range=False): where the CPU's int8 dot products can saturate (no VNNI)
        # the rounding is coarser, still the draft's own q
        return torch.ops.quantized.linear_dynamic(x, self._packed, False)


def packed_for_inference(module: ModuleT, int8_children: Collection[str] = ()) -> ModuleT:
    """A copy of ``module`` whose linear layers :func:`can_pack` are :class:`PackedLinear` ones, and those under
    the children named in ``int8_children`` that :func:`can_quantize` :class:`Int8Linear` ones; every other
    parameter and buffer is shared with ``module``, not copied. Training ``module`` later does not reach it."""
    duplicate = copy.copy(module)  # shares the parameter and buffer dicts, which nothing below changes
    duplicate._modules = {name: _packed(child, int8=name in int8_children) for name, child in module._modules.items()}
    return duplicate


def _packed(module: nn.Module | None, *, int8: bool) -> nn.Module | None:
    if isinstance(module, nn.Linear):
        if int8 and can_quantize(module):
            return Int8Linear(module)
        return PackedLinear(module) if can_pack(module) else module
    if module is None:
        return None
    return packed_for_inference(module, int8_children=module._modules.keys() if int8 else ())
