"""Published training runs against autopar's predictions, per framework, through the public API.

Usage:
    python benchmarks/calibration.py            # every run: measured, predicted, error, memory
    python benchmarks/calibration.py --loso     # and leave-one-source-out error (refits per source)
    python benchmarks/calibration.py --fit      # fit each framework's parameters on its records
    python benchmarks/calibration.py --fit-dp-overlap  # the clusters' DP overlap, by LOSO error

Every record of benchmarks/data/published_runs.json (each number with its source) names its
framework, its model (kind, shape, attention kernel, dropout, tied embeddings), its cluster (GPU,
count) and its split. A record becomes exactly what a user would type (``record_inputs``):

    model    = autopar.models.build(kind, layers=..., attention=..., dropout=..., ...)
    profile  = autopar.profile(model, seq_len=...)
    cluster  = autopar.Cluster.preset(gpu, nodes=n_gpus // gpus_per_node, gpus_per_node=...)
    estimate = autopar.estimate(profile, cluster, config, framework=record["framework"])

with fixed, documented defaults for fields a record leaves out (``DEFAULTS``, docs/frameworks.md)
and no rule keyed on a record's id. Records outside autopar's space are listed and skipped.

The fit (``--fit``): for each framework, its own records only, the few fitted fields of its
``Framework`` record (``FITTED``) minimise the squared log error of tokens/s per GPU
(scipy ``least_squares``). Leave-one-source-out (``--loso``): for each publication
(``source_key``), fit without it, predict it. A framework's step-time band is the 10th-90th
percentile of measured over predicted step time in that cross-validation.

``--fit-dp-overlap``: the GPU presets' ``dp_overlap_efficiency`` (presets.DP_OVERLAP, a cluster
field, and the field of the torchtitan, Megatron-LM and DeepSpeed records: how much of the last
backward hides the data-parallel reduction) is shared by every framework, so no one framework's
fit can set it; each value of ``DP_OVERLAP_GRID`` is given to
every record's cluster, every framework refitted leaving each source out, and the value with the
lowest leave-one-source-out median error (then p90) is the fitted one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from autopar.cost_model.framework_fit import FITTED_FIELDS, NEUTRAL_FIT  # noqa: E402
from autopar.cost_model.frameworks import Framework, get_framework  # noqa: E402
from autopar.cost_model.recompute_layers import pattern_recompute, stage_ranks  # noqa: E402

RUNS = ROOT / "benchmarks" / "data" / "published_runs.json"
# Fields a record leaves out: one default each, never a per-record choice.
DEFAULTS = {
    "microbatch": 1,  # Megatron's usual for large runs
    # "interleaved" without a chunk count: the fewest chunks (>= 2) that split each stage's
    # blocks evenly, as Megatron-LM requires (validate_args: the blocks per stage divisible by
    # the blocks per virtual stage); else 2, lowered until the layers allow.
    "virtual_stages": 2,
    "sequence_parallel": "with tp > 1",  # Megatron-Core's and torchtitan's default
    "zero_stage": {"megatron-lm": 1, "torchtitan": 3, "deepspeed": 1},  # distributed optimizer /
    # FSDP2 / ZeRO-1: each framework's default for data parallelism at scale
    "recompute": "the least of none, selective, full that fits",
    # torchtitan's "selective" is its per-op checkpointing, which the torchtitan framework
    # record costs as such (Framework.selective_policy "op"); a record whose selective
    # checkpointing wraps every n-th block says so with plan.recompute_every.
    "stage_layers": "the framework's default split (estimate's); a source that states its "
                    "pipeline layout gives plan.stage_layers: profile layers per stage, the "
                    "embedding and the head included",
    "gpus_per_node": 8,
    "memory_GB": "the preset's",
}
# step_overhead_s: at most half a second per step (data loading, clipping, logging), so that a
# fit cannot turn it into a stand-in for what the layers' terms miss.
BOUNDS = {"kernel_efficiency": (0.5, 1.6), "step_overhead_s": (0.0, 0.5),
          "overlap_slowdown": (0.0, 0.9),
          "dp_comm_efficiency": (0.02, 1.0), "zero3_comm_efficiency": (0.02, 1.0)}


_BY_ID: dict[str, dict] = {}


def load_records(path: Path = RUNS) -> list[dict]:
    """Every published record."""
    records = json.loads(path.read_text())
    _BY_ID.update({r["id"]: r for r in records})
    return records


def out_of_space(rec: dict) -> str | None:
    """Why autopar cannot express a record yet (None when it can)."""
    if rec["plan"].get("master_weights", "fp32") != "fp32":
        return "16-bit weights and optimizer states without an fp32 master copy (autopar's " \
               "16-bit training keeps fp32 master weights, gradients and Adam moments)"
    return None


def model_spec(rec: dict) -> tuple[str, dict]:
    """(zoo kind, shape) of a record's model: the fields the zoo takes, from the record."""
    m = rec["model"]
    shape = dict(layers=m["layers"], hidden=m["hidden"], heads=m["heads"], vocab=m["vocab"],
                 seq_len=m["seq_len"], attention="eager" if m["attention"] == "eager" else "sdpa",
                 tie_embeddings=bool(m["tie_embeddings"]))
    if m.get("ffn_hidden"):
        shape["ffn_hidden"] = m["ffn_hidden"]
    if m["kind"] == "llama":
        shape["kv_heads"] = m.get("kv_heads") or m["heads"]
    else:
        shape["dropout"] = float(m.get("dropout") or 0.0)
        if m.get("kv_heads"):
            shape["kv_heads"] = m["kv_heads"]
    return m["kind"], shape


