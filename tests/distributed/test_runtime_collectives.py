"""One training step emits exactly the collectives the cost model charges, kind by kind.

Measured with CommDebugMode's collective registry (``autopar.runtime.comm_count``) around the
second ``train_step`` of each case; expected is ``autopar.cost_model.collectives.
expected_collectives(profile, plan, pp_rank)`` with the profile of the same zoo model traced on
the meta device and the very Plan the case runs, and the cost model's time terms charge the same
calls (tests/unit/test_cost_collectives.py holds ``charged_collectives`` equal to it).
2 processes: the zoo GPT and Llama with TP (with and without SP, recompute none / selective /
full) and FSDP2 at zero 1, 2 and 3, 2 and 3 blocks, 1 and 2 micro-batches. 4 processes: pp = 2
with FSDP2 (zero 1, 2, 3) and replicate() (zero 0) under GPipe and 1F1B, pp = 2 with TP + SP and
full recompute, and dp x tp with replicate() and FSDP2.

The only collective outside the cost model is the reported loss's all-reduce of one float on the
world group, which every step with world size > 1 issues once: it is expected on top.
With sequence parallelism and dp > 1, FSDP2 / replicate() all-reduce over tp the gradient of
every sequence-parallel norm parameter at each gradient reduction; the profile records the norms'
parameter tensors and the cost model charges them (the SP cases below).
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import pytest
from test_runtime_equivalence import make_plan

HIDDEN, HEADS, VOCAB, SEQ = 32, 4, 64, 8

CASES_2: list[tuple[str, str, dict[str, Any]]] = [
    (f"{kind}-L{L}-mb{n_mb}-{name}", kind, dict(cfg, layers=L, n_mb=n_mb))
    for L in (2, 3)
    for n_mb in (1, 2)
    for kind, name, cfg in [
        ("gpt", "tp", {"tp": 2}),
        ("gpt", "tp-sp", {"tp": 2, "sequence_parallel": True}),
        ("gpt", "tp-full", {"tp": 2, "recompute": "full"}),
        ("gpt", "tp-sp-full", {"tp": 2, "sequence_parallel": True, "recompute": "full"}),
        ("gpt", "tp-selective", {"tp": 2, "recompute": "selective"}),
        ("gpt", "zero1", {"dp": 2, "zero": 1}),
        ("gpt", "zero2", {"dp": 2, "zero": 2}),
        ("gpt", "zero3", {"dp": 2, "zero": 3}),
        ("llama", "tp", {"tp": 2}),
        ("llama", "tp-sp-full", {"tp": 2, "sequence_parallel": True, "recompute": "full"}),
    ]
]

CASES_4: list[tuple[str, str, dict[str, Any]]] = [
    ("gpt-L4-mb4-pp2-dp2-zero3-1f1b", "gpt",
     {"pp": 2, "dp": 2, "zero": 3, "schedule": "1f1b", "layers": 4, "n_mb": 4}),
    ("gpt-L2-mb2-pp2-dp2-zero3-gpipe", "gpt",
     {"pp": 2, "dp": 2, "zero": 3, "schedule": "gpipe", "layers": 2, "n_mb": 2}),
    ("gpt-L4-mb2-pp2-dp2-zero1-gpipe", "gpt",
     {"pp": 2, "dp": 2, "zero": 1, "schedule": "gpipe", "layers": 4, "n_mb": 2}),
    ("gpt-L4-mb4-pp2-dp2-zero2-1f1b", "gpt",
     {"pp": 2, "dp": 2, "zero": 2, "schedule": "1f1b", "layers": 4, "n_mb": 4}),
    ("gpt-L2-mb2-pp2-dp2-zero0-1f1b", "gpt",
     {"pp": 2, "dp": 2, "zero": 0, "schedule": "1f1b", "layers": 2, "n_mb": 2}),
    ("llama-L2-mb2-pp2-tp2-sp-full-1f1b", "llama",
     {"pp": 2, "tp": 2, "sequence_parallel": True, "recompute": "full", "schedule": "1f1b",
      "layers": 2, "n_mb": 2}),
    ("gpt-L2-mb2-dp2-tp2-zero0", "gpt", {"dp": 2, "tp": 2, "zero": 0, "layers": 2, "n_mb": 2}),
    ("gpt-L2-mb2-dp2-tp2-zero3", "gpt", {"dp": 2, "tp": 2, "zero": 3, "layers": 2, "n_mb": 2}),
    # Sequence parallelism with dp > 1: the norm parameters' partial gradients are all-reduced
    # over tp at every gradient reduction (per micro-batch at zero 3, per step at zero 0 / 1).
    ("gpt-L2-mb2-dp2-tp2-sp-zero3", "gpt",
     {"dp": 2, "tp": 2, "zero": 3, "sequence_parallel": True, "layers": 2, "n_mb": 2}),
    ("gpt-L2-mb2-dp2-tp2-sp-zero1", "gpt",
     {"dp": 2, "tp": 2, "zero": 1, "sequence_parallel": True, "layers": 2, "n_mb": 2}),
    ("llama-L2-mb2-dp2-tp2-sp-zero0", "llama",
     {"dp": 2, "tp": 2, "zero": 0, "sequence_parallel": True, "layers": 2, "n_mb": 2}),
]


def _shape(kind: str, num_blocks: int) -> dict[str, int]:
    shape = {"layers": num_blocks, "hidden": HIDDEN, "heads": HEADS, "vocab": VOCAB,
             "seq_len": SEQ}
    if kind == "llama":
        shape["kv_heads"] = 2
    return shape


def _plan(params: dict[str, Any]) -> tuple[Any, int]:
    """The case's Plan (balanced stages, the config's recompute) and its global batch."""
    from autopar.config import ParallelConfig

    params = dict(params)
    num_blocks, n_mb = params.pop("layers"), params.pop("n_mb")
    dp = params.get("dp", 1)
    micro_batch = 2 if params.get("pp", 1) > 1 else 1
    global_batch = dp * n_mb * micro_batch
    cfg = ParallelConfig(global_batch=global_batch, micro_batch=micro_batch, dtype="fp32",
                         **params)
    return make_plan(cfg, num_blocks), global_batch


def count_by_axis(fn: Any, mesh: Any) -> dict[str, int]:
    """``kind@axis`` counts of ``fn()``'s collectives, each group named by its member ranks.

    The axis of a call is the mesh axis (size > 1) whose ranks are exactly the group's, else
    "world" for a group of every rank, else "other". (Group names alone are not enough: a
    second mesh built in one process can reuse groups under other names.)
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    from autopar.runtime.comm_count import _counting_mode, _kind

    mode = _counting_mode()
    with mode:
        fn()
    axes = {a: frozenset(mesh[a].mesh.flatten().tolist()) for a in mesh.mesh_dim_names}
    world = dist.get_world_size()
    labels: dict[str, str] = {}
    counts: Counter[str] = Counter()
    for packet, group in mode.calls:
        if group not in labels:
            ranks = frozenset(dist.get_process_group_ranks(_resolve_process_group(group)))
            names = [a for a, r in axes.items() if r == ranks and len(r) > 1]
            labels[group] = names[0] if names else ("world" if len(ranks) == world else "other")
        counts[f"{_kind(packet)}@{labels[group]}"] += 1
    return dict(sorted(counts.items()))


