"""Device mesh for a plan: axes ("pp", "dp", "tp") with tensor parallelism innermost.

TP is the innermost axis so that its ranks are consecutive (on a GPU node they share the fast
intra-node links); dp is next and pp outermost, as in torchtitan and Megatron-LM. The mesh always
has all three axes, also when a degree is 1, so code can name an axis without checking for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.config import ParallelConfig
from autopar.errors import PlanMismatchError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from autopar.plan import Plan

__all__ = ["MESH_AXES", "build_mesh", "config_of"]

# Mesh axis names, outermost first. Rank r has coordinates (r // (dp*tp), (r // tp) % dp, r % tp).
MESH_AXES: tuple[str, str, str] = ("pp", "dp", "tp")


def config_of(plan_or_config: Plan | ParallelConfig) -> ParallelConfig:
    """The ParallelConfig of a Plan, or the config itself."""
    if isinstance(plan_or_config, ParallelConfig):
        return plan_or_config
    return plan_or_config.config


def build_mesh(plan_or_config: Plan | ParallelConfig, device_type: str = "cpu") -> DeviceMesh:
    """Build the 3-D device mesh ("pp", "dp", "tp") of a plan on the current process group.

    The default process group must already be initialised (``torch.distributed.init_process_group``)
    with exactly ``pp * dp * tp`` ranks.

    Args:
        plan_or_config: a Plan or a ParallelConfig.
        device_type: "cpu" (gloo) or "cuda" (NCCL).

    Returns:
        A DeviceMesh of shape (pp, dp, tp) named ``MESH_AXES``.

    Raises:
        PlanMismatchError: the world size of the process group differs from the plan's.

    Example:
        >>> mesh = build_mesh(plan, "cpu")
        >>> mesh["tp"].size(), mesh["dp"].get_local_rank()
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cfg = config_of(plan_or_config)
    world_size = dist.get_world_size()
    if world_size != cfg.world_size:
        raise PlanMismatchError(
            f"the plan needs {cfg.world_size} processes (pp={cfg.pp} x dp={cfg.dp} x tp={cfg.tp}) "
            f"but {world_size} were launched; launch with --nproc-per-node {cfg.world_size}"
        )
    return init_device_mesh(device_type, (cfg.pp, cfg.dp, cfg.tp), mesh_dim_names=MESH_AXES)
