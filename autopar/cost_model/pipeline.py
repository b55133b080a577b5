"""Pipeline-schedule terms: bubble and in-flight micro-batches per stage.

Notation (reference/formulas.md section 0 and 4): p pipeline ranks, m micro-batches per pipeline
per step, v model chunks per rank (virtual stages).

Bubble. GPipe and 1F1B idle for (p - 1) micro-batch slots: bubble / ideal = (p - 1) / m
(Megatron-LM SC'21 section 2.2.1). Interleaving v chunks shrinks each slot v-fold:
(p - 1) / (v m) (section 2.2.2; Llama 3 section 3.3.2). The zero-bubble schedules split the
backward into input-gradient and weight-gradient passes and fill most of the remaining bubble with
weight-gradient work; the ZB-H1 schedule leaves about a third of 1F1B's bubble (Qi et al. 2023,
"Zero Bubble Pipeline Parallelism", section 3: bubble (p-1)(T_F + T_B - T_W) with T_W ~ T_B/2 ...
T_F ~ T_B/2, i.e. about 1/3 of (p-1)(T_F+T_B)), which ``ZERO_BUBBLE_RESIDUAL`` encodes.
"""

from __future__ import annotations

from autopar.schedules import (
    get_schedule,
    interleaved_warmup_forwards,
    microbatches_per_round,
    rank_of_stage,
)

# Receive-buffer policies of a pipeline runtime (``Framework.pipeline_recv_buffers``).
PER_MICROBATCH = "per_microbatch"  # torch PipelineStage: one buffer per micro-batch, whole step
IN_FLIGHT = "in_flight"  # one tensor per transfer, freed with its micro-batch

__all__ = [
    "IN_FLIGHT",
    "PER_MICROBATCH",
    "ZERO_BUBBLE_RESIDUAL",
    "bubble_coefficient",
    "bubble_ratio",
    "in_flight_microbatches",
    "pipeline_buffer_microbatches",
]

# Fraction of the 1F1B bubble that the zero-bubble schedules leave (sourced: Qi et al. 2023,
# ZB-H1, section 3).
ZERO_BUBBLE_RESIDUAL = 1.0 / 3.0


