"""Which experts autopar's runtime shards over ep (graph/moe.py ``ep_blocker``): the experts it
runs one at a time with ``run_expert`` (the zoo's, Mixtral's, Qwen3-MoE's, DeepSeek-V3's stacked
[E, out, in]; gpt-oss's [E, in, out] with biases and its own clamped gate; DBRX's [E f, h]
matrices, an expert f rows of each; Llama 4's, called on rows already routed to every expert,
whose zero rows it skips), checked against each module's own forward; the profile records why
not for the others (experts computing anything else, capacity-bound experts), and the pre-launch
check refuses them with that reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.config import ParallelConfig
from autopar.errors import AutoparError
from autopar.graph.moe import (
    GLU_MATRICES,
    ep_blocker,
    expert_modules,
    local_experts,
    routed_rows,
    run_expert,
    run_sorted,
)
from autopar.runtime.apply import check_plan_runnable
from autopar.search.planner import plan_from_config

pytest.importorskip("transformers")

_BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64, max_position_embeddings=16,
             tie_word_embeddings=False)
CONFIGS = {
    "mixtral": dict(_BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    # More experts than the probe routes to (transformers' default grouped_mm kernel sizes its
    # groups by the module's num_experts, so the probe keeps all E).
    "mixtral_e8": dict(_BASE, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(_BASE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, head_dim=8),
    "deepseek_v3": dict(_BASE, model_type="deepseek_v3", n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=16,
                        q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                        num_key_value_heads=4),
    "gpt_oss": dict(_BASE, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                    head_dim=8),
    "llama4_text": dict(_BASE, model_type="llama4_text", num_local_experts=4, head_dim=8,
                        intermediate_size_mlp=64, num_experts_per_tok=1),
    "dbrx": {"model_type": "dbrx", "d_model": 32, "n_heads": 4, "n_layers": 2,
             "max_seq_len": 16, "vocab_size": 64,
             "attn_config": {"clip_qkv": 8, "kv_n_heads": 2, "rope_theta": 10000},
             "ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2,
                            "moe_jitter_eps": None}},
}
RUNNABLE = ("mixtral", "mixtral_e8", "qwen3_moe", "deepseek_v3", "gpt_oss", "dbrx")


def _model(name: str, device: str = "meta"):
    return autopar.models.from_hf_config(CONFIGS[name], device=device, seed=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_profile_records_why_the_experts_cannot_be_sharded(name):
    profile = autopar.profile(_model(name), seq_len=16)
    moes = [x.moe for x in profile.layers if x.moe]
    assert moes and {m.ep_blocker for m in moes} == {""}
    for layer in (x for x in profile.layers if x.moe):
        assert "ep_blocker" not in layer.to_dict()["moe"]
    assert type(profile).from_dict(profile.to_dict()) == profile


@pytest.mark.parametrize("name", RUNNABLE)
def test_run_sorted_equals_the_modules_own_forward(name):
    module = expert_modules(_model(name, "cpu"))[0][1]
    experts = local_experts(module)
    if name == "gpt_oss":  # its biases are initialised to zeros: make them count
        for bias in (module.gate_up_proj_bias, module.down_proj_bias):
            bias.data.normal_()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 32, generator=gen)
    index = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(12)])
    weights = torch.rand(12, 2, generator=gen)
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = run_sorted(module, x.index_select(0, order // 2),
                      torch.bincount(flat, minlength=experts).tolist())
    rows = rows * weights.reshape(-1)[order][:, None]
    got = torch.zeros_like(x).index_add(0, order // 2, rows)
    # DBRX hands back [b, s, h] as it was given: the same rows.
    torch.testing.assert_close(got, module(x, index, weights).reshape(got.shape), rtol=1e-5,
                               atol=1e-6)


class _Experts(nn.Module):
    """Stacked [E, out, in] experts whose forward is not one expert at a time as
    ``run_expert`` runs it: ``mode`` "interleaved" gate and up (without gpt-oss's own
    ``_apply_gate`` that says so), or "scaled" outputs."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 8))
        self.down_proj = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(top_k_index.shape[1]):
                e = int(top_k_index[t, j])
                h = F.linear(x[t], self.gate_up_proj[e])
                gate, up = (h[::2], h[1::2]) if self.mode == "interleaved" else h.chunk(2)
                y = F.linear(F.silu(gate) * up, self.down_proj[e])
                out[t] += top_k_weights[t, j] * (2 * y if self.mode == "scaled" else y)
        return out


@pytest.mark.parametrize("mode", ["interleaved", "scaled"])
def test_experts_computing_something_else_are_refused(mode):
    assert "computes something other than its experts" in ep_blocker(_Experts(mode))
    assert ep_blocker(_Experts("plain")) == ""


def test_zoo_capacity_experts_are_refused():
    kw = dict(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, seq_len=16, experts=4, top_k=2)
    dropless = autopar.models.build("llama", **kw)
    assert all(ep_blocker(m) == "" for _n, m in expert_modules(dropless))
    capped = autopar.models.build("llama", capacity_factor=1.5, **kw)
    assert "drops the tokens over its experts' capacity" in ep_blocker(
        expert_modules(capped)[0][1])


