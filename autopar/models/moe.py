"""Mixture-of-experts feed-forward for the zoo's llama blocks (Mixtral / DeepSeek-MoE style).

``MoE``: a top-k softmax router (``router.gate``, a bias-free linear h -> E), ``experts`` (E
SwiGLU experts of inner width f_e stored as 3-D tensors in the layout of HF transformers 5's
``*Experts`` modules: ``gate_up_proj[E, 2 f_e, h]``, ``down_proj[E, h, f_e]``, so one profiler
stand-in serves the zoo and HF alike), and optionally ``shared_experts`` (a dense SwiGLU of inner
width ``shared * f_e`` that every token passes through, DeepSeekMoE, Dai et al. 2024).

Routing (Mixtral, Jiang et al. 2024, section 2.1): softmax over the E router logits, keep the top
k, renormalise them to sum to 1; the output is ``sum_k w_k expert_k(x)`` (+ shared(x)).
With ``capacity_factor`` c > 0 each expert takes at most ``ceil(c * T * k / E)`` of the T * k
token assignments of a batch (first come, first served in token order, Switch Transformer, Fedus
et al. 2022, section 2.2); the assignments beyond it are dropped (their weight contributes 0).
c = 0: dropless (every assignment is computed).

Parameters of one MoE feed-forward: router ``E h``, routed experts ``E * 3 h f_e``, shared
experts ``3 h (shared f_e)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Experts", "MoE", "TopKRouter", "expert_capacity"]


def expert_capacity(tokens: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """Token assignments one expert may take: ``ceil(c * T * k / E)`` (0 if c is 0: no limit)."""
    if capacity_factor <= 0:
        return 0
    return math.ceil(capacity_factor * tokens * top_k / experts)


class TopKRouter(nn.Module):
    """Softmax router: ``(weights[T, k], indices[T, k])`` of each token's top-k experts."""

    def __init__(self, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``x[T, h]``; the weights are renormalised over the top k (sum to 1)."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), indices


class Experts(nn.Module):
    """E SwiGLU experts as 3-D tensors: ``down(silu(gate(x)) * up(x))`` for each routed token.

    Args:
        hidden: model width h.
        expert_hidden: inner width f_e of one expert.
        experts: number of experts E.
        capacity_factor: c (see the module docstring); 0 is dropless.
    """

    def __init__(
        self, hidden: int, expert_hidden: int, experts: int, capacity_factor: float = 0.0
    ) -> None:
        super().__init__()
        self.num_experts = experts
        self.capacity_factor = capacity_factor
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * expert_hidden, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, expert_hidden))

    def expert_forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index`` (of this module's local experts) on tokens ``x[n, h]``."""
        gate, up = F.linear(x, self.gate_up_proj[index].to(x.dtype)).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[index].to(x.dtype))

    def run_sorted(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each local expert on its contiguous slice of ``rows`` (sorted by expert, ``counts``
        rows each), the outputs in the same order."""
        pieces = [self.expert_forward(e, part)
                  for e, part in enumerate(rows.split(counts)) if part.shape[0]]
        return torch.cat(pieces) if pieces else rows[:0]

    def forward(
        self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``sum_k w_k expert_k(x)`` for ``x[T, h]``, indices and weights ``[T, k]``.

        The T k assignments are sorted by expert once (stable: token order within an expert,
        which is the order the capacity keeps) and gathered once; each expert runs on its
        contiguous slice and the weighted results are summed into the tokens by one
        ``index_add``, in expert order per token as a loop over experts would add them.
        """
        top_k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        capacity = expert_capacity(x.shape[0], top_k, self.num_experts, self.capacity_factor)
        if capacity:  # keep each expert's first ``capacity`` assignments in token order
            kept = [part[:capacity] for part in order.split(counts)]
            counts = [min(n, capacity) for n in counts]
            order = torch.cat(kept)
        token = order // top_k
        y = self.run_sorted(x.index_select(0, token), counts)
        y = y * top_k_weights.reshape(-1).index_select(0, order)[:, None]
        return torch.zeros_like(x).index_add(0, token, y.to(x.dtype))


class MoE(nn.Module):
    """The MoE feed-forward: ``[b, s, h] -> [b, s, h]`` (see the module docstring).

    Args:
        hidden: model width h.
        expert_hidden: inner width f_e of one routed expert.
        experts: routed experts E.
        top_k: experts per token k.
        shared_experts: shared experts (their combined inner width is ``shared * f_e``).
        capacity_factor: c; 0 is dropless.
        router_imbalance: the busiest expert-parallel rank's routed rows over the average
            (ModelSpec.router_imbalance; 0: unknown). The forward does not use it: the
            profiler reads it as the cost model's input (graph/moe_structure.py ``block_moe``).
    """

    def __init__(
        self,
        hidden: int,
        expert_hidden: int,
        experts: int,
        top_k: int,
        shared_experts: int = 0,
        capacity_factor: float = 0.0,
        router_imbalance: float = 0.0,
    ) -> None:
        super().__init__()
        from autopar.models.llama import SwiGLU  # llama imports this module

        self.top_k = top_k
        self.router_imbalance = router_imbalance
        self.router = TopKRouter(hidden, experts, top_k)
        self.experts = Experts(hidden, expert_hidden, experts, capacity_factor)
        self.shared_experts = (
            SwiGLU(hidden, shared_experts * expert_hidden) if shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the routed (and shared) experts to ``x[b, s, h]``."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.router(flat)
        out = self.experts(flat, indices, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(shape)
