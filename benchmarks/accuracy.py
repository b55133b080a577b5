"""How close autopar's predictions are to real runs: predicted vs measured step time and memory.

On this machine: CPU, gloo, 4 processes, fp32 (profiled and estimated at fp32). First
``autopar calibrate`` measures the machine (or ``--cluster`` gives a calibrated cluster YAML),
then each configuration of a small GPT and a small Llama (DP, ZeRO/FSDP, TP, TP+SP, PP with each
schedule, mixed splits, micro-batch sizes, recompute) runs a few steps through the launcher of
``autopar run`` and is compared with ``autopar.estimate`` on the calibrated cluster.

Printed and written to ``benchmarks/results/accuracy_<device>_<yyyymm>.md``: one row per
configuration, the Spearman rank correlation of the step times, the time MAPE, the memory error,
and every pair of configurations whose predictions differ by more than 30% but whose measured
order is the other way round. On a GPU machine the same script runs with NCCL and bf16.

    .venv/bin/python benchmarks/accuracy.py                 # full run (~5 minutes here)
    .venv/bin/python benchmarks/accuracy.py --quick         # 4 configs, 3 steps (development)

``--calibration cal.json`` keeps the raw calibration (read when the file exists, written after
calibrating otherwise) and ``--measurements runs.json`` the raw measurements (configurations
found there are not run again): together they re-predict a real run after a cost-model change
without re-measuring. A measurement keeps the stage split its plan ran (``split``), and the
re-prediction costs that split, whatever the default split of the day. The predicted time terms
of every configuration go to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from autopar.config import ParallelConfig
from autopar.cost_model.calibration import median
from autopar.cost_model.hardware import Cluster
from autopar.errors import AutoparError

GPT = "gpt:layers=4,hidden=128,heads=4,vocab=512,seq_len=64"
LLAMA = "llama:layers=6,hidden=128,heads=4,kv_heads=2,vocab=512,seq_len=64"
GLOBAL_BATCH = 8
NPROC = 4  # every configuration below spans 4 processes (devices)
# Targets (issue 7): rank correlation, mean absolute percentage error, memory error.
SPEARMAN_TARGET = 0.9
MAPE_TARGET = 0.25
MEMORY_TARGET = 0.10
PAIR_GAP = 0.30  # predictions differing by more than this must be ordered as measured


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One configuration to run: a label, the model and the split."""

    label: str
    model: str
    config: ParallelConfig


def _cfg(dtype: str, **kw) -> ParallelConfig:
    kw.setdefault("global_batch", GLOBAL_BATCH)
    return ParallelConfig(dtype=dtype, **kw)


