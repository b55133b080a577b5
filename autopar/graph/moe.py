"""Mixture-of-experts layers as a known operation while profiling on the meta device.

Which expert runs which token depends on the router's values, which meta tensors do not have:
HF's expert loops find no expert hit (their FLOPs vanish) and the zoo's per-expert row counts
(``bincount(...).tolist()``) cannot be read. So, like SDPA (``gpu_kernels.py``), the routed
experts are replaced by a stand-in whose shapes do not depend on values, and counted by formula.

Expert modules are recognised by the layouts transformers 5 and the zoo store them in
(``expert_weights``), E experts of width h and inner width f_e:

- stacked ``[E, out, in]`` (Mixtral, Qwen2/3-MoE, DeepSeek-V3, OLMoE, Jamba, most families,
  and the zoo's ``models/moe.py``): ``gate_up_proj[E, 2 f_e, h]`` (``up_proj[E, f_e, h]``
  without a gate: Nemotron-H) and ``down_proj[E, h, f_e]``;
- stacked ``[E, in, out]`` (gpt-oss, Llama 4, Aria): ``gate_up_proj[E, h, 2 f_e]`` and
  ``down_proj[E, f_e, h]``, with optional ``gate_up_proj_bias`` / ``down_proj_bias`` (gpt-oss);
- DBRX: an ``mlp`` holding ``w1``, ``v1`` (gate, up) and ``w2`` as ``[E f_e, h]`` matrices.

A gated ``[E, in, out]`` module is told from an ``[E, out, in]`` one by which dimension the two
tensors share; an ungated module whose shapes fit both reads as ``[E, out, in]``.

autopar's runtime shards experts over ep ranks where it can run them itself (``ep_blocker``: ""),
one expert at a time with ``run_expert``: every layout above (the stacked ones with their
biases; DBRX's expert e is rows ``e f_e .. (e+1) f_e`` of each matrix, ``expert_params``),
every parameter per expert, dropless, gated by the module's own ``_apply_gate`` (transformers
5) or ``act(gate) * up``; and only where the module's own forward, run once on small random
weights of the same layout (``_probe``), gives what ``run_expert`` gives: a family whose
experts compute anything else is refused, not run differently. Experts called on rows already
routed to every expert (``routed_rows``: Llama 4, below) run only the rows the router picked,
the others being zero rows whose result is zero (``_probe_routed`` checks that too).

They are called as ``experts(x[T, h], top_k_index[T, k], top_k_weights[T, k])``, or, in
Llama 4, on rows already repeated per expert and weighted by the router,
``experts(x[E T, h])`` (transformers runs every expert on every token there; a training
framework runs the k the router picks, as the stand-in counts).

The stand-in applies one expert's weights to the R dispatched rows: every token repeated for
each of its k experts (R = T k), or, with a capacity factor c > 0, every expert padded to its
capacity ``ceil(c T k / E)`` (R = E ceil(c T k / E), what a capacity-bound grouped GEMM runs).
Per routed row a SwiGLU expert costs ``2 * 3 h f_e`` forward FLOPs (gate, up, down matmuls;
backward 2x), so the routed experts of one MoE layer cost, per sample of s tokens,

    fwd = 2 * R/T * s * P_e          with P_e = 3 h f_e  (an expert's parameters)

which ``FlopCounterMode`` counts on the stand-in's matmuls; what it saves for backward (the
dispatched input, the gate/up outputs, the product fed to the down projection, the expert
outputs) is counted by the saved-tensor recorder like any other tensor. The gate's activation
is the module's own (``act_fn``; SiLU where the module's is not a plain function, as gpt-oss's
clamped sigmoid gate).
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GLU_MATRICES", "ExpertWeights", "ep_blocker", "expert_activation",
           "expert_modules", "expert_params", "expert_weights", "install_expert_standins",
           "local_experts", "modules_ep_blocker", "routed_rows", "routed_top_k", "run_expert",
           "run_sorted", "stacked_names"]


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """The first expert of an experts module, as ``F.linear`` takes its weights.

    Attributes:
        experts: routed experts E.
        hidden: model width h.
        inner: inner width f_e.
        gated: whether the expert is gated (SwiGLU-like).
        ins: the input projections ``[out, h]``: one (gate and up fused, or up alone) or two
            (gate, up).
        in_biases: their biases (None where absent).
        down: the output projection ``[h, f_e]``.
        down_bias: its bias (None where absent).
        layout: "out-in" (stacked ``[E, out, in]``), "in-out" (stacked ``[E, in, out]``) or
            "matrices" (DBRX's ``[E f_e, h]``).
    """

    experts: int
    hidden: int
    inner: int
    gated: bool
    ins: tuple[torch.Tensor, ...]
    in_biases: tuple[torch.Tensor | None, ...]
    down: torch.Tensor
    down_bias: torch.Tensor | None
    layout: str = "out-in"

    @property
    def params(self) -> int:
        """Parameters of one expert (weights and biases)."""
        tensors = [*self.ins, *self.in_biases, self.down, self.down_bias]
        return sum(t.numel() for t in tensors if t is not None)


def _tensor(module: Any, name: str, dims: int) -> torch.Tensor | None:
    value = getattr(module, name, None)
    return value if isinstance(value, torch.Tensor) and value.dim() == dims else None


def stacked_names(module: nn.Module) -> tuple[str, str]:
    """The names of a stacked experts module's input and output tensors: ("gate_up_proj", or
    "up_proj" without a gate, "down_proj")."""
    fused = _tensor(module, "gate_up_proj", 3) is not None
    return ("gate_up_proj" if fused else "up_proj", "down_proj")


def _stacked(module: nn.Module) -> ExpertWeights | None:
    up, down = (_tensor(module, name, 3) for name in stacked_names(module))
    if up is None or down is None or up.shape[0] != down.shape[0] or up.shape[0] == 0:
        return None
    if up.shape[2] == down.shape[1] and up.shape[1] in (down.shape[2], 2 * down.shape[2]):
        w_in, w_down, layout = up[0], down[0], "out-in"
    elif up.shape[1] == down.shape[2] and up.shape[2] in (down.shape[1], 2 * down.shape[1]):
        w_in, w_down, layout = up[0].T, down[0].T, "in-out"
    else:
        return None
    bias_in, bias_down = _tensor(module, "gate_up_proj_bias", 2), _tensor(
        module, "down_proj_bias", 2)
    hidden, inner = w_down.shape
    return ExpertWeights(
        experts=int(up.shape[0]), hidden=int(hidden), inner=int(inner),
        gated=w_in.shape[0] == 2 * inner, ins=(w_in,),
        in_biases=(None if bias_in is None else bias_in[0],), down=w_down,
        down_bias=None if bias_down is None else bias_down[0], layout=layout)


GLU_MATRICES = ("w1", "v1", "w2")  # DBRX's gate, up and down matrices, [E f_e, h] each


def _glu_mlp(module: nn.Module) -> ExpertWeights | None:
    mlp, experts = getattr(module, "mlp", None), getattr(module, "num_experts", None)
    weights = [_tensor(mlp, name, 2) for name in GLU_MATRICES]
    if not isinstance(experts, int) or experts <= 0 or any(w is None for w in weights):
        return None
    w1, v1, w2 = (w for w in weights if w is not None)
    # The module's own inner width where it says (DBRX's ffn_hidden_size): the experts are then
    # the rows it holds, also once sharded over ep; else num_experts.
    inner = getattr(module, "ffn_hidden_size", None)
    if isinstance(inner, int) and inner > 0 and w1.shape[0] % inner == 0:
        experts = w1.shape[0] // inner
    if not (w1.shape == v1.shape == w2.shape and w1.shape[0] % experts == 0):
        return None
    inner, hidden = w1.shape[0] // experts, w1.shape[1]
    first = [w.view(experts, inner, hidden)[0] for w in (w1, v1, w2)]
    return ExpertWeights(experts=experts, hidden=int(hidden), inner=int(inner), gated=True,
                         ins=(first[0], first[1]), in_biases=(None, None), down=first[2].T,
                         down_bias=None, layout="matrices")


def expert_weights(module: nn.Module) -> ExpertWeights | None:
    """The first expert of ``module`` if it is a grouped-experts module (module docstring's
    layouts), else None."""
    return _stacked(module) or _glu_mlp(module)


def expert_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """(FQN relative to ``root``, module) of every grouped-experts module under ``root``."""
    return [(name, m) for name, m in root.named_modules() if expert_weights(m) is not None]


def _rows(module: Any, experts: int, tokens: int, top_k: int) -> int:
    cf = float(getattr(module, "capacity_factor", 0.0) or 0.0)
    if cf > 0:
        return experts * math.ceil(cf * tokens * top_k / experts)
    return tokens * top_k


def expert_activation(module: nn.Module):
    """The experts' activation: the module's own ``act_fn`` / ``activation_fn``, else SiLU."""
    for owner in (module, getattr(module, "mlp", None)):
        for name in ("act_fn", "activation_fn"):
            act = getattr(owner, name, None)
            if callable(act):
                return act
    return F.silu


def expert_params(module: nn.Module) -> tuple[nn.Module, tuple[str, ...], int]:
    """Where an experts module (``ep_blocker`` "") keeps its per-expert tensors, each holding
    its experts along dim 0: (the module holding them, their names, rows per expert). Stacked
    layouts: the module's own parameters (weights and biases), one row an expert; DBRX: its
    ``mlp``'s three matrices, ``f_e`` rows an expert."""
    w = _weights(module)
    if w.layout == "matrices":
        return module.get_submodule("mlp"), GLU_MATRICES, w.inner
    return module, tuple(n for n, _p in module.named_parameters(recurse=False)), 1


