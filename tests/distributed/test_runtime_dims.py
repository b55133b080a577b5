"""HSDP, offload and context parallelism equal the one-process step, alone and with tp or pp.

Same check as test_runtime_equivalence.py (first-step gradients at rtol 1e-5 / atol 1e-7 with
DTensors gathered, three AdamW losses at 1e-3, fp32, gloo): the zoo GPT (learned positions) and
Llama (RoPE, grouped-query attention) at seq_len 8, so cp = 2 runs load-balanced chunks of 2
tokens. On these CPU runs the "device" is the host, so the offload cases prove that FSDP2's
CPUOffloadPolicy path (host shards, host optimizer step) gives the one-process numbers, not where
the bytes live.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_runtime_equivalence import check_results, run_cases

CASES_2: list[tuple[str, str, dict[str, Any], Any]] = [
    ("gpt-cp2", "gpt", {"cp": 2, "micro_batch": 4}, None),
    ("llama-cp2", "llama", {"cp": 2, "micro_batch": 4}, None),
    ("llama-cp2-full-recompute", "llama", {"cp": 2, "micro_batch": 2, "recompute": "full"}, None),
    ("gpt-dp2-zero3-offload-params", "gpt",
     {"dp": 2, "zero": 3, "offload": "params", "micro_batch": 2}, None),
    ("llama-dp2-zero1-offload-optimizer", "llama",
     {"dp": 2, "zero": 1, "offload": "optimizer", "micro_batch": 2}, None),
]
CASES_4: list[tuple[str, str, dict[str, Any], Any]] = [
    ("gpt-hsdp2x2-zero3", "gpt", {"dp": 4, "dp_replicate": 2, "zero": 3}, None),
    ("llama-hsdp2x2-zero2", "llama", {"dp": 4, "dp_replicate": 2, "zero": 2}, None),
    ("llama-hsdp2x1-tp2", "llama", {"dp": 2, "dp_replicate": 2, "zero": 3, "tp": 2}, None),
    ("gpt-hsdp2x1-pp2", "gpt",
     {"dp": 2, "dp_replicate": 2, "zero": 1, "pp": 2, "schedule": "1f1b"}, None),
    ("gpt-hsdp2-x-cp2", "gpt", {"dp": 2, "dp_replicate": 2, "cp": 2, "zero": 3}, None),
    ("llama-cp2-tp2-sp", "llama",
     {"cp": 2, "tp": 2, "sequence_parallel": True, "micro_batch": 4}, None),
    ("gpt-cp2-pp2", "gpt", {"cp": 2, "pp": 2, "schedule": "1f1b", "micro_batch": 2}, None),
    ("llama-dp2-tp2-offload-params", "llama",
     {"dp": 2, "tp": 2, "zero": 3, "offload": "params"}, None),
    ("gpt-dp2-pp2-offload-optimizer", "gpt",
     {"dp": 2, "pp": 2, "zero": 1, "offload": "optimizer", "schedule": "gpipe"}, None),
]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_cp_and_offload_two_processes_equal_one_process(run_distributed: Any) -> None:
    results = run_distributed(run_cases, 2, CASES_2, timeout_s=220)
    check_results(results, CASES_2)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_hsdp_cp_offload_four_processes_equal_one_process(run_distributed: Any) -> None:
    results = run_distributed(run_cases, 4, CASES_4, timeout_s=280)
    check_results(results, CASES_4)
