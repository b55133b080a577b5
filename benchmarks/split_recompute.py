"""Why autopar recomputes nothing under a schedule that splits backwards (docs/cost_model.md,
``framework_support.split_recompute_refusal``): torch's weight pass and activation
checkpointing, measured on this machine's CPU with torch's own functions.

For one block of a small Llama and GPT (autopar's zoo, fp32, micro-batch 2), checkpointed as
autopar's runtime checkpoints it (runtime/recompute.py), run through
``_backward.stage_backward_input`` and ``stage_backward_weight`` as torch's pipeline stages do:

- the forwards the weight pass re-runs (one per parameter group),
- the weight pass's seconds with full recompute over its seconds without,
- the most the weight pass holds (above what the input pass left), over the block's
  activations without recompute,
- whether selective recompute runs at all.

Run: ``python benchmarks/split_recompute.py``.
"""

from __future__ import annotations

import gc
import time

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from autopar.models import build
from autopar.runtime.recompute import apply_recompute
from autopar.runtime.worker import LiveTensorBytes

SHAPES = {
    "llama": dict(layers=1, hidden=256, heads=4, kv_heads=2, vocab=512, seq_len=256),
    "gpt": dict(layers=1, hidden=256, heads=4, vocab=512, seq_len=256),
}
MICRO_BATCH = 2
REPEATS = 5


def _run(kind: str, mode: str) -> dict:
    """One block's forward, input pass and weight pass under ``mode``: forwards run, the
    weight pass's seconds (median of REPEATS), bytes after the forward and the weight pass's
    peak above the input pass's."""
    shape = SHAPES[kind]
    block = build(kind, device="cpu", seed=0, **shape).layers["0"]
    calls: list[int] = []
    inner = block.forward
    block.forward = lambda h: (calls.append(1), inner(h))[1]
    apply_recompute({"layers.0": block}, {"layers.0": mode})
    params = list(block.parameters())
    times, out = [], {}
    for _ in range(REPEATS):
        calls.clear()
        meter = LiveTensorBytes()
        with meter:
            x = torch.randn(MICRO_BATCH, shape["seq_len"], shape["hidden"], requires_grad=True)
            gc.collect()
            base = meter.current_bytes
            y = block(x)
            gc.collect()
            out["forward_bytes"] = meter.current_bytes - base
            dx, groups = stage_backward_input([y], [torch.ones_like(y)], [x], iter(params))
            del dx
            gc.collect()
            after_input = meter.peak_bytes = meter.current_bytes
            before_weight = len(calls)
            start = time.perf_counter()
            stage_backward_weight(iter(params), groups)
            times.append(time.perf_counter() - start)
            out["weight_peak_bytes"] = meter.peak_bytes - after_input
            out["weight_forwards"], out["groups"] = len(calls) - before_weight, len(groups)
        for p in params:
            p.grad = None
    out["weight_s"] = sorted(times)[len(times) // 2]
    return out


def _selective_runs(kind: str) -> str:
    try:
        _run(kind, "selective")
    except RuntimeError as e:
        return f"no ({str(e).splitlines()[0][:60]})"
    return "yes"


def main() -> int:
    torch.manual_seed(0)
    print(f"{'block':6} {'groups':>6} {'W forwards':>10} {'W time full/none':>17} "
          f"{'W peak / activations':>21}  selective runs")
    for kind in SHAPES:
        none, full = _run(kind, "none"), _run(kind, "full")
        print(f"{kind:6} {full['groups']:6d} {full['weight_forwards']:10d} "
              f"{full['weight_s'] / none['weight_s']:17.1f} "
              f"{full['weight_peak_bytes'] / none['forward_bytes']:21.1f}  "
              f"{_selective_runs(kind)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
