"""The cost tables' shared terms (table_cache.py) and repeated blocks' shared costs."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.config import ParallelConfig
from autopar.cost_model import table_cache
from autopar.cost_model.frameworks import FRAMEWORKS, framework_cluster, get_framework
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_costs import build_cost_table
from autopar.cost_model.tables import LayerCost
from tests.fixtures.profiles import analytic_transformer_profile

PROFILE = analytic_transformer_profile(6, 256, 8, 1024, 128)
CONFIGS = (
    ParallelConfig(tp=2, sequence_parallel=True, global_batch=8),
    ParallelConfig(dp=2, pp=2, zero=3, micro_batch=2, global_batch=8),
    ParallelConfig(cp=2, dp=2, zero=1, recompute="full", global_batch=8),
)


def _bits(cost: LayerCost) -> tuple:
    """Every field of ``cost``, floats as their exact bits (float.hex)."""
    def one(v):
        if isinstance(v, tuple):
            return tuple(one(x) for x in v)
        return v.hex() if isinstance(v, float) else v
    return tuple(one(getattr(cost, f.name)) for f in dataclasses.fields(LayerCost))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_repeated_blocks_share_their_source(framework: str) -> None:
    terms = table_cache.profile_terms(PROFILE)
    # layers.1 is computed (layers.0, the first block, apart); layers.2.. share its costs.
    assert [(i, len(shared)) for i, shared in terms.computed] == [
        (0, 0), (1, 0), (2, 4), (7, 0)]
    for cfg in CONFIGS:
        cluster = Cluster.preset("h100", nodes=1, gpus_per_node=cfg.world_size)
        table = build_cost_table(PROFILE, cluster, cfg, framework)
        assert table.names == tuple(x.name for x in PROFILE.layers)
        source = table.layers[2]
        assert source.name == PROFILE.layers[2].name
        assert all(copy is source for copy in table.layers[3:7])
        # Computed on its own, a copy's position gives the same terms, bit for bit.
        alone = build_cost_table(dataclasses.replace(PROFILE, layers=tuple(
            dataclasses.replace(x, repeat_of=None) for x in PROFILE.layers)), cluster, cfg,
            framework)
        for k in range(3, 7):
            assert _bits(alone.layers[k]) == _bits(dataclasses.replace(
                source, name=PROFILE.layers[k].name))


def test_table_names_default_to_the_layers_and_must_match_them() -> None:
    table = build_cost_table(PROFILE, Cluster.preset("h100", nodes=1, gpus_per_node=2),
                             CONFIGS[0])
    own = dataclasses.replace(table, layers=table.layers[:2], names=(), blocks=())
    assert own.names == tuple(x.name for x in table.layers[:2])
    assert own.block_mask == (True, True)
    assert table.blocks == tuple(layer.kind == "block" for layer in PROFILE.layers)
    with pytest.raises(ValueError, match=r"2 layers but \d+ block flags"):
        dataclasses.replace(table, layers=table.layers[:2], names=())
    assert dataclasses.replace(table, config=CONFIGS[1]).names == table.names
    with pytest.raises(ValueError, match="3 layers but 2 names"):
        dataclasses.replace(table, layers=table.layers[:3], names=table.names[:2])


def test_caches_answer_for_their_own_inputs() -> None:
    cfg = CONFIGS[1]
    cluster = Cluster.preset("h100", nodes=1, gpus_per_node=cfg.world_size)
    fw = get_framework("torchtitan")
    driven = table_cache.driven_cluster(cluster, fw)
    assert driven == framework_cluster(cluster, fw)
    assert table_cache.driven_cluster(cluster, fw) is driven
    slower = dataclasses.replace(cluster, dp_overlap_efficiency=0.25)
    assert table_cache.driven_cluster(slower, get_framework("autopar")).dp_overlap_efficiency == (
        0.25)
    # A profile with twice the layer outputs: its own stage-boundary tensor, not the cached one.
    wider = dataclasses.replace(PROFILE, layers=tuple(
        dataclasses.replace(x, output_bytes=2 * x.output_bytes) for x in PROFILE.layers))
    a = build_cost_table(PROFILE, cluster, cfg)
    b = build_cost_table(wider, cluster, cfg)
    assert b.recv_buffer_bytes == 2 * a.recv_buffer_bytes > 0
    for k in range(20):  # bounded
        table_cache.profile_terms(dataclasses.replace(PROFILE, name=f"p{k}"))
    assert len(table_cache._TERMS) <= table_cache._MAX_ENTRIES
