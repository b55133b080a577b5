"""Expert parallelism equals the one-process step: the zoo MoE model with its experts sharded
over ep ranks (all_to_all_single dispatch and combine on gloo) gives the reference gradients
(fp32, CPU: rtol 1e-5, atol 1e-7; each rank's experts against their slice) and three AdamW
losses (1e-3 relative), and emits the collectives the cost model charges. Style of
test_runtime_equivalence.py."""

from __future__ import annotations

import functools
import traceback
from typing import Any

import pytest

from tests.helpers import case_errors, count_mismatches, with_counts

SHAPE: dict[str, Any] = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": 64,
                         "seq_len": 8, "experts": 4, "top_k": 2, "shared_experts": 1}
GLOBAL_BATCH = 8
STEPS = 3
LR = 1e-2
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def _batches() -> list[tuple[Any, Any]]:
    import torch

    gen = torch.Generator().manual_seed(1234)
    size = (GLOBAL_BATCH, SHAPE["seq_len"])
    return [(torch.randint(0, SHAPE["vocab"], size, generator=gen),
             torch.randint(0, SHAPE["vocab"], size, generator=gen)) for _ in range(STEPS)]


def _expected(reference: Any, fqn: str, cfg: Any, dp_rank: int) -> Any:
    full = reference.get_parameter(fqn).grad
    if fqn.rpartition(".")[2] not in EXPERT_PARAMS:
        return full
    local = SHAPE["experts"] // cfg.ep
    lo = (dp_rank % cfg.ep) * local
    return full[lo:lo + local]


def run_case(cfg_kwargs: dict[str, Any]) -> dict:
    """One expert-parallel split against the one-process reference on this rank."""
    import torch
    from torch.testing import assert_close

    from autopar.config import ParallelConfig
    from autopar.models import build
    from autopar.runtime import apply_plan, build_mesh
    from autopar.runtime.step import gathered_grads, local_batch, one_process_reference, train_step
    from tests.distributed.test_runtime_equivalence import make_plan

    cfg = ParallelConfig(global_batch=GLOBAL_BATCH, dtype="fp32", **cfg_kwargs)
    plan = make_plan(cfg, SHAPE["layers"])
    reference = build("llama", device="cpu", seed=0, **SHAPE)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    pm = apply_plan(build("llama", device="cpu", seed=0, **SHAPE), plan, build_mesh(plan, "cpu"))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    # The rank's place among the dp x cp ranks the ep groups are cut from (ep_groups).
    dp_rank = pm.mesh["dp"].get_local_rank() * cfg.cp + pm.mesh["cp"].get_local_rank()
    ref_losses, losses, grads = [], [], {}
    for step, (tokens, labels) in enumerate(_batches()):
        ref_losses.append(one_process_reference(reference, tokens, labels))
        x, y = local_batch(pm, tokens), local_batch(pm, labels)
        losses.append(train_step(pm, x, y, None if step == 0 else opt))
        if step == 0:
            grads = gathered_grads(pm)
            for fqn, grad in grads.items():
                assert_close(grad, _expected(reference, fqn, cfg, dp_rank), rtol=1e-5,
                             atol=1e-7, msg=lambda m, f=fqn: f"{f}: {m}")
            opt.step()
        ref_opt.step()
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-3 * abs(want), f"losses {losses} != {ref_losses}"
    return {"fqns": sorted(grads), "losses": losses}


