"""Hand-made Plans for the report, export and CLI tests (no planner needed)."""

from __future__ import annotations

from autopar.config import ParallelConfig
from autopar.cost_model.estimate import Estimate, MemoryBreakdown, StageEstimate, TimeBreakdown
from autopar.plan import Plan, StagePlan

GIB = 2**30
NAMES = ("embedding", "layers.0", "layers.1", "layers.2", "layers.3", "head")
SEQ_LEN = 32


def make_estimate(config: ParallelConfig, *, step_s: float = 2.0, mem_gib: float = 40.0,
                  tp_comm_s: float = 0.1, chunks: tuple[tuple[int, int], ...] = ()) -> Estimate:
    """An Estimate whose terms add up to ``step_s`` and whose per-rank figures are plausible."""
    tb = TimeBreakdown(compute_s=step_s - tp_comm_s - 0.3, tp_comm_s=tp_comm_s, dp_comm_s=0.1,
                       bubble_s=0.15, optimizer_s=0.05)
    g = mem_gib * GIB
    mem = MemoryBreakdown(parameters_bytes=0.2 * g, gradients_bytes=0.2 * g,
                          optimizer_bytes=0.3 * g, activations_bytes=0.25 * g,
                          buffers_bytes=0.05 * g)
    stages = []
    per_rank = config.virtual_stages if config.pp > 1 else 1
    for rank in range(config.pp):
        idx = tuple(rank + k * config.pp for k in range(per_rank)) if config.pp > 1 else (0,)
        layers = tuple(chunks[i] for i in idx) if chunks else ((0, len(NAMES) - 1),)
        stages.append(StageEstimate(rank=rank, stages=idx, layers=layers, num_params=1_000_000,
                                    time_per_microbatch_s=0.1, memory=mem))
    tokens = config.global_batch * SEQ_LEN
    return Estimate(step_time_s=step_s, tokens_per_s=tokens / step_s, tflops_per_gpu=150.0,
                    hardware_tflops_per_gpu=180.0, mfu=0.48, memory_per_gpu_bytes=mem.total_bytes,
                    memory_capacity_bytes=76 * GIB, fits=mem_gib <= 76, time_breakdown=tb,
                    memory_breakdown=mem, stages=tuple(stages), binding="memory of pipeline rank 0")


def make_plan(**overrides: object) -> Plan:
    """dp=2 tp=2 pp=2 interleaved (4 chunks over 6 layers) unless ``overrides`` say otherwise."""
    fields = dict(dp=2, tp=2, pp=2, micro_batch=1, global_batch=16, schedule="interleaved-1f1b",
                  virtual_stages=2, recompute="selective", sequence_parallel=True, zero=1)
    fields.update(overrides)
    config = ParallelConfig(**fields)
    n = config.num_stages
    bounds = {1: [(0, 5)], 2: [(0, 2), (3, 5)], 4: [(0, 1), (2, 2), (3, 4), (5, 5)]}[n]
    stages = tuple(StagePlan(index=i, layers=b, layer_names=NAMES[b[0]:b[1] + 1],
                             recompute=(config.recompute,) * (b[1] - b[0] + 1))
                   for i, b in enumerate(bounds))
    world = config.world_size  # the recorded cluster holds exactly the split's GPUs
    cluster = {"name": "a100-80g", "nodes": max(1, world // 8), "gpus_per_node": min(world, 8)}
    return Plan(config=config, stages=stages, estimate=make_estimate(config, chunks=tuple(bounds)),
                model="gpt:layers=4,hidden=64,heads=4,vocab=256,seq_len=32", cluster=cluster,
                profile_fingerprint="abc", cluster_fingerprint="def")
