"""Collectives one rank issues per training step, by kind and mesh axis, as the runtime emits them.

Keys are ``"kind@axis"`` with the functional-collective kinds that
``autopar.runtime.count_collectives(fn, mesh)`` reports (``all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``). Counts follow the runtime's torch calls
(autopar/runtime/tensor_parallel.py and data_parallel.py), per micro-batch unless stated:

tp, without sequence parallelism:
- block: forward one all-reduce per row-parallel linear (wo, w2); backward one all-reduce per
  parent of column-parallel linears (attention, feed_forward: their replicated input's gradient);
  full recompute repeats the forward ones.
- embedding (vocab-parallel): one all-reduce forward.
- head (column-parallel, replicated output): one logits all-gather forward, one input-gradient
  all-reduce backward.
tp, with sequence parallelism:
- block: forward one all-gather per colwise parent and one reduce-scatter per row-parallel
  linear; backward the mirror image (reduce-scatter per parent, all-gather per row-parallel);
  full recompute repeats the forward ones. The first block's input cut adds one backward
  all-gather; the head all-gathers the sequence and the logits forward and reduce-scatters the
  input gradient backward.
dp (FSDP2, zero >= 1; one unit per block plus the stage root if it owns parameters):
- zero 3: per micro-batch an all-gather in forward for every unit and again in backward for the
  blocks (the root stays unsharded after forward), one reduce-scatter per unit.
- zero 1: one all-gather per unit per step, one reduce-scatter per unit per step.
- zero 2: one all-gather per unit per step, one reduce-scatter per unit per micro-batch.
Not listed: DDP's and replicate()'s gradient reduction (the C++ reducer is not visible to the
counter), pipeline send/recv, and the small all-reduces of a parameter-norm or loss report.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from autopar.config import ParallelConfig
from autopar.cost_model.pipeline import rank_of_stage
from autopar.graph.types import LayerProfile, ModelProfile

if TYPE_CHECKING:
    from autopar.plan import Plan

__all__ = ["expected_collectives"]

AR, AG, RS = "all_reduce@tp", "all_gather_into_tensor@tp", "reduce_scatter_tensor@tp"
DP_AG, DP_RS = "all_gather_into_tensor@dp", "reduce_scatter_tensor@dp"


def _block_tp(layer: LayerProfile, sp: bool, full: bool) -> Counter[str]:
    rowwise = len(layer.tp.rowwise)
    parents = len({fqn.rsplit(".", 1)[0] for fqn in layer.tp.colwise})
    if not (rowwise and parents):
        return Counter()
    if not sp:
        fwd = Counter({AR: rowwise})
        return fwd + Counter({AR: parents}) + (fwd if full else Counter())
    fwd = Counter({AG: parents, RS: rowwise})
    bwd = Counter({RS: parents, AG: rowwise})
    return fwd + bwd + (fwd if full else Counter())


def _layer_tp(layer: LayerProfile, sp: bool, recompute: str, first_block: bool) -> Counter[str]:
    if layer.kind == "block":
        counts = _block_tp(layer, sp, recompute == "full")
        if sp and first_block and counts:
            counts[AG] += 1
        return counts
    if not layer.tp.vocab_parallel:
        return Counter()
    if layer.kind == "embedding":
        return Counter({AR: 1})
    if layer.kind == "head":
        return Counter({AG: 2, RS: 1}) if sp else Counter({AG: 1, AR: 1})
    return Counter()


def _split(profile: ModelProfile, plan_or_config):
    if isinstance(plan_or_config, ParallelConfig):
        from autopar.cost_model.partition import balanced_partition

        cfg = plan_or_config
        n = profile.num_layers
        costs = [layer.fwd_flops + layer.bwd_flops for layer in profile.layers]
        split = ((0, n - 1),) if cfg.num_stages == 1 else balanced_partition(costs, cfg.num_stages)
        return cfg, split, (cfg.recompute,) * n
    plan = plan_or_config
    return plan.config, tuple(s.layers for s in plan.stages), plan.recompute_per_layer


def expected_collectives(
    profile: ModelProfile, plan_or_config: ParallelConfig | Plan, pp_rank: int = 0
) -> dict[str, int]:
    """Collectives per training step on one rank of pipeline rank ``pp_rank``.

    Args:
        profile: the model profile.
        plan_or_config: a Plan (its split and recompute) or a ParallelConfig (a split balanced
            by FLOPs, the config's recompute everywhere).
        pp_rank: the pipeline rank whose stages to count.

    Returns:
        ``"kind@axis"`` -> count, sorted; kinds with no call omitted.
    """
    cfg, split, recompute = _split(profile, plan_or_config)
    m = cfg.num_microbatches
    first_block = next((i for i, x in enumerate(profile.layers) if x.kind == "block"), -1)
    counts: Counter[str] = Counter()
    for j, (a, b) in enumerate(split):
        if rank_of_stage(cfg.schedule, cfg.pp, j) != pp_rank:
            continue
        layers = range(a, b + 1)
        if cfg.tp > 1:
            for i in layers:
                for key, value in _layer_tp(profile.layers[i], cfg.sequence_parallel,
                                            recompute[i], i == first_block).items():
                    counts[key] += value * m
        if cfg.dp > 1 and cfg.zero >= 1:
            blocks = sum(1 for i in layers if profile.layers[i].kind == "block")
            root = int(any(profile.layers[i].kind != "block" and profile.layers[i].num_params
                           for i in layers))
            units = blocks + root
            if cfg.zero == 3:
                counts[DP_AG] += m * (units + blocks)
                counts[DP_RS] += m * units
            else:
                counts[DP_AG] += units
                counts[DP_RS] += units * (m if cfg.zero == 2 else 1)
    return dict(sorted((k, v) for k, v in counts.items() if v))
