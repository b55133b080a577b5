"""Collectives one rank issues per training step, by kind and mesh axis, as the runtime emits them.

Keys are ``"kind@axis"`` with the functional-collective kinds that
``autopar.runtime.count_collectives(fn, mesh)`` reports (``all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``). These counts were measured on the runtime
(tests/distributed/test_runtime_collectives.py compares them call for call, GPT and Llama,
pp = 1 and pp = 2). Per micro-batch unless stated; R = row-parallel linears of a block (wo, w2),
P = parents of its column-parallel linears (attention, feed_forward):

tp, without sequence parallelism:
- block: forward one all-reduce per row-parallel output (R); backward one all-reduce per parent
  (P: the gradient of its replicated input). Full recompute re-runs the forward except the last
  row-parallel linear (R - 1): the non-reentrant checkpoint stops after the last activation
  backward needs, and nothing saves the block's last projection.
- embedding (vocab-parallel): one all-reduce forward.
- head (column-parallel): the input-gradient all-reduce backward; for a model's own loss
  (``ModelProfile.own_loss``) the logits all-gather forward. The default loss on the vocab-sharded
  logits under ``loss_parallel()`` all-reduces three [b, s] tensors (the max, the sum of
  exponentials, the target's logit: ``LOSS_PARALLEL_REDUCES``) inside DTensor's op dispatch,
  where CommDebugMode does not see them: charged in time (tp_comm.py), not listed here.
tp, with sequence parallelism:
- block: forward one all-gather per parent and one reduce-scatter per row-parallel linear;
  backward the mirror image. Full recompute re-runs the P all-gathers and R - 1 reduce-scatters.
  The model's first block cuts its input to the sequence shard: one all-gather in backward.
  A mixture-of-experts module (``MoEStructure.module``) gathers the whole sequence: one
  all-gather forward and one backward; its shared experts' linears run on the gathered
  sequence as without sequence parallelism (``block_tp_calls``).
- embedding: one all-reduce forward. Head: all-gathers the sequence forward (and the logits,
  for a model file's own loss), reduce-scatters the input gradient backward.
- with dp > 1 as well: one all-reduce per sequence-parallel norm parameter at each gradient
  reduction (per step, or per micro-batch for zero 2 and 3 at pp == 1).
dp, per step, U = FSDP2 / replicate() units of the rank: one per block plus each stage module's
root if it holds parameters (pp == 1: one root holding the embedding and the head):
- zero 0 with replicate() (tp > 1 or pp > 1): U all-reduces. DDP (tp == pp == 1) reduces in its
  C++ reducer, which the counter does not see: nothing listed.
- zero 1: U all-gathers, U reduce-scatters.
- zero 2: U all-gathers, U * m reduce-scatters (pp == 1); U with pp > 1 (the schedule syncs
  gradients only in the last micro-batch).
- zero 3: pp == 1: 2 U m all-gathers (forward and backward, the root too), U m reduce-scatters;
  pp > 1: U (m + 1) all-gathers (every forward, and the first backward: the schedule keeps
  parameters unsharded after a backward until the last one), U reduce-scatters.
HSDP (dp_replicate > 1): after each reduce-scatter one all-reduce of the gradient shard over
"dp_replicate"; "dp" is then the shard group (dp_shard x cp).
cp (the all-gather variant, cp_comm.py), per block with attention: one all-gather of K and V
forward (two with full recompute), one reduce-scatter of their gradient backward, axis "cp";
dp's collectives run over dp x cp.
ep (moe.py, ep_comm.py), per MoE layer: 6 all-to-alls per micro-batch on "ep" (10 under full
recompute); the routed experts' gradients over "edp" (dp * cp / ep ranks, when more than one):
zero 0 one all-reduce per expert tensor and micro-batch, else their own FSDP2 unit's calls.
Schedules with several stages per rank (interleaved, V-shaped) with zero >= 1 are not listed:
torch's schedule runtime inserts its own unshard/reshard actions there (measured 1.75-2x the
single-stage all-gathers), so ``expected_collectives`` raises ValueError for them.
Not listed either: pipeline send/recv and the loss report's all-reduce of one float.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from autopar.config import ParallelConfig
from autopar.cost_model.comm import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from autopar.cost_model.moe import A2A, EXPERT_TENSORS, expert_dp
from autopar.graph.types import LayerProfile, ModelProfile
from autopar.schedules import rank_of_stage

__all__ = [
    "MOE_TPS",
    "block_tp_calls",
    "expected_collectives",
    "first_block_index",
    "fsdp_units",
    "grad_reductions_per_step",
    "multi_stage_fsdp",
    "rank_stages",
    "sp_norm_tensors",
    "stage_split",
]

_AR, _AG, _RS = ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER
# How a framework's MoE blocks talk over tp (``block_tp_calls``; ``Framework.moe_tp``).
MOE_TPS = ("gather", "boundary", "rows", "linears")
AR, AG, RS = f"{_AR}@tp", f"{_AG}@tp", f"{_RS}@tp"
# A vocab-parallel cross entropy's forward all-reduces (sourced: torch/distributed/tensor/parallel/
# loss.py, _log_softmax's max and sum of exponentials and _nll_loss_forward's target logit;
# Megatron-LM's _VocabParallelCrossEntropy the same three), each of fp32 [b, s].
LOSS_PARALLEL_REDUCES = 3
DP_AR, DP_AG, DP_RS = f"{_AR}@dp", f"{_AG}@dp", f"{_RS}@dp"
HSDP_AR = f"{_AR}@dp_replicate"
CP_AG, CP_RS = f"{_AG}@cp", f"{_RS}@cp"


def block_tp_calls(layer: LayerProfile, *, sp: bool, first_block: bool, moe_tp: str
                   ) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """The tp calls of one block and micro-batch by kind ("all_reduce", "all_gather_into_tensor",
    "reduce_scatter_tensor"): (forward, backward, what a full recompute re-runs); the module
    docstring's rule, which tp_comm.py times and ``expected_collectives`` counts.

    ``moe_tp`` (framework_support ``moe_tp_mode``) says how the block's MoE module
    (``MoEStructure.module``) talks over tp. "gather", under sequence parallelism: its input is
    all-gathered forward (its gradient, replicated, is cut back without communication) and its
    replicated output cut to the sequence shard (the gradient all-gathered backward); the
    column-parallel parents and row-parallel linears inside it (shared experts) run on the
    gathered sequence as without sequence parallelism: an all-reduce per row-parallel output
    forward, per parent backward. A full recompute re-runs the forward's calls but the last
    row-parallel one inside the MoE module (nothing saves the shared experts' output); without
    shared experts it re-runs them all (the gathered input is saved). "boundary": the MoE
    module is one column-parallel parent and one row-parallel output (an MLP's calls) and the
    linears inside it issue none of their own. "linears" and "rows": the listed linears' calls
    (the routed rows' own all-gather and reduce-scatter of "rows" are tp_comm.py's, sized by
    the dispatched rows).
    """
    parents_all = {fqn.rsplit(".", 1)[0] for fqn in layer.tp.colwise}
    if not (layer.tp.rowwise and parents_all):
        return Counter(), Counter(), Counter()
    boundary = moe_tp == "boundary" and layer.moe is not None
    moe = layer.moe if (layer.moe is not None and layer.moe.module and (
        boundary or (moe_tp == "gather" and sp))) else None
    inside = moe.holds if moe is not None else (lambda _fqn: False)
    parents = sum(1 for p in parents_all if not inside(p)) + int(boundary)
    rowwise = sum(1 for r in layer.tp.rowwise if not inside(r)) + int(boundary)
    if not sp:
        return (Counter({_AR: rowwise}), Counter({_AR: parents}),
                Counter({_AR: rowwise - 1}))
    if moe is None or boundary:
        return (Counter({_AG: parents, _RS: rowwise}),
                Counter({_RS: parents, _AG: rowwise + int(first_block)}),
                Counter({_AG: parents, _RS: rowwise - 1}))
    in_parents, in_rowwise = len(parents_all) - parents, len(layer.tp.rowwise) - rowwise
    return (Counter({_AG: parents + 1, _RS: rowwise, _AR: in_rowwise}),
            Counter({_RS: parents, _AG: rowwise + int(first_block) + 1, _AR: in_parents}),
            Counter({_AG: parents + 1, _RS: rowwise,
                     _AR: in_rowwise - 1 if in_rowwise else 0}))


def _block_tp(layer: LayerProfile, sp: bool, full: bool, first_block: bool) -> Counter[str]:
    forward, backward, rerun = block_tp_calls(layer, sp=sp, first_block=first_block,
                                              moe_tp="gather")  # autopar's runtime
    total = forward + backward + (rerun if full else Counter())
    return Counter({f"{kind}@tp": n for kind, n in total.items() if n})


def _layer_tp(layer: LayerProfile, sp: bool, recompute: str, first_block: bool,
              loss_parallel: bool) -> Counter[str]:
    if layer.kind == "block":
        return _block_tp(layer, sp, recompute == "full", first_block)
    if not layer.tp.vocab_parallel:
        return Counter()
    if layer.kind == "embedding":
        return Counter({AR: 1})
    if layer.kind == "head":  # the loss's all-reduces run inside DTensor's dispatch: unseen
        logits = Counter() if loss_parallel else Counter({AG: 1})
        return logits + (Counter({AG: 1, RS: 1}) if sp else Counter({AR: 1}))
    return Counter()


def sp_norm_tensors(layer: LayerProfile, cfg: ParallelConfig) -> int:
    """Norm parameters whose gradients sequence parallelism leaves partial over tp, when dp > 1.

    Every tp rank sees only its sequence shard, so the gradient of a replicated norm parameter
    is a partial sum; FSDP2 / replicate() all-reduce it over tp when they reduce gradients
    (measured: 10 calls per reduction for the 2-block GPT, 2 LayerNorms of 2 tensors per block
    plus the final one). With dp == 1 nothing reduces there.
    """
    if not (cfg.sequence_parallel and cfg.tp > 1 and cfg.dp > 1):
        return 0
    return layer.tp.sequence_param_tensors


def grad_reductions_per_step(cfg: ParallelConfig) -> int:
    """Gradient reductions per step (FSDP2 / replicate()): every micro-batch for zero 2 and 3 at
    pp == 1 (FSDP2 reduce-scatters each micro-batch), else once (gradient sync only in the last
    micro-batch: ``runtime/step.py`` for zero 0/1, the pipeline schedule's REDUCE_GRAD for
    pp > 1)."""
    return cfg.num_microbatches if (cfg.pp == 1 and cfg.zero in (2, 3)) else 1


def stage_split(
    profile: ModelProfile,
    config: ParallelConfig,
    split: tuple[tuple[int, int], ...] | None = None,
    recompute: tuple[str, ...] | None = None,
) -> tuple[ParallelConfig, tuple[tuple[int, int], ...], tuple[str, ...]]:
    """(config, stage layer ranges, per-layer recompute), the defaults filled in.

    Without a split the stages are balanced by FLOPs (``partition.balanced_partition``); without
    a recompute list the config's ``recompute`` holds on every layer.
    """
    n = profile.num_layers
    if split is None:
        from autopar.cost_model.partition import balanced_partition

        costs = [layer.fwd_flops + layer.bwd_flops for layer in profile.layers]
        split = ((0, n - 1),) if config.num_stages == 1 else balanced_partition(
            costs, config.num_stages)
    if recompute is None:
        recompute = (config.recompute,) * n
    return config, tuple((a, b) for a, b in split), tuple(recompute)


def rank_stages(
    config: ParallelConfig, split: tuple[tuple[int, int], ...], pp_rank: int
) -> list[tuple[int, int]]:
    """The layer ranges of the stages pipeline rank ``pp_rank`` holds, in stage order."""
    return [(a, b) for j, (a, b) in enumerate(split)
            if rank_of_stage(config.schedule, config.pp, j) == pp_rank]


def first_block_index(profile: ModelProfile) -> int:
    """Index of the profile's first block layer (-1: none)."""
    return next((i for i, x in enumerate(profile.layers) if x.kind == "block"), -1)


def fsdp_units(profile: ModelProfile, first: int, last: int) -> int:
    """FSDP2 / replicate() units of one stage module: its blocks plus a root with parameters."""
    layers = profile.layers[first : last + 1]
    blocks = sum(1 for layer in layers if layer.kind == "block")
    root = any(layer.kind != "block" and layer.num_params for layer in layers)
    return blocks + int(root)


def multi_stage_fsdp(cfg: ParallelConfig) -> bool:
    """Whether torch's multi-stage schedule runtime decides the FSDP2 gathers (see above)."""
    return cfg.num_stages > cfg.pp and cfg.dp > 1 and cfg.zero >= 1


def _dp_counts(cfg: ParallelConfig, units: int) -> Counter[str]:
    m, u = cfg.num_microbatches, units
    if cfg.data_ranks == 1 or u == 0:
        return Counter()
    reductions = u * grad_reductions_per_step(cfg)
    if cfg.zero == 0:
        replicate = cfg.tp > 1 or cfg.pp > 1
        return Counter({DP_AR: reductions}) if replicate else Counter()
    gathers = u if cfg.zero < 3 else (2 * u * m if cfg.pp == 1 else u * (m + 1))
    counts = Counter({DP_AG: gathers, DP_RS: reductions})
    if cfg.dp_replicate > 1:
        counts[HSDP_AR] = reductions
    return counts


def _ep_counts(layer: LayerProfile, cfg: ParallelConfig, full: bool) -> Counter[str]:
    """Expert parallelism's collectives of one MoE layer per step (moe.py, ep_comm.py): per
    micro-batch 6 all-to-alls (10 under full recompute); the experts' own gradient reduction
    over the edp ranks (zero 0: a hook per expert tensor and micro-batch; else an FSDP2 unit)."""
    if cfg.ep <= 1 or layer.moe is None:
        return Counter()
    m = cfg.num_microbatches
    counts = Counter({f"{A2A}@ep": (10 if full else 6) * m})
    if expert_dp(cfg) <= 1:
        return counts
    if cfg.zero == 0:
        counts[f"{_AR}@edp"] = EXPERT_TENSORS * m
        return counts
    alone = _dp_counts(dataclasses.replace(cfg, dp_replicate=1), 1)
    counts.update({k.replace("@dp", "@edp"): v for k, v in alone.items()})
    return counts


def _cp_counts(layer: LayerProfile, cfg: ParallelConfig, full: bool) -> Counter[str]:
    """The all-gather variant's K/V collectives of one block per micro-batch (cp_comm.py)."""
    if cfg.cp == 1 or layer.kind != "block":
        return Counter()
    return Counter({CP_AG: 2 if full else 1, CP_RS: 1})


def expected_collectives(
    profile: ModelProfile,
    config: ParallelConfig,
    pp_rank: int = 0,
    *,
    split: tuple[tuple[int, int], ...] | None = None,
    recompute: tuple[str, ...] | None = None,
) -> dict[str, int]:
    """Collectives per training step on one rank of pipeline rank ``pp_rank``.

    Args:
        profile: the model profile.
        config: the degrees, batch and schedule.
        pp_rank: the pipeline rank whose stages to count.
        split: stage layer ranges (a Plan's); default balanced by FLOPs.
        recompute: per-layer recompute (a Plan's); default the config's everywhere.

    Returns:
        ``"kind@axis"`` -> count, sorted; kinds with no call omitted.

    Raises:
        ValueError: several stages per rank with zero >= 1 and dp > 1 (counts set by torch's
            schedule runtime, see the module docstring).
    """
    cfg, split, recompute = stage_split(profile, config, split, recompute)
    if multi_stage_fsdp(cfg):
        raise ValueError(
            f"FSDP collective counts of schedule {cfg.schedule} with {cfg.virtual_stages} stages "
            "per rank are decided by torch's schedule runtime; use one stage per rank to count them"
        )
    m = cfg.num_microbatches
    first_block = first_block_index(profile)
    counts: Counter[str] = Counter()
    for a, b in rank_stages(cfg, split, pp_rank):
        if cfg.tp > 1:
            for i in range(a, b + 1):
                for key, value in _layer_tp(profile.layers[i], cfg.sequence_parallel,
                                            recompute[i], i == first_block,
                                            not profile.own_loss).items():
                    counts[key] += value * m
                counts[AR] += grad_reductions_per_step(cfg) * sp_norm_tensors(
                    profile.layers[i], cfg)
        for i in range(a, b + 1) if profile.heads else ():
            for key, value in _cp_counts(profile.layers[i], cfg, recompute[i] == "full").items():
                counts[key] += value * m
        for i in range(a, b + 1):
            counts.update(_ep_counts(profile.layers[i], cfg, recompute[i] == "full"))
        counts.update(_dp_counts(cfg, fsdp_units(profile, a, b)))
    return dict(sorted((k, v) for k, v in counts.items() if v))
