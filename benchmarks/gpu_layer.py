"""One transformer block of each zoo model, forward + backward on a GPU, beside the cost model.

The cost model's compute term of a block (``LayerCost.compute_s``: forward + backward matmuls,
elementwise traffic and framework overhead of one micro-batch on one rank) and its saved
activations (``LayerCost.act_bytes``, no recompute, live bytes without the allocator's unusable
share) are predicted here for the cluster preset
(default ``h200``) at the models' real shapes, for several tensor-parallel degrees and
micro-batch sizes. On the GPU, the same block is built with the local shard shapes a
tensor-parallel rank holds (q/k/v and MLP up/gate projections ``1/tp`` of their outputs, the
output and MLP down projections ``1/tp`` of their inputs; heads are viewed as ``-1`` so the
block runs unchanged) and timed with CUDA events; the memory the forward leaves allocated is
its saved activations (the block input counted, as the cost model counts it: the output
becomes the next block's input).

Three steps (the GPU machine needs only torch; predicting needs autopar's full install):

    .venv/bin/python benchmarks/gpu_layer.py predict          # here: predictions JSON
    python3 benchmarks/gpu_layer.py measure --out m.json      # on the GPU machine
    .venv/bin/python benchmarks/gpu_layer.py report m.json    # here: table + refit

``report`` prints predicted beside measured times and activation bytes, the error of each, and
the matmul-efficiency parameters (``matmul_efficiency_max``, ``matmul_half_flops``) that fit the
measurements best, and writes ``benchmarks/results/gpu_layer_<device>.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PREDICTIONS = RESULTS / "gpu_layer_predictions.json"
MODELS = ("gpt3-1.3b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b",
          "llama2-7b", "llama3-8b", "llama3-70b", "llama3-405b")
TP_DEGREES = (1, 2, 4, 8)
MICRO_BATCHES = (1, 2, 4)
WARMUP = 2
REPEATS = 5
COLWISE = ("wq", "wk", "wv", "w1", "w3")  # output dim split over tp (Megatron column-parallel)
ROWWISE = ("wo", "w2")  # input dim split over tp (row-parallel)


# ---- predict (here) ------------------------------------------------------------------------
def predict(models, tps, mbs, cluster_name: str, seq_len: int | None) -> list[dict]:
    """Cost-model compute term and saved activations of one block per (model, tp, mb)."""
    from autopar.config import ParallelConfig
    from autopar.cost_model.frameworks import get_framework
    from autopar.cost_model.hardware import Cluster
    from autopar.cost_model.layer_costs import build_cost_table
    from autopar.graph.model_text import build_and_profile
    from autopar.models.zoo import make_spec

    # The measured blocks hold bf16 weights and drop their gradients every iteration: none of
    # the runtime's per-micro-batch weight casts and gradient accumulation to charge.
    cluster = dataclasses.replace(Cluster.preset(cluster_name), param_traffic_factor=0.0)
    # The measurement is the bytes the forward leaves allocated (torch.cuda.memory_allocated):
    # the caching allocator's unusable share, which the cost model adds to churning memory, is
    # not in it, so it is left out of the prediction compared with it.
    live_bytes = dataclasses.replace(get_framework("autopar"), fragmentation_fraction=0.0)
    rows = []
    for name in models:
        _, prof = build_and_profile(name, seq_len=seq_len, dtype="bf16")
        spec = make_spec(name, seq_len=prof.seq_len)
        block = next(i for i, layer in enumerate(prof.layers) if layer.kind == "block")
        block += 1 if block + 1 < len(prof.layers) and prof.layers[block + 1].kind == "block" else 0
        for tp in tps:
            if spec.heads % tp or spec.kv_heads % tp or spec.ffn_hidden % tp:
                continue
            for mb in mbs:
                # Two micro-batches: act_bytes is then the raw saved bytes (not net of the
                # backward-born state, which only a one-micro-batch step nets out).
                config = ParallelConfig(tp=tp, micro_batch=mb, global_batch=2 * mb, dtype="bf16")
                cost = build_cost_table(prof, cluster, config, live_bytes).layers[block]
                rows.append({
                    "model": name, "kind": spec.kind, "seq_len": prof.seq_len, "tp": tp,
                    "micro_batch": mb, "hidden": spec.hidden, "heads": spec.heads,
                    "kv_heads": spec.kv_heads, "ffn_hidden": spec.ffn_hidden,
                    "model_flops": cost.model_flops_per_sample * mb / tp,
                    "predicted_forward_s": cost.compute_s - cost.backward_s,
                    "predicted_backward_s": cost.backward_s,
                    "predicted_act_bytes": cost.act_bytes[0],
                    "predicted_param_bytes": cost.param_bytes,
                })
        print(f"predicted {name}", file=sys.stderr)
    return rows


# ---- measure (GPU machine; torch and autopar.models only) -----------------------------------
def _shard_block(block, tp: int):
    """Replace the block's projections by the local shards one tensor-parallel rank holds."""
    import torch
    from torch import nn

    if tp == 1:
        return block
    for parent in list(block.modules()):
        for leaf, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or leaf not in COLWISE + ROWWISE:
                continue
            fan_in, fan_out = child.in_features, child.out_features
            if leaf in COLWISE:
                fan_out //= tp
            else:
                fan_in //= tp
            new = nn.Linear(fan_in, fan_out, bias=child.bias is not None,
                            device=child.weight.device, dtype=child.weight.dtype)
            with torch.no_grad():
                new.weight.normal_(0.0, 0.02)
                if new.bias is not None:
                    new.bias.zero_()
            setattr(parent, leaf, new)
    return block


