"""The cost model's main formulas as sympy expressions, and ``explain`` (of one split).

Units: bytes and seconds. The expressions are built once (module constants) and evaluated with
numbers from the plan's CostTable; tests check that they evaluate to what the numeric code
(memory.py, comm.py, compute.py, assemble.py) computes, so the printed formulas are the model.

Symbols: Psi parameters a rank holds after tensor-parallel and pipeline sharding, d the ranks
ZeRO shards them over (Psi_e and d_e: routed experts held apart under expert parallelism), w bytes
of the training dtype, g bytes of a gradient element and o of Adam's two moments (the framework's
``grad_reduce_bytes`` and ``adam_moment_bytes``), m micro-batches, p pipeline ranks, v chunks
per rank, c the schedule's bubble coefficient, n group size, S message bytes, B bus bandwidth,
alpha per-step latency, F FLOPs, P peak FLOP/s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy as sp

from autopar.config import ParallelConfig, dp_mechanism
from autopar.cost_model.expert_tp import costed_profiles
from autopar.cost_model.layer_costs import build_cost_table
from autopar.cost_model.layer_terms import static_grad_element_bytes
from autopar.cost_model.memory import (
    ADAM_BYTES,
    GRAD_BYTES,
    MASTER_BYTES,
    fsdp_accumulates_grads,
    fsdp_keeps_params_unsharded,
)
from autopar.cost_model.moe import state_parts
from autopar.cost_model.pipeline import bubble_coefficient
from autopar.cost_model.tp_comm import tp_sharded
from autopar.units import format_bytes

if TYPE_CHECKING:
    from autopar.cost_model.estimate import Estimate
    from autopar.cost_model.frameworks import Framework
    from autopar.cost_model.hardware import Cluster
    from autopar.cost_model.tables import CostTable
    from autopar.graph.types import ModelProfile

__all__ = [
    "ALL_REDUCE",
    "BUBBLE_COEFFICIENT",
    "MATMUL_TIME",
    "MODEL_STATE",
    "STEP_TIME",
    "explain",
    "model_state_expr",
    "model_state_expr_for",
    "state_byte_sizes",
]

Psi, d, w, m, p, v, n, S, B, alpha = sp.symbols("Psi d w m p v n S B alpha", positive=True)
Psi_e, d_e, g, o = sp.symbols("Psi_e d_e g o", positive=True)
c = sp.Symbol("c", nonnegative=True)
F, P, eff_max, W, W_half = sp.symbols("F P eff_max W W_half", positive=True)
R_max, T_sum, E_max = sp.symbols("R_max T_sum E_max", nonnegative=True)

# Model state per mechanism (memory.py's table): (parameters, gradients, optimizer) bytes.
# a = 1 when FSDP2 accumulates unsharded fp32 gradients across micro-batches, u = 1 when zero 3
# keeps unsharded parameters through a pipeline step (memory.fsdp_accumulates_grads and
# memory.fsdp_keeps_params_unsharded say when). An unsharded accumulator and the sharded gradient
# that replaces it at its reduce-scatter never coexist: gradients are 4 a + 4 (1 - a) / d.
# The byte counts are memory.py's (fp32 master weights; gradients of g bytes and Adam's two
# moments of o bytes, memory.GRAD_BYTES and ADAM_BYTES unless the framework keeps them narrower;
# DDP's reducer keeps a bucket copy of the gradients).
a, u = sp.symbols("a u", nonnegative=True)
_M, _G, _A = sp.Integer(MASTER_BYTES), g, o
_SHARDED_GRADS = (_G * a + _G * (1 - a) / d) * Psi
MODEL_STATE: dict[str, tuple[sp.Expr, sp.Expr, sp.Expr]] = {
    "none": ((_M + w) * Psi, _G * Psi, _A * Psi),
    "ddp": ((_M + w) * Psi, 2 * _G * Psi, _A * Psi),
    "replicate": ((_M + w) * Psi, (_G + _G * a) * Psi, _A * Psi),
    "zero1": ((_M / d + w) * Psi, _SHARDED_GRADS, _A * Psi / d),
    "zero2": ((_M / d + w) * Psi, _SHARDED_GRADS, _A * Psi / d),
    "zero3": ((_M / d + w * u) * Psi, _SHARDED_GRADS, _A * Psi / d),
}
# Ring all-reduce = reduce-scatter + all-gather (formulas.md section 6).
REDUCE_SCATTER = (n - 1) / n * S / B + (n - 1) * alpha
ALL_REDUCE = 2 * REDUCE_SCATTER
# Matmul time at the saturating efficiency eff(W) = eff_max W / (W + W_half) (compute.py).
MATMUL_TIME = F / (P * eff_max * W / (W + W_half))
# Pipeline: step = m R_max + c sum_j T_j + max_k E_k (assemble.py), with c the schedule's
# ``pipeline.bubble_coefficient``: (p - 1) / (v p) for 1F1B and interleaved 1F1B with m >= p (the
# zero-bubble schedules keep ``ZERO_BUBBLE_RESIDUAL`` of it; fewer micro-batches than ranks more).
BUBBLE_COEFFICIENT = (p - 1) / (v * p)
STEP_TIME = m * R_max + c * T_sum + E_max


def model_state_expr(
    kind: str, zero: int, dtype: str, *, accumulates: bool = False, keeps_params: bool = False
) -> tuple[sp.Expr, sp.Expr, sp.Expr]:
    """(parameters, gradients, optimizer) expressions of a mechanism, w' = 0 for fp32 copies.

    ``accumulates`` and ``keeps_params`` set the symbols a and u (see ``MODEL_STATE``); g and o
    stay symbols (``model_state_expr_for`` gives them a framework's values).
    """
    key = f"zero{zero}" if kind == "fsdp" else kind
    exprs = tuple(e.subs({a: int(accumulates), u: int(keeps_params)}) for e in MODEL_STATE[key])
    if dtype == "fp32" and kind in ("none", "ddp", "replicate"):
        exprs = tuple(e.subs(w, 0) for e in exprs)
    return exprs


def model_state_expr_for(
    config: ParallelConfig, framework: Framework | None = None
) -> tuple[sp.Expr, sp.Expr, sp.Expr]:
    """``model_state_expr`` with a and u read off the config as memory.py decides them; the
    gradients g Psi where ``framework`` keeps a static gradient buffer
    (``Framework.static_grad_buffer``, layer_terms.grad_bytes_of)."""
    params, grads, optimizer = model_state_expr(
        dp_mechanism(config),
        config.zero,
        config.dtype,
        accumulates=fsdp_accumulates_grads(config),
        keeps_params=fsdp_keeps_params_unsharded(config) and config.zero == 3,
    )
    if framework is not None and framework.static_grad_buffer:
        size = static_grad_element_bytes(framework, config.dtype)
        grads = (g if size == framework.grad_reduce_bytes else sp.Integer(size)) * Psi
    return params, grads, optimizer


def state_byte_sizes(framework: Framework | None = None) -> dict[sp.Symbol, int]:
    """Values of g and o: the ``framework``'s gradient and Adam moment bytes (its
    ``grad_reduce_bytes`` and ``adam_moment_bytes``; default memory.py's)."""
    if framework is None:
        return {g: GRAD_BYTES, o: ADAM_BYTES}
    return {g: framework.grad_reduce_bytes, o: framework.adam_moment_bytes}


def explain(
    profile: ModelProfile,
    cluster: Cluster,
    config: ParallelConfig,
    split: tuple[tuple[int, int], ...],
    recompute: tuple[str, ...],
    framework: str,
) -> str:
    """A split's memory and time formulas, then the same with its numbers substituted.

    Args:
        profile: the model profile the split was made for.
        cluster: the cluster.
        config: the degrees, batch and schedule.
        split: (first, last) profile layer of every stage, in stage order.
        recompute: the recompute choice of every profile layer.
        framework: the framework that runs it (a name in ``FRAMEWORKS``).

    Returns:
        Multi-line text.
    """
    from autopar.cost_model.assemble import assemble

    table = build_cost_table(profile, cluster, config, framework)
    est = assemble(table, split, recompute)
    lines = [f"plan: {config.describe()} on {cluster.name} ({cluster.num_gpus} GPUs)", ""]
    lines += _memory_lines(profile, config, est, table.framework)
    lines += ["", f"step time: {sp.sstr(STEP_TIME)}"]
    lines += _time_lines(config, cluster, table, est, framework)
    return "\n".join(lines)


def _rank_parts(profile: ModelProfile, cfg: ParallelConfig, fw: Framework,
                rank_layers) -> tuple[float, dict[int, float]]:
    """Parameters (after tp) the rank holds: its dense parts (over the config's shard group)
    and, by the ranks ZeRO shards them over, the routed experts held apart: each of its layers'
    ``moe.state_parts`` (the first part dense), on the layers the cost table costs."""
    layers = costed_profiles(profile, cfg, fw)[2].layers
    dense, experts = 0.0, dict[int, float]()
    for first, last in rank_layers:
        for layer in layers[first:last + 1]:
            shard = cfg.tp if tp_sharded(layer) else 1
            (params, _), *held = state_parts(layer, cfg, shard)
            dense += params
            for params, ranks in held:
                experts[ranks] = experts.get(ranks, 0.0) + params
    return dense, experts


def _memory_lines(
    profile: ModelProfile, cfg: ParallelConfig, est: Estimate, fw: Framework
) -> list[str]:
    from autopar.config import DTYPE_BYTES

    largest = max(est.stages, key=lambda s: (s.memory_bytes, -s.rank))
    dense, parts = _rank_parts(profile, cfg, fw, largest.layers)
    values = {Psi: dense, d: cfg.shard_ranks, w: DTYPE_BYTES[cfg.dtype], **state_byte_sizes(fw)}
    lines = [
        f"memory of pipeline rank {largest.rank} (data parallel: {dp_mechanism(cfg)}, "
        f"zero {cfg.zero}; {fw.name}: gradients g = {values[g]} bytes, Adam moments o = "
        f"{values[o]} bytes):",
        f"  Psi = parameters of the rank after tp = {dense:,.0f}, over d = {cfg.shard_ranks}",
    ]
    groups = [(Psi, d)]
    for i, (ranks, params) in enumerate(sorted(parts.items())):
        psi_i, d_i = (Psi_e, d_e) if len(parts) == 1 else sp.symbols(f"Psi_e{i} d_e{i}",
                                                                     positive=True)
        values |= {psi_i: params, d_i: ranks}
        groups.append((psi_i, d_i))
        lines.append(f"  {psi_i} = routed-expert parameters held apart (ep {cfg.ep}) = "
                     f"{params:,.0f}, over {d_i} = {ranks}")
    mem = largest.memory
    held = (mem.parameters_bytes, mem.gradients_bytes, mem.optimizer_bytes)
    for name, expr, on_device in zip(("parameters", "gradients", "optimizer"),
                                     model_state_expr_for(cfg, fw), held):
        total = sum((expr.subs({Psi: x, d: y}) for x, y in groups), sp.Integer(0))
        value = float(total.subs(values))
        moved = (f" ({format_bytes(on_device, 2)} on the device: offload {cfg.offload})"
                 if cfg.offload != "none" else "")
        lines.append(f"  {name:11s} = {sp.sstr(total)} = {format_bytes(value, 2)}{moved}")
    lines += [
        f"  activations = max_c sum_j c_j * sum_i act_i + max_i transient_i = "
        f"{format_bytes(mem.activations_bytes, 2)}",
        f"  buffers     = comm buffers + allocator reserve = {format_bytes(mem.buffers_bytes, 2)}",
        f"  pipeline    = receive buffers of the in-flight micro-batches = "
        f"{format_bytes(mem.pipeline_buffers_bytes, 2)}",
        f"  total       = {format_bytes(largest.memory_bytes, 2)} of "
        f"{format_bytes(est.memory_capacity_bytes, 2)} "
        f"usable -> {'fits' if est.fits else 'does NOT fit'}",
    ]
    return lines


def _time_lines(
    cfg: ParallelConfig, cluster: Cluster, table: CostTable, est: Estimate, framework: str
) -> list[str]:
    coef = bubble_coefficient(cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches)
    r_max = max(s.time_per_microbatch_s for s in est.stages)
    tb = est.time_breakdown
    e_max = est.step_time_s - table.num_microbatches * r_max - tb.bubble_s
    step_values = {m: table.num_microbatches, R_max: r_max, E_max: e_max, c: coef,
                   T_sum: tb.bubble_s / coef if coef else 0.0}
    step = float(STEP_TIME.subs(step_values))
    return [
        f"  m = {table.num_microbatches}, R_max = {r_max * 1e3:.3f} ms per micro-batch "
        f"(slowest rank), c = {coef:.4f} ({cfg.schedule}: pipeline.bubble_coefficient), "
        f"E_max = {e_max * 1e3:.3f} ms (DP tail + optimizer + "
        f"{framework}'s fixed {table.step_fixed_s * 1e3:.3f} ms per step)",
        f"  step = {step:.4f} s -> {est.tokens_per_s:,.0f} tokens/s, MFU {100 * est.mfu:.1f}%",
        "",
        f"collectives: all_reduce = {sp.sstr(ALL_REDUCE)} (ring: reduce-scatter + all-gather)",
        f"matmul time: {sp.sstr(MATMUL_TIME)}  (eff_max = "
        f"{cluster.device.matmul_efficiency_max}, W_half = {cluster.device.matmul_half_flops:.3g}"
        " FLOPs)",
        "time by term: " + ", ".join(f"{k.removesuffix('_s')} {val:.4f} s"
                                     for k, val in tb.to_dict().items()),
    ]
