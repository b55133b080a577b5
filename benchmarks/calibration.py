"""Measured vs predicted throughput for every published run in calibration_runs.json.

Usage:
    python benchmarks/calibration.py            # table of measured vs predicted tokens/s per GPU
    python benchmarks/calibration.py --fit      # fit the efficiency parameters once, jointly
    python benchmarks/calibration.py --analytic # closed-form profiles instead of traced ones

Each record becomes a ParallelConfig on a cluster preset by the rules in ``record_config``
(documented in docs/cost_model.md: fields a record leaves out get one fixed default, never a
per-record choice). The profile of each run's shape is autopar's traced profile of the zoo
model of that shape on the meta device (default, ``--traced``), or the closed-form profile
(tests/fixtures/profiles.py) with ``--analytic``; both follow the same record rules (eager
attention, dropout, tied embeddings).
The ``--fit`` mode minimises the squared log error over all records at once for three
parameters (A100 and H100 matmul efficiency maxima and the elementwise traffic factor; the
matmul half-work time is set from GEMM physics, the records cannot separate it) and prints
them; they are then written into autopar/cost_model/presets.py.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autopar.config import ParallelConfig  # noqa: E402
from autopar.cost_model.assemble import assemble  # noqa: E402
from autopar.cost_model.estimator import default_split  # noqa: E402
from autopar.cost_model.hardware import Cluster  # noqa: E402
from autopar.cost_model.layer_costs import build_cost_table  # noqa: E402
from autopar.cost_model.validate import check_config  # noqa: E402
from tests.fixtures.profiles import analytic_transformer_profile  # noqa: E402

# The published runs (with their sources) are kept beside this script, so the figures in README
# reproduce from a checkout alone.
RUNS = ROOT / "benchmarks" / "data" / "calibration_runs.json"

DEFAULT_MICRO_BATCH = 1  # a record without a micro-batch size: 1 (Megatron's usual for big runs)
DEFAULT_VIRTUAL_STAGES = 2  # "interleaved" without a chunk count: 2 when the stage layers allow


def _is_llama(rec: dict) -> bool:
    return "llama" in rec["model"]["name"].lower()


def record_profile(rec: dict, traced: bool = False):
    """The ModelProfile of a record's model at its sequence length."""
    m = rec["model"]
    llama = _is_llama(rec)
    mpt = "mpt" in m["name"].lower()
    # Megatron-LM 2021 and Korthikanti 2022 predate fused (flash) attention: their attention
    # materialises the s x s scores (Korthikanti's 5as/h term), which costs memory traffic.
    eager = rec["id"].startswith(("megatron2021", "korthikanti2022"))
    if traced:  # the zoo model of the same shape, with the same rules, traced on meta
        import autopar

        kind = "llama" if llama else "gpt"
        kw = dict(layers=m["layers"], hidden=m["hidden"], heads=m["heads"], vocab=m["vocab"],
                  seq_len=m["seq_len"], attention="eager" if eager else "sdpa")
        if llama:
            kw.update(kv_heads=m["kv_heads"] or m["heads"], ffn_hidden=m["ffn_hidden"])
        else:
            kw.update(dropout=0.0 if mpt else 0.1,
                      tie_embeddings="131" not in str(m["vocab"]))
        return autopar.profile(autopar.models.build(kind, **kw), seq_len=m["seq_len"])
    return analytic_transformer_profile(
        m["layers"], m["hidden"], m["heads"], m["vocab"], m["seq_len"],
        kv_heads=m["kv_heads"], ffn_hidden=m["ffn_hidden"], gated_mlp=llama,
        dropout=not (llama or mpt), tied_embeddings=not llama and "131" not in str(m["vocab"]),
        position_embeddings=not (llama or mpt), bias=not (llama or mpt), name=m["name"],
        attention="eager" if eager else "sdpa",
    )


def _recompute(rec: dict) -> tuple[str, bool]:
    """(recompute mode, every-other-layer) from the record's text."""
    text = str(rec["plan"]["recompute"] or "none").lower()
    if text.startswith("full"):
        return "full", False
    if "selective layer" in text:  # torchtitan layer SAC: every second block fully recomputed
        return "none", True
    if text.startswith("selective"):
        return "selective", False
    return "none", False


