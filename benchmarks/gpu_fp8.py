"""fp8 linears against bf16, one transformer block on a GPU, beside the cost model.

``--dtype fp8`` (docs/cost_model.md, ``cost_model/precision.py``) runs the three GEMMs of every
linear of the blocks at the device's fp8 rate and charges torchao's tensorwise dynamic scaling
as memory traffic (an amax read and a cast of each operand). This benchmark checks that claim on
the blocks ``benchmarks/gpu_layer.py`` builds (real shapes, a tensor-parallel rank's local shard,
no communication): each block runs forward + backward in bf16, then again with its linears
swapped for torchao's ``Float8Linear`` (``convert_to_float8_training``, recipe "tensorwise", the
one torchtitan's ``quantize.linear.float8`` uses by default), eager; the first ``--compile``
rows also run both under ``torch.compile``, as torchtitan runs fp8. Predictions are the cost
model's ``LayerCost.compute_s`` for the same block under ``--framework torchtitan`` (the
framework that runs torchao's fp8), bf16 and fp8.

    .venv/bin/python benchmarks/gpu_fp8.py predict                  # here
    python3 benchmarks/gpu_fp8.py measure --out m.json --compile 2  # GPU machine, torchao
    .venv/bin/python benchmarks/gpu_fp8.py report m.json            # here

``report`` prints the predicted and measured fp8 block times, the measured and predicted
fp8 speed-up over bf16 (eager and, where measured, compiled) and the saved activations of the
fp8 block, and writes ``benchmarks/results/gpu_fp8_<device>.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_layer  # benchmarks/ is not a package: its folder is put on sys.path above

RESULTS = Path(__file__).resolve().parent / "results"
PREDICTIONS = RESULTS / "gpu_fp8_predictions.json"
MODELS = ("llama3-8b", "llama3-70b", "llama3-405b", "gpt3-13b", "gpt3-175b")
TP_DEGREES = (1, 2, 4, 8)
MICRO_BATCHES = (1, 2)
FRAMEWORK = "torchtitan"


# ---- predict (here) ------------------------------------------------------------------------
def predict(models, tps, mbs, cluster_name: str) -> list[dict]:
    """The cost model's bf16 and fp8 block times (torchtitan) per (model, tp, mb)."""
    from autopar.config import ParallelConfig
    from autopar.cost_model.hardware import Cluster
    from autopar.cost_model.layer_costs import build_cost_table
    from autopar.graph.model_text import build_and_profile
    from autopar.models.zoo import make_spec

    cluster = Cluster.preset(cluster_name)
    rows = []
    for name in models:
        _, prof = build_and_profile(name, dtype="bf16")
        spec = make_spec(name, seq_len=prof.seq_len)
        block = max(i for i, layer in enumerate(prof.layers) if layer.kind == "block")
        for tp in tps:
            if spec.heads % tp or spec.kv_heads % tp or spec.ffn_hidden % tp:
                continue
            for mb in mbs:
                row = {"model": name, "kind": spec.kind, "seq_len": prof.seq_len, "tp": tp,
                       "micro_batch": mb, "hidden": spec.hidden}
                for dtype in ("bf16", "fp8"):
                    config = ParallelConfig(tp=tp, micro_batch=mb, global_batch=2 * mb,
                                            dtype=dtype)
                    cost = build_cost_table(prof, cluster, config, FRAMEWORK).layers[block]
                    row[f"predicted_{dtype}_s"] = cost.compute_s
                    row[f"predicted_{dtype}_act_bytes"] = cost.act_bytes[0]
                rows.append(row)
        print(f"predicted {name}", file=sys.stderr)
    return rows


# ---- measure (GPU machine: torch, torchao, autopar.models) ----------------------------------
def _fp8_block(row: dict, device, dtype):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    block = gpu_layer._build_block(row, device, dtype)
    return convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name(
        "tensorwise"))