def cases(dtype: str) -> list[Case]:
    """The configurations (world size 4 each)."""
    c = lambda **kw: _cfg(dtype, **kw)  # noqa: E731
    return [
        Case(label="gpt ddp", model=GPT, config=c(dp=4, micro_batch=2)),
        Case(label="gpt fsdp", model=GPT, config=c(dp=4, micro_batch=2, zero=3)),
        Case(label="gpt tp4", model=GPT, config=c(tp=4, micro_batch=4)),
        Case(label="gpt dp2 tp2 sp", model=GPT,
             config=c(dp=2, tp=2, micro_batch=2, sequence_parallel=True)),
        Case(label="gpt pp4 gpipe", model=GPT, config=c(pp=4, micro_batch=1, schedule="gpipe")),
        Case(label="gpt pp4 1f1b mb2", model=GPT, config=c(pp=4, micro_batch=2)),
        Case(label="gpt pp2 dp2 interleaved fsdp", model=GPT,
             config=c(pp=2, dp=2, micro_batch=1, schedule="interleaved-1f1b",
                      virtual_stages=2, zero=3)),
        Case(label="gpt dp2 pp2 gpipe selective", model=GPT,
             config=c(dp=2, pp=2, micro_batch=2, schedule="gpipe", zero=3,
                      recompute="selective")),
        Case(label="llama ddp full-recompute", model=LLAMA,
             config=c(dp=4, micro_batch=1, recompute="full")),
        Case(label="llama dp4 mb2", model=LLAMA, config=c(dp=4, micro_batch=2)),
        Case(label="llama dp2 tp2 zero1", model=LLAMA, config=c(dp=2, tp=2, micro_batch=4, zero=1)),
        Case(label="llama tp2 pp2 sp", model=LLAMA,
             config=c(tp=2, pp=2, micro_batch=2, sequence_parallel=True)),
        Case(label="llama pp4 1f1b", model=LLAMA, config=c(pp=4, micro_batch=1)),
        # zero 2: under zero 3 torch's stages run deferred weight passes on resharded
        # parameters (wrong gradients; framework_support refuses it)
        Case(label="llama pp2 interleaved-zb zero2", model=LLAMA,
             config=c(pp=2, dp=2, micro_batch=1, schedule="interleaved-zero-bubble",
                      virtual_stages=2, zero=2)),
        Case(label="llama pp2 zbv", model=LLAMA,
             config=c(pp=2, tp=2, micro_batch=2, schedule="zbv-zero-bubble", virtual_stages=2)),
        Case(label="llama pp4 dualpipe-v", model=LLAMA,
             config=c(pp=4, micro_batch=1, schedule="dualpipe-v", virtual_stages=2)),
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One configuration's prediction and measurement (``error`` set when it failed)."""

    case: Case
    predicted_s: float = 0.0
    measured_s: float = 0.0
    predicted_bytes: float = 0.0
    predicted_buffers_bytes: float = 0.0
    measured_bytes: int = 0
    breakdown: dict | None = None
    error: str = ""

    @property
    def time_error(self) -> float:
        """(predicted - measured) / measured step time."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def memory_error(self) -> float:
        """(predicted - measured) / measured peak memory."""
        return (self.predicted_bytes - self.measured_bytes) / max(self.measured_bytes, 1)

    @property
    def memory_error_without_buffers(self) -> float:
        """The same, leaving out the predicted communication buffers and allocator reserve."""
        predicted = self.predicted_bytes - self.predicted_buffers_bytes
        return (predicted - self.measured_bytes) / max(self.measured_bytes, 1)


def _ranks(values: list[float]) -> list[float]:
    """Ranks 1..n, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks."""
    rx, ry = _ranks(xs), _ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var > 0 else 0.0


def disagreeing_pairs(rows: list[Row]) -> list[tuple[Row, Row]]:
    """Pairs (a, b) predicted a faster by more than PAIR_GAP whose measurement says b is faster."""
    out = []
    for a in rows:
        for b in rows:
            if a.predicted_s * (1 + PAIR_GAP) < b.predicted_s and a.measured_s > b.measured_s:
                out.append((a, b))
    return out


def predict_case(case: Case, cluster: Cluster, kernels: str = "cpu",
                 split: list[list[int]] | None = None):
    """The plan (``split``, or the split chosen by autopar for the config) and its estimate on
    ``cluster``.

    The profile counts what the measured device's kernels save (``kernels``: "cpu" for the
    gloo runs here, "cuda" on GPU; on CPU torch's RMSNorm is a composite that keeps one more
    [b, s, h] per norm than the fused GPU kernel).
    """
    from autopar.graph.model_text import build_and_profile
    from autopar.search.planner import plan_from_config

    # fp32 runs profiled at fp32
    profile = build_and_profile(case.model, dtype=case.config.dtype, kernels=kernels)[1]
    return plan_from_config(profile, cluster, case.config, model=case.model,
                            split=None if split is None else tuple(map(tuple, split)))


def run_case(case: Case, cluster: Cluster, steps: int, warmup: int,
             measured: dict[str, dict] | None = None, kernels: str = "cpu") -> Row:
    """Predict and measure one configuration (or take the measurement from ``measured``)."""
    from autopar.runtime.verify import measure_plan

    try:
        stored = (measured or {}).get(case.label)
        # a measurement stored before splits were kept: today's default split
        plan = predict_case(case, cluster, kernels, None if stored is None else stored.get("split"))
        if stored is not None:
            m = stored
            times = m["step_times_s"][m["warmup_steps"]:]
            measured_s, peak = median(times), int(m["peak_memory_bytes"])
        else:
            run = measure_plan(plan, case.model, steps=steps, warmup_steps=warmup)
            measured_s, peak = run.step_time_s, run.peak_memory_bytes
            if measured is not None:
                measured[case.label] = {
                    "step_times_s": list(run.step_times_s), "warmup_steps": warmup,
                    "peak_memory_bytes": peak,
                    "peak_memory_bytes_per_rank": list(run.peak_memory_bytes_per_rank),
                    "split": [list(stage.layers) for stage in plan.stages]}
    except (AutoparError, ValueError, RuntimeError) as err:
        return Row(case=case, error=" ".join(str(err).split())[:120])
    return Row(case=case, predicted_s=plan.estimate.step_time_s, measured_s=measured_s,
               predicted_bytes=plan.estimate.memory_per_gpu_bytes,
               predicted_buffers_bytes=plan.estimate.memory_breakdown.buffers_bytes,
               measured_bytes=peak, breakdown=plan.estimate.time_breakdown.to_dict())


def summary(rows: list[Row]) -> dict[str, float]:
    """Spearman, time MAPE, memory errors over the rows that ran."""
    ok = [r for r in rows if not r.error]
    if len(ok) < 2:
        return {}
    return {
        "spearman": spearman([r.predicted_s for r in ok], [r.measured_s for r in ok]),
        "time_mape": sum(abs(r.time_error) for r in ok) / len(ok),
        "memory_median_abs_error": median([abs(r.memory_error) for r in ok]),
        "memory_max_abs_error": max(abs(r.memory_error) for r in ok),
        "memory_within_target": sum(abs(r.memory_error) <= MEMORY_TARGET for r in ok) / len(ok),
        "memory_median_abs_error_without_buffers": median(
            [abs(r.memory_error_without_buffers) for r in ok]),
        "memory_max_abs_error_without_buffers": max(
            abs(r.memory_error_without_buffers) for r in ok),
    }


def report(rows: list[Row], cluster: Cluster, meta: str) -> str:
    """The markdown report: table, summary, disagreeing pairs."""
    mib = 2**20
    lines = [
        "# Prediction accuracy: predicted vs measured", "", meta, "",
        "| # | configuration | split | predicted ms | measured ms | time error "
        "| predicted MiB | measured MiB | memory error | error w/o buffers |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        split = r.case.config.describe()
        if r.error:
            lines.append(f"| {i} | {r.case.label} | {split} | failed: {r.error} | | | | | | |")
            continue
        lines.append(
            f"| {i} | {r.case.label} | {split} | {r.predicted_s * 1e3:.1f} | "
            f"{r.measured_s * 1e3:.1f} | {r.time_error:+.0%} | {r.predicted_bytes / mib:.2f} | "
            f"{r.measured_bytes / mib:.2f} | {r.memory_error:+.1%} | "
            f"{r.memory_error_without_buffers:+.1%} |"
        )
    s = summary(rows)
    lines += ["", "## Summary", ""]
    if s:
        lines += [
            f"- Spearman rank correlation of step times: **{s['spearman']:.3f}** "
            f"(target >= {SPEARMAN_TARGET})",
            f"- time MAPE: **{s['time_mape']:.1%}** (target <= {MAPE_TARGET:.0%})",
            f"- memory error: median {s['memory_median_abs_error']:.1%}, largest "
            f"{s['memory_max_abs_error']:.1%}; {s['memory_within_target']:.0%} of the "
            f"configurations within {MEMORY_TARGET:.0%} (target: all)",
            f"- memory error leaving out the predicted communication buffers and allocator "
            f"reserve (which gloo does not allocate as tensors): median "
            f"{s['memory_median_abs_error_without_buffers']:.1%}, largest "
            f"{s['memory_max_abs_error_without_buffers']:.1%}",
        ]
    pairs = disagreeing_pairs([r for r in rows if not r.error])
    lines += ["", f"## Pairs ordered wrongly (predictions > {PAIR_GAP:.0%} apart): {len(pairs)}",
              ""]
    for a, b in pairs:
        lines.append(
            f"- predicted {a.case.label} ({a.predicted_s * 1e3:.1f} ms) faster than "
            f"{b.case.label} ({b.predicted_s * 1e3:.1f} ms); measured "
            f"{a.measured_s * 1e3:.1f} ms vs {b.measured_s * 1e3:.1f} ms"
        )
    d, link = cluster.device, cluster.intra_node
    lines += [
        "", "## Cluster used for the predictions", "",
        f"`{cluster.name}`: {cluster.gpus_per_node} devices; matmul "
        f"{d.peak_fp32_flops * d.matmul_efficiency_max / 1e9:.1f} GFLOP/s (fp32) per device, "
        f"half-efficiency work {d.matmul_half_flops / 1e6:.1f} MFLOP, memory "
        f"{d.hbm_bytes_per_s / 1e9:.2f} GB/s; link {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
        f"{link.latency_s * 1e6:.0f} us per ring step; measured over ring-model time: "
        f"all-reduce {cluster.all_reduce_time_factor:.2f}, all-gather "
        f"{cluster.all_gather_time_factor:.2f}, reduce-scatter "
        f"{cluster.reduce_scatter_time_factor:.2f}.",
    ]
    return "\n".join(lines) + "\n"


def _cluster(args: argparse.Namespace, device_type: str) -> Cluster:
    """The cluster to predict on: ``--cluster`` YAML, a stored calibration, or a new one."""
    from autopar.cli.cmd_calibrate import format_calibration
    from autopar.cost_model.calibration import Calibration, calibration_to_cluster
    from autopar.runtime.calibrate import calibrate

    if args.cluster:
        return Cluster.from_yaml(args.cluster)
    path = Path(args.calibration) if args.calibration else None
    if path is not None and path.exists():
        cal = Calibration.from_dict(json.loads(path.read_text()))
    else:
        cal = calibrate(NPROC, device_type, quick=args.quick)
        if path is not None:
            path.write_text(json.dumps(cal.to_dict(), indent=1))
    print(format_calibration(cal), file=sys.stderr)
    return calibration_to_cluster(cal)


def _print_breakdowns(rows: list[Row]) -> None:
    """Per configuration: predicted terms (ms) beside the measured step (stderr)."""
    for r in rows:
        if r.error or not r.breakdown:
            continue
        terms = ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.1f}"
                          for k, v in r.breakdown.items() if v > 0)
        print(f"[terms] {r.case.label:<30s} measured {r.measured_s * 1e3:7.1f} predicted "
              f"{r.predicted_s * 1e3:7.1f} ms = {terms}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Calibrate, run every configuration, print and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="leading steps not timed")
    parser.add_argument("--cluster", default=None, help="calibrated cluster YAML")
    parser.add_argument("--quick", action="store_true", help="4 configurations, 3 steps")
    parser.add_argument("--only", default="", help="comma-separated labels to run")
    parser.add_argument("--calibration", default=None,
                        help="calibration JSON: read it when it exists, else calibrate and "
                        "write it there")
    parser.add_argument("--measurements", default=None,
                        help="measurements JSON: configurations found there are not run again "
                        "(predictions are recomputed); new measurements are added to it")
    parser.add_argument("--out", default=None, help="report path (default benchmarks/results/...)")
    args = parser.parse_args(argv)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda" and torch.cuda.device_count() < NPROC:
        print(f"accuracy: the configurations need {NPROC} GPUs; this machine has "
              f"{torch.cuda.device_count()}", file=sys.stderr)
        return 2
    dtype = "bf16" if device_type == "cuda" else "fp32"
    todo = cases(dtype)
    if args.only:
        wanted = {w.strip() for w in args.only.split(",")}
        todo = [c for c in todo if c.label in wanted]
    if args.quick:
        todo, args.steps, args.warmup = todo[::4], 3, 1
    start = time.perf_counter()
    cluster = _cluster(args, device_type)
    store = Path(args.measurements) if args.measurements else None
    measured = json.loads(store.read_text()) if store is not None and store.exists() else {}
    rows = []
    for case in todo:
        row = run_case(case, cluster, args.steps, args.warmup, measured, kernels=device_type)
        if store is not None:
            store.write_text(json.dumps(measured, indent=1))
        rows.append(row)
        status = row.error or (f"predicted {row.predicted_s * 1e3:.1f} ms, measured "
                               f"{row.measured_s * 1e3:.1f} ms")
        print(f"[accuracy] {case.label}: {status}", file=sys.stderr)
    month = datetime.date.today().strftime("%Y%m")
    meta = (f"{device_type}, {NPROC} processes, {dtype}; {args.steps} steps per configuration "
            f"(median after {args.warmup} warm-up); torch {torch.__version__}; "
            f"{time.perf_counter() - start:.0f} s in all; reproduce: "
            f"`.venv/bin/python benchmarks/accuracy.py`")
    if args.calibration or args.measurements:
        meta += (f"; raw calibration `{args.calibration or '-'}`, raw measurements "
                 f"`{args.measurements or '-'}` (configurations found there were not run again)")
    _print_breakdowns(rows)
    text = report(rows, cluster, meta)
    print(text)
    out = Path(args.out or Path(__file__).parent / "results" / f"accuracy_{device_type}_{month}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