@functools.cache
def _profile(kind: str, items: tuple, loss: str = "eager"):
    shape = dict(items)
    return autopar.profile(autopar.models.build(kind, **shape), seq_len=shape["seq_len"],
                           loss=loss)


@functools.cache
def _hf_profile(config_json: str, seq_len: int, loss: str):
    model = autopar.models.from_hf_config(json.loads(config_json))
    return autopar.profile(model, seq_len=seq_len, loss=loss)


def record_profile(rec: dict):
    """autopar's traced profile of the record's model with the loss kernel its training ran
    (``model.loss``: "fused" for a fused cross-entropy kernel; cached per shape): a zoo kind
    with its shape, or ``kind: "hf"`` with the Hugging Face config the run trained
    (``models.from_hf_config``, no download)."""
    loss = rec["model"].get("loss") or "eager"
    if rec["model"]["kind"] == "hf":
        config = json.dumps(rec["model"]["hf_config"], sort_keys=True)
        return _hf_profile(config, rec["model"]["seq_len"], loss)
    kind, shape = model_spec(rec)
    return _profile(kind, tuple(sorted(shape.items())), loss)


def record_cluster(rec: dict) -> autopar.Cluster:
    """The preset of the record's GPU with its GPU count."""
    c = rec["cluster"]
    gpn = c.get("gpus_per_node") or DEFAULTS["gpus_per_node"]
    return autopar.Cluster.preset(c["gpu"], nodes=max(1, c["n_gpus"] // gpn), gpus_per_node=gpn,
                                  gpu_memory_gb=c.get("memory_GB"))


def _schedule(p: dict, num_layers: int, blocks: int) -> tuple[str, int]:
    if p["pp"] <= 1:
        return "1f1b", 1
    if "interleaved" not in str(p.get("schedule") or ""):
        return "1f1b", 1
    per_stage = blocks // p["pp"] if blocks % p["pp"] == 0 else 0
    even = [v for v in range(2, per_stage + 1) if per_stage % v == 0]
    v = p.get("virtual_stages") or (even[0] if even else DEFAULTS["virtual_stages"])
    while v > 1 and p["pp"] * v > num_layers:
        v -= 1
    return ("interleaved-1f1b", v) if v > 1 else ("1f1b", 1)


def record_configs(rec: dict, num_layers: int) -> list[autopar.ParallelConfig]:
    """The record's split; several when it leaves recompute out (tried in order)."""
    p, fw = rec["plan"], rec["framework"]
    schedule, v = _schedule(p, num_layers, rec["model"]["layers"])
    zero = p.get("zero_stage")
    zero = DEFAULTS["zero_stage"][fw] if zero is None else int(zero)
    zero = zero if p["dp"] * (p.get("cp") or 1) > 1 else 0  # FSDP shards over dp * cp
    sp = p.get("sequence_parallel")
    sp = p["tp"] > 1 if sp is None else bool(sp) and p["tp"] > 1
    dtype = p.get("precision") if p.get("precision") in ("fp16", "fp8") else "bf16"
    modes = [p["recompute"]] if p.get("recompute") else ["none", "selective", "full"]
    return [autopar.ParallelConfig(
        dp=p["dp"], cp=p.get("cp") or 1, tp=p["tp"], pp=p["pp"], ep=p.get("ep") or 1,
        dp_replicate=p.get("dp_replicate") or 1,
        micro_batch=p.get("microbatch") or DEFAULTS[
            "microbatch"], global_batch=p["global_batch"], schedule=schedule, virtual_stages=v,
        recompute=mode, sequence_parallel=sp, zero=zero, dtype=dtype) for mode in modes]


def _every_other_plan(profile, cluster, config, framework, every: int):
    """A Plan recomputing every ``every``-th block of a rank fully (torchtitan's layer AC,
    selective_ac_option "every"), the others not at all."""
    from autopar.search import plan_from_config

    plan = plan_from_config(profile, cluster, dataclasses.replace(config, recompute="none"),
                            framework=framework)
    recompute = pattern_recompute(
        "every-nth", every, [s.layers for s in plan.stages],
        [lay.kind == "block" for lay in profile.layers], stage_ranks(plan.config))
    stages = tuple(dataclasses.replace(s, recompute=recompute[s.layers[0]:s.layers[1] + 1])
                   for s in plan.stages)
    return dataclasses.replace(plan, stages=stages)


def record_framework(rec: dict, framework: Framework | None = None) -> Framework:
    """The record's framework with the settings its source states (``framework_settings``:
    e.g. Megatron-LM's --tp-comm-overlap); none stated: the framework's defaults."""
    fw = framework or get_framework(rec["framework"])
    settings = tuple(rec.get("framework_settings") or ())
    if rec["plan"].get("cp_rotate_method") == "alltoall":  # torchtitan's ring (its default:
        settings += ("cp-rotate-alltoall",)                 # "allgather")
    return fw.with_settings(settings)


DP_OVERLAP_GRID = (0.6, 0.7, 0.8, 0.9, 1.0)  # the values --fit-dp-overlap tries


def record_inputs(rec: dict, framework: Framework | None = None,
                  dp_overlap: float | None = None):
    """(profile, cluster, config-or-plan, framework) exactly as a user would pass them;
    ``dp_overlap`` (--fit-dp-overlap): the clusters' dp_overlap_efficiency, and the framework
    records' that share it, as a cluster file and a fitted record would set them."""
    fw = record_framework(rec, framework)
    profile, cluster, chosen = _record_split(rec["id"])
    if dp_overlap is not None:
        cluster = dataclasses.replace(cluster, dp_overlap_efficiency=dp_overlap)
        if fw.dp_overlap_efficiency is not None:
            fw = fw.with_fit(dp_overlap_efficiency=dp_overlap)
        if isinstance(chosen, autopar.Plan):  # a split planned on the preset, re-targeted
            chosen = chosen.for_cluster(cluster)
    return profile, cluster, chosen, fw


@functools.cache
def _record_split(record_id: str):
    """(profile, cluster, config-or-plan) of a record under its framework's committed record
    with the record's settings (the fitted fields change no memory term, so the recompute
    choice does not depend on them; settings such as bf16-adam-moments do)."""
    rec = _BY_ID[record_id]
    profile = record_profile(rec)
    cluster = record_cluster(rec)
    fw = record_framework(rec)
    configs = record_configs(rec, profile.num_layers)
    every = rec["plan"].get("recompute_every")
    if every:
        return profile, cluster, _every_other_plan(profile, cluster, configs[0], fw.name, every)
    sizes = rec["plan"].get("stage_layers")
    split = None
    if sizes:  # the source's own layout: a Plan with that split
        bounds = list(itertools.accumulate(sizes, initial=0))
        split = tuple((a, b - 1) for a, b in itertools.pairwise(bounds))

    def as_given(config):
        from autopar.search import plan_from_config

        return config if split is None else plan_from_config(
            profile, cluster, config, framework=fw.name, split=split)

    for config in configs:
        chosen = as_given(config)
        if autopar.estimate(profile, cluster, chosen, framework=fw).fits:
            break
    return profile, cluster, chosen


def cli_args(rec: dict) -> list[str] | None:
    """The ``autopar estimate`` command line of a record (None when it needs a per-layer
    recompute plan, which the command line does not express)."""
    _profile_unused, cluster, config, fw = record_inputs(rec)
    if not isinstance(config, autopar.ParallelConfig) or rec["model"]["kind"] == "hf":
        return None  # a per-layer recompute plan, or a model the CLI reads from a config file
    kind, shape = model_spec(rec)
    spec = kind + ":" + ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                                 for k, v in shape.items())
    args = ["estimate", spec, "--gpus", str(cluster.num_gpus), "--gpu", rec["cluster"]["gpu"],
            "--dp", str(config.dp), "--tp", str(config.tp), "--pp", str(config.pp),
            "--micro-batch", str(config.micro_batch), "--global-batch", str(config.global_batch),
            "--schedule", config.schedule, "--virtual-stages", str(config.virtual_stages),
            "--recompute", config.recompute, "--zero", str(config.zero), "--dtype", config.dtype,
            "--cp", str(config.cp), "--ep", str(config.ep),
            "--dp-replicate", str(config.dp_replicate),
            "--framework", fw.spec, "--json"]
    if rec["cluster"].get("memory_GB"):
        args += ["--gpu-memory", str(rec["cluster"]["memory_GB"])]
    if config.sequence_parallel:
        args.append("--sequence-parallel")
    if rec["model"].get("loss"):
        args += ["--loss", rec["model"]["loss"]]
    return args