def _measure_one(row: dict, device, dtype, fp8: bool, compiled: bool) -> dict:
    import torch

    def make_block():
        block = (_fp8_block(row, device, dtype) if fp8
                 else gpu_layer._build_block(row, device, dtype))
        return torch.compile(block) if compiled else block

    fwd_s, bwd_s, saved = gpu_layer.measure_block(make_block, row, device, dtype)
    return {"s": fwd_s + bwd_s, "forward_s": fwd_s, "act_bytes": saved}


def measure(rows: list[dict], device_name: str, out: Path, compile_rows: int,
            compiled_only: bool = False) -> None:
    import torch

    device = torch.device(device_name)
    dtype = torch.bfloat16
    import torchao

    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "torchao": torchao.__version__,
               "warmup": gpu_layer.WARMUP, "repeats": gpu_layer.REPEATS, "rows": []}
    # Eager rows first, then the compiled ones (slow to build): a cut-off run keeps the most.
    passes = [] if compiled_only else [
        (i, [("bf16", False, False), ("fp8", True, False)]) for i in range(len(rows))]
    passes += [(i, [("bf16_compiled", False, True), ("fp8_compiled", True, True)])
               for i in range(min(compile_rows, len(rows)))]
    done_rows = [dict(row) for row in rows]
    for i, runs in passes:
        row, done = rows[i], done_rows[i]
        for key, fp8, compiled in runs:
            try:
                m = _measure_one(row, device, dtype, fp8, compiled)
                done.update({f"measured_{key}_s": m["s"], f"measured_{key}_act_bytes":
                             m["act_bytes"]})
            except torch.OutOfMemoryError:
                done[f"error_{key}"] = "out of memory"
                torch.cuda.empty_cache()
        results["rows"] = [d for d in done_rows if any(k.startswith("measured_") for k in d)]
        out.write_text(json.dumps(results, indent=1))
        print(f"{row['model']:12s} tp={row['tp']} mb={row['micro_batch']}  " + "  ".join(
            f"{k[9:-2]} {v * 1e3:.2f} ms" for k, v in done.items()
            if k.startswith("measured_") and k.endswith("_s")), flush=True)


# ---- report (here) -------------------------------------------------------------------------
def _merged(paths: list[Path]) -> tuple[dict, list[dict]]:
    """The first file's facts and every file's rows, merged by (model, tp, micro-batch)."""
    data = [json.loads(p.read_text()) for p in paths]
    rows: dict[tuple, dict] = {}
    for d in data:
        for r in d["rows"]:
            rows.setdefault((r["model"], r["tp"], r["micro_batch"]), {}).update(r)
    return data[0], list(rows.values())


def _speedup(r: dict, suffix: str) -> float | None:
    bf16, fp8 = r.get(f"measured_bf16{suffix}_s"), r.get(f"measured_fp8{suffix}_s")
    return bf16 / fp8 if bf16 and fp8 else None


def _times(speedup: float | None) -> str:
    return f"{speedup:.2f}x" if speedup else "-"


