"""Test vectors of reference/formulas.md sections 1-4 (parameters, MFU, activations, ZeRO)."""

from __future__ import annotations

import pytest

from autopar.config import ParallelConfig
from autopar.cost_model.estimator import estimate
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.memory import activation_bytes, zero_paper_model_state_bytes
from autopar.cost_model.pipeline import bubble_ratio, in_flight_microbatches
from autopar.cost_model.tp_comm import tp_sharded
from tests.fixtures.profiles import analytic_transformer_profile

GPT3 = dict(layers=96, hidden=12288, heads=96, vocab=51200, seq_len=2048)


@pytest.mark.parametrize(
    ("layers", "hidden", "billions"),
    [(24, 2304, 1.7), (30, 3072, 3.6), (36, 4096, 7.5), (40, 6144, 18.4), (48, 8192, 39.1),
     (60, 10240, 76.1), (80, 12288, 145.6), (96, 16384, 310.1), (105, 20480, 529.6),
     (128, 25600, 1008.0)],
)
def test_parameter_count_megatron_eq2(layers, hidden, billions):
    prof = analytic_transformer_profile(layers, hidden, hidden // 128, 51200, 2048)
    # Eq. 2 leaves out the final layer norm (2h parameters).
    assert round((prof.num_params - 2 * hidden) / 1e9, 1) == billions


def _block_act(cfg: ParallelConfig) -> tuple[float, float, float]:
    prof = analytic_transformer_profile(2, 12288, 96, 51200, 2048, attention="eager")
    block = prof.layers[1]
    return activation_bytes(block, cfg, dtype_ratio=1.0, tp_sharded=tp_sharded(block),
                            logprob_elements=0.0)


def _cfg(tp: int, sp: bool = False) -> ParallelConfig:
    return ParallelConfig(tp=tp, micro_batch=1, global_batch=1, sequence_parallel=sp)


def test_activation_memory_per_layer_six_configurations():
    none, _, full = _block_act(_cfg(1))
    assert none == 2_868_903_936  # s b h (34 + 5 a s / h)
    tp_none, tp_sel, tp_full = _block_act(_cfg(8))
    assert tp_none == 578_813_952  # s b h (10 + 24/t + 5 a s / (h t))
    assert tp_sel == 327_155_712  # s b h (10 + 24/t)
    assert tp_full == 50_331_648  # s b h 2
    sp_none, sp_sel, _ = _block_act(_cfg(8, sp=True))
    assert sp_none == 358_612_992  # s b h (34/t + 5 a s / (h t))
    assert sp_sel == 106_954_752  # s b h 34 / t
    assert full == 50_331_648


def test_selective_recompute_savings_ratio():
    none, sel, _ = _block_act(_cfg(1))
    assert (none - sel) / none == pytest.approx(0.70, abs=0.005)  # 5as/h / (34 + 5as/h)


def test_interleaving_factor_and_bubble():
    # Korthikanti: first stage holds p (1 + (p-1)/(p v)) micro-batches when interleaved.
    assert in_flight_microbatches("interleaved-1f1b", 8, 3, 64, 0) / 8 == pytest.approx(
        1.2917, abs=1e-4
    )
    assert bubble_ratio("1f1b", 8, 32) == 0.21875
    assert bubble_ratio("gpipe", 8, 32) == 0.21875
    assert bubble_ratio("interleaved-1f1b", 8, 32, 2) == 0.109375


# ZeRO Table 1 (GB = 1e9 bytes): (Nd, psi in billions, (os, os+g, os+g+p)).
TABLE1 = [
    (1, 7.5, (120, 120, 120)), (4, 7.5, (52.5, 41.3, 30)), (16, 7.5, (35.6, 21.6, 7.5)),
    (64, 7.5, (31.4, 16.6, 1.88)), (256, 7.5, (30.4, 15.4, 0.47)),
    (1024, 7.5, (30.1, 15.1, 0.12)),
    (1, 128, (2048, 2048, 2048)), (4, 128, (896, 704, 512)), (16, 128, (608, 368, 128)),
    (64, 128, (536, 284, 32)), (256, 128, (518, 263, 8)), (1024, 128, (513, 257, 2)),
    (1, 1000, (16000, 16000, 16000)), (4, 1000, (7000, 5500, 4000)),
    (16, 1000, (4750, 2875, 1000)), (64, 1000, (4187, 2218, 250)),
    (256, 1000, (4046, 2054, 62.5)), (1024, 1000, (4011, 2013, 15.6)),
]


def _last_digit_unit(value: float) -> float:
    text = f"{value}"
    if "." in text and not text.endswith(".0"):
        return 10.0 ** -len(text.split(".")[1])
    return 1.0


@pytest.mark.parametrize(("nd", "psi_b", "expected"), TABLE1)
def test_zero_paper_table1(nd, psi_b, expected):
    for stage, value in zip((1, 2, 3), expected):
        got = zero_paper_model_state_bytes(psi_b * 1e9, nd, stage) / 1e9
        assert abs(got - value) <= _last_digit_unit(value) + 1e-9, (stage, got, value)


def test_zero_paper_figure1():
    psi = 7.5e9
    got = [zero_paper_model_state_bytes(psi, 64, s) / 1e9 for s in range(4)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.06)


@pytest.mark.parametrize(
    ("shape", "batch", "gpus", "iteration_s", "mfu"),
    [(dict(layers=48, hidden=6144, heads=64), 4, 8, 1.10, 0.415),
     (dict(layers=96, hidden=12288, heads=96), 64, 64, 13.75, 0.514)],
)
def test_mfu_formula_korthikanti_eq7(shape, batch, gpus, iteration_s, mfu):
    prof = analytic_transformer_profile(vocab=51200, seq_len=2048, **shape)
    cluster = Cluster.preset("a100-80g", nodes=gpus // 8)
    cfg = ParallelConfig(dp=gpus // 8, tp=8, micro_batch=1, global_batch=batch)
    est = estimate(prof, cluster, cfg)
    model_flops = est.mfu * est.step_time_s * gpus * 312e12
    s, h, n_layers, v = 2048, shape["hidden"], shape["layers"], 51200
    eq7 = 72 * batch * n_layers * s * h**2 * (1 + s / (6 * h) + v / (12 * h * n_layers))
    assert model_flops == pytest.approx(eq7, rel=1e-9)
    assert eq7 / (iteration_s * gpus * 312e12) == pytest.approx(mfu, abs=0.002)
    assert est.tflops_per_gpu * 1e12 == pytest.approx(model_flops / gpus / est.step_time_s)
