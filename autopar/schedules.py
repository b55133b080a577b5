"""Pipeline schedules: one record per schedule, its properties, placement and validity check.

Every rule about a schedule lives here once; the config, the cost model, the search, the plot
and the runtime read it from these records. The names are autopar's (``ParallelConfig.schedule``);
each record names the torch 2.13 class that runs it (``torch.distributed.pipelining.schedules``),
and the properties are read from those classes:

- ``ScheduleGPipe``, ``Schedule1F1B``: one stage per rank (``PipelineScheduleSingle``).
- ``ScheduleInterleaved1F1B``: several stages per rank, loop placement, full backwards.
- ``ScheduleInterleavedZeroBubble``: several stages per rank, loop placement; every backward is
  an input-gradient action (``BACKWARD_INPUT``) and a later weight action (``BACKWARD_WEIGHT``).
- ``ScheduleZBVZeroBubble``: two stages per rank in V placement (rank r holds stages r and
  2p - 1 - r); every backward split into I and W.
- ``ScheduleDualPipeV``: two stages per rank in V placement; its steady state runs overlapped
  forward/full-backward pairs (``OVERLAP_F_B`` over ``FULL_BACKWARD``) and only part of its
  warm-up and cool-down splits I from W (``_calculate_single_rank_operations``), so it is a
  zero-bubble schedule whose backward is *not* split.

Micro-batch rules (the classes' ``__init__`` / ``_validate_schedule``):

- GPipe: any number of micro-batches; 1F1B: ``n_microbatches >= num_stages`` (= pp).
- Interleaved1F1B and InterleavedZeroBubble: with ``rounds = max(1, m // pp)``, ``m % rounds == 0``.
- ZBVZeroBubble: exactly 2 stages per rank (it pads the micro-batch count itself).
- DualPipeV: exactly 2 stages per rank and ``m >= num_stages`` (= 2 pp).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "DEFAULT_SCHEDULE",
    "SCHEDULES",
    "SCHEDULE_NAMES",
    "Schedule",
    "check_schedule",
    "get_schedule",
    "interleaved_warmup_forwards",
    "microbatches_per_round",
    "rank_of_stage",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """One pipeline schedule and the properties every layer of autopar reads from it.

    Attributes:
        name: autopar's name (the ``ParallelConfig.schedule`` string).
        torch_class: the ``torch.distributed.pipelining`` class that runs it.
        multi_chunk: several model chunks ("virtual stages") per pipeline rank.
        chunks_per_rank: the exact chunk count the class requires, or 0 when any count >= 2
            (multi-chunk) or 1 (single-chunk) is accepted.
        v_shaped: V placement (rank r holds stages r and 2p - 1 - r) instead of loop placement.
        split_backward: every backward runs as an input-gradient pass then a weight pass.
        zero_bubble: weight-gradient work fills most of the bubble (Qi et al. 2023).
    """

    name: str
    torch_class: str
    multi_chunk: bool = False
    chunks_per_rank: int = 0
    v_shaped: bool = False
    split_backward: bool = False
    zero_bubble: bool = False

    @property
    def torchtitan_name(self) -> str:
        """torchtitan's ``pipeline_parallel_schedule``: the torch class less "Schedule"."""
        return self.torch_class.removeprefix("Schedule")

    def default_virtual_stages(self, pp: int) -> int:
        """Model chunks per rank when none is asked for: 2 for a multi-chunk schedule over
        pp > 1 ranks (the fewest it accepts), else 1."""
        return 2 if self.multi_chunk and pp > 1 else 1

    def rank_of_stage(self, num_ranks: int, stage_index: int) -> int:
        """Pipeline rank that runs model chunk ``stage_index``.

        Loop placement: stage s on rank s % p (torch's default stage-to-rank map). V placement:
        rank r holds stages r and 2p - 1 - r.
        """
        if num_ranks <= 1:
            return 0
        if self.v_shaped:
            return stage_index if stage_index < num_ranks else 2 * num_ranks - 1 - stage_index
        return stage_index % num_ranks


_ALL = (
    Schedule(name="gpipe", torch_class="ScheduleGPipe", chunks_per_rank=1),
    Schedule(name="1f1b", torch_class="Schedule1F1B", chunks_per_rank=1),
    Schedule(name="interleaved-1f1b", torch_class="ScheduleInterleaved1F1B", multi_chunk=True),
    Schedule(name="interleaved-zero-bubble", torch_class="ScheduleInterleavedZeroBubble",
             multi_chunk=True, split_backward=True, zero_bubble=True),
    Schedule(name="zbv-zero-bubble", torch_class="ScheduleZBVZeroBubble", multi_chunk=True,
             chunks_per_rank=2, v_shaped=True, split_backward=True, zero_bubble=True),
    Schedule(name="dualpipe-v", torch_class="ScheduleDualPipeV", multi_chunk=True,
             chunks_per_rank=2, v_shaped=True, zero_bubble=True),
)
SCHEDULES: MappingProxyType[str, Schedule] = MappingProxyType({s.name: s for s in _ALL})
SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULES)
# The schedule of a config that names none (and of pp == 1, where it is ignored).
DEFAULT_SCHEDULE = "1f1b"