def _build_block(row: dict, device, dtype):
    import torch

    from autopar.models.gpt import GPTBlock
    from autopar.models.llama import LlamaBlock
    from autopar.models.zoo import make_spec

    spec = make_spec(row["model"], seq_len=row["seq_len"])
    cls = GPTBlock if row["kind"] == "gpt" else LlamaBlock
    with torch.device("meta"):
        block = cls(spec)
    block = _shard_block(block, row["tp"])
    block = block.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return block.train()


def _time_block(block, x, dy, device) -> tuple[float, float]:
    """Median forward and backward seconds over REPEATS after WARMUP (CUDA events)."""
    import torch

    cuda = device.type == "cuda"
    fwd, bwd = [], []
    for i in range(WARMUP + REPEATS):
        block.zero_grad(set_to_none=True)
        x.grad = None
        if cuda:
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record()
        else:
            import time
            t0 = time.perf_counter()
        out = block(x)
        if cuda:
            marks[1].record()
        else:
            t1 = time.perf_counter()
        out.backward(dy)
        if cuda:
            marks[2].record()
            torch.cuda.synchronize(device)
            f, b = marks[0].elapsed_time(marks[1]) / 1e3, marks[1].elapsed_time(marks[2]) / 1e3
        else:
            t2 = time.perf_counter()
            f, b = t1 - t0, t2 - t1
        del out
        if i >= WARMUP:
            fwd.append(f)
            bwd.append(b)
    return statistics.median(fwd), statistics.median(bwd)


def _saved_bytes(block, x, device) -> int:
    """Bytes the forward leaves allocated (saved activations + output - nothing of the input)."""
    import torch

    if device.type != "cuda":
        return 0
    block.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    out = block(x)
    torch.cuda.synchronize(device)
    saved = torch.cuda.memory_allocated(device) - before
    del out
    return int(saved)


def measure_block(make_block, row: dict, device, dtype) -> tuple[float, float, int]:
    """(forward s, backward s, saved bytes) of the block ``make_block()`` builds (seeded), on a
    random input of the row's shape; the GPU's cache is emptied afterwards."""
    import torch

    torch.manual_seed(0)
    block = make_block()
    shape = (row["micro_batch"], row["seq_len"], row["hidden"])
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, device=device, dtype=dtype)
    fwd_s, bwd_s = _time_block(block, x, dy, device)
    saved = _saved_bytes(block, x, device)
    del block, x, dy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return fwd_s, bwd_s, saved


