"""Mixtral 8x7B on 64 H100 (global batch 512): the plan, the best expert-parallel split and how
the router's load imbalance decides between them (the figures README's "Experts, long context,
precision" section quotes).

Run: ``python benchmarks/moe_plans.py``. Prints, for autopar's runtime, the planned split and
the plan for the same model with a router that states no imbalance (the default); the
step time of the best ep split (dp=16 pp=4 ep=8, TP 1 PP 4 EP 8) at the router imbalance the
preset carries (``models.presets.MIXTRAL_ROUTER_IMBALANCE``, fitted by router_imbalance.py), at
the default for a model that states none (``cost_model.moe.DROPLESS_IMBALANCE``) and at 1.0x
(the profile's ``router_imbalance`` set for this sensitivity run only); the split the README
showed before (dp=4 tp=4 pp=4) as autopar's runtime runs it (experts whole on every tp rank);
NeMo's split for Megatron-LM against EP 4 x TP 2 at the fitted and the default imbalance;
megatron-lm's plan; and torchtitan's, without and with a force-balanced router and DeepEP's
dispatch (its two settings). Then Mixtral 8x22B on 128 H100 (global batch 256, bf16, the
Megatron-MoE-ModelZoo benchmark's model, GPUs and batch): megatron-lm's plan, whose framework
spec says whether the planner chose Megatron-Core's experts folded over tp (``expert-tp-1``,
a searched setting), and the ModelZoo's own layout (TP 2 PP 8 EP 8 VPP 7) with the experts
split over tp (Megatron's default) and folded (what the ModelZoo runs).
"""

from __future__ import annotations

from router_imbalance import with_imbalance

import autopar
from autopar.config import ParallelConfig
from autopar.cost_model.moe import DROPLESS_IMBALANCE
from autopar.models.presets import MIXTRAL_ROUTER_IMBALANCE
from autopar.search import SearchOptions

GPUS, BATCH = 64, 512
EP_SPLIT = ParallelConfig(dp=16, pp=4, ep=8, zero=1, micro_batch=1, global_batch=BATCH,
                          schedule="zbv-zero-bubble", virtual_stages=2)
TP_SPLIT = ParallelConfig(dp=4, tp=4, pp=4, zero=1, micro_batch=4, global_batch=BATCH,
                          schedule="interleaved-zero-bubble", virtual_stages=2)

# NeMo's recommended split for this model (TP 1 PP 4 EP 8 VP 8, global batch 256) and the
# EP 4 x TP 2 one the Megatron-Core MoE README says it outperforms (docs/frameworks.md).
NEMO_SPLITS = tuple(
    ParallelConfig(zero=1, micro_batch=1, global_batch=256, schedule="interleaved-1f1b",
                   virtual_stages=8, **kw)
    for kw in (dict(dp=16, pp=4, ep=8), dict(dp=8, tp=2, pp=4, ep=4, sequence_parallel=True)))


def _split(cfg) -> str:
    parts = [f"{k}={getattr(cfg, k)}" for k in ("dp", "cp", "tp", "pp", "ep")
             if getattr(cfg, k) > 1]
    return " ".join(parts) + f" zero={cfg.zero} {cfg.dtype}"


def main() -> int:
    profile = autopar.profile(autopar.models.build("mixtral-8x7b"))
    cluster = autopar.Cluster.preset("h100", nodes=GPUS // 8)
    best = autopar.plan(profile, cluster, BATCH)
    print(f"autopar plan: {_split(best.config)}  {best.estimate.step_time_s:.2f} s")
    unknown = autopar.plan(with_imbalance(profile, DROPLESS_IMBALANCE), cluster, BATCH)
    print(f"autopar plan for a router that states no imbalance ({DROPLESS_IMBALANCE:g}x): "
          f"{_split(unknown.config)}  {unknown.estimate.step_time_s:.2f} s")
    for factor in (MIXTRAL_ROUTER_IMBALANCE, DROPLESS_IMBALANCE, 1.0):
        est = autopar.estimate(with_imbalance(profile, factor), cluster, EP_SPLIT)
        print(f"ep split {_split(EP_SPLIT)} at {factor:.2f}x imbalance: "
              f"{est.step_time_s:.2f} s ({est.step_time_s / best.estimate.step_time_s - 1:+.1%})"
              f"  {est.memory_per_gpu_bytes / 2**30:.1f} GiB")
    tp = autopar.estimate(profile, cluster, TP_SPLIT)
    print(f"{_split(TP_SPLIT)} as autopar's runtime runs it: {tp.step_time_s:.2f} s, "
          f"{tp.memory_per_gpu_bytes / 2**30:.0f} GiB a GPU (fits: {tp.fits})")
    for factor in (MIXTRAL_ROUTER_IMBALANCE, DROPLESS_IMBALANCE):
        times = [autopar.estimate(with_imbalance(profile, factor), cluster, cfg,
                                  framework="megatron-lm") for cfg in NEMO_SPLITS]
        print(f"megatron-lm, NeMo's split (EP 8 TP 1) against EP 4 TP 2 at {factor:.2f}x: "
              + " against ".join(f"{e.step_time_s:.2f} s ({e.memory_per_gpu_bytes / 2**30:.1f}"
                                 f" GiB)" for e in times))
    mega = autopar.plan(profile, cluster, BATCH, framework="megatron-lm")
    print(f"megatron-lm plan: {_split(mega.config)}  {mega.estimate.step_time_s:.2f} s "
          f"({mega.framework})")
    for fw in ("torchtitan", "torchtitan+moe-force-balance+ep-deepep"):
        titan = autopar.plan(profile, cluster, BATCH, framework=fw)
        print(f"{fw} plan: {_split(titan.config)}  {titan.estimate.step_time_s:.2f} s")
    _mixtral_8x22b()
    return 0


def _mixtral_8x22b() -> None:
    """Megatron-LM's plan for Mixtral 8x22B on the ModelZoo's 128 H100, and its layout."""
    profile = autopar.profile(autopar.models.build("mixtral-8x22b"))
    cluster = autopar.Cluster.preset("h100", nodes=16)
    for chunks in (SearchOptions().max_virtual_stages, 8):  # the default, and up to 8 chunks
        mega = autopar.plan(profile, cluster, 256, framework="megatron-lm",
                            options=SearchOptions(dtype="bf16", max_virtual_stages=chunks))
        print(f"mixtral-8x22b on 128 h100, megatron-lm plan with up to {chunks} chunks a rank: "
              f"{_split(mega.config)} v={mega.config.virtual_stages}  "
              f"{mega.estimate.step_time_s:.2f} s ({mega.framework})")
    zoo = ParallelConfig(dp=8, tp=2, pp=8, ep=8, zero=1, micro_batch=1, global_batch=256,
                         schedule="interleaved-1f1b", virtual_stages=7, sequence_parallel=True)
    for fw in ("megatron-lm", "megatron-lm+expert-tp-1"):
        est = autopar.estimate(profile, cluster, zoo, framework=fw)
        print(f"  the ModelZoo's layout TP 2 PP 8 EP 8 VPP 7 under {fw}: "
              f"{est.step_time_s:.2f} s, {est.memory_per_gpu_bytes / 2**30:.1f} GiB")


if __name__ == "__main__":
    raise SystemExit(main())