def report(paths: list[Path], cluster_name: str) -> str:
    facts, rows = _merged(paths)
    rows = [r for r in rows if "measured_fp8_s" in r or "measured_fp8_compiled_s" in r]
    now = {(p["model"], p["tp"], p["micro_batch"]): p for p in predict(
        sorted({r["model"] for r in rows}), sorted({r["tp"] for r in rows}),
        sorted({r["micro_batch"] for r in rows}), cluster_name)}
    lines = [f"# fp8 linears vs bf16, one block forward + backward: cost model "
             f"({cluster_name} preset, {FRAMEWORK}) vs {facts['device']}", "",
             f"torch {facts['torch']}, torchao {facts['torchao']} `Float8Linear` (tensorwise "
             f"dynamic scaling), CUDA events, median of {facts['repeats']} after "
             f"{facts['warmup']} warm-up; local tensor-parallel shard shapes, no communication; "
             "eager, and for some rows under `torch.compile` (as torchtitan runs fp8). "
             "Predictions from the current cost model. Reproduce: `benchmarks/gpu_fp8.py` "
             "(predict here, measure on the GPU, report here).", "",
             "| model | tp | mb | bf16 ms eager / compiled | fp8 ms eager / compiled | fp8 "
             "predicted ms | error (compiled) | speed-up predicted | speed-up eager | speed-up "
             "compiled |", "|---|---|---|---|---|---|---|---|---|---|"]
    errs, ratio_errs, eager = [], [], []
    for r in rows:
        p = now[(r["model"], r["tp"], r["micro_batch"])]
        pred = p["predicted_fp8_s"]
        sp_pred = p["predicted_bf16_s"] / pred
        sp_eager, sp_comp = _speedup(r, ""), _speedup(r, "_compiled")
        comp = r.get("measured_fp8_compiled_s")
        if comp:
            errs.append(abs(pred - comp) / comp)
        if sp_comp:
            ratio_errs.append(abs(sp_pred - sp_comp) / sp_comp)
        if sp_eager:
            eager.append(sp_eager)

        def ms(key: str, r: dict = r) -> str:
            return f"{r[key] * 1e3:.2f}" if key in r else "-"

        lines.append(
            f"| {r['model']} | {r['tp']} | {r['micro_batch']} | {ms('measured_bf16_s')} / "
            f"{ms('measured_bf16_compiled_s')} | {ms('measured_fp8_s')} / "
            f"{ms('measured_fp8_compiled_s')} | {pred * 1e3:.2f} | "
            f"{gpu_layer._err(pred, comp) if comp else '-'} | {sp_pred:.2f}x | "
            f"{_times(sp_eager)} | {_times(sp_comp)} |")
    lines.append("")
    if errs:
        lines.append(f"- fp8 block time against the compiled block: MAPE "
                     f"{statistics.mean(errs) * 100:.1f}%, median "
                     f"{statistics.median(errs) * 100:.1f}% over {len(errs)} configurations; "
                     f"predicted speed-up over bf16 against the compiled one: median error "
                     f"{statistics.median(ratio_errs) * 100:.1f}%, largest "
                     f"{max(ratio_errs) * 100:.1f}%")
    if eager:
        lines.append(f"- eager (no torch.compile) fp8 is slower than bf16 in every "
                     f"configuration: speed-up {min(eager):.2f}x to {max(eager):.2f}x over "
                     f"{len(eager)}" if max(eager) < 1 else
                     f"- eager speed-up {min(eager):.2f}x to {max(eager):.2f}x over {len(eager)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("predict", help="cost-model predictions (needs autopar's install)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tp", default=",".join(map(str, TP_DEGREES)))
    p.add_argument("--mb", default=",".join(map(str, MICRO_BATCHES)))
    p.add_argument("--cluster", default="h200")
    p.add_argument("--out", type=Path, default=PREDICTIONS)
    m = sub.add_parser("measure", help="time the blocks (GPU machine, torchao)")
    m.add_argument("--predictions", type=Path, default=PREDICTIONS)
    m.add_argument("--device", default="cuda")
    m.add_argument("--compile", type=int, default=0, help="rows also run under torch.compile")
    m.add_argument("--compiled-only", action="store_true", help="skip the eager runs")
    m.add_argument("--rows", default="", help="only these rows: model:tp:mb,...")
    m.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("report", help="predicted vs measured table")
    r.add_argument("measurements", type=Path, nargs="+")
    r.add_argument("--cluster", default="h200")
    r.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.step == "predict":
        rows = predict(args.models.split(","), [int(t) for t in args.tp.split(",")],
                       [int(b) for b in args.mb.split(",")], args.cluster)
        args.out.write_text(json.dumps(rows, indent=1))
        print(f"{len(rows)} predictions -> {args.out}")
    elif args.step == "measure":
        rows = json.loads(args.predictions.read_text())
        if args.rows:
            keep = [tuple(k.split(":")) for k in args.rows.split(",")]
            rows = [r for k in keep for r in rows
                    if (r["model"], str(r["tp"]), str(r["micro_batch"])) == k]
        measure(rows, args.device, args.out, args.compile, args.compiled_only)
    else:
        text = report(args.measurements, args.cluster)
        print(text)
        if args.out:
            args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
