"""Time ``autopar.profile`` on the largest zoo presets and on Hugging Face configs (meta device;
repeated blocks measured once).

Run: ``.venv/bin/python benchmarks/profile_speed.py``. Prints build and profile wall times in
seconds per model, the parameter count, how many distinct blocks were measured, and how the module
order was captured (fx for the zoo; the profiling run's module hooks for HF models, which fx
cannot trace: docs/graph.md).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

import autopar
import autopar.models

DATA = Path(__file__).parent / "data"
# Hugging Face configs (no download): Mixtral 8x7B as mistralai/Mixtral-8x7B-v0.1's config.json
# gives its shape; the Llama 4 text configs are the files in benchmarks/data.
HF_CONFIGS = {
    "hf mixtral-8x7b": {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
                        "num_attention_heads": 32, "num_key_value_heads": 8,
                        "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8,
                        "num_experts_per_tok": 2, "max_position_embeddings": 32768},
    "hf llama4-scout": DATA / "hf_llama4_scout.json",
    "hf llama4-maverick": DATA / "hf_llama4_maverick.json",
}


def _build(name: str):
    config = HF_CONFIGS.get(name)
    if config is None:
        return autopar.models.build(name), None
    if isinstance(config, Path):
        config = json.loads(config.read_text())
    return autopar.models.from_hf_config(config), 4096


def main() -> None:
    """Profile each preset once after a small warm-up and print the times."""
    # Warm-up: first use imports torch's flop counter and tracer machinery (a one-time cost).
    autopar.profile(
        autopar.models.build("gpt", layers=1, hidden=64, heads=4, vocab=256, seq_len=32)
    )
    print(f"torch {torch.__version__}")
    header = ("model", "build_s", "profile_s", "params", "measured", "layers", "order")
    print(f"{header[0]:<18} " + " ".join(f"{h:>9}" for h in header[1:]))
    for name in ("gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b", *HF_CONFIGS):
        start = time.perf_counter()
        model, seq_len = _build(name)
        built = time.perf_counter()
        prof = autopar.profile(model, seq_len=seq_len)
        done = time.perf_counter()
        measured = sum(1 for layer in prof.layers if layer.kind == "block" and not layer.repeat_of)
        print(
            f"{name:<18} {built - start:>9.2f} {done - built:>9.2f} "
            f"{prof.num_params / 1e9:>8.1f}B {measured:>9} {prof.num_layers:>9} "
            f"{prof.trace_method:>9}"
        )


if __name__ == "__main__":
    main()
