"""Data-parallel collectives of a layer under expert parallelism, as autopar's runtime issues them.

The routed experts are left out of a block's data-parallel unit (runtime/expert_parallel.py:
``ignored_params``). Their gradients are reduced over the ``edp`` group, the ``dp * cp / ep``
ranks holding the same experts (ranks ``ep * tp`` apart: the ep ranks of a group are
consecutive): with zero >= 1 the experts module is its own FSDP2 unit over that group (the
same all-gathers and reduce-scatters as a block's unit, on the "edp" axis); with zero 0 a hook
all-reduces each expert tensor's gradient every micro-batch. With ``edp == 1`` nothing is
reduced. Measured: tests/distributed/test_runtime_moe.py counts them on the running runtime.
Experts folded over tp (moe.py ``experts_whole``, Megatron-Core's expert tensor parallel size 1)
are whole on every tp rank: their group is the ``tp * dp * cp / ep`` ranks ``ep`` apart, at
ep 1 too.
"""

from __future__ import annotations

import dataclasses

from autopar.config import ParallelConfig
from autopar.cost_model import comm, memory
from autopar.cost_model.dp_comm import dp_collectives
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.moe import EXPERT_TENSORS, expert_dp, experts_whole, held_expert_params
from autopar.cost_model.tp_comm import tp_sharded
from autopar.graph.types import LayerProfile

__all__ = ["edp_link", "unit_collectives"]


def edp_link(cluster: Cluster, config: ParallelConfig, whole: bool = False) -> comm.GroupLink:
    """The expert-data-parallel group's link: ``dp * cp / ep`` ranks, ``ep * tp`` apart; with
    the experts folded over tp (``whole``), ``tp * dp * cp / ep`` ranks ``ep`` apart."""
    return comm.group_link(cluster, expert_dp(config, whole),
                           config.ep * (1 if whole else config.tp))


def unit_collectives(layer: LayerProfile, config: ParallelConfig,
                     unit_params: float) -> tuple[comm.Collective, ...]:
    """The dp collectives of the unit charged on ``layer`` (``unit_params`` on this rank,
    ``dp_comm.fsdp_unit_params``) and, under ep, of its routed experts (module docstring)."""
    shard = config.tp if tp_sharded(layer) else 1
    experts = held_expert_params(layer, config, shard) if unit_params > 0 else 0.0
    dense = dp_collectives(config, unit_params - experts)
    if experts <= 0 or expert_dp(config, experts_whole(layer, shard)) <= 1:
        return dense
    if config.zero == 0:
        hook = comm.Collective(kind=comm.ALL_REDUCE, axis="edp",
                               size_bytes=memory.GRAD_BYTES * experts / EXPERT_TENSORS,
                               calls=EXPERT_TENSORS, per="microbatch", phase="backward")
        return (*dense, hook)
    own = dp_collectives(dataclasses.replace(config, dp_replicate=1), experts)
    return (*dense, *(dataclasses.replace(c, axis="edp") for c in own))