def measure_row(row: dict, device, dtype) -> dict:
    fwd_s, bwd_s, saved = measure_block(lambda: _build_block(row, device, dtype), row, device,
                                        dtype)
    return {**row, "measured_forward_s": fwd_s, "measured_backward_s": bwd_s,
            "measured_act_bytes": saved}


def measure(rows: list[dict], device_name: str, dtype_name: str, out: Path) -> None:
    import torch

    device = torch.device(device_name)
    dtype = getattr(torch, dtype_name)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "dtype": dtype_name, "warmup": WARMUP,
               "repeats": REPEATS, "rows": []}
    for row in rows:
        try:
            done = measure_row(row, device, dtype)
        except torch.OutOfMemoryError:
            done = {**row, "error": "out of memory"}
            torch.cuda.empty_cache()
        results["rows"].append(done)
        out.write_text(json.dumps(results, indent=1))
        total = done.get("measured_forward_s", 0) + done.get("measured_backward_s", 0)
        pred = row["predicted_forward_s"] + row["predicted_backward_s"]
        print(f"{row['model']:12s} tp={row['tp']} mb={row['micro_batch']}  measured "
              f"{total * 1e3:8.2f} ms  predicted {pred * 1e3:8.2f} ms  "
              f"{done.get('error', '')}", flush=True)


# ---- report (here) -------------------------------------------------------------------------
def _err(pred: float, meas: float) -> str:
    return f"{(pred - meas) / meas * 100:+.0f}%" if meas else "-"


def _fit_curve(rows: list[dict], peak_flops: float) -> tuple[float, float, float, float]:
    """(eff_max, w_half, floor_s, MAPE) minimising the block-time MAPE (grid search).

    The prediction's non-matmul part (elementwise traffic) is kept; the matmul part is
    F / (peak eff(w)) with eff(w) = eff_max w / (w + w_half), and the block takes at least the
    host's dispatch floor (autopar/cost_model/compute.py).
    """
    import numpy as np

    w = np.array([r["fwd_flops_rank"] for r in rows])
    flops = np.array([r["total_flops_rank"] for r in rows])
    other = np.array([r["other_s"] for r in rows])
    meas = np.array([r["measured_s"] for r in rows])
    best = (0.0, 0.0, 0.0, float("inf"))
    for eff_max in np.arange(0.50, 0.95, 0.01):
        for w_half in np.geomspace(1e9, 1e13, 81):
            t = flops / (peak_flops * eff_max * w / (w + w_half)) + other
            for floor in np.arange(0.0, 3.05e-3, 0.1e-3):
                mape = float(np.mean(np.abs(np.maximum(t, floor) - meas) / meas))
                if mape < best[3]:
                    best = (float(eff_max), float(w_half), float(floor), mape)
    return best


def _current_predictions(rows: list[dict], cluster_name: str) -> dict[tuple, dict]:
    """The cost model's predictions now (not those stored at measurement time)."""
    keys = {(r["model"], r["seq_len"]) for r in rows}
    out: dict[tuple, dict] = {}
    for model, seq_len in sorted(keys):
        tps = sorted({r["tp"] for r in rows if r["model"] == model})
        mbs = sorted({r["micro_batch"] for r in rows if r["model"] == model})
        for p in predict([model], tps, mbs, cluster_name, seq_len):
            out[(p["model"], p["tp"], p["micro_batch"])] = p
    return out


