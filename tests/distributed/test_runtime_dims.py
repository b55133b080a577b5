"""HSDP, offload and context parallelism equal the one-process step, alone and with tp or pp.

Same check as test_runtime_equivalence.py (first-step gradients at rtol 1e-5 / atol 1e-7 with
DTensors gathered, three AdamW losses at 1e-3, fp32, gloo): the zoo GPT (learned positions) and
Llama (RoPE, grouped-query attention) at seq_len 8, so cp = 2 runs load-balanced chunks of 2
tokens. On these CPU runs the "device" is the host, so the offload cases prove that FSDP2's
CPUOffloadPolicy path (host shards, host optimizer step) gives the one-process numbers, not where
the bytes live.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
from test_runtime_equivalence import check_results, run_cases

from tests.helpers import count_mismatches, with_counts

CASES_2: list[tuple[str, str, dict[str, Any], Any]] = [
    ("gpt-cp2", "gpt", {"cp": 2, "micro_batch": 4}, None),
    ("llama-cp2-full-recompute", "llama", {"cp": 2, "micro_batch": 2, "recompute": "full"}, None),
    ("llama-cp2-selective-recompute", "llama",
     {"cp": 2, "micro_batch": 2, "recompute": "selective"}, None),
    ("gpt-dp2-zero3-offload-params", "gpt",
     {"dp": 2, "zero": 3, "offload": "params", "micro_batch": 2}, None),
    ("llama-dp2-zero1-offload-optimizer", "llama",
     {"dp": 2, "zero": 1, "offload": "optimizer", "micro_batch": 2}, None),
    # dp 1: FSDP2 over one rank does the offload (config.dp_mechanism).
    ("llama-tp2-zero1-offload-optimizer", "llama",
     {"tp": 2, "zero": 1, "offload": "optimizer", "micro_batch": 2}, None),
]
CASES_4: list[tuple[str, str, dict[str, Any], Any]] = [
    ("gpt-hsdp2x2-zero3", "gpt", {"dp": 4, "dp_replicate": 2, "zero": 3}, None),
    ("llama-hsdp2x1-tp2", "llama", {"dp": 2, "dp_replicate": 2, "zero": 2, "tp": 2}, None),
    ("llama-hsdp2-x-cp2", "llama", {"dp": 2, "dp_replicate": 2, "cp": 2, "zero": 3}, None),
    ("llama-cp2-tp2-sp", "llama",
     {"cp": 2, "tp": 2, "sequence_parallel": True, "micro_batch": 4}, None),
    ("gpt-cp2-pp2", "gpt", {"cp": 2, "pp": 2, "schedule": "1f1b", "micro_batch": 2}, None),
    ("llama-dp2-tp2-offload-params", "llama",
     {"dp": 2, "tp": 2, "zero": 3, "offload": "params"}, None),
    ("gpt-hsdp2x1-pp2-offload-optimizer", "gpt",
     {"dp": 2, "pp": 2, "zero": 1, "offload": "optimizer", "schedule": "gpipe",
      "dp_replicate": 2}, None),
]

# Collective counts of one step (CommDebugMode, ``autopar.runtime.comm_count``'s registry) for
# the zoo GPT with L blocks, n_mb micro-batches (micro_batch 1) and FSDP2 units U = L + 1 (one per
# block plus the root), against closed forms:
# * context parallelism, axis "cp": per attention per micro-batch one all_gather_into_tensor of
#   K and V (forward) and one reduce_scatter_tensor of their gradient (backward): n_mb * L each;
#   full recomputation gathers again in backward (n_mb * (L + F), F = recomputed blocks),
#   selective recomputation keeps the gathered K/V.
# * FSDP2 (docs/runtime.md): zero 1: U all-gathers, U reduce-scatters per step; zero 2: U,
#   U * n_mb; zero 3: 2 * U * n_mb, U * n_mb; on the shard axis ("dp_shard", or "dp_shard_cp" =
#   dp_shard x cp, or the whole dp x cp axis without HSDP).
# * HSDP: after each reduce-scatter, one all_reduce of the gradient shard over "dp_replicate".
# * the reported loss: one all_reduce on the world group.
# The cost model charges the same calls (``charged_collectives``, compared in the 4-process
# test). A group is named by its ranks; when two axes have the same ranks (dp_shard x cp with
# dp_shard = 1 is the cp axis) the first name in LABEL_ORDER is used and the counts add up.
COUNT_LAYERS, COUNT_N_MB = 2, 2
COUNT_CASES: list[tuple[str, dict[str, Any]]] = [
    ("cp2-dp2-zero3", {"cp": 2, "dp": 2, "zero": 3}),
    ("cp2-dp2-zero3-full", {"cp": 2, "dp": 2, "zero": 3, "recompute": "full"}),
    ("cp2-dp2-zero1-selective", {"cp": 2, "dp": 2, "zero": 1, "recompute": "selective"}),
    ("hsdp2x2-zero3", {"dp": 4, "dp_replicate": 2, "zero": 3}),
    ("hsdp2x2-zero1", {"dp": 4, "dp_replicate": 2, "zero": 1}),
    ("hsdp2x1-cp2-zero2", {"dp": 2, "dp_replicate": 2, "cp": 2, "zero": 2}),
]
LABEL_ORDER = ("tp", "cp", "dp_shard", "dp_replicate", "dp", "pp")


def expected_counts(cfg: dict[str, Any]) -> dict[str, int]:
    """The closed-form counts above for one COUNT_CASES config (pp = tp = 1, world size 4)."""
    L, n_mb, units = COUNT_LAYERS, COUNT_N_MB, COUNT_LAYERS + 1
    dp, cp, rep = cfg["dp"], cfg.get("cp", 1), cfg.get("dp_replicate", 1)
    counts: Counter[str] = Counter({"all_reduce@world": 1})
    full = L if cfg.get("recompute") == "full" else 0
    if cp > 1:
        counts["all_gather_into_tensor@cp"] += n_mb * (L + full)
        counts["reduce_scatter_tensor@cp"] += n_mb * L
    shard_size = dp // rep * cp
    shard = "world" if shard_size == 4 else ("cp" if dp // rep == 1 else "dp_shard")
    gathers, scatters = {1: (units, units), 2: (units, units * n_mb),
                         3: (2 * units * n_mb, units * n_mb)}[cfg["zero"]]
    counts[f"all_gather_into_tensor@{shard}"] += gathers
    counts[f"reduce_scatter_tensor@{shard}"] += scatters
    if rep > 1:
        counts["all_reduce@dp_replicate"] += scatters
    return dict(sorted(counts.items()))


def charged_counts(cfg_kwargs: dict[str, Any]) -> dict[str, int]:
    """The collectives the cost model charges for one COUNT_CASES config
    (``layer_costs.charged_collectives`` on the zoo GPT traced on the meta device, the same
    Plan), each axis named as ``count_case`` names its group, plus the loss's all-reduce."""
    from test_runtime_equivalence import make_plan

    import autopar
    from autopar.config import ParallelConfig
    from autopar.cost_model.layer_costs import charged_collectives

    cfg = ParallelConfig(global_batch=cfg_kwargs["dp"] * COUNT_N_MB, dtype="fp32", **cfg_kwargs)
    plan = make_plan(cfg, COUNT_LAYERS)
    shape = {"layers": COUNT_LAYERS, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 8}
    profile = autopar.profile(autopar.models.build("gpt", **shape), seq_len=8)
    charged = charged_collectives(profile, cfg, split=tuple(s.layers for s in plan.stages),
                                  recompute=tuple(m for s in plan.stages for m in s.recompute))
    # The cost model's axes as groups of ranks: "dp" is the ZeRO shard group dp_shard x cp.
    sizes = {"cp": cfg.cp, "dp": cfg.dp_shard * cfg.cp, "dp_replicate": cfg.dp_replicate}
    names = {"cp": "cp", "dp_replicate": "dp_replicate",
             "dp": "cp" if cfg.dp_shard == 1 else "dp_shard"}
    counts: Counter[str] = Counter({"all_reduce@world": 1})
    for key, calls in charged.items():
        kind, axis = key.split("@")
        counts[f"{kind}@{'world' if sizes[axis] == cfg.world_size else names[axis]}"] += calls
    return dict(sorted(counts.items()))


