"""Time ``autopar.profile`` on the largest zoo presets (meta device; repeated blocks measured once).

Run: ``.venv/bin/python benchmarks/profile_speed.py``. Prints build and profile wall times in
seconds per preset, the parameter count, and how many distinct blocks were measured.
"""

from __future__ import annotations

import time

import torch

import autopar
import autopar.models


def main() -> None:
    """Profile each preset once after a small warm-up and print the times."""
    # Warm-up: first use imports torch's flop counter and tracer machinery (a one-time cost).
    autopar.profile(
        autopar.models.build("gpt", layers=1, hidden=64, heads=4, vocab=256, seq_len=32)
    )
    print(f"torch {torch.__version__}")
    header = ("preset", "build_s", "profile_s", "params", "measured", "layers")
    print(f"{header[0]:<14} " + " ".join(f"{h:>9}" for h in header[1:]))
    for name in ("gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b"):
        start = time.perf_counter()
        model = autopar.models.build(name)
        built = time.perf_counter()
        prof = autopar.profile(model)
        done = time.perf_counter()
        measured = sum(1 for layer in prof.layers if layer.kind == "block" and not layer.repeat_of)
        print(
            f"{name:<14} {built - start:>9.2f} {done - built:>9.2f} "
            f"{prof.num_params / 1e9:>8.1f}B {measured:>9} {prof.num_layers:>9}"
        )


if __name__ == "__main__":
    main()