def record_config(rec: dict, num_layers: int) -> ParallelConfig:
    """The ParallelConfig of a record; fields it leaves out get the documented defaults."""
    p = rec["plan"]
    tp, pp, dp = p["tp"], p["pp"], p["dp"]
    mb = p["microbatch"] or DEFAULT_MICRO_BATCH
    schedule, v = "1f1b", 1
    if pp > 1 and "interleaved" in str(p["schedule"]).lower():
        schedule = "interleaved-1f1b"
        v = p["virtual_stages"] or DEFAULT_VIRTUAL_STAGES
        while v > 1 and pp * v > num_layers:
            v -= 1
        if v == 1:
            schedule = "1f1b"
    zero = p["zero_stage"]
    zero = 3 if isinstance(zero, str) and "zero-3" in zero.lower() else int(zero or 0)
    if p["zero_stage"] is None and "--overlap-param-gather" in rec["notes"]:
        zero = 1  # Megatron's --overlap-param-gather exists only with the distributed optimizer
    sp = p["sequence_parallel"]
    sp = (tp > 1) if sp is None else bool(sp)  # unstated: SP with TP (Megatron-Core's default)
    recompute, _ = _recompute(rec)
    return ParallelConfig(
        dp=dp, tp=tp, pp=pp, micro_batch=mb, global_batch=p["global_batch"], schedule=schedule,
        virtual_stages=v, recompute=recompute, sequence_parallel=sp and tp > 1, zero=zero,
        dtype="bf16",
    )


