"""The outer search space: every ParallelConfig the planner considers, in a fixed order.

A candidate fixes (dp, tp, pp), the micro-batch size, the pipeline schedule and its virtual
stages, the ZeRO stage and sequence parallelism; the ILP (``ilp.py``) then decides the layer
split and per-layer recomputation for it.

Rules (each one a constraint the runtime or torch imposes):
- dp * tp * pp = number of GPUs; tp divides heads and kv_heads (sharded attention views heads
  as -1; ``validate.tp_problem``, the rule ``estimate`` checks); tp stays within a node (and
  divides its size) unless allowed across nodes;
- pp * v <= number of profile layers (every stage holds at least one layer;
  ``validate.stages_problem``);
- global_batch divisible by dp; micro-batch sizes divide the per-replica batch;
- micro-batch counts per schedule follow torch 2.13's ``torch.distributed.pipelining``:
  Schedule1F1B needs m >= stages; ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble need
  m to be a multiple of max(1, m // pp) ("rounds"); ScheduleZBVZeroBubble and ScheduleDualPipeV
  run exactly 2 chunks per rank, and DualPipeV needs m >= 2 pp; GPipe takes any m;
- sequence parallelism only when tp > 1 divides each rank's sequence, seq_len / cp
  (``validate.sp_problem``); ZeRO stages > 0 only when dp > 1 (nothing to shard:
  they are the same plan as stage 0);
- expert parallelism only for mixture-of-experts models: ep divides dp (* cp) and every layer's
  number of experts (``expert_degrees``, ``validate.ep_problem``);
- only what the framework runs (``frameworks.framework_supports``: its schedules, ZeRO stages,
  ZeRO with pipelines, sequence parallelism, cp, HSDP, offload, dtypes);
- cp, HSDP (dp_replicate) and the dtype as ``dimensions.py`` chooses them; offloaded variants
  are added by the planner where a candidate fits no split without (``offload_variants``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from autopar.config import ParallelConfig
from autopar.cost_model.comm import tp_spans_nodes
from autopar.cost_model.frameworks import framework_supports, get_framework
from autopar.cost_model.hardware import DeviceSpec
from autopar.cost_model.validate import ep_problem, sp_problem, stages_problem, tp_problem
from autopar.schedules import DEFAULT_SCHEDULE, check_schedule, get_schedule
from autopar.search.dimensions import cp_choices, dtype_choices, replicate_choices
from autopar.search.options import SearchOptions

__all__ = [
    "divisors",
    "enumerate_candidates",
    "expert_degrees",
    "mesh_shapes",
    "schedule_accepts",
    "schedule_variants",
]



def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending: pairs (d, n // d) for d up to sqrt(n).

    O(sqrt(n)); callers bound n first (``MAX_GPUS``, ``MAX_GLOBAL_BATCH``).
    """
    if n < 1:
        raise ValueError(f"divisors() needs a positive integer, got {n}")
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if d * d != n]
    return small + large