def run_cases(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict:
    """Run every case; a failing case is reported, the others still run."""
    results: dict[str, Any] = {}
    for name, cfg_kwargs in cases.items():
        try:
            results[name] = run_case(cfg_kwargs)
        except Exception:
            results[name] = {"error": traceback.format_exc(limit=8)}
    return results


def check_results(results: list[dict], cases: dict[str, dict[str, Any]]) -> None:
    """Fail with every failing case; every parameter's gradient was checked on some rank."""
    from autopar.models import build

    errors = []
    all_fqns = {n for n, _ in build("llama", **SHAPE).named_parameters()}
    for name in cases:
        errors += case_errors(name, [r[name] for r in results], all_fqns)
    assert not errors, "\n".join(errors)


CASES_4 = {
    # ep 2 of dp 4: the experts' gradients are all-reduced over the 2 ranks holding each half
    # (zero 0), or FSDP2 shards and reduces them over those 2 ranks (zero >= 1).
    "dp4-ep2-ddp": {"dp": 4, "ep": 2},
    "dp4-ep2-zero3-recompute": {"dp": 4, "ep": 2, "zero": 3, "recompute": "full"},
    "dp4-ep4-zero1": {"dp": 4, "ep": 4, "zero": 1},
    "pp2xdp2-ep2-1f1b": {"pp": 2, "dp": 2, "ep": 2, "schedule": "1f1b", "micro_batch": 2},
    # ep cut from the dp x cp ranks: the cp ranks hold other tokens of the same sequences. At
    # cp 4 a rank routes 2 tokens a micro-batch, so some ranks' experts get no rows: their
    # gradient hooks (zero 0) and FSDP2's reduction (zero 3) still run there.
    "dp2xcp2-ep2-ddp": {"dp": 2, "cp": 2, "ep": 2},
    "dp2xcp2-ep4-zero1": {"dp": 2, "cp": 2, "ep": 4, "zero": 1},
    "cp4-ep2-ddp": {"cp": 4, "ep": 2},
    "cp4-ep2-zero3": {"cp": 4, "ep": 2, "zero": 3},
    # tp 2 without ep: every tp rank holds all experts and runs every token's (the cost
    # model's Framework.expert_tensor_parallel False for autopar).
    "dp2-tp2": {"dp": 2, "tp": 2},
    # tp 2 with ep 2: one ep group per tp index (ep_groups); both tp ranks of a dp rank hold
    # the same experts and route the same tokens.
    "dp2xtp2-ep2-ddp": {"dp": 2, "tp": 2, "ep": 2},
    "dp2xtp2-ep2-zero3-recompute": {"dp": 2, "tp": 2, "ep": 2, "zero": 3, "recompute": "full"},
    # Sequence parallelism: the MoE module gathers the whole sequence (tp_styles.GatherSequence)
    # and cuts its output back to the rank's shard; its shared experts split as without SP.
    "dp2-tp2-sp": {"dp": 2, "tp": 2, "sequence_parallel": True},
    "dp2xtp2-ep2-sp-zero3-recompute": {"dp": 2, "tp": 2, "ep": 2, "zero": 3,
                                       "recompute": "full", "sequence_parallel": True},
}


# Collectives of one step (CommDebugMode's registry, ``autopar.runtime.comm_count``) equal to the
# calls the cost model charges (``layer_costs.charged_collectives``): the 6 all-to-alls per MoE
# layer and micro-batch (10 under full recompute) on the ep group, the experts' own FSDP2 unit
# on the edp group, the dense units on dp, and the loss's all-reduce. A group is named by its
# ranks ("world" when it spans all 4).
COUNT_CASES = {
    "dp4-ep2-zero1": {"dp": 4, "ep": 2, "zero": 1},
    "dp4-ep2-zero3-full": {"dp": 4, "ep": 2, "zero": 3, "recompute": "full"},
    "dp4-ep4-zero1": {"dp": 4, "ep": 4, "zero": 1},
    "dp2xtp2-ep2-zero1": {"dp": 2, "tp": 2, "ep": 2, "zero": 1},
    # The MoE's all-gathers under SP (forward and backward), re-run by a full recompute.
    "dp2xtp2-ep2-sp-zero1": {"dp": 2, "tp": 2, "ep": 2, "zero": 1, "sequence_parallel": True},
    "dp2xtp2-sp-zero1-full": {"dp": 2, "tp": 2, "zero": 1, "recompute": "full",
                              "sequence_parallel": True},
}


def _axis_ranks(cfg: Any, rank: int) -> dict[str, frozenset[int]]:
    """The ranks of each group ``rank`` belongs to (pp = cp = 1), in ``ep_groups``' layout:
    rank = (b ep + j) tp + t."""
    tp, ep = cfg.tp, cfg.ep
    f, t = divmod(rank, tp)
    b, j = divmod(f, ep)
    return {"dp": frozenset(g * tp + t for g in range(cfg.dp)),
            "ep": frozenset((b * ep + i) * tp + t for i in range(ep)),
            "edp": frozenset((c * ep + j) * tp + t for c in range(cfg.dp // ep)),
            "tp": frozenset(f * tp + i for i in range(tp))}


def _label(ranks: frozenset[int], axes: dict[str, frozenset[int]], world: int) -> str:
    """A group's name: "world" when it spans every rank, else the first axis with its ranks
    (dp and ep name the same group when ep == dp)."""
    if len(ranks) == world:
        return "world"
    return next((name for name, members in axes.items() if members == ranks), "other")


def count_case(cfg_kwargs: dict[str, Any]) -> dict[str, int]:
    """``kind@axis`` counts of the second step on this rank (dp x tp x ep: pp = cp = 1)."""
    from collections import Counter

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    from autopar.config import ParallelConfig
    from autopar.models import build
    from autopar.runtime import apply_plan, build_mesh
    from autopar.runtime.comm_count import _counting_mode, _kind
    from autopar.runtime.step import local_batch, train_step
    from tests.distributed.test_runtime_equivalence import make_plan

    cfg = ParallelConfig(global_batch=GLOBAL_BATCH, dtype="fp32", **cfg_kwargs)
    plan = make_plan(cfg, SHAPE["layers"])
    pm = apply_plan(build("llama", device="cpu", seed=0, **SHAPE), plan, build_mesh(plan, "cpu"))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    tokens, labels = _batches()[0]
    x, y = local_batch(pm, tokens), local_batch(pm, labels)
    train_step(pm, x, y, opt)
    mode = _counting_mode()
    with mode:
        train_step(pm, x, y, opt)
    axes = _axis_ranks(cfg, dist.get_rank())
    counts: Counter[str] = Counter()
    for packet, group in mode.calls:
        ranks = frozenset(dist.get_process_group_ranks(_resolve_process_group(group)))
        counts[f"{_kind(packet)}@{_label(ranks, axes, dist.get_world_size())}"] += 1
    return dict(sorted(counts.items()))


def charged_counts(cfg_kwargs: dict[str, Any]) -> dict[str, int]:
    """The cost model's calls for the same Plan, axes named as ``count_case`` names them."""
    from collections import Counter

    import autopar
    from autopar.config import ParallelConfig
    from autopar.cost_model.layer_costs import charged_collectives
    from autopar.cost_model.moe import expert_dp
    from tests.distributed.test_runtime_equivalence import make_plan

    cfg = ParallelConfig(global_batch=GLOBAL_BATCH, dtype="fp32", **cfg_kwargs)
    plan = make_plan(cfg, SHAPE["layers"])
    profile = autopar.profile(autopar.models.build("llama", **SHAPE), seq_len=SHAPE["seq_len"])
    charged = charged_collectives(profile, cfg, split=tuple(s.layers for s in plan.stages),
                                  recompute=tuple(m for s in plan.stages for m in s.recompute))
    axes = _axis_ranks(cfg, 0)
    assert len(axes["edp"]) == expert_dp(cfg)
    counts: Counter[str] = Counter({"all_reduce@world": 1})
    for key, calls in charged.items():
        kind, axis = key.split("@")
        counts[f"{kind}@{_label(axes[axis], axes, cfg.world_size)}"] += calls
    return dict(sorted(counts.items()))


def run_all(rank: int, world_size: int, cases: dict, count_cases: dict) -> dict:
    """The equivalence cases, then the collective counts (or their errors), in one launch."""
    return with_counts(run_cases(rank, world_size, cases),
                       ((name, functools.partial(count_case, cfg))
                        for name, cfg in count_cases.items()))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_expert_parallel_equals_one_process(run_distributed: Any) -> None:
    results = run_distributed(run_all, 4, CASES_4, COUNT_CASES, timeout_s=220)
    check_results(results, CASES_4)
    errors = []
    for name, cfg_kwargs in COUNT_CASES.items():
        errors += count_mismatches(results, name, charged_counts(cfg_kwargs), "charged")
    assert not errors, "\n".join(errors)
