"""Linear layers for inference: the layers that read the same input as one matrix multiply, prepacked for
oneDNN on CPU.

Why: in float32 on CPU, torch's default BLAS (MKL) multiplies a few rows slowly and unevenly. On this project's
2-core machine SmolLM2's 49 152-row LM head took 12 ms for one row, 25-38 ms for two or three and 20 ms for five,
so verifying a draft cost up to 1.7x a plain decoding step. oneDNN over a weight reordered once into its blocked
layout took 4-5 ms for one to nine rows alike; there, each row's result was also bit for bit the same whatever
other rows shared the call (MKL's was not).
(``python -m bench.forward_cost --kernels packed,plain`` measures the whole forward.)

Elsewhere (GPUs, other dtypes) the modules run as they are: no copy of their weights is made.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TypeVar

import torch
from torch import nn

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def can_pack(module: nn.Linear) -> bool:
    """Whether ``module`` can run as a packed :class:`Projection`: float32 weights in a plain CPU tensor (not a
    tensor-parallel shard), no hooks on it (tensor parallelism's all-reduce is one), and oneDNN in this torch."""
    weight = module.weight
    return (
        type(weight.data) is torch.Tensor
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and not (module._forward_hooks or module._forward_pre_hooks)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
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


def packed_for_inference(module: ModuleT) -> ModuleT:
    """A copy of ``module`` whose linear layers :func:`can_pack` are :class:`PackedLinear` ones; every other
    parameter and buffer is shared with ``module``, not copied. Training ``module`` later does not reach it."""
    duplicate = copy.copy(module)  # shares the parameter and buffer dicts, which nothing below changes
    duplicate._modules = {name: _packed(child) for name, child in module._modules.items()}
    return duplicate


def _packed(module: nn.Module | None) -> nn.Module | None:
    if isinstance(module, nn.Linear):
        return PackedLinear(module) if can_pack(module) else module
    return None if module is None else packed_for_inference(module)
