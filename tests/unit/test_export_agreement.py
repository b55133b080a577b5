"""What a framework may plan, its exporter writes: no plan the search or ``estimate`` makes for
a framework is refused by the export to that framework's tool (Megatron-LM plans in fp16 with ep
and DeepSpeed plans with ep had been refused at export)."""

from __future__ import annotations

import itertools

import pytest

from autopar.config import ParallelConfig
from autopar.cost_model.frameworks import FRAMEWORKS, get_framework
from autopar.exporters import export_plan
from autopar.search import plan_from_config
from tests.fixtures.profiles import analytic_transformer_profile
from tests.unit.test_export_moe import CLUSTER, PROFILE

DENSE = analytic_transformer_profile(4, 128, 4, 256, 64)



def _configs():
    """Splits of 4 GPUs over dp, tp, pp and ep, in both 16-bit dtypes, ZeRO 0, 1 and 3, with
    and without sequence parallelism, each recompute mode."""
    for (dp, tp, pp), ep, zero, dtype, sp, recompute in itertools.product(
            [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)], [1, 2], [0, 1, 3], ["bf16", "fp16"],
            [False, True], ["none", "selective", "full"]):
        try:
            yield ParallelConfig(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, dtype=dtype,
                                 sequence_parallel=sp, recompute=recompute, global_batch=8)
        except ValueError:
            continue


def _offload_configs():
    """Offloaded splits, on four data ranks and on one (ZeRO-Offload on one data rank)."""
    for (dp, tp, pp), zero, offload in itertools.product(
            [(4, 1, 1), (1, 2, 2), (1, 4, 1)], [1, 3], ["optimizer", "params"]):
        try:
            yield ParallelConfig(dp=dp, tp=tp, pp=pp, zero=zero, offload=offload, global_batch=8)
        except ValueError:
            continue


@pytest.mark.parametrize("profile", [PROFILE, DENSE], ids=["moe", "dense"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_plan_a_framework_makes_exports_to_its_tool(framework, profile):
    formats = get_framework(framework).exports
    planned = 0
    for cfg in [*_configs(), *_offload_configs()]:
        try:
            plan = plan_from_config(profile, CLUSTER, cfg, model="moe", framework=framework)
        except ValueError:
            continue  # a split this framework does not run
        planned += 1
        for fmt in formats:
            try:
                export_plan(plan, fmt)
            except ValueError as error:
                pytest.fail(f"{framework} planned {cfg.describe()}, export to {fmt}: {error}")
    assert planned >= 10