def local_experts(module: nn.Module) -> int:
    """The experts ``module`` holds (all E, or E / ep once sharded over ep)."""
    return _weights(module).experts


def _matrices_expert(module: nn.Module, index: int, x: torch.Tensor, rows: int) -> torch.Tensor:
    """DBRX's expert ``index``: ``(act(x w1_e^T) * x v1_e^T) w2_e`` on rows ``rows`` (f_e)
    apart."""
    mlp = module.get_submodule("mlp")
    w1, v1, w2 = (getattr(mlp, n)[index * rows:(index + 1) * rows].to(x.dtype)
                  for n in GLU_MATRICES)
    return F.linear(expert_activation(module)(F.linear(x, w1)) * F.linear(x, v1), w2.T)


def run_expert(module: nn.Module, index: int, x: torch.Tensor,
               weights: ExpertWeights | None = None) -> torch.Tensor:
    """Expert ``index`` of an experts module (``ep_blocker`` "") on its rows ``x[n, h]``:
    ``down(gate(up(x)))`` with the module's biases where it has them, the gate the module's own
    ``_apply_gate`` where it has one (transformers 5: gpt-oss's clamped, interleaved SwiGLU),
    else ``act(gate) * up`` (``act(up)`` ungated). ``weights``: ``expert_weights(module)``
    (read when not given; a caller running every expert reads it once)."""
    w = weights or _weights(module)
    layout = w.layout
    if layout == "matrices":
        return _matrices_expert(module, index, x, w.inner)
    names = stacked_names(module)
    w_in, w_down = (getattr(module, n)[index].to(x.dtype) for n in names)
    if layout == "in-out":  # to F.linear's [out, in]
        w_in, w_down = w_in.T, w_down.T
    b_in, b_down = (_bias(module, n, index, x.dtype) for n in names)
    h = F.linear(x, w_in, b_in)
    own_gate = getattr(module, "_apply_gate", None)
    if h.shape[-1] != 2 * w_down.shape[-1]:
        inner = expert_activation(module)(h)
    elif callable(own_gate):
        inner = own_gate(h)
    else:
        gate, up = h.chunk(2, dim=-1)
        inner = expert_activation(module)(gate) * up
    return F.linear(inner, w_down, b_down)