def bubble_ratio(
    schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> float:
    """Bubble time over ideal (bubble-free) time for uniform stages.

    Args:
        schedule: schedule name (see ``autopar.config.SCHEDULES``).
        num_ranks: p, pipeline ranks.
        num_microbatches: m, micro-batches per pipeline per step.
        virtual_stages: v, model chunks per rank.

    Returns:
        (p - 1) / (v m), times ``ZERO_BUBBLE_RESIDUAL`` for zero-bubble schedules; 0 when p == 1.
    """
    if num_ranks <= 1:
        return 0.0
    ratio = (num_ranks - 1) / (virtual_stages * num_microbatches)
    if get_schedule(schedule).zero_bubble:
        ratio *= ZERO_BUBBLE_RESIDUAL
    return ratio


def bubble_coefficient(
    schedule: str, num_ranks: int, virtual_stages: int = 1, num_microbatches: int | None = None
) -> float:
    """Coefficient c of the bubble term ``c * sum_j T_j`` over all stages' per-micro-batch times.

    With uniform stages (T_j = T for all p v stages) the step is m v T (ideal) plus the bubble
    (p - 1) T: c = (p - 1) / (v p) makes ``c * sum_j T_j = (p - 1) T``, which reproduces
    ``bubble_ratio`` exactly, and for uneven stages charges each stage's share of the fill/drain.
    """
    if num_ranks <= 1:
        return 0.0
    p, v = num_ranks, virtual_stages
    m = num_microbatches or p
    if m < p:
        # Too few micro-batches to fill p ranks: one micro-batch's forward and backward cross
        # all p v chunks in turn, (m + v p - 1) chunk-times for m of them, against the ideal
        # m v: c = (v p - 1 - m (v - 1)) / (v p), which is (p - 1) / (v p) at m = p.
        return (v * p - 1 - m * (v - 1)) / (v * p)
    c = (p - 1) / (v * p)
    if get_schedule(schedule).zero_bubble:
        c *= ZERO_BUBBLE_RESIDUAL
    return c


def in_flight_microbatches(
    schedule: str, num_ranks: int, virtual_stages: int, num_microbatches: int, rank: int
) -> float:
    """Micro-batches whose activations a chunk on ``rank`` holds at the rank's peak.

    - no pipeline (p == 1): 1 (gradient accumulation runs micro-batches one after another);
    - gpipe: all m forwards run before any backward: m;
    - 1f1b: rank r warms up with p - r forwards: min(m, p - r) (Megatron-LM SC'21 section 2.2.1);
    - interleaved 1F1B (loop placement, v chunks, N = ``schedules.microbatches_per_round``
      micro-batches back to back per chunk: p when p divides m): torch's Interleaved1F1B and
      Megatron-LM warm up with (v - 1) N + 2 (p - 1 - r) chunk-forwards, then keep one more
      in flight (``schedules.interleaved_warmup_forwards``); per chunk that is
      ((v - 1) N + 2 (p - 1 - r) + 1) / v, which at r = 0 and N = p is p (1 + (p - 1) / (p v)),
      Korthikanti et al. 2022's interleaving factor;
    - interleaved zero bubble: torch's ScheduleInterleavedZeroBubble warms up with one forward
      per hop, not two, but a chunk-micro-batch holds its activations until its weight pass,
      which the schedule defers: every rank holds (v - 1) N + min(N, p) chunk-micro-batches
      (at most v m), (v - 1) N / v + min(N, p) / v per chunk;
    - V-shaped, counted on torch's own per-rank action lists (``_calculate_single_rank_operations``
      of ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV`` in torch/distributed/pipelining/
      schedules.py; tests/unit/test_cost_pipeline_orders.py replays them): a chunk-micro-batch
      holds its activations from its forward F to its weight pass W (or its full backward B).
      The most held at once over the rank's two chunks is, for zbv-zero-bubble,
      min(2 p, 2 m, m + r + 1) (its warm-up runs 2 (p - r) - 1 forwards of chunk 0, then
      alternates chunks; I and W run back to back until the cool-down), and for dualpipe-v
      (m >= 2 p) 2 p + 1 (one more than zbv: its overlapped F/B pairs run the forward first).
      Charged as half of it per chunk (chunks balanced by the split).
    Capped at m.
    """
    p, v, m = num_ranks, virtual_stages, num_microbatches
    if p <= 1:
        return 1.0
    if schedule == "gpipe":
        value = float(m)
    elif schedule == "zbv-zero-bubble":
        value = min(2 * p, 2 * m, m + rank + 1) / 2.0
    elif schedule == "dualpipe-v":
        value = (2 * p + 1) / 2.0
    elif schedule == "interleaved-zero-bubble":
        n = microbatches_per_round(p, m)
        value = min(v * m, (v - 1) * n + min(n, p)) / v
    elif v > 1:
        value = interleaved_warmup_forwards(p, v, rank, m) / v
    else:
        value = float(p - rank)
    return min(float(m), value)


def pipeline_buffer_microbatches(
    schedule: str, num_ranks: int, virtual_stages: int, num_microbatches: int, rank: int,
    policy: str = PER_MICROBATCH,
) -> int:
    """One-micro-batch stage-boundary tensors that torch's PipelineStages of ``rank`` hold.

    torch/distributed/pipelining/stage.py (``PipelineStage._setup_forward_recv_info``,
    ``_create_grad_recv_info``, via ``_make_tensor_from_meta``) allocates, once per micro-batch,
    a receive buffer for the stage input on every stage but the first and one for the output
    gradient on every stage but the last, and keeps them in ``args_recv_info`` /
    ``grad_recv_info`` for the whole step (a V schedule's same-rank neighbour hands its tensor
    over in place of the buffer, which is then kept instead). With the backward split into
    input and weight passes (interleaved-zero-bubble, zbv-zero-bubble),
    ``_backward.stage_backward_input`` also leaves each micro-batch's input gradient on the
    receive buffer's ``.grad`` until ``clear_runtime_states`` at the next step: m more per
    stage but the first. (dualpipe-v runs full backwards until its cool-down, after its peak.)
    Every such tensor has the boundary activation's size; the caller multiplies.

    ``policy="in_flight"`` counts what a runtime that allocates a tensor per transfer and frees
    it with its micro-batch holds at most (Megatron-LM's p2p_communication, DeepSpeed's pipe
    buffers): one input and one output-gradient tensor per chunk of the rank.

    Returns:
        The count (0 without a pipeline).
    """
    p, m = num_ranks, num_microbatches
    if p <= 1:
        return 0
    num_stages = p * virtual_stages
    split_backward = get_schedule(schedule).split_backward
    count = 0
    for stage in range(num_stages):
        if rank_of_stage(schedule, p, stage) != rank:
            continue
        per = 1 if policy == IN_FLIGHT else m
        if stage > 0:
            count += per * (2 if split_backward else 1)
        if stage < num_stages - 1:
            count += per
    return count