def report(path: Path, cluster_name: str) -> str:
    from autopar.cost_model.compute import matmul_efficiency
    from autopar.cost_model.hardware import Cluster

    data = json.loads(path.read_text())
    device = Cluster.preset(cluster_name).device
    peak = device.peak_flops("bf16")
    now = _current_predictions([r for r in data["rows"] if "error" not in r], cluster_name)
    lines = [f"# One block forward + backward: cost model ({cluster_name} preset) vs "
             f"{data['device']}", "",
             f"bf16, torch {data['torch']}, CUDA events, median of {data['repeats']} after "
             f"{data['warmup']} warm-up; local tensor-parallel shard shapes, no communication. "
             "Predictions from the current cost model. Reproduce: `benchmarks/gpu_layer.py` "
             "(predict here, measure on the GPU, report here).",
             "", "| model | seq | tp | mb | predicted ms | measured ms | error | achieved "
             "TFLOP/s | predicted act GiB | measured act GiB | act error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    time_errs, act_errs, fit_rows = [], [], []
    gib = 2**30
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['seq_len']} | {r['tp']} | {r['micro_batch']} | "
                         f"{r['error']} |||||||")
            continue
        p = now[(r["model"], r["tp"], r["micro_batch"])]
        pred = p["predicted_forward_s"] + p["predicted_backward_s"]
        meas = r["measured_forward_s"] + r["measured_backward_s"]
        time_errs.append(abs(pred - meas) / meas)
        act = r["measured_act_bytes"]
        if act:
            act_errs.append(abs(p["predicted_act_bytes"] - act) / act)
        lines.append(
            f"| {r['model']} | {r['seq_len']} | {r['tp']} | {r['micro_batch']} | "
            f"{pred * 1e3:.2f} | {meas * 1e3:.2f} | {_err(pred, meas)} | "
            f"{r['model_flops'] / meas / 1e12:.0f} | {p['predicted_act_bytes'] / gib:.2f} | "
            f"{act / gib:.2f} | {_err(p['predicted_act_bytes'], act)} |")
        # Split the prediction into matmul, floor and the rest, to refit the curve.
        fwd_flops = r["model_flops"] / 3.0
        mm_s = r["model_flops"] / (peak * matmul_efficiency(device, fwd_flops))
        unfloored = mm_s + max(0.0, pred - mm_s) if pred > device.dispatch_floor_s else mm_s
        fit_rows.append({"fwd_flops_rank": fwd_flops, "total_flops_rank": r["model_flops"],
                         "other_s": max(0.0, unfloored - mm_s), "measured_s": meas})
    lines.append("")
    if time_errs:
        lines.append(f"- block time: MAPE {statistics.mean(time_errs) * 100:.1f}%, median "
                     f"{statistics.median(time_errs) * 100:.1f}%, largest "
                     f"{max(time_errs) * 100:.1f}% over {len(time_errs)} configurations")
    if act_errs:
        lines.append(f"- saved activations: median error {statistics.median(act_errs) * 100:.1f}%,"
                     f" largest {max(act_errs) * 100:.1f}%")
    if fit_rows:
        eff_max, w_half, floor, mape = _fit_curve(fit_rows, peak)
        lines.append(
            f"- preset: eff_max {device.matmul_efficiency_max:.2f}, w_half "
            f"{device.matmul_half_flops:.3g} FLOPs, dispatch floor "
            f"{device.dispatch_floor_s * 1e3:.1f} ms; best fit to these blocks: eff_max "
            f"{eff_max:.2f}, w_half {w_half:.3g} FLOPs, floor {floor * 1e3:.1f} ms "
            f"(block-time MAPE {mape * 100:.1f}%)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("predict", help="cost-model predictions (needs autopar's install)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tp", default=",".join(map(str, TP_DEGREES)))
    p.add_argument("--mb", default=",".join(map(str, MICRO_BATCHES)))
    p.add_argument("--seq-len", type=int, default=None, help="override the models' own")
    p.add_argument("--cluster", default="h200")
    p.add_argument("--out", type=Path, default=PREDICTIONS)
    m = sub.add_parser("measure", help="time the blocks (GPU machine)")
    m.add_argument("--predictions", type=Path, default=PREDICTIONS)
    m.add_argument("--device", default="cuda")
    m.add_argument("--dtype", default="bfloat16")
    m.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("report", help="predicted vs measured table and refit")
    r.add_argument("measurements", type=Path)
    r.add_argument("--cluster", default="h200")
    r.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.step == "predict":
        rows = predict(args.models.split(","), [int(t) for t in args.tp.split(",")],
                       [int(b) for b in args.mb.split(",")], args.cluster, args.seq_len)
        args.out.write_text(json.dumps(rows, indent=1))
        print(f"{len(rows)} predictions -> {args.out}")
    elif args.step == "measure":
        measure(json.loads(args.predictions.read_text()), args.device, args.dtype, args.out)
    else:
        text = report(args.measurements, args.cluster)
        print(text)
        if args.out:
            args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
