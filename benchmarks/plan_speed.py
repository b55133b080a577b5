"""Planning time of ``autopar.plan`` on large models and clusters (figures in docs/search.md).

Run: ``python benchmarks/plan_speed.py`` (add ``--quick`` for the first case only,
``--long-context``, ``--llama4``, ``--maverick`` and ``--moe`` for more). Profiling
the model (tracing on the meta device) is timed separately from the search itself.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import autopar

# (zoo preset, GPU preset, GPUs, global batch, goal seconds)
CASES = [
    ("gpt3-175b", "a100-80g", 1024, 1536, 5.0),
    ("llama3-70b", "h100", 512, 1024, 10.0),
    ("llama3-405b", "h100", 16384, 2048, 30.0),
]


# Llama 3 405B's long-context case (131,072 tokens) for torchtitan, whose cp, HSDP and fp8 the
# search then covers (--long-context). Llama 3 trained this phase at cp=16 tp=8 pp=16
# (arXiv:2407.21783, section 3.3.4).
# llama3-405b at 131,072 tokens, for torchtitan (cp, fp8) and for autopar's own runtime (goal
# 10 s: docs/search.md, planning speed).
LONG_CONTEXT = tuple(("llama3-405b", "h100", 16384, 2048, goal, 131072, framework)
                     for framework, goal in (("torchtitan", 30.0), ("autopar", 10.0)))
# Llama 4 Scout from its Hugging Face text config (meta-llama/Llama-4-Scout-17B-16E, config.json
# "text_config"; benchmarks/data/hf_llama4_scout.json, needs transformers): its blocks alternate
# two kinds (no rotary positions every fourth), split by their envelopes (search/envelope.py).
LLAMA4 = ("data/hf_llama4_scout.json", "h100", 64, 512, 30.0, None, "autopar")
# Llama 4 Maverick (meta-llama/Llama-4-Maverick-17B-128E, config.json "text_config";
# benchmarks/data/hf_llama4_maverick.json): dense and mixture-of-experts blocks alternate, each
# MoE block 128 experts, so the kinds are far apart and the section is counted by kind
# (search/ilp_pattern.py). No goal: the per-layer ILP took past 10 minutes.
MAVERICK = ("data/hf_llama4_maverick.json", "h100", 256, 512, None, None, "autopar")
# DeepSeek-V3 on 2,048 H100 for torchtitan and Megatron-LM, whose searched setting (expert-tp-1,
# the experts folded over tp) costs a second search over the candidates it changes
# (search/dimensions.py; docs/search.md). No goal.
MOE = tuple(("deepseek-v3", "h100", 2048, 4096, None, None, framework)
            for framework in ("torchtitan", "megatron-lm"))


def run_case(preset: str, gpu: str, gpus: int, global_batch: int, seq_len: int | None = None,
             framework: str = "autopar") -> dict:
    """Profile the model, then plan it; timings (wall and this process's CPU) and counters."""
    t0 = time.perf_counter()
    if preset.endswith(".json"):  # a Hugging Face config: its context capped, as the CLI does
        config = Path(__file__).parent / preset
        model = autopar.models.from_hf_config(json.loads(config.read_text()))
    else:
        model = autopar.models.build(preset, seq_len=seq_len) if seq_len else (
            autopar.models.build(preset))
    profile = autopar.profile(model)
    profile_s = time.perf_counter() - t0
    cluster = autopar.Cluster.preset(gpu, nodes=gpus // 8)
    t0, c0 = time.perf_counter(), time.process_time()
    plan = autopar.plan(profile, cluster, global_batch=global_batch, model=preset,
                        framework=framework)
    plan_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    return {"profile_s": profile_s, "plan_s": plan_s, "cpu_s": cpu_s, "plan": plan}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="only the first case")
    parser.add_argument("--only", default=None, help="only this model preset")
    parser.add_argument("--long-context", action="store_true",
                        help="also llama3-405b at 131,072 tokens for torchtitan (cp, fp8) "
                        "and for autopar")
    parser.add_argument("--llama4", action="store_true",
                        help="also Llama 4 Scout (Hugging Face config) on 64 H100")
    parser.add_argument("--maverick", action="store_true",
                        help="also Llama 4 Maverick (Hugging Face config) on 256 H100 (minutes)")
    parser.add_argument("--moe", action="store_true",
                        help="also DeepSeek-V3 on 2,048 H100 for torchtitan and megatron-lm")
    args = parser.parse_args()
    cases = CASES[:1] if args.quick else CASES
    cases = [(*c, None, "autopar") for c in cases if args.only in (None, c[0])]
    if args.long_context:
        cases.extend(LONG_CONTEXT)
    if args.llama4:
        cases.append(LLAMA4)
    if args.maverick:
        cases.append(MAVERICK)
    if args.moe:
        cases.extend(MOE)
    header = (
        f"{'model':12s} {'cluster':16s} {'batch':>5s} {'plan s':>7s} {'cpu s':>6s} {'goal':>5s} "
        f"{'cands':>6s} {'pruned':>6s} {'ILPs':>4s} {'proven':>6s} {'gap':>6s}  best split (MFU)"
    )
    print(header)
    print("-" * len(header))
    for preset, gpu, gpus, batch, goal, seq_len, framework in cases:
        r = run_case(preset, gpu, gpus, batch, seq_len, framework)
        info, est = r["plan"].search, r["plan"].estimate
        print(
            f"{Path(preset).stem:12s} {f'{gpus} x {gpu}':16s} {batch:5d} {r['plan_s']:7.2f} "
            f"{r['cpu_s']:6.2f} "
            f"{goal or '-':>5} {info.candidates_considered:6d} {info.candidates_pruned:6d} "
            f"{info.ilps_solved:4d} {info.optimal and info.mip_gap <= 1e-4!s:>6s} "
            f"{100 * info.mip_gap:5.2f}%  "
            f"{r['plan'].config.describe()} ({100 * est.mfu:.1f}%)"
            + (f" [{r['plan'].framework}]" if framework != "autopar" else ""),
            flush=True,
        )


if __name__ == "__main__":
    main()
