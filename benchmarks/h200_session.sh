#!/usr/bin/env bash
# The GPU checks of one H200 lease, as one script (each part bounded; raw outputs to $OUT).
# Prepared here: the plans in benchmarks/results/h200/plan_*.json (autopar plan MODEL --gpus 1
# --gpu h200 --global-batch 16) and benchmarks/results/gpu_fp8_predictions.json
# (benchmarks/gpu_fp8.py predict). The machine's python3 holds torch; pulp, highspy and torchao
# travel as wheels in .whl/ (the pins of requirements-dev.txt, torchao 0.17.0 for its torch).
# Afterwards, here: gpu_fp8.py report (both JSON files), gpu_verify.py, and the runtime-overhead
# tables (benchmarks/results/runtime_overhead_h200_*.md). It ran in December 2026 as three calls
# (a first try's runtime-overhead part failed on a CPU tensor handed to NCCL, since fixed).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, torchao; print(torch.__version__, torchao.__version__)"

# 1. Runtime overhead, one process: autopar's worker path against the hand-written torch loop.
for spec in "fp32 gpt:layers=4,hidden=128,heads=4,vocab=512,seq_len=64 tiny" \
            "bf16 gpt:layers=4,hidden=128,heads=4,vocab=512,seq_len=64 tiny" \
            "bf16 gpt:layers=8,hidden=2048,heads=16,vocab=32000,seq_len=1024 h2048"; do
  set -- $spec
  timeout 75 python3 benchmarks/runtime_overhead.py --device cuda --splits "one process" \
      --dtype "$1" --model "$2" --out "$OUT/overhead_${1}_$3.md" \
      2>&1 | tail -4
done

# 2. fp8 against bf16, one block per configuration (eager), the first row compiled too.
timeout 170 python3 benchmarks/gpu_fp8.py measure --out "$OUT/gpu_fp8.json" --compile 1 \
    > "$OUT/gpu_fp8.log" 2>&1
tail -3 "$OUT/gpu_fp8.log"
timeout 210 python3 benchmarks/gpu_fp8.py measure --out "$OUT/gpu_fp8_compiled.json" --compile 4 \
    --compiled-only --rows llama3-8b:1:2,llama3-70b:8:1,llama3-70b:4:2,gpt3-175b:8:2 \
    > "$OUT/gpu_fp8_compiled.log" 2>&1

# 3. Whole steps on one GPU: the plans made today (a per-layer recompute mix, packed).
for name in llama2-7b-mixed gpt3-6.7b; do
  timeout 110 python3 -m autopar.cli verify "benchmarks/results/h200/plan_$name.json" \
      --steps 4 --warmup 1 > "$OUT/verify2_$name.txt" 2>&1
  grep -E "step time|peak memory  " "$OUT/verify2_$name.txt"
done