def measured_tokens_per_gpu(rec: dict, profile) -> float:
    """Measured tokens/s per GPU, from whichever figure the record gives (model FLOPs for
    TFLOP/s figures without tokens: the record's notes say which)."""
    meas, n = rec["measured"], rec["cluster"]["n_gpus"]
    seq = rec["model"]["seq_len"]
    if meas.get("tokens_per_s_per_gpu"):
        return float(meas["tokens_per_s_per_gpu"])
    if meas.get("iteration_time_s"):
        return rec["plan"]["global_batch"] * seq / meas["iteration_time_s"] / n
    flops_per_token = sum(lay.fwd_flops + lay.bwd_flops for lay in profile.layers) / seq
    return meas["tflops_per_gpu"] * 1e12 / flops_per_token


def predict(rec: dict, framework: Framework | None = None,
            dp_overlap: float | None = None) -> dict:
    """One row: measured and predicted tokens/s per GPU, error, memory, fit."""
    profile, cluster, config, fw = record_inputs(rec, framework, dp_overlap)
    est = autopar.estimate(profile, cluster, config, framework=fw)
    measured = measured_tokens_per_gpu(rec, profile)
    predicted = est.tokens_per_s / cluster.num_gpus
    flops_per_token = sum(lay.fwd_flops + lay.bwd_flops for lay in profile.layers) / (
        rec["model"]["seq_len"])
    dtype = getattr(config, "config", config).dtype  # a Plan carries its config
    return {"id": rec["id"], "source": rec["source_key"], "framework": fw.name,
            "group": (rec["model"]["name"], rec["cluster"]["gpu"]),
            "tokens_per_peak": cluster.device.peak_flops(dtype) / flops_per_token,
            "measured": measured, "predicted": predicted, "error": predicted / measured - 1,
            "memory_gib": est.memory_per_gpu_bytes / 2**30, "fits": est.fits,
            "interval": [i / est.step_time_s for i in est.step_time_interval_s]}