def measure(kind: str, params: dict[str, Any]) -> dict[str, int]:
    """Counts of the second step of one case on this rank (the first one warms up)."""
    import torch

    from autopar.models import build
    from autopar.runtime import apply_plan, build_mesh
    from autopar.runtime.step import local_batch, train_step

    plan, global_batch = _plan(params)
    model = build(kind, device="cpu", seed=0, **_shape(kind, params["layers"]))
    pm = apply_plan(model, plan, build_mesh(plan, "cpu"))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    x = local_batch(pm, torch.randint(0, VOCAB, (global_batch, SEQ), generator=gen))
    y = local_batch(pm, torch.randint(0, VOCAB, (global_batch, SEQ), generator=gen))
    train_step(pm, x, y, opt)
    return count_by_axis(lambda: train_step(pm, x, y, opt), pm.mesh)


def measure_all(rank: int, world_size: int, cases: list[Any]) -> dict[str, Any]:
    """Every case on this rank: its counts, or the error."""
    results: dict[str, Any] = {}
    for name, kind, params in cases:
        try:
            results[name] = measure(kind, params)
        except Exception:
            results[name] = traceback.format_exc(limit=6)
    return results


def _expected(kind: str, params: dict[str, Any], rank: int, profiles: dict) -> dict[str, int]:
    """The cost model's counts for this rank's pipeline stage, plus the loss all-reduce."""
    import autopar
    from autopar.costing import expected_collectives

    key = (kind, params["layers"])
    if key not in profiles:
        model = autopar.models.build(kind, **_shape(kind, params["layers"]))  # meta device
        profiles[key] = autopar.profile(model, seq_len=SEQ)
    plan, _ = _plan(params)
    cfg = plan.config
    counts = Counter(expected_collectives(profiles[key], plan, pp_rank=rank // (cfg.dp * cfg.tp)))
    # The loss report: one all-reduce on the world group, named after the axis spanning it.
    spanning = [a for a, d in (("pp", cfg.pp), ("dp", cfg.dp), ("tp", cfg.tp))
                if d == cfg.world_size]
    counts[f"all_reduce@{spanning[0] if spanning else 'world'}"] += 1
    return dict(sorted(counts.items()))


def _check(results: list[dict[str, Any]], cases: list[Any]) -> None:
    profiles: dict = {}
    errors = []
    for rank, per_case in enumerate(results):
        for name, kind, params in cases:
            outcome = per_case[name]
            if isinstance(outcome, str):
                errors.append(f"[{name}] rank {rank}: {outcome}")
                continue
            expected = _expected(kind, params, rank, profiles)
            if outcome != expected:
                errors.append(f"[{name}] rank {rank}: measured {outcome} != charged {expected}")
    assert not errors, "\n".join(errors)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_step_collectives_match_cost_model_2_processes(run_distributed: Any) -> None:
    _check(run_distributed(measure_all, 2, CASES_2, timeout_s=280), CASES_2)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_step_collectives_match_cost_model_4_processes(run_distributed: Any) -> None:
    _check(run_distributed(measure_all, 4, CASES_4, timeout_s=280), CASES_4)