def _axis_ranks(mesh: Any, cfg: Any) -> dict[str, frozenset[int]]:
    # The rank sets of this rank's groups on every axis (HSDP's from dp = replicate x shard).
    import itertools

    grid = mesh.mesh  # ranks, shape (pp, dp, cp, tp)
    here = [int(i) for i in (grid == mesh.get_rank()).nonzero()[0]]
    p, d, c, t = here
    shard = cfg.dp_shard
    sets = {
        "tp": {int(grid[p, d, c, x]) for x in range(cfg.tp)},
        "cp": {int(grid[p, d, x, t]) for x in range(cfg.cp)},
        "dp": {int(grid[p, x, c, t]) for x in range(cfg.dp)},
        "pp": {int(grid[x, d, c, t]) for x in range(cfg.pp)},
        "dp_replicate": {int(grid[p, r * shard + d % shard, c, t])
                         for r in range(cfg.dp_replicate)},
        "dp_shard": {int(grid[p, (d // shard) * shard + x, c, t]) for x in range(shard)},
    }
    sets["dp_shard_cp"] = {int(grid[p, (d // shard) * shard + x, y, t])
                           for x, y in itertools.product(range(shard), range(cfg.cp))}
    return {name: frozenset(ranks) for name, ranks in sets.items()}


def count_case(name: str, cfg_kwargs: dict[str, Any]) -> dict[str, int]:
    """``kind@axis`` counts of the second step of a zoo GPT under ``cfg_kwargs``."""
    import torch
    import torch.distributed as dist
    from test_runtime_equivalence import make_plan
    from torch.distributed.distributed_c10d import _resolve_process_group

    from autopar.config import ParallelConfig
    from autopar.models import build
    from autopar.runtime import apply_plan, build_mesh
    from autopar.runtime.comm_count import _counting_mode, _kind
    from autopar.runtime.step import local_batch, train_step

    batch = cfg_kwargs["dp"] * COUNT_N_MB
    cfg = ParallelConfig(global_batch=batch, dtype="fp32", **cfg_kwargs)
    plan = make_plan(cfg, COUNT_LAYERS)
    shape = {"layers": COUNT_LAYERS, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 8}
    pm = apply_plan(build("gpt", device="cpu", seed=0, **shape), plan, build_mesh(plan, "cpu"))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    x = local_batch(pm, torch.randint(0, 64, (batch, 8), generator=gen))
    y = local_batch(pm, torch.randint(0, 64, (batch, 8), generator=gen))
    train_step(pm, x, y, opt)
    mode = _counting_mode()
    with mode:
        train_step(pm, x, y, opt)
    axes = _axis_ranks(pm.mesh, cfg)
    counts: Counter[str] = Counter()
    for packet, group in mode.calls:
        ranks = frozenset(dist.get_process_group_ranks(_resolve_process_group(group)))
        names = [a for a in LABEL_ORDER if axes[a] == ranks and len(ranks) > 1]
        label = "world" if len(ranks) == dist.get_world_size() else (names or ["other"])[0]
        counts[f"{_kind(packet)}@{label}"] += 1
    return dict(sorted(counts.items()))


def run_all(rank: int, world_size: int, cases: list[Any], count_cases: list[Any]) -> dict:
    """The equivalence cases, then the collective counts (or their errors), in one launch."""
    return with_counts(run_cases(rank, world_size, cases),
                       ((name, functools.partial(count_case, name, cfg))
                        for name, cfg in count_cases))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_cp_and_offload_two_processes_equal_one_process(run_distributed: Any) -> None:
    results = run_distributed(run_all, 2, CASES_2, [], timeout_s=220)
    check_results(results, CASES_2)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_hsdp_cp_offload_four_processes_equal_one_process(run_distributed: Any) -> None:
    results = run_distributed(run_all, 4, CASES_4, COUNT_CASES, timeout_s=280)
    check_results(results, CASES_4)
    errors = []
    for name, cfg in COUNT_CASES:
        errors += count_mismatches(results, name, expected_counts(cfg), "closed form")
        charged = charged_counts(cfg)
        if charged != results[0][f"count:{name}"]:
            errors.append(f"[{name}] cost model charges {charged} != measured "
                          f"{results[0][f'count:{name}']}")
    assert not errors, "\n".join(errors)