def summary(rows: list[dict]) -> dict:
    """Median and p90 absolute error, pairs ranked right, runs predicted not to fit."""
    errs = sorted(abs(r["error"]) for r in rows)
    p90 = errs[min(len(errs) - 1, math.ceil(0.9 * len(errs)) - 1)] if errs else 0.0
    right = total = 0
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if a["group"] != b["group"]:
                continue
            hi, lo = (a, b) if a["measured"] > b["measured"] else (b, a)
            if hi["measured"] <= 1.1 * lo["measured"]:
                continue
            total += 1
            right += hi["predicted"] > lo["predicted"]
    return {"runs": len(rows), "median": statistics.median(errs) if errs else 0.0, "p90": p90,
            "pairs": total, "pairs_right": right / total if total else 1.0,
            "not_fit": [r["id"] for r in rows if not r["fits"]]}


def fit(records: Iterable[dict], base: Framework, dp_overlap: float | None = None) -> Framework:
    """The framework's fitted fields (``FITTED_FIELDS``) fitted to ``records``: bounded least
    squares of the log error of tokens/s per GPU (scipy ``least_squares``), started from the
    neutral values, so a field the records say nothing about stays neutral."""
    from scipy.optimize import least_squares

    records = list(records)
    fitted = FITTED_FIELDS[base.name]
    if not records or not fitted:
        return base
    start = neutral_framework(base.name)
    lo = [BOUNDS[name][0] for name in fitted]
    hi = [BOUNDS[name][1] for name in fitted]
    x0 = [min(max(getattr(start, name), a + 1e-6), b - 1e-6)
          for name, a, b in zip(fitted, lo, hi)]

    def trial(x) -> Framework:
        return start.with_fit(**dict(zip(fitted, (float(v) for v in x))))

    def residuals(x) -> list[float]:
        fw = trial(x)
        return [math.log1p(predict(r, fw, dp_overlap)["error"]) for r in records]

    res = least_squares(residuals, x0, bounds=(lo, hi), diff_step=1e-3, xtol=1e-4,
                        ftol=1e-6, max_nfev=60)
    return trial(res.x)


