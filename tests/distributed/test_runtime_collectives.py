"""The collectives one training step emits match docs/runtime.md's formulas, kind by kind.

Measured with ``autopar.runtime.comm_count.count_collectives`` (CommDebugMode's collective
registry) around ``train_step`` on 2 processes, for the zoo GPT (and Llama for TP, which follows
the same formulas) with tensor parallelism (with and without sequence parallelism, with full
recomputation) and FSDP2 at zero 1, 2 and 3, over several block counts and micro-batch counts.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
from test_runtime_equivalence import make_plan

HIDDEN, HEADS, VOCAB, SEQ = 32, 4, 64, 8


def expected_step_collectives(
    *, num_blocks: int, n_mb: int, tp: int, dp: int, zero: int, sp: bool, full_blocks: int
) -> dict[str, int]:
    """docs/runtime.md's counts for one step of the zoo GPT / Llama at pp == 1 (per rank).

    Keys are ``kind@axis``. ``full_blocks`` blocks use full recomputation. The reported loss adds
    one all-reduce on the world group (counted here under the only axis of size > 1).
    """
    counts: dict[str, int] = {}

    def add(key: str, value: int) -> None:
        if value:
            counts[key] = counts.get(key, 0) + value

    L = num_blocks
    if tp > 1 and not sp:
        # fwd: embedding + (wo, w2) per block; bwd: (attention, MLP) input per block + head input.
        add("all_reduce@tp", n_mb * (4 * L + 2 + full_blocks))
        add("all_gather_into_tensor@tp", n_mb * 1)  # logits over the vocabulary
    if tp > 1 and sp:
        add("all_reduce@tp", n_mb * 1)  # vocab-parallel embedding
        add("all_gather_into_tensor@tp", n_mb * (4 * L + 3 + 2 * full_blocks))
        add("reduce_scatter_tensor@tp", n_mb * (4 * L + 1 + full_blocks))
    if dp > 1:
        units = L + 1  # one FSDP2 unit per block + the root (embeddings, final norm, head)
        gathers = {1: units, 2: units, 3: 2 * units * n_mb}[zero]
        scatters = {1: units, 2: units * n_mb, 3: units * n_mb}[zero]
        add("all_gather_into_tensor@dp", gathers)
        add("reduce_scatter_tensor@dp", scatters)
    add("all_reduce@tp" if tp > 1 else "all_reduce@dp", 1)  # the reported loss (world group)
    return dict(sorted(counts.items()))


CASES: list[tuple[str, str, dict[str, Any]]] = [
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
        ("llama", "tp-sp", {"tp": 2, "sequence_parallel": True}),
    ]
]


def measure(kind: str, params: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """Measured and expected counts of the second step (the first one warms up)."""
    import torch

    from autopar.config import ParallelConfig
    from autopar.models import build
    from autopar.runtime import apply_plan, build_mesh, count_collectives
    from autopar.runtime.step import local_batch, train_step

    params = dict(params)
    num_blocks, n_mb = params.pop("layers"), params.pop("n_mb")
    dp = params.get("dp", 1)
    global_batch = 4
    cfg = ParallelConfig(
        global_batch=global_batch, micro_batch=global_batch // dp // n_mb, dtype="fp32", **params
    )
    shape = {"layers": num_blocks, "hidden": HIDDEN, "heads": HEADS, "vocab": VOCAB, "seq_len": SEQ}
    if kind == "llama":
        shape["kv_heads"] = 2
    plan = make_plan(cfg, num_blocks)
    pm = apply_plan(build(kind, device="cpu", seed=0, **shape), plan, build_mesh(plan, "cpu"))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    x = local_batch(pm, torch.randint(0, VOCAB, (global_batch, SEQ), generator=gen))
    y = local_batch(pm, torch.randint(0, VOCAB, (global_batch, SEQ), generator=gen))
    train_step(pm, x, y, opt)
    measured = count_collectives(lambda: train_step(pm, x, y, opt), pm.mesh)
    full_blocks = num_blocks if cfg.recompute == "full" else 0
    expected = expected_step_collectives(
        num_blocks=num_blocks, n_mb=n_mb, tp=cfg.tp, dp=cfg.dp, zero=cfg.zero,
        sp=cfg.sequence_parallel, full_blocks=full_blocks,
    )
    return measured, expected


def measure_all(rank: int, world_size: int) -> dict[str, Any]:
    """Every case on this rank: (measured, expected) or the error."""
    results: dict[str, Any] = {}
    for name, kind, params in CASES:
        try:
            results[name] = measure(kind, params)
        except Exception:
            results[name] = traceback.format_exc(limit=6)
    return results


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_step_collectives_match_documented_counts(run_distributed: Any) -> None:
    results = run_distributed(measure_all, 2, timeout_s=280)
    errors = []
    for rank, per_case in enumerate(results):
        for name, outcome in per_case.items():
            if isinstance(outcome, str):
                errors.append(f"[{name}] rank {rank}: {outcome}")
            elif outcome[0] != outcome[1]:
                errors.append(f"[{name}] rank {rank}: measured {outcome[0]} != doc {outcome[1]}")
    assert not errors, "\n".join(errors)