def get_schedule(name: str) -> Schedule:
    """The Schedule record of ``name`` (ValueError naming the known ones otherwise)."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"ParallelConfig.schedule {name!r} is unknown; use one of {SCHEDULE_NAMES}"
        ) from None


def rank_of_stage(schedule: str, num_ranks: int, stage_index: int) -> int:
    """Pipeline rank that runs model chunk ``stage_index`` under ``schedule`` (by name)."""
    return get_schedule(schedule).rank_of_stage(num_ranks, stage_index)


def microbatches_per_round(num_ranks: int, num_microbatches: int) -> int:
    """N, the micro-batches an interleaved schedule runs back to back through each chunk:
    torch's ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble`` take
    m // max(1, m // p) (p when m is a multiple of p, as Megatron-LM requires; m when m < p)."""
    p, m = num_ranks, max(1, num_microbatches)
    return m // max(1, m // p)


def interleaved_warmup_forwards(num_ranks: int, virtual_stages: int, rank: int,
                                num_microbatches: int) -> int:
    """Chunk forwards an interleaved (loop placement) rank runs before its first backward, plus
    the one its steady state keeps in flight: (v - 1) N + 2 (p - 1 - r) + 1, at most v m
    (Narayanan et al. 2021; Megatron-LM schedules.py and torch's ``ScheduleInterleaved1F1B``
    warm up with (v - 1) N + 2 (p - 1 - r); N: ``microbatches_per_round``)."""
    p, v, m = num_ranks, virtual_stages, num_microbatches
    n = microbatches_per_round(p, m)
    return min(v * m, (v - 1) * n + 2 * (p - 1 - rank) + 1)


def _chunk_problem(s: Schedule, pp: int, virtual_stages: int, exact: bool) -> str | None:
    if pp == 1 and virtual_stages != 1:
        return (f"virtual_stages={virtual_stages} splits each pipeline rank's layers into chunks, "
                "and pp = 1 has no pipeline; set virtual_stages=1 or pp > 1")
    if s.multi_chunk and pp > 1 and virtual_stages < 2:
        return f"schedule {s.name!r} needs virtual_stages >= 2 (model chunks per rank)"
    if not s.multi_chunk and virtual_stages != 1:
        return (f"schedule {s.name!r} runs one model chunk per rank; set virtual_stages=1 or "
                "use an interleaved schedule")
    if exact and s.chunks_per_rank > 1 and pp > 1 and virtual_stages != s.chunks_per_rank:
        return (f"schedule {s.name} needs exactly {s.chunks_per_rank} stages per rank "
                f"(virtual_stages={s.chunks_per_rank}), got {virtual_stages}")
    return None


def _microbatch_problem(s: Schedule, pp: int, virtual_stages: int, m: int) -> str | None:
    stages = pp * virtual_stages
    if s.name == "1f1b" and m < stages:
        return (f"schedule 1f1b needs at least pp = {pp} micro-batches per pipeline, got {m}; "
                "raise global_batch or lower dp * micro_batch")
    if s.name in ("interleaved-1f1b", "interleaved-zero-bubble"):
        rounds = max(1, m // pp)
        if m % rounds:
            return (f"schedule {s.name} needs micro-batches per pipeline ({m}) to be a multiple "
                    f"of the number of rounds max(1, m // pp) = {rounds}; use a multiple of "
                    f"pp = {pp}")
    if s.name == "dualpipe-v" and m < stages:
        return f"schedule dualpipe-v needs micro-batches per pipeline >= stages ({m} < {stages})"
    return None


def check_schedule(
    schedule: str, pp: int, virtual_stages: int, num_microbatches: int | None = None
) -> None:
    """Raise ValueError unless torch's schedule class accepts this pipeline shape.

    Args:
        schedule: schedule name.
        pp: pipeline ranks.
        virtual_stages: model chunks per rank.
        num_microbatches: micro-batches per pipeline per step (m); None checks only the rules
            a ParallelConfig enforces on its own (multi-chunk or not).
    """
    s = get_schedule(schedule)
    problem = _chunk_problem(s, pp, virtual_stages, exact=num_microbatches is not None)
    if problem is None and num_microbatches is not None and pp > 1:
        problem = _microbatch_problem(s, pp, virtual_stages, num_microbatches)
    if problem is not None:
        raise ValueError(problem)