def neutral_framework(name: str) -> Framework:
    """The framework's record with its fitted fields at their neutral values (what a fit
    without any record of the framework leaves)."""
    base = get_framework(name)
    return base.with_fit(**{k: NEUTRAL_FIT[k] for k in FITTED_FIELDS[name]})


def leave_one_source_out(records: list[dict], name: str,
                         dp_overlap: float | None = None) -> list[dict]:
    """Each source of framework ``name`` predicted by a fit on the framework's other sources
    (``dp_overlap``: as ``record_inputs``)."""
    own = [r for r in records if r["framework"] == name]
    neutral = neutral_framework(name)
    rows = []
    for source in sorted({r["source_key"] for r in own}):
        rest = [r for r in own if r["source_key"] != source]
        fw = fit(rest, neutral, dp_overlap)  # with no other source, nothing is fitted: neutral
        rows += [predict(r, fw, dp_overlap) for r in own if r["source_key"] == source]
    return rows


def fit_dp_overlap(records: list[dict], frameworks: list[str]) -> float:
    """Print the leave-one-source-out error of every ``DP_OVERLAP_GRID`` value; return the
    value with the lowest median (then p90) error."""
    scores = []
    for value in DP_OVERLAP_GRID:
        rows = [row for name in frameworks
                for row in leave_one_source_out(records, name, value)]
        s = summary(rows)
        scores.append((round(s["median"], 4), round(s["p90"], 4), value))
        _print_summary(f"dp_overlap_efficiency {value}: LOSO all", s)
    best = min(scores)[2]
    print(f"fitted dp_overlap_efficiency: {best} (lowest leave-one-source-out median, then p90)")
    return best


def step_time_band(rows: list[dict]) -> tuple[float, float]:
    """10th and 90th percentile of measured over predicted step time."""
    ratios = sorted((1 + r["error"]) for r in rows)  # predicted / measured throughput
    pick = lambda q: ratios[min(len(ratios) - 1, int(q * len(ratios)))]  # noqa: E731
    return pick(0.1), pick(0.9)


def framework_table() -> str:
    """The framework records, field by field, as a markdown table (docs/frameworks.md)."""
    from autopar.cost_model.frameworks import FRAMEWORKS

    records = [get_framework(n) for n in FRAMEWORKS]
    fields = [f.name for f in dataclasses.fields(records[0]) if f.name not in ("name",
                                                                                "sources")]
    lines = ["| field | " + " | ".join(FRAMEWORKS) + " |",
             "|---|" + "---|" * len(FRAMEWORKS)]
    for field in fields:
        values = []
        for fw in records:
            v = getattr(fw, field)
            if isinstance(v, tuple):
                v = ", ".join(str(x) for x in v)
            kind = fw.sources[field].split(":")[0]
            values.append(f"{v} ({kind})")
        lines.append(f"| `{field}` | " + " | ".join(values) + " |")
    return "\n".join(lines)