@pytest.mark.parametrize("name", ["mixtral", "llama4_text", "dbrx"])
def test_pre_launch_check_runs_or_refuses_ep(name):
    model = _model(name)
    profile = autopar.profile(model, seq_len=16)
    cluster = autopar.Cluster.preset("h100", nodes=1, gpus_per_node=2)
    cfg = ParallelConfig(dp=2, ep=2, zero=1, global_batch=4, micro_batch=2)
    plan = plan_from_config(profile, cluster, cfg, framework="torchtitan")
    check_plan_runnable(model, plan)
    assert autopar.estimate(profile, cluster, cfg).fits


def test_pre_launch_check_refuses_ep_of_experts_it_cannot_run():
    model = autopar.models.build("llama", layers=2, hidden=32, heads=4, kv_heads=2, vocab=64,
                                 seq_len=16, experts=4, top_k=2, capacity_factor=1.5)
    profile = autopar.profile(model, seq_len=16)
    cluster = autopar.Cluster.preset("h100", nodes=1, gpus_per_node=2)
    cfg = ParallelConfig(dp=2, ep=2, zero=1, global_batch=4, micro_batch=2)
    plan = plan_from_config(profile, cluster, cfg, framework="torchtitan")
    with pytest.raises(AutoparError, match=r"cannot shard these experts over ep: .*capacity"):
        check_plan_runnable(model, plan)
    with pytest.raises(ValueError, match=r"one at a time .*drops the tokens over its experts"):
        autopar.estimate(profile, cluster, cfg)


def test_routed_rows_experts_equal_running_each_expert_on_its_rows():
    """Llama 4's experts, called on every expert's block of rows: the module's own forward
    equals ``run_expert`` on each block, and a zero row (a token its router did not pick for
    that expert) gives zero, so skipping those rows changes nothing."""
    module = expert_modules(_model("llama4_text", "cpu"))[0][1]
    assert routed_rows(module)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 32, generator=gen)
    blocks = x * (torch.rand(4, 6, 1, generator=gen) < 0.5)
    want = torch.cat([run_expert(module, e, blocks[e]) for e in range(4)])
    torch.testing.assert_close(module(blocks.reshape(-1, 32)), want, rtol=1e-5, atol=1e-6)
    assert not run_expert(module, 0, x[:1] * 0).any()


class _RoutedExperts(nn.Module):
    """Experts called on routed rows (Llama 4's convention), with a bias (a zero row is not
    zero) or a forward scaling each output."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self.hidden_size = mode, 8
        self.gate_up_proj = nn.Parameter(torch.randn(4, 8, 16))
        self.down_proj = nn.Parameter(torch.randn(4, 8, 8))
        if mode == "bias":
            self.down_proj_bias = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        blocks = x.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
        gate, up = torch.bmm(blocks, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * up, self.down_proj)
        if self.mode == "bias":
            out = out + self.down_proj_bias[:, None]
        return (3 * out if self.mode == "scaled" else out).reshape(-1, self.hidden_size)


def test_routed_rows_experts_computing_something_else_are_refused():
    assert ep_blocker(_RoutedExperts("plain")) == ""
    assert "do not map a zero row to zero" in ep_blocker(_RoutedExperts("bias"))
    assert "computes something other" in ep_blocker(_RoutedExperts("scaled"))


def test_experts_sharing_a_parameter_are_refused():
    module = _Experts("plain")
    module.scale = nn.Parameter(torch.ones(8))
    assert ep_blocker(module) == "_Experts holds 'scale', shared by its experts"


class _Matrices(nn.Module):
    """DBRX's layout (an ``mlp`` holding w1, v1, w2 as [E f, h]), its forward scaling each
    expert's output when ``scaled``: not what ``run_expert`` runs."""

    def __init__(self, scaled: bool) -> None:
        super().__init__()
        self.scaled, self.num_experts, self.ffn_hidden_size = scaled, 4, 8
        self.mlp = nn.Module()
        for name in GLU_MATRICES:
            setattr(self.mlp, name, nn.Parameter(torch.randn(4 * 8, 8)))

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(top_k_index.shape[1]):
                f = self.ffn_hidden_size
                rows = slice(int(top_k_index[t, j]) * f, int(top_k_index[t, j]) * f + f)
                w1, v1, w2 = (getattr(self.mlp, n)[rows] for n in GLU_MATRICES)
                y = (F.silu(x[t] @ w1.T) * (x[t] @ v1.T)) @ w2
                out[t] += top_k_weights[t, j] * (3 * y if self.scaled else y)
        return out


def test_matrices_experts_run_one_at_a_time_or_are_refused():
    assert ep_blocker(_Matrices(scaled=False)) == ""
    assert "computes something other than its experts" in ep_blocker(_Matrices(scaled=True))
    module = _Matrices(scaled=False)
    module.mlp.extra = nn.Parameter(torch.ones(8))
    assert ep_blocker(module) == "_Matrices holds 'mlp.extra', shared by its experts"
