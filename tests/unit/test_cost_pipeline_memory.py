"""Pipeline memory terms against torch's own schedules and PipelineStage buffers.

``in_flight_microbatches`` for the interleaved and V-shaped schedules is a closed form; here it is
checked against the per-rank action lists torch's schedule classes generate
(``_calculate_single_rank_operations``, run without a process group).
``pipeline_buffer_microbatches`` counts PipelineStage's receive buffers; ``assemble`` charges them
per rank as ``pipeline_buffers_bytes``.
"""

from __future__ import annotations

import pytest

from autopar.config import ParallelConfig
from autopar.cost_model.assemble import assemble
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table
from autopar.cost_model.pipeline import in_flight_microbatches, pipeline_buffer_microbatches

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def _torch_order(cls, p: int, m: int) -> dict[int, list]:
    """torch's compute actions per rank for two stages per rank (no stages or groups needed)."""
    sched = object.__new__(cls)
    sched.pp_group_size, sched._n_microbatches = p, m
    sched.num_stages = sched._num_stages = 2 * p
    out = {}
    for rank in range(p):
        flat = []
        for action in sched._calculate_single_rank_operations(rank):
            if action is None:
                continue
            if action.computation_type == schedules.OVERLAP_F_B:
                flat.extend(action.sub_actions)  # the runtime runs the forward first
            else:
                flat.append(action)
        out[rank] = flat
    return out


def _most_held(actions: list) -> int:
    """Most chunk-micro-batches holding activations at once: from F to W (split) or B (full)."""
    held: set[tuple[int, int]] = set()
    most = 0
    for a in actions:
        key = (a.stage_index, a.microbatch_index)
        if a.computation_type == schedules.FORWARD:
            held.add(key)
        elif a.computation_type in (schedules.BACKWARD_WEIGHT, schedules.FULL_BACKWARD):
            held.discard(key)
        most = max(most, len(held))
    return most


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_zbv_in_flight_matches_torch_order(p):
    for m in range(1, 3 * p + 1):
        order = _torch_order(schedules.ScheduleZBVZeroBubble, p, m)
        for rank in range(p):
            fly = in_flight_microbatches("zbv-zero-bubble", p, 2, m, rank)
            assert 2 * fly == _most_held(order[rank]), (p, m, rank)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_dualpipe_v_in_flight_matches_torch_order(p):
    for m in range(2 * p, 4 * p + 1):
        order = _torch_order(schedules.ScheduleDualPipeV, p, m)
        for rank in range(p):
            fly = in_flight_microbatches("dualpipe-v", p, 2, m, rank)
            assert 2 * fly == _most_held(order[rank]), (p, m, rank)


def _torch_interleaved_order(cls, p: int, v: int, m: int) -> dict[int, list]:
    """torch's compute actions per rank of an interleaved (loop placement) schedule."""
    sched = object.__new__(cls)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    return {rank: [a for a in sched._calculate_single_rank_operations(rank) if a is not None]
            for rank in range(p)}


@pytest.mark.parametrize(("name", "cls"), [
    ("interleaved-1f1b", "ScheduleInterleaved1F1B"),
    ("interleaved-zero-bubble", "ScheduleInterleavedZeroBubble")])
@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_interleaved_in_flight_matches_torch_order(name, cls, p):
    """Both interleaved schedules, every m torch takes (m a multiple of its round count), so
    also the m that are no multiple of pp: the groups of N = m // (m // p) micro-batches."""
    for v in (2, 3, 4):
        for m in range(1, 5 * p + 1):
            if m % max(1, m // p):
                continue  # torch refuses it
            order = _torch_interleaved_order(getattr(schedules, cls), p, v, m)
            for rank in range(p):
                fly = in_flight_microbatches(name, p, v, m, rank)
                assert v * fly == pytest.approx(_most_held(order[rank])), (p, v, m, rank)


def test_buffer_counts_per_rank():
    m = 8
    # 1F1B, 4 ranks: the first stage receives gradients only, the last activations only.
    assert [pipeline_buffer_microbatches("1f1b", 4, 1, m, r) for r in range(4)] == [
        m, 2 * m, 2 * m, m]
    # Interleaved, 2 ranks x 2 chunks: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3.
    assert [pipeline_buffer_microbatches("interleaved-1f1b", 2, 2, m, r) for r in range(2)] == [
        3 * m, 3 * m]
    # ZBV (split backward): + the input gradients kept on the receive buffers.
    assert [pipeline_buffer_microbatches("zbv-zero-bubble", 2, 2, m, r) for r in range(2)] == [
        m + 2 * m, 3 * m + 3 * m]
    assert [pipeline_buffer_microbatches("dualpipe-v", 2, 2, m, r) for r in range(2)] == [
        2 * m, 4 * m]
    assert pipeline_buffer_microbatches("1f1b", 1, 1, m, 0) == 0


def _llama_profile(kernels: str = "cuda"):
    import autopar
    from autopar.models import build

    model = build("llama", layers=4, hidden=64, heads=4, kv_heads=2, vocab=128, seq_len=16)
    return autopar.profile(model, dtype="fp32", kernels=kernels)


def test_assemble_charges_pipeline_buffers():
    profile = _llama_profile()
    cluster = Cluster.preset("cpu", gpus_per_node=4)
    cfg = ParallelConfig(pp=4, global_batch=8, micro_batch=1, dtype="fp32")
    split = ((0, 1), (2, 2), (3, 3), (4, 5))
    # torch's PipelineStage (torchtitan): one buffer per micro-batch and direction, all step;
    # autopar's lean stages: one per transfer in flight (frameworks.py).
    for framework, counts in (("torchtitan", (8, 16, 16, 8)), ("autopar", (1, 2, 2, 1))):
        table = build_cost_table(profile, cluster, cfg, framework)
        assert table.recv_buffer_bytes == 16 * 64 * 4  # one [1, s, h] fp32 boundary tensor
        est = assemble(table, split, ["none"] * profile.num_layers)
        got = [s.memory.pipeline_buffers_bytes for s in est.stages]
        assert got == [n * table.recv_buffer_bytes for n in counts], framework
        assert all(s.memory_bytes == s.memory.total_bytes for s in est.stages)
    single = build_cost_table(profile, cluster, ParallelConfig(dp=4, global_batch=8,
                                                              dtype="fp32"))
    assert single.recv_buffer_bytes == 0.0


def test_profile_cpu_kernels_keep_composite_rms_norm():
    """On CPU torch's RMSNorm composite also keeps x * 1/rms: one [s, h] more per norm."""
    cuda, cpu = _llama_profile("cuda"), _llama_profile("cpu")
    row = 16 * 64 * 4  # [s, h] fp32 per sample
    for a, b in zip(cuda.layers, cpu.layers):
        norms = {"block": 2, "head": 1}.get(a.kind, 0)
        assert b.saved_bytes["none"] - a.saved_bytes["none"] == norms * row, a.name
        assert b.saved_bytes_replicated["none"] - a.saved_bytes_replicated["none"] == norms * row
