"""``autopar run --dry-run``: apply a plan at its full world size without hardware.

One process simulates every rank in turn: it joins torch's ``fake`` process-group backend as rank
``r`` of the plan's world size (collectives return at once and move nothing), builds the model on
the meta device (no memory), runs ``apply_plan`` exactly as a worker would, and records the bytes
of the parameters that rank holds (the local shard of every DTensor). Whatever ``apply_plan``
rejects at that scale (heads not divisible by tp, a schedule with too few micro-batches, a model
the runtime cannot shard) fails here, before any machine is booked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DryRunReport", "dry_run", "format_report", "parameter_bytes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DryRunReport:
    """What the dry run found.

    Attributes:
        world_size: ranks simulated.
        per_rank_parameter_bytes: bytes of the parameters each rank holds, by global rank.
        per_rank_stages: the pipeline stage indices each rank runs, by global rank.
        config: the plan's ParallelConfig as a dict.
    """

    world_size: int
    per_rank_parameter_bytes: tuple[int, ...]
    per_rank_stages: tuple[tuple[int, ...], ...]
    config: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the ``--dry-run --json`` document)."""
        return {
            "dry_run": True,
            "world_size": self.world_size,
            "per_rank_parameter_bytes": list(self.per_rank_parameter_bytes),
            "per_rank_stages": [list(s) for s in self.per_rank_stages],
            "config": self.config,
        }


def parameter_bytes(modules: Any) -> int:
    """Bytes of the parameters held locally by ``modules`` (DTensors count their local shard).

    Parameters shared between modules (tied weights) are counted once.
    """
    seen: set[int] = set()
    total = 0
    for module in modules:
        for param in module.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            local = getattr(param, "_local_tensor", param)
            total += local.numel() * local.element_size()
    return total


def _simulate_rank(plan: Any, model_builder: Any, rank: int) -> tuple[int, tuple[int, ...]]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.runtime.apply import apply_plan
    from autopar.runtime.mesh import build_mesh

    world_size = plan.config.world_size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = build_mesh(plan, "cpu")
        pmodel = apply_plan(model_builder(), plan, mesh)
        pp_rank = mesh["pp"].get_local_rank() if plan.config.pp > 1 else 0
        stages = tuple(s.index for s in plan.stages_for_rank(pp_rank))
        return parameter_bytes(pmodel.model_parts), stages
    finally:
        dist.destroy_process_group()


def dry_run(plan: Any, model_text: str) -> DryRunReport:
    """Apply ``plan`` to the model ``model_text`` on every simulated rank.

    Args:
        plan: the Plan to validate.
        model_text: how to build the model (as ``autopar run`` takes it).

    Returns:
        Per-rank parameter bytes and stages.

    Raises:
        AutoparError: what ``apply_plan`` raises for a plan the runtime cannot run.
    """
    from autopar.runtime.worker import build_model

    def build_meta() -> Any:
        return build_model(model_text, device="meta")

    sizes, stages = [], []
    for rank in range(plan.config.world_size):
        nbytes, rank_stages = _simulate_rank(plan, build_meta, rank)
        sizes.append(nbytes)
        stages.append(rank_stages)
    return DryRunReport(
        world_size=plan.config.world_size,
        per_rank_parameter_bytes=tuple(sizes),
        per_rank_stages=tuple(stages),
        config=plan.config.to_dict(),
    )


def format_report(report: DryRunReport) -> str:
    """The dry run as text, one line per rank."""
    lines = [f"autopar run --dry-run: the plan applies on all {report.world_size} ranks"]
    for rank, (nbytes, stages) in enumerate(
        zip(report.per_rank_parameter_bytes, report.per_rank_stages)
    ):
        stage_text = ",".join(str(s) for s in stages)
        lines.append(f"  rank {rank:4d}  stages {stage_text:8s}  parameters {nbytes:,d} bytes")
    return "\n".join(lines) + "\n"