def constant_mfu_rows(rows: list[dict]) -> list[dict]:
    """The same rows predicted by one MFU for every run (the median measured MFU of all runs,
    fitted in sample, which flatters it): the baseline a cost model has to beat."""
    mfu = statistics.median(r["measured"] / r["tokens_per_peak"] for r in rows)
    out = []
    for r in rows:
        predicted = mfu * r["tokens_per_peak"]
        out.append({**r, "predicted": predicted, "error": predicted / r["measured"] - 1,
                    "fits": True})
    return out


def _print_rows(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(f"{'run':46s} {'framework':11s} {'measured':>9s} {'predicted':>9s} {'error':>7s} "
          f"{'GiB':>6s} fits")
    for r in rows:
        print(f"{r['id'][:46]:46s} {r['framework']:11s} {r['measured']:9.1f} "
              f"{r['predicted']:9.1f} {100 * r['error']:6.1f}% {r['memory_gib']:6.1f} {r['fits']}")


def _print_sources(rows: list[dict]) -> None:
    """Median and largest |error| of each publication's runs (docs/frameworks.md quotes them)."""
    print("\nper publication, left out (runs, median / largest |error|):")
    for source in sorted({r["source"] for r in rows}):
        errs = [abs(r["error"]) for r in rows if r["source"] == source]
        print(f"  {source:32s} {len(errs):3d}  {100 * statistics.median(errs):5.1f}% / "
              f"{100 * max(errs):5.1f}%")


def _print_summary(label: str, s: dict) -> None:
    print(f"{label:28s} runs {s['runs']:3d}  median |error| {100 * s['median']:5.1f}%  p90 "
          f"{100 * s['p90']:5.1f}%  pairs right {100 * s['pairs_right']:5.1f}% of "
          f"{s['pairs']}  not fit: {len(s['not_fit'])}")


def main(argv: list[str] | None = None) -> int:
    """Print the tables (and fits)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loso", action="store_true", help="leave-one-source-out error")
    ap.add_argument("--fit", action="store_true", help="fit each framework on its records")
    ap.add_argument("--fit-dp-overlap", action="store_true",
                    help="fit the clusters' dp_overlap_efficiency by leave-one-source-out error")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--records", action="store_true",
                    help="print the framework records (values and sources) as markdown")
    args = ap.parse_args(argv)
    if args.records:
        print(framework_table())
        return 0
    records = load_records()
    skipped = [(r["id"], out_of_space(r)) for r in records if out_of_space(r)]
    records = [r for r in records if not out_of_space(r)]
    frameworks = sorted({r["framework"] for r in records})
    if args.fit_dp_overlap:
        fit_dp_overlap(records, frameworks)
        return 0
    if args.fit:
        for name in frameworks:
            fw = fit([r for r in records if r["framework"] == name], get_framework(name))
            print(name, {k: round(getattr(fw, k), 4) for k in FITTED_FIELDS[name]})
    rows = [predict(r) for r in records]
    if args.json and not args.loso:
        print(json.dumps(rows, indent=2, default=list))
        return 0
    if args.json:  # the leave-one-source-out rows
        loso = [row for name in frameworks for row in leave_one_source_out(records, name)]
        print(json.dumps(loso, indent=2, default=list))
        return 0
    _print_rows(rows, "In sample (the committed framework records):")
    print()
    for name in frameworks:
        _print_summary(name, summary([r for r in rows if r["framework"] == name]))
    _print_summary("all", summary(rows))
    _print_summary("constant MFU (all)", summary(constant_mfu_rows(rows)))
    if args.loso:
        loso = []
        for name in frameworks:
            part = leave_one_source_out(records, name)
            loso += part
            band = step_time_band(part)
            print(f"{name}: leave-one-source-out step-time band (measured / predicted, p10-p90) "
                  f"{band[0]:.2f} - {band[1]:.2f}")
        _print_rows(loso, "Leave one source out (fit without the run's publication):")
        print()
        for name in frameworks:
            _print_summary(f"LOSO {name}", summary([r for r in loso if r["framework"] == name]))
        _print_summary("LOSO all", summary(loso))
        _print_sources(loso)
    print(f"\nskipped {len(skipped)} runs outside autopar's space: "
          + "; ".join(sorted({why for _, why in skipped})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
