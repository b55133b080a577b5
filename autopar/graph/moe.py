"""Mixture-of-experts layers as a known operation while profiling on the meta device.

Which expert runs which token depends on the router's values, which meta tensors do not have:
HF's expert loops find no expert hit (their FLOPs vanish) and the zoo's per-expert row counts
(``bincount(...).tolist()``) cannot be read. So, like SDPA (``gpu_kernels.py``), the routed
experts are replaced by a stand-in whose shapes do not depend on values, and counted by formula.

Expert modules are recognised by their layout, the one of HF transformers 5's ``*Experts``
modules (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) and of the zoo's ``models/moe.py``: 3-D
parameters ``gate_up_proj[E, 2 f_e, h]`` (or ``[E, f_e, h]`` without a gate) and
``down_proj[E, h, f_e]``, called as ``experts(x[T, h], top_k_index[T, k], top_k_weights[T, k])``.

The stand-in applies one expert's weights to the R dispatched rows: every token repeated for
each of its k experts (R = T k), or, with a capacity factor c > 0, every expert padded to its
capacity ``ceil(c T k / E)`` (R = E ceil(c T k / E), what a capacity-bound grouped GEMM runs).
Per routed row a SwiGLU expert costs ``2 * 3 h f_e`` forward FLOPs (gate, up, down matmuls;
backward 2x), so the routed experts of one MoE layer cost, per sample of s tokens,

    fwd = 2 * R/T * s * P_e          with P_e = 3 h f_e  (an expert's parameters)

which ``FlopCounterMode`` counts on the stand-in's matmuls; what it saves for backward (the
dispatched input, the gate/up outputs, the product fed to the down projection, the expert
outputs) is counted by the saved-tensor recorder like any other tensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autopar.graph.types import MoEStructure

__all__ = ["MoEStructure", "block_moe", "expert_modules", "install_expert_standins"]


def _is_experts(module: nn.Module) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3 and down.dim() == 3 and gate_up.shape[0] == down.shape[0]
    )


def expert_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """(FQN relative to ``root``, module) of every grouped-experts module under ``root``."""
    return [(name, m) for name, m in root.named_modules() if _is_experts(m)]


def _rows(module: Any, tokens: int, top_k: int) -> int:
    experts = module.gate_up_proj.shape[0]
    cf = float(getattr(module, "capacity_factor", 0.0) or 0.0)
    if cf > 0:
        return experts * math.ceil(cf * tokens * top_k / experts)
    return tokens * top_k


def _standin(module: Any):
    act = getattr(module, "act_fn", F.silu)

    def forward(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        tokens, top_k = top_k_index.shape
        rows = _rows(module, tokens, top_k)
        # Static-shape dispatch: row r takes token r % T (values do not matter on meta).
        index = torch.arange(rows, device=x.device) % tokens
        dispatched = x.index_select(0, index)
        gate_up = F.linear(dispatched, module.gate_up_proj[0])
        f_e = module.down_proj.shape[2]
        if gate_up.shape[-1] == 2 * f_e:
            gate, up = gate_up.chunk(2, dim=-1)
            inner = act(gate) * up
        else:
            inner = act(gate_up)
        y = F.linear(inner, module.down_proj[0])
        weights = top_k_weights.reshape(-1).index_select(0, index % (tokens * top_k))
        y = y * weights[:, None].to(y.dtype)
        return torch.zeros_like(x).index_add(0, index, y.to(x.dtype))

    return forward


def install_expert_standins(model: nn.Module) -> int:
    """Replace the forward of every experts module of ``model`` (a private meta copy) by the
    stand-in; return how many were replaced."""
    found = expert_modules(model)
    for _, module in found:
        module.forward = _standin(module)
    return len(found)


def _int_attr(root: nn.Module, names: tuple[str, ...]) -> int:
    for module in root.modules():
        for name in names:
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        config = getattr(module, "config", None)
        value = getattr(config, "num_experts_per_tok", None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _shared_width(block: nn.Module) -> int:
    """Inner width of the block's shared experts (a dense MLP named shared_expert(s))."""
    width = 0
    for name, module in block.named_modules():
        if name.rpartition(".")[2] not in ("shared_expert", "shared_experts"):
            continue
        for leaf in ("w2", "down_proj"):
            down = getattr(module, leaf, None)
            if isinstance(down, nn.Linear):
                width += down.in_features
    return width


def block_moe(block: nn.Module) -> MoEStructure | None:
    """The MoEStructure of a block (its first experts module), or None for a dense block."""
    found = expert_modules(block)
    if not found:
        return None
    experts: Any = found[0][1]  # HF grouped experts: gate_up_proj, down_proj parameters
    num, hidden, f_e = experts.down_proj.shape
    per_expert = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel())
    top_k = _int_attr(block, ("top_k", "num_experts_per_tok"))
    return MoEStructure(
        experts=int(num),
        top_k=top_k,
        shared_experts=round(_shared_width(block) / f_e) if f_e else 0,
        hidden=int(hidden),
        expert_hidden=int(f_e),
        expert_params=int(per_expert),
        capacity_factor=float(getattr(experts, "capacity_factor", 0.0) or 0.0),
    )
