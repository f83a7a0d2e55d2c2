#!/usr/bin/env bash
# Every figure a GPU changes, from one command (issue 32): `bench/gpu.sh` or `make bench-gpu`.
# On a machine without CUDA it prints one "no GPU here" line and exits 0 (nothing is written).
# On one GPU (at most ~8 minutes) it writes bench/*_gpu.json:
#   floor_gpu.json  the lens readout against its floor (bench_floor.py, bf16 model)
#   tuned_gpu.json  time to quality of the tuned lens: the published recipe against the fast
#                   path (bench_tuned.py, toy models; held-out KL per layer and wall time)
# Not yet covered (the scripts have no --device): the fused analyzers, the Jacobian fit against
# TransformerLens' fit, the study and data-path figures, tuned-lens's own step.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} MPLBACKEND=Agg
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "bench/gpu.sh: no GPU here (torch sees no CUDA device): nothing run, no *_gpu.json written"
    exit 0
fi
"$PY" -c 'import torch; print("bench/gpu.sh on", torch.cuda.get_device_name())'
timeout 240 "$PY" bench/bench_floor.py --device cuda --json bench/floor_gpu.json
for model in toy:d8 toy:d4-w128; do
    name=${model//[:]/_}
    timeout 240 "$PY" bench/bench_tuned.py --model "$model" --preset cpu --fast-steps 8,16 \
        --device cuda --json "bench/tuned_${name}_gpu.json"
done
echo "bench/gpu.sh: wrote $(ls bench/*_gpu.json | tr '\n' ' ')"