def _weights(module: nn.Module) -> ExpertWeights:
    w = expert_weights(module)
    assert w is not None  # an experts module
    return w


def _bias(module: nn.Module, name: str, index: int, dtype: torch.dtype) -> torch.Tensor | None:
    bias = _tensor(module, f"{name}_bias", 2)
    return None if bias is None else bias[index].to(dtype)


def run_sorted(module: nn.Module, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each of the module's experts on its contiguous slice of ``rows`` (sorted by expert,
    ``counts`` rows each), the outputs in the same order."""
    w = _weights(module)
    pieces = [run_expert(module, e, part, w)
              for e, part in enumerate(rows.split(counts)) if part.shape[0]]
    return torch.cat(pieces) if pieces else rows[:0]


def modules_ep_blocker(modules: list[nn.Module]) -> str:
    """The first reason any of these experts modules cannot be sharded over ep ("" if none)."""
    return next((r for r in map(ep_blocker, modules) if r), "")


def ep_blocker(module: nn.Module) -> str:
    """Why autopar's runtime cannot run this experts module's experts one at a time with
    ``run_expert`` (and so cannot shard them over ep), or "" when it can (module docstring)."""
    w = expert_weights(module)
    name = type(module).__name__
    if w is None:
        return f"{name} is not a grouped-experts module"
    if w.layout == "matrices":
        shared = [n for n, _p in module.named_parameters()
                  if n not in {f"mlp.{m}" for m in GLU_MATRICES}]
    else:
        shared = [n for n, p in module.named_parameters(recurse=False)
                  if p.dim() == 0 or p.shape[0] != w.experts]
    if shared:
        return f"{name} holds {shared[0]!r}, shared by its experts"
    if float(getattr(module, "capacity_factor", 0.0) or 0.0) > 0:
        return f"{name} drops the tokens over its experts' capacity"
    return _probe_routed(module, w) if routed_rows(module) else _probe(module, w)


def routed_rows(module: nn.Module) -> bool:
    """Whether an experts module is called on rows already routed to every expert,
    ``experts(x[E T, h])`` (Llama 4: expert e's block is every token scaled by its router
    weight, 0 where the router did not pick e), not with the router's choices."""
    return len(inspect.signature(type(module).forward).parameters) < 4


