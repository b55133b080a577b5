"""Device mesh for a plan: axes ("pp", "dp", "cp", "tp") with tensor parallelism innermost.

TP is the innermost axis so that its ranks are consecutive (on a GPU node they share the fast
intra-node links); context parallelism (cp) is next, then dp, and pp outermost, as in torchtitan
(its order pp, dp_replicate, dp_shard, cp, tp) and Megatron-LM. The mesh always has all four axes,
also when a degree is 1, so code can name an axis without checking for it.

Data parallelism runs on ``data_parallel_mesh(mesh, config)``: the "dp" axis itself, or, with
context parallelism, "dp" and "cp" flattened into one axis "dp_cp" (the cp ranks of a replica hold
the same parameters and their gradients are averaged together, as torchtitan's "dp_shard_cp");
with HSDP (``dp_replicate > 1``) that axis is unflattened into the 2-D (replicate, shard) mesh
("dp_replicate", "dp_shard") or ("dp_replicate", "dp_shard_cp") that FSDP2 takes for HSDP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.config import MESH_AXES, ParallelConfig
from autopar.errors import PlanMismatchError

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from autopar.plan import Plan

__all__ = ["MESH_AXES", "backend_of", "build_mesh", "config_of", "data_parallel_mesh",
           "default_dtype", "dp_rank", "mesh_device", "random_ops_seed"]

# A large prime that mixes a rank's (pp, dp, cp) coordinate into the seed of its random ops.
_RANK_MIX = 1_000_003



def config_of(plan_or_config: Plan | ParallelConfig) -> ParallelConfig:
    """The ParallelConfig of a Plan, or the config itself."""
    if isinstance(plan_or_config, ParallelConfig):
        return plan_or_config
    return plan_or_config.config


def build_mesh(plan_or_config: Plan | ParallelConfig, device_type: str = "cpu") -> DeviceMesh:
    """Build the 4-D device mesh ("pp", "dp", "cp", "tp") of a plan on the current process group.

    The default process group must already be initialised (``torch.distributed.init_process_group``)
    with exactly ``pp * dp * cp * tp`` ranks.

    Args:
        plan_or_config: a Plan or a ParallelConfig.
        device_type: "cpu" (gloo) or "cuda" (NCCL).

    Returns:
        A DeviceMesh of shape (pp, dp, cp, tp) named ``MESH_AXES``.

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
            f"the plan needs {cfg.world_size} processes (pp={cfg.pp} x dp={cfg.dp} x cp={cfg.cp} x "
            f"tp={cfg.tp}) but {world_size} were launched; launch with --nproc-per-node "
            f"{cfg.world_size}"
        )
    return init_device_mesh(
        device_type, tuple(getattr(cfg, axis) for axis in MESH_AXES), mesh_dim_names=MESH_AXES
    )


def data_parallel_mesh(mesh: DeviceMesh, config: ParallelConfig) -> DeviceMesh:
    """The mesh data parallelism (DDP, replicate(), FSDP2) runs on, for ``build_mesh``'s mesh.

    * cp == 1, dp_replicate == 1: the 1-D "dp" axis.
    * cp > 1: "dp" x "cp" flattened into the 1-D axis "dp_cp" (dp-major): gradients are averaged
      over the cp ranks too, and FSDP2 shards over them (torchtitan's "dp_shard_cp").
    * dp_replicate > 1 (HSDP): that 1-D axis unflattened into the 2-D (replicate, shard) mesh
      ("dp_replicate", "dp_shard") (or "dp_shard_cp" with cp > 1): FSDP2 shards over the inner
      axis and all-reduces gradients over the outer one. Replica r holds dp ranks
      ``r * dp_shard .. (r + 1) * dp_shard - 1``.

    Args:
        mesh: ``build_mesh(config)``'s mesh.
        config: the plan's config.

    Returns:
        A 1-D or 2-D DeviceMesh.
    """
    dp_mesh = mesh["dp"] if config.cp == 1 else mesh["dp", "cp"]._flatten("dp_cp")
    if config.dp_replicate == 1:
        return dp_mesh
    shard_name = "dp_shard" if config.cp == 1 else "dp_shard_cp"
    return dp_mesh._unflatten(
        0, (config.dp_replicate, config.shard_ranks), ("dp_replicate", shard_name)
    )


def dp_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's coordinate on the "dp" axis, the axis's size), without building a sub-mesh.

    NOTE: indexing the mesh (``mesh["dp"]``) builds a sub-mesh on every call (about 0.2 ms on
    CPU); the dimension's size and this rank's coordinate need none.
    """
    dim = mesh.mesh_dim_names.index("dp")
    return mesh.get_local_rank(dim), mesh.size(dim)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device on ``mesh``: its current CUDA device, or the mesh's device type."""
    import torch

    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def backend_of(device_type: str) -> str:
    """The process-group backend for a device type: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def default_dtype(device_type: str) -> str:
    """The training dtype when none is given: bf16 on a GPU, fp32 on the CPU (where autopar's
    runs are checked against one process to fp32's precision)."""
    return "bf16" if device_type == "cuda" else "fp32"


def random_ops_seed(mesh: DeviceMesh, seed: int) -> int:
    """The generator seed of this rank's random ops (dropout) for ``seed``.

    The same on the ranks of one tensor-parallel group: they run the same ops on the same
    replicated activations (the embedding's and the residual's dropout) and must draw the same
    masks, or the replicated parameters drift apart. Distinct across the pp, dp and cp
    coordinates, which hold other layers, samples or tokens. Within torch's signed 64-bit seeds.
    """
    index = 0
    for axis in ("pp", "dp", "cp"):
        dim = mesh.mesh_dim_names.index(axis)
        index = index * mesh.size(dim) + mesh.get_local_rank(dim)
    return (seed * _RANK_MIX + index) % 2**63
