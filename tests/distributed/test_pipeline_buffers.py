"""Lean pipeline buffers: a pipelined step's peak memory does not grow with the micro-batch count.

One launch of four processes (pp = 4, gloo, fp32, zoo GPT) checks two things:

- memory, with the runtime's exact live-tensor counter (``LiveTensorBytes``, what ``autopar
  verify`` measures on CPU), over the second training step at 4, 8 and 32 micro-batches of one
  sequence: from 4 to 32 the peak may grow by at most one in-flight window (what the 4-micro-batch
  step itself adds to the memory it starts with), and from 8 to 32 (every schedule's window full)
  by nothing but the larger batch of token ids. torch's own ``PipelineStage`` and runtime hold a
  receive buffer per micro-batch per direction (and, for the action-list schedules, every sent
  tensor) to the end of the step, and fail both;
- gradients: every schedule the runtime runs equals the one-process step (two steps).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

SHAPE: dict[str, int] = {"layers": 6, "hidden": 32, "heads": 2, "vocab": 32, "seq_len": 32}
# One boundary tensor: a micro-batch's stage input (or output gradient), [1, seq_len, hidden] fp32.
BOUNDARY_BYTES = SHAPE["seq_len"] * SHAPE["hidden"] * 4
PP = 4
# Full recompute keeps a micro-batch's activations small (block inputs), so the boundary tensors
# are a large share of what a step holds and their growth is plain to see.
RECOMPUTE = "full"
FEW, FULL, MANY = 4, 8, 32
# What may still grow from 8 to 32 micro-batches: the data. The counter counts a batch's storage
# once a slice of it reaches an operator; a rank with the first (last) stage holds the int64
# tokens (labels) of two steps' batches at the second step's peak; 1 KiB covers the last stage's
# loss scalars.
SLACK_BYTES = 2 * 2 * (MANY - FULL) * SHAPE["seq_len"] * 8 + 1024

# Schedule -> micro-batch counts measured (ZBV, the split backward, from 8 on only: time).
MEMORY_CASES: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    "1f1b": ({"schedule": "1f1b"}, (FEW, FULL, MANY)),
    "interleaved-1f1b": (
        {"schedule": "interleaved-1f1b", "virtual_stages": 2}, (FEW, FULL, MANY),
    ),
    "zbv-zero-bubble": ({"schedule": "zbv-zero-bubble", "virtual_stages": 2}, (FULL, MANY)),
}
# Every schedule the runtime runs, at 2 pp micro-batches (ZBV and DualPipeV need that many).
GRAD_MICROBATCHES = 2 * PP
GRAD_CASES: dict[str, dict[str, Any]] = {
    "gpipe": {"schedule": "gpipe"},
    "1f1b": {"schedule": "1f1b"},
    "interleaved-1f1b": {"schedule": "interleaved-1f1b", "virtual_stages": 2},
    "interleaved-zero-bubble": {"schedule": "interleaved-zero-bubble", "virtual_stages": 2},
    "zbv-zero-bubble": {"schedule": "zbv-zero-bubble", "virtual_stages": 2},
    "dualpipe-v": {"schedule": "dualpipe-v", "virtual_stages": 2},
}


def _batch(num_sequences: int, step: int) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(100 + step)
    size = (num_sequences, SHAPE["seq_len"])
    return (torch.randint(0, SHAPE["vocab"], size, generator=gen),
            torch.randint(0, SHAPE["vocab"], size, generator=gen))


def _apply(cfg_kwargs: dict[str, Any], num_microbatches: int, recompute: str) -> Any:
    from autopar.config import ParallelConfig
    from autopar.models import build
    from autopar.runtime import apply_plan, build_mesh

    cfg = ParallelConfig(
        pp=PP, global_batch=num_microbatches, dtype="fp32", recompute=recompute, **cfg_kwargs
    )
    from tests.distributed.test_runtime_equivalence import make_plan

    plan = make_plan(cfg, SHAPE["layers"])
    return apply_plan(build("gpt", device="cpu", seed=0, **SHAPE), plan, build_mesh(plan, "cpu"))


def step_memory(cfg_kwargs: dict[str, Any], num_microbatches: int) -> tuple[int, int]:
    """This rank's live tensor bytes at the start of the second step and their peak during it.

    The first step sets the pipeline up and allocates the gradients; the second (the schedule's
    own ``step``) accumulates into them, so every micro-batch count holds the gradients
    throughout (with gradients zeroed to None, a 4-micro-batch 1F1B step peaks before the first
    gradient exists, a 32-micro-batch one after).
    """
    from autopar.cost_model.held_counts import splits_backward
    from autopar.runtime.step import train_step
    from autopar.runtime.worker import LiveTensorBytes

    batches = [_batch(num_microbatches, step) for step in range(2)]
    gc.collect()
    tracker = LiveTensorBytes()
    with tracker:
        # a schedule that splits backwards recomputes nothing (split_recompute_refusal)
        split = splits_backward(cfg_kwargs["schedule"])
        pm = _apply(cfg_kwargs, num_microbatches, "none" if split else RECOMPUTE)
        train_step(pm, *batches[0], None)
        gc.collect()
        start = tracker.peak_bytes = tracker.current_bytes
        tokens, labels = batches[1]
        kwargs: dict[str, Any] = {"return_outputs": False}
        if pm.has_last_stage:
            kwargs.update(target=labels, losses=[])
        pm.schedule.step(*((tokens,) if pm.has_first_stage else ()), **kwargs)
        peak = tracker.peak_bytes
        del pm
        gc.collect()
    return start, peak


def check_gradients() -> dict[str, Any]:
    """Per schedule: the fqns whose gradients equal the one-process step's (two steps), or the
    first error."""
    from torch.testing import assert_close

    from autopar.models import build
    from autopar.runtime.step import gathered_grads, one_process_reference, train_step

    reference = build("gpt", device="cpu", seed=0, **SHAPE)
    batches = [_batch(GRAD_MICROBATCHES, step) for step in range(2)]
    expected = []
    for tokens, labels in batches:
        loss = one_process_reference(reference, tokens, labels)
        expected.append((loss, {n: p.grad.clone() for n, p in reference.named_parameters()}))
    results: dict[str, Any] = {}
    for name, kwargs in GRAD_CASES.items():
        pm = _apply(kwargs, GRAD_MICROBATCHES, "none")
        checked: set[str] = set()
        try:
            # Two steps: the second runs on buffers allocated afresh after the first freed them.
            for step, ((tokens, labels), (ref_loss, ref_grads)) in enumerate(
                zip(batches, expected)
            ):
                loss = train_step(pm, tokens, labels, None)
                assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (step, loss, ref_loss)
                for fqn, grad in gathered_grads(pm).items():
                    assert_close(grad, ref_grads[fqn], rtol=1e-5, atol=1e-7,
                                 msg=lambda m, f=fqn, s=step: f"step {s} {f}: {m}")
                    checked.add(fqn)
            results[name] = sorted(checked)
        except AssertionError as e:
            results[name] = {"error": str(e)[:2000]}
    return results


def run_checks(rank: int, world_size: int) -> dict[str, Any]:
    """One launch for both checks (each launch costs seconds of ``import torch`` per process)."""
    memory = {
        name: {m: step_memory(kwargs, m) for m in counts}
        for name, (kwargs, counts) in MEMORY_CASES.items()
    }
    return {"memory": memory, "gradients": check_gradients()}


def memory_errors(results: list[dict[str, dict[int, tuple[int, int]]]]) -> list[str]:
    """Every rank and case whose peak grows with the micro-batch count beyond the allowance."""
    errors = []
    for rank, per_case in enumerate(results):
        for name, memory in per_case.items():
            peak = {m: p for m, (_, p) in memory.items()}
            if FEW in memory:
                # One in-flight window: what the 4-micro-batch step adds to what it starts with
                # (activations and boundary tensors of the at most pp micro-batches in flight).
                window = peak[FEW] - memory[FEW][0]
                if peak[MANY] - peak[FEW] > window:
                    errors.append(
                        f"{name} rank {rank}: peak {peak[FEW]} B at {FEW} micro-batches, "
                        f"{peak[MANY]} B at {MANY}: more than one in-flight window ({window} B)"
                    )
            # 8 = 2 pp micro-batches fill every schedule's window: nothing may grow after that.
            if peak[MANY] - peak[FULL] > SLACK_BYTES:
                errors.append(
                    f"{name} rank {rank}: peak {peak[FULL]} B at {FULL} micro-batches, "
                    f"{peak[MANY]} B at {MANY}: "
                    f"+{(peak[MANY] - peak[FULL]) / BOUNDARY_BYTES:.1f} boundary tensors"
                )
    return errors


def gradient_errors(results: list[dict[str, Any]]) -> list[str]:
    """Failed comparisons, and parameters no rank checked."""
    from autopar.models import build

    every = {n for n, _ in build("gpt", **SHAPE).named_parameters()}
    errors = []
    for name in GRAD_CASES:
        per_rank = [r[name] for r in results]
        failed = [f"{name} rank {i}: {r['error']}" for i, r in enumerate(per_rank)
                  if isinstance(r, dict)]
        covered = set().union(*(r for r in per_rank if not isinstance(r, dict)))
        if not failed and covered != every:
            failed.append(f"{name}: gradients not checked for {sorted(every - covered)}")
        errors += failed
    return errors


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_lean_buffers_keep_memory_flat_and_gradients_exact(run_distributed: Any) -> None:
    results = run_distributed(run_checks, PP, timeout_s=140)
    errors = memory_errors([r["memory"] for r in results])
    errors += gradient_errors([r["gradients"] for r in results])
    assert not errors, "\n".join(errors)