_PROBE_WIDTH = 4  # the probe's widths and experts (small: the check is on the math)


def _probe_copy(module: nn.Module, w: ExpertWeights, gen: torch.Generator) -> nn.Module:
    """A copy of ``module`` holding small random weights of its layout (all E experts, inner
    and model width ``_PROBE_WIDTH``), its own weights untouched."""
    def param(*shape: int) -> nn.Parameter:
        return nn.Parameter(torch.randn(shape, generator=gen), requires_grad=False)

    probe = copy.copy(module)  # its own parameter table: the module's weights are not copied
    probe._parameters = dict(module._parameters)
    width = _PROBE_WIDTH
    # The widths the family's forward reads from attributes (Llama 4's and DBRX's views).
    for attr in ("hidden_size", "ffn_hidden_size"):
        if hasattr(module, attr):
            setattr(probe, attr, width)
    if w.layout == "matrices":  # DBRX: [E f_e, h] matrices in its mlp, widths read from attributes
        probe._modules = dict(module._modules)  # its own child table too
        mlp = copy.copy(module.get_submodule("mlp"))
        mlp._parameters = dict(mlp._parameters)
        for name in GLU_MATRICES:
            setattr(mlp, name, param(w.experts * width, width))
        probe.mlp = mlp
        return probe
    inner = width * (2 if w.gated else 1)
    shapes = [(w.experts, inner, width), (w.experts, width, inner // (2 if w.gated else 1))]
    if w.layout == "in-out":
        shapes = [(e, b, a) for e, a, b in shapes]
    for name, shape in zip(stacked_names(module), shapes, strict=True):
        setattr(probe, name, param(*shape))
        if _tensor(module, f"{name}_bias", 2) is not None:
            setattr(probe, f"{name}_bias",
                    param(w.experts, shape[1] if w.layout == "out-in" else shape[2]))
    return probe


def _probe_routed(module: nn.Module, w: ExpertWeights) -> str:
    """``_probe`` for experts called on rows already routed (``routed_rows``): their forward on
    every expert's block of rows (each token scaled by a router weight, zero where not picked)
    against ``run_expert`` on each block, and a zero row's result zero, so the runtime may
    skip the rows the router did not pick ("" when both hold)."""
    gen = torch.Generator().manual_seed(0)
    probe = _probe_copy(module, w, gen)
    pw = _weights(probe)  # the probe's own widths
    tokens, name = 2 * min(w.experts, _PROBE_WIDTH), type(module).__name__
    x = torch.randn(tokens, _PROBE_WIDTH, generator=gen)
    picked = torch.rand(w.experts, tokens, 1, generator=gen) < 0.5
    blocks = x * torch.rand(w.experts, tokens, 1, generator=gen) * picked
    with torch.no_grad():
        want = torch.cat([run_expert(probe, e, blocks[e], pw) for e in range(w.experts)])
        zero = torch.cat([run_expert(probe, e, x[:1] * 0, pw) for e in range(w.experts)])
        try:
            got = type(module).forward(probe, blocks.reshape(-1, _PROBE_WIDTH))
        except Exception as e:  # any failure: not runnable one expert at a time
            return f"{name}'s forward does not run as stacked experts ({' '.join(str(e).split())})"
    if bool(zero.any()):
        return (f"{name}'s experts do not map a zero row to zero (the rows its router did not "
                "pick cannot be skipped)")
    if not isinstance(got, torch.Tensor) or got.numel() != want.numel() or not torch.allclose(
            got.reshape(want.shape), want, rtol=1e-4, atol=1e-5):
        return (f"{name}'s forward computes something other than its experts one at a time "
                "(a norm, a scale or a different gate)")
    return ""


def _probe(module: nn.Module, w: ExpertWeights) -> str:
    """Run the module's own forward on a copy holding small random weights of its layout
    (``_probe_copy``; tokens routed to the first few experts), and compare it with
    ``run_expert`` applied per routed token ("" when they agree)."""
    gen = torch.Generator().manual_seed(0)
    probe = _probe_copy(module, w, gen)
    pw = _weights(probe)  # the probe's own widths
    experts = min(w.experts, _PROBE_WIDTH)
    tokens, top_k = 2 * experts, min(2, experts)
    x = torch.randn(tokens, _PROBE_WIDTH, generator=gen)
    index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    name = type(module).__name__
    with torch.no_grad():
        each = torch.stack([run_expert(probe, e, x, pw) for e in range(experts)])
        want = (weights[..., None] * each[index, torch.arange(tokens)[:, None]]).sum(dim=1)
        try:
            got = type(module).forward(probe, x, index, weights)
        except Exception as e:  # any failure: not runnable one expert at a time
            return f"{name}'s forward does not run as stacked experts ({' '.join(str(e).split())})"
    # The same rows, maybe under a batch dimension (DBRX hands back [b, s, h] as it was given).
    if not isinstance(got, torch.Tensor) or got.numel() != want.numel() or not torch.allclose(
            got.reshape(want.shape), want, rtol=1e-4, atol=1e-5):
        return (f"{name}'s forward computes something other than its experts one at a time "
                "(a norm, a scale or a different gate)")
    return ""


def _standin(module: nn.Module, routed_top_k: int):
    act = expert_activation(module)

    def forward(x: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None):
        # Looked up per call: the profiler may swap the parameters (fake tensors) after install.
        w = expert_weights(module)
        assert w is not None  # installed on recognised modules only
        flat = x.reshape(-1, x.shape[-1])
        if top_k_index is None:  # rows repeated per expert, router weights applied (Llama 4)
            tokens, top_k = flat.shape[0] // w.experts, routed_top_k
        else:
            tokens, top_k = top_k_index.shape
        rows = _rows(module, w.experts, tokens, top_k)
        # Static-shape dispatch: row r takes input row r % rows-in (values do not matter).
        index = torch.arange(rows, device=x.device) % flat.shape[0]
        dispatched = flat.index_select(0, index)
        outs = [F.linear(dispatched, p, b) for p, b in zip(w.ins, w.in_biases)]
        if len(outs) == 2:
            inner = act(outs[0]) * outs[1]
        elif w.gated:
            gate, up = outs[0].chunk(2, dim=-1)
            inner = act(gate) * up
        else:
            inner = act(outs[0])
        y = F.linear(inner, w.down, w.down_bias)
        if top_k_weights is not None:
            weights = top_k_weights.reshape(-1).index_select(0, index % (tokens * top_k))
            y = y * weights[:, None].to(y.dtype)
        return torch.zeros_like(flat).index_add(0, index, y.to(flat.dtype)).view(x.shape)

    return forward


def install_expert_standins(model: nn.Module) -> int:
    """Replace the forward of every experts module of ``model`` (a private meta copy) by the
    stand-in; return how many were replaced."""
    found = expert_modules(model)
    for name, module in found:
        parent = model.get_submodule(name.rpartition(".")[0])
        module.forward = _standin(module, routed_top_k(parent))
    return len(found)


def routed_top_k(root: nn.Module) -> int:
    """Experts per token: the first ``top_k`` / ``num_experts_per_tok`` attribute (or config
    field) found under ``root``, else 0."""
    for module in root.modules():
        for name in ("top_k", "num_experts_per_tok"):
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        config = getattr(module, "config", None)
        value = getattr(config, "num_experts_per_tok", None)
        if isinstance(value, int) and value > 0:
            return value
    return 0