def record_cluster(rec: dict, overrides: dict | None = None) -> Cluster:
    """The preset of the record's GPU with the record's GPU count (8 per node by default)."""
    c = rec["cluster"]
    name = "h100" if "h100" in c["gpu"].lower() else "a100-80g"
    gpn = c["gpus_per_node"] or 8
    cluster = Cluster.preset(name, nodes=c["n_gpus"] // gpn, gpus_per_node=gpn)
    data = cluster.to_dict()
    if rec["id"].startswith(("megatron", "korthikanti")):
        # Megatron-LM keeps bf16 weights and accumulates gradients inside the weight-gradient
        # GEMM (gradient_accumulation_fusion): none of autopar's runtime's per-micro-batch
        # weight casts and gradient accumulation passes.
        data["param_traffic_factor"] = 0.0
    if overrides:
        data["device"].update(overrides.get(name, {}))
        data["device"].update(overrides.get("all", {}))
    return Cluster.from_dict(data)


def measured_tokens_per_gpu(rec: dict, profile) -> float:
    """Measured tokens/s per GPU, from whichever figure the record gives."""
    meas, der = rec["measured"], rec.get("derived") or {}
    n, seq = rec["cluster"]["n_gpus"], rec["model"]["seq_len"]
    if meas.get("tokens_per_s_per_gpu"):
        return float(meas["tokens_per_s_per_gpu"])
    if der.get("tokens_per_s_per_gpu_from_eq3"):
        return float(der["tokens_per_s_per_gpu_from_eq3"])
    if meas.get("iteration_time_s"):
        return rec["plan"]["global_batch"] * seq / meas["iteration_time_s"] / n
    # Model TFLOP/s per GPU over model FLOPs per token (Megatron's formula = Korthikanti Eq. 7).
    flops_per_token = sum(layer.fwd_flops + layer.bwd_flops for layer in profile.layers) / seq
    return meas["tflops_per_gpu"] * 1e12 / flops_per_token


def predict(rec: dict, profile, overrides: dict | None = None):
    """(Estimate, predicted tokens/s per GPU) of one record."""
    cluster = record_cluster(rec, overrides)
    cfg = record_config(rec, profile.num_layers)
    check_config(profile, cluster, cfg)
    table = build_cost_table(profile, cluster, cfg)
    split, recompute = default_split(table)
    if _recompute(rec)[1]:
        recompute = tuple(
            "full" if layer.kind == "block" and i % 2 == 1 else "none"
            for i, layer in enumerate(profile.layers)
        )
    est = assemble(table, split, recompute)
    return est, est.tokens_per_s / cluster.num_gpus


def published_run_memory_bytes(est) -> float:
    """The largest rank's memory without torch pipelining's receive buffers.

    The published runs used Megatron-LM / torchtitan runtimes; Megatron's p2p communication
    allocates one receive tensor per transfer and frees it with the micro-batch, unlike torch's
    PipelineStage, which keeps one per micro-batch for the whole step (the estimate's
    ``pipeline_buffers`` term, which autopar's own plans are charged). A published run's fit is
    judged on the memory of its own runtime, so that term is left out here.
    """
    if not est.stages:
        return est.memory_per_gpu_bytes - est.memory_breakdown.pipeline_buffers_bytes
    return max(s.memory_bytes - s.memory.pipeline_buffers_bytes for s in est.stages)


def evaluate(records, profiles, overrides=None) -> list[dict]:
    """One row per record: measured, predicted, error, memory and fit."""
    rows = []
    for rec, prof in zip(records, profiles):
        est, pred = predict(rec, prof, overrides)
        meas = measured_tokens_per_gpu(rec, prof)
        mem = published_run_memory_bytes(est)
        rows.append({
            "id": rec["id"], "measured": meas, "predicted": pred, "error": pred / meas - 1,
            "memory_gib": mem / 2**30, "fits": mem <= est.memory_capacity_bytes,
            "mfu": est.mfu,
        })
    return rows


def summary(rows) -> tuple[float, float]:
    """(median, p90) of the absolute relative error."""
    errs = sorted(abs(r["error"]) for r in rows)
    p90 = errs[min(len(errs) - 1, math.ceil(0.9 * len(errs)) - 1)]
    return statistics.median(errs), p90


def fit(records, profiles) -> dict:
    """Joint least squares of the log error over all records for the efficiency parameters."""
    from scipy.optimize import minimize

    from autopar.cost_model import presets

    half_s = presets.MATMUL_HALF_S  # set from GEMM physics, not fitted (docs/cost_model.md)

    def overrides(x):
        a100, h100, traffic = x
        return {
            "a100-80g": {"matmul_efficiency_max": a100, "matmul_half_flops": half_s * 312e12},
            "h100": {"matmul_efficiency_max": h100, "matmul_half_flops": half_s * 989e12},
            "all": {"elementwise_traffic_factor": traffic},
        }

    def loss(x):
        a100, h100, traffic = x
        if not (0.2 < a100 <= 1 and 0.2 < h100 <= 1 and traffic >= 0):
            return 1e9
        rows = evaluate(records, profiles, overrides(x))
        return sum(math.log1p(r["error"]) ** 2 for r in rows)

    x0 = [presets.A100_EFFICIENCY_MAX, presets.H100_EFFICIENCY_MAX, presets.ELEMENTWISE_TRAFFIC]
    res = minimize(loss, x0, method="Nelder-Mead",
                   options={"xatol": 1e-4, "fatol": 1e-8, "maxiter": 600})
    a100, h100, traffic = res.x
    return {"A100_EFFICIENCY_MAX": round(a100, 3), "H100_EFFICIENCY_MAX": round(h100, 3),
            "ELEMENTWISE_TRAFFIC": round(traffic, 2), "loss": res.fun}


def main(argv: list[str] | None = None) -> int:
    """Print the table (or the fitted parameters with --fit)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="fit the efficiency parameters")
    ap.add_argument("--traced", action="store_true", help="traced zoo profiles (the default)")
    ap.add_argument("--analytic", action="store_true", help="closed-form profiles instead")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    records = [r for r in json.loads(RUNS.read_text()) if r["record_type"] == "training_throughput"]
    profiles = [record_profile(r, traced=not args.analytic) for r in records]
    if args.fit:
        print(json.dumps(fit(records, profiles), indent=2))
        return 0
    rows = evaluate(records, profiles)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'run':45s} {'measured':>9s} {'predicted':>9s} {'error':>7s} {'mem GiB':>8s} fits")
    for r in rows:
        print(f"{r['id']:45s} {r['measured']:9.1f} {r['predicted']:9.1f} {100 * r['error']:6.1f}% "
              f"{r['memory_gib']:8.1f} {r['fits']}")
    med, p90 = summary(rows)
    print(f"median |error| {100 * med:.1f}%   p90 |error| {100 * p90:.1f}%   "
          f"all fit: {all(r['fits'] for r in rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