def mesh_shapes(
    world_size: int,
    *,
    head_counts: tuple[int, ...],
    gpus_per_node: int,
    num_layers: int,
    max_tp: int | None = None,
    allow_tp_across_nodes: bool = False,
) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) with dp * tp * pp = world_size, ordered by pp, then tp.

    Args:
        world_size: GPUs in the job.
        head_counts: attention and key/value head counts of the model and its layers; tp
            divides each.
        gpus_per_node: GPUs per node; tp stays within (and divides) it unless allowed across.
        num_layers: profile layers (pp <= num_layers).
        max_tp: optional upper bound on tp.
        allow_tp_across_nodes: let tp exceed the node size.
    """
    shapes = []
    heads = [("heads", h) for h in head_counts]
    for pp in divisors(world_size):
        if stages_problem(pp, num_layers):
            continue
        for tp in divisors(world_size // pp):
            if tp_problem(tp, heads):
                continue
            if max_tp is not None and tp > max_tp:
                continue
            if not allow_tp_across_nodes and tp_spans_nodes(tp, gpus_per_node):
                continue
            shapes.append((world_size // (pp * tp), tp, pp))
    return shapes


def expert_degrees(dp: int, cp: int, expert_counts: tuple[int, ...]) -> list[int]:
    """Expert-parallel degrees to consider: divisors of dp * cp that divide every count in
    ``expert_counts`` (the routed experts of each MoE layer); [1] for a dense model."""
    if not expert_counts:
        return [1]
    return [e for e in divisors(dp * cp) if ep_problem(e, expert_counts) is None]


def schedule_accepts(schedule: str, pp: int, virtual_stages: int, num_microbatches: int) -> bool:
    """Whether torch 2.13's schedule class accepts m micro-batches on pp ranks x v chunks.

    The rules live once, in ``autopar.schedules.check_schedule``.
    """
    try:
        check_schedule(schedule, pp, virtual_stages, num_microbatches)
    except ValueError:
        return False
    return True


def schedule_variants(pp: int, num_layers: int, options: SearchOptions) -> list[tuple[str, int]]:
    """(schedule, virtual_stages) pairs for pp ranks, in ``options.schedules`` order.

    pp == 1 has one variant, (``DEFAULT_SCHEDULE``, 1): no pipeline, the schedule is ignored.
    A schedule with a fixed chunk count (``Schedule.chunks_per_rank``) gets that count, the other
    multi-chunk ones 2 .. ``options.max_virtual_stages``.
    """
    if pp == 1:
        return [(DEFAULT_SCHEDULE, 1)]
    out: list[tuple[str, int]] = []
    for name in options.schedules:
        schedule = get_schedule(name)
        if schedule.zero_bubble and not options.allow_zero_bubble:
            continue
        if schedule.chunks_per_rank:
            vs = [schedule.chunks_per_rank]
        else:
            vs = list(range(2, options.max_virtual_stages + 1))
        out.extend((name, v) for v in vs if stages_problem(pp * v, num_layers) is None)
    return out


def enumerate_candidates(
    *,
    world_size: int,
    gpus_per_node: int,
    head_counts: tuple[int, ...],
    num_layers: int,
    global_batch: int,
    options: SearchOptions,
    seq_len: int | None = None,
    device: DeviceSpec | None = None,
    dtypes: list[str] | None = None,
    expert_counts: tuple[int, ...] = (),
    moe_sequence_parallel: bool = True,
    sequence_parallel: bool = True,
) -> Iterator[ParallelConfig]:
    """Every outer candidate, in a deterministic order (pp, tp, cp, micro-batch, schedule, ZeRO,
    HSDP, SP, ep, dtype). Without ``seq_len`` no cp > 1 is tried; the dtypes are ``dtypes``,
    else ``dimensions.dtype_choices`` of ``device``; ``expert_counts``: routed experts of each
    MoE layer (empty for a dense model); ``moe_sequence_parallel``: whether the framework runs
    the model's MoE blocks under sequence parallelism (``framework_support.moe_sp_blocker``);
    ``sequence_parallel``: whether it runs the model sequence-parallel at all
    (``framework_support.sp_runs_on``)."""
    shapes = mesh_shapes(
        world_size,
        head_counts=head_counts,
        gpus_per_node=gpus_per_node,
        num_layers=num_layers,
        max_tp=options.max_tp,
        allow_tp_across_nodes=options.allow_tp_across_nodes,
    )
    framework = get_framework(options.framework)
    dtypes = dtypes or dtype_choices(device, options)
    for data_ranks, tp, pp in shapes:
        for cp in cp_choices(data_ranks, seq_len, options, framework):
            yield from _shape_candidates(data_ranks // cp, cp, tp, pp, gpus_per_node,
                                         num_layers, global_batch, options, dtypes,
                                         expert_counts, moe_sequence_parallel, seq_len,
                                         sequence_parallel)


def _shape_candidates(dp, cp, tp, pp, gpus_per_node, num_layers, global_batch, options,
                      dtypes, expert_counts, moe_sp: bool,
                      seq_len: int | None, sp_ok: bool = True) -> Iterator[ParallelConfig]:
    framework = get_framework(options.framework)
    if global_batch % dp:
        return
    per_replica = global_batch // dp
    sizes = divisors(per_replica)
    if options.micro_batch_sizes is not None:
        sizes = [b for b in sizes if b in options.micro_batch_sizes]
    sps = [sp for sp in sorted(set(options.sequence_parallel))
           if sp_problem(sp, tp, cp, seq_len) is None] or [False]
    if not (framework.sequence_parallel and sp_ok):  # none, or not on this model: without it
        sps = [False]
    if expert_counts and not moe_sp:  # the framework runs these MoE blocks without SP
        sps = [False]
    # ZeRO shards over dp * cp: with one such rank every stage is the same plan as stage 0.
    zeros = sorted(set(options.zero_stages)) if dp * cp > 1 else [0]
    eps = expert_degrees(dp, cp, expert_counts)
    for mb in sizes:
        m = per_replica // mb
        for schedule, v in schedule_variants(pp, num_layers, options):
            if pp > 1 and not schedule_accepts(schedule, pp, v, m):
                continue
            for zero in zeros:
                for rep in replicate_choices(dp, cp, tp, zero, gpus_per_node, options,
                                             framework):
                    for sp, ep, dtype in itertools.product(sps, eps, dtypes):
                        config = ParallelConfig(
                            dp=dp, cp=cp, tp=tp, pp=pp, ep=ep, dp_replicate=rep,
                            micro_batch=mb, global_batch=global_batch, schedule=schedule,
                            virtual_stages=v, sequence_parallel=sp, zero=zero, dtype=dtype,
                        )
                        if framework_supports(framework, config) is None:
                            yield config
