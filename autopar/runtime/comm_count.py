"""Count the collectives a piece of code emits, by kind and mesh axis (torch's CommDebugMode).

Kinds are the functional-collective names: ``all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``, ``broadcast``, and their ``_coalesced`` forms.
Both DTensor's functional collectives (tensor parallelism) and the c10d collectives that FSDP2,
``replicate()`` and ``torch.distributed`` calls issue are counted, using CommDebugMode's own
registry of collective ops. DDP's C++ reducer and pipeline send/recv do not pass through the
Python dispatcher and are not counted.

NOTE: CommDebugMode's per-module tracker fails on repeated forwards of one model inside one mode
(``IndexError`` in ``_fw_set_module_hook``, torch 2.13), so ``count_collectives`` runs the mode
without it; the counting rule (which ops are collectives, native funcol names mapped to their
Python names) is CommDebugMode's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autopar.cost_model.comm import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["count_collectives"]

# c10d op name -> functional-collective kind.
_C10D_KINDS: dict[str, str] = {
    "allreduce_": ALL_REDUCE,
    "allreduce_coalesced_": "all_reduce_coalesced",
    "_allgather_base_": ALL_GATHER,
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather_coalesced",
    "allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
    "_reduce_scatter_base_": REDUCE_SCATTER,
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced",
    "alltoall_": "all_to_all",
    "alltoall_base_": ALL_TO_ALL,
    "broadcast_": "broadcast",
    "gather_": "gather",
    "scatter_": "scatter",
    "reduce_": "reduce",
}


def _kind(packet: Any) -> str:
    name = getattr(packet, "__name__", str(packet)).split(".")[0]
    return _C10D_KINDS.get(name, name)


def _group_name(args: tuple[Any, ...]) -> str:
    import torch
    import torch.distributed as dist

    # funcol ops carry the group's name as their last str argument (after e.g. the reduce op);
    # c10d ops carry the ProcessGroup object.
    for arg in reversed(args):
        if isinstance(arg, str):
            return arg
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg).group_name
            except (RuntimeError, TypeError):
                continue
    return ""


def _axis_names(mesh: DeviceMesh | None) -> dict[str, str]:
    import torch.distributed as dist

    world = dist.group.WORLD if dist.is_initialized() else None
    names: dict[str, str] = {world.group_name: "world"} if world is not None else {}
    if mesh is not None:
        for axis in mesh.mesh_dim_names or ():
            names[mesh[axis].get_group().group_name] = axis
        # Flattened axes (context parallelism's "dp_cp"), where no root axis already names the
        # group. NOTE: ``_flatten_mapping`` is DeviceMesh's private registry (torch 2.13).
        for axis, flat in getattr(mesh, "_flatten_mapping", {}).items():
            names.setdefault(flat.get_group().group_name, axis)
    return names


def _counting_mode() -> Any:
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import (
        NATIVE_TO_PY_MAPPING,
        c10d_collective_ops,
    )
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Counting(CommDebugMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[Any, str]] = []

        def __enter__(self) -> _Counting:
            TorchDispatchMode.__enter__(self)
            return self

        def __exit__(self, *args: Any) -> None:
            TorchDispatchMode.__exit__(self, *args)

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            packet = func._overloadpacket
            if packet in self.comm_registry or packet in c10d_collective_ops:
                packet = NATIVE_TO_PY_MAPPING.get(packet, packet)
                self.comm_counts[packet] += 1
                self.calls.append((packet, _group_name(tuple(args))))
            return out

    return _Counting()


def count_collectives(
    fn: Callable[[], Any], mesh: DeviceMesh | None = None
) -> dict[str, int]:
    """Run ``fn()`` and count the collectives it issues on this rank.

    Args:
        fn: the code to run (e.g. ``lambda: train_step(pm, x, y, opt)``); capture its results
            through a closure.
        mesh: if given, count per mesh axis: keys become ``"kind@axis"`` (axis "pp", "dp", "cp",
            "tp", a flattened axis such as "dp_cp", "world" for the default group, "other" for
            any other group, e.g. HSDP's replicate and shard groups).

    Returns:
        Kind (or ``kind@axis``) -> number of calls, sorted; kinds never called are omitted.
    """
    axes = _axis_names(mesh)
    mode = _counting_mode()
    with mode:
        fn()
    counts: Counter[str] = Counter()
    for packet, group in mode.calls:
        kind = _kind(packet)
        counts[f"{kind}@{axes.get(group, 'other')}" if mesh is not None else kind] += 1
    return dict(sorted(counts.items()))
