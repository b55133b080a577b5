"""Timing helpers and framework-overhead measurements of ``autopar calibrate`` (in each process).

Every figure is measured in all calibration processes at once and averaged (or maximised) over
them, so that contention for shared cores is part of it. The framework overhead is measured on
the zoo's tiny blocks and models (gpt and llama): eager, with DTensor linears, under FSDP2, with
activation checkpointing, and an AdamW step over their parameters (see ``measure_overheads``).

Units: seconds.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
import torch.distributed as dist

from autopar.cost_model.calibration import median
from autopar.models.tp_names import ZOO_COLWISE, ZOO_ROWWISE

__all__ = ["OVERHEAD_WINDOW_S", "SMALL_HIDDEN", "SMALL_SEQ", "max_over_ranks", "mean_over_ranks",
           "measure_overheads", "sync"]

# Shortest window a framework-overhead figure averages over (several scheduler time slices).
OVERHEAD_WINDOW_S = 0.1
# Shape at which the fixed per-layer cost is measured (a small model's: operators on [b, s, h]
# tensors of this size cost more than their dispatch).
SMALL_HIDDEN = 128
SMALL_SEQ = 64


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mean_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _count_ops(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    counter = _Count()
    with counter:
        fn()
    return counter.calls


def _time_median(fn, iters: int, device: torch.device) -> float:
    """Seconds per call of ``fn``: median of 3 repetitions, each the mean over at least
    ``iters`` calls and OVERHEAD_WINDOW_S seconds.

    A mean over a window longer than the scheduler's time slice, not a median of single calls:
    with more processes than cores a call shorter than a slice is either not preempted or
    preempted for a whole slice, and the median of single calls would miss the sharing.
    """
    for _ in range(3):
        fn()
    dist.barrier()
    per_call = []
    for _ in range(3):
        calls, start = 0, time.perf_counter()
        while calls < iters or time.perf_counter() - start < OVERHEAD_WINDOW_S:
            fn()
            sync(device)
            calls += 1
        per_call.append((time.perf_counter() - start) / calls)
    return median(per_call)


def _time_fwd_bwd(module: Any, x: torch.Tensor, iters: int,
                  device: torch.device) -> float:
    """Forward + backward of a block (output summed) or of a model (the runtime's loss)."""
    from autopar.models import cross_entropy_loss

    def run() -> None:
        out = module(x)
        loss = out.sum() if x.is_floating_point() else cross_entropy_loss(out, x)
        loss.backward()

    return _time_median(run, iters, device)


def _time_optimizer(module: torch.nn.Module, iters: int, device: torch.device) -> float:
    """Seconds of one AdamW step (the runtime's optimizer) over ``module``'s parameters."""
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    return _time_median(opt.step, iters, device)


def _zoo_model(kind: str, device: torch.device, *, small: bool) -> torch.nn.Module:
    """A one-block zoo model: tiny (width 16, dispatch only) or small (width SMALL_HIDDEN)."""
    from autopar.models import build

    h, heads, vocab, seq = (SMALL_HIDDEN, 4, 512, SMALL_SEQ) if small else (16, 2, 32, 8)
    shape = {"layers": 1, "hidden": h, "heads": heads, "vocab": vocab, "seq_len": seq}
    if kind == "llama":
        shape["kv_heads"] = heads // 2
    return build(kind, device=device, seed=0, **shape)


def _fixed_part(module: Any, inputs: list[torch.Tensor], iters: int,
                device: torch.device) -> float:
    """The batch-independent seconds of a forward + backward: t(b) = fixed + b * per-sample,
    extrapolated to b = 0 from b = 1 and 2 (``inputs``), fixed = 2 t(1) - t(2)."""
    t1, t2 = (_time_fwd_bwd(module, x, iters, device) for x in inputs)
    return 2.0 * t1 - t2


def _tp_styles(block: torch.nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles: dict[str, Any] = {}
    for fqn, _ in block.named_modules():
        leaf = fqn.rsplit(".", 1)[-1]
        if leaf in ZOO_COLWISE:
            styles[fqn] = ColwiseParallel()
        elif leaf in ZOO_ROWWISE:
            styles[fqn] = RowwiseParallel()
    return styles


def _measure_kind(kind: str, mesh: Any, iters: int, device: torch.device) -> dict[str, float]:
    """The overheads of one zoo kind's tiny block and model (seconds; see measure_overheads)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(1, 8, 16, device=device, requires_grad=True)
    tokens = torch.randint(0, 32, (1, 8), device=device)
    block = _zoo_model(kind, device, small=False).layers["0"]
    out = {"ops": float(_count_ops(lambda: block(x).sum().backward()))}
    out["block"] = _time_fwd_bwd(block, x, iters, device)
    out["opt_block"] = _time_optimizer(block, iters, device)
    model = _zoo_model(kind, device, small=False)
    out["nonblock"] = max(_time_fwd_bwd(model, tokens, iters, device) - out["block"], 0.0)
    out["opt_nonblock"] = max(_time_optimizer(model, iters, device) - out["opt_block"], 0.0)
    # At a small model's shapes the operators cost more than their dispatch: the fixed part
    # of a block (and of the rest of a one-block model) at width SMALL_HIDDEN, never below the
    # tiny block's.
    small = _zoo_model(kind, device, small=True)
    xs = [torch.randn(b, SMALL_SEQ, SMALL_HIDDEN, device=device, requires_grad=True)
          for b in (1, 2)]
    out["block_fixed"] = max(_fixed_part(small.layers["0"], xs, iters, device), out["block"])
    toks = [torch.randint(0, 512, (b, SMALL_SEQ), device=device) for b in (1, 2)]
    out["nonblock_fixed"] = max(_fixed_part(small, toks, iters, device) - out["block_fixed"],
                                out["nonblock"])
    block = _zoo_model(kind, device, small=False).layers["0"]
    styles = _tp_styles(block)
    parallelize_module(block, mesh["tp"], styles)
    out["tp_modules"] = float(len(styles))
    out["dtensor"] = max(_time_fwd_bwd(block, x, iters, device) - out["block"], 0.0)
    out["opt_dtensor"] = max(_time_optimizer(block, iters, device) - out["opt_block"], 0.0)
    block = _zoo_model(kind, device, small=False).layers["0"]
    fully_shard(block, mesh=mesh["tp"])
    out["fsdp"] = max(_time_fwd_bwd(block, x, iters, device) - out["block"], 0.0)
    out["opt_fsdp"] = max(_time_optimizer(block, iters, device) - out["opt_block"], 0.0)
    # The same extras at the small shape (their fixed parts), never below the tiny ones.
    block = _zoo_model(kind, device, small=True).layers["0"]
    parallelize_module(block, mesh["tp"], _tp_styles(block))
    out["dtensor"] = max(_fixed_part(block, xs, iters, device) - out["block_fixed"],
                         out["dtensor"])
    block = _zoo_model(kind, device, small=True).layers["0"]
    fully_shard(block, mesh=mesh["tp"])
    out["fsdp"] = max(_fixed_part(block, xs, iters, device) - out["block_fixed"], out["fsdp"])
    block = small.layers["0"]  # non-reentrant checkpointing: the runtime's full recompute
    rerun = functools.partial(checkpoint, block, use_reentrant=False)
    out["checkpoint"] = max(_fixed_part(rerun, xs, iters, device) - out["block_fixed"], 0.0)
    return out


def measure_overheads(iters: int, device: torch.device) -> dict[str, float]:
    """Framework seconds of the zoo's tiny blocks and models (gpt and llama averaged).

    Forward + backward of one block: eager, with DTensor linears (TP on a one-rank mesh, per
    sharded module) and under FSDP2 (one-rank mesh); of the rest of a one-block model
    (embedding, head, loss); one AdamW step over a block's parameters as plain tensors and as
    DTensors (what TP and FSDP2 make them), and over the rest of the model; per aten op.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("dp", "tp"))
    runs = [_measure_kind(kind, mesh, iters, device) for kind in ("gpt", "llama")]

    def mean(key: str) -> float:
        return mean_over_ranks(sum(r[key] for r in runs) / len(runs), device)

    opt_dtensor = 0.5 * (mean("opt_dtensor") + mean("opt_fsdp"))
    return {
        "op_overhead_s": mean("block") / mean("ops"),
        "layer_overhead_s": mean("block_fixed"),
        "nonblock_overhead_s": mean("nonblock_fixed"),
        "dtensor_layer_overhead_s": mean("dtensor"),
        "dtensor_module_overhead_s": mean_over_ranks(
            sum(r["dtensor"] / r["tp_modules"] for r in runs) / len(runs), device),
        "fsdp_layer_overhead_s": mean("fsdp"),
        "optimizer_layer_overhead_s": mean("opt_block"),
        "optimizer_nonblock_overhead_s": mean("opt_nonblock"),
        "dtensor_optimizer_layer_overhead_s": opt_dtensor,
        "recompute_layer_overhead_s": mean("checkpoint"),
    }
