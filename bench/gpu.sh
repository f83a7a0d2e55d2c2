#!/usr/bin/env bash
# Every figure a GPU changes, from one command (issue 32): `bench/gpu.sh` or `make bench-gpu`.
#
# On one CUDA GPU (at most ~8 minutes: each script under `timeout`, all under GPU_SH_BUDGET_S,
# default 480 s) it writes into bench/ (bench/README.md, "gpu.sh", says what each holds):
#   floor_gpu.json       the lens and the fused analyzers against their floor, bf16 (bench_floor.py)
#   fused_gpu.json       lens,contrib fused against lens alone, bf16 (bench_fused.py)
#   tuned_step_gpu.json  lensdiv's tuned-lens training step against tuned-lens's own
#                        (bench_tuned_step.py; skipped, with a line, when tuned-lens's source is
#                        not importable: TUNED_LENS_SRC=DIR names it, DIR/tuned_lens/...)
#   lenses_gpu.json      the Jacobian fit against TransformerLens' JacobianLens.fit
#                        (bench_lenses.py --only jacobian)
#   study_gpu.json       a study's cost beyond its runs (bench_study.py, the toy zoo's depths)
#   data_gpu.json        the data path, and its overlap with the model (bench_data.py)
#   tuned_gpu.json/.png  tuned lens, time to quality: recipe vs fast path (bench_tuned.py)
# and then the GPU section of bench/README.md (bench/gpu_report.py, from those files).
# The toy models are trained first where not cached ($LENSDIV_CACHE; copy ~/.cache/lensdiv/toy
# there to stay inside the budget).
#
# Without CUDA it prints one "no GPU here" line and exits 0 (nothing is run or written).
#
# `bench/gpu.sh --smoke` runs every script at tiny sizes on the CPU into a temporary folder
# (toy models trained for a few steps there; nothing under bench/ is written): that the script
# works before a GPU is ever lent. Exit status 1 if any script failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} MPLBACKEND=Agg
SMOKE=0
case "${1:-}" in
    --smoke) SMOKE=1 ;;
    "") ;;
    *) echo "usage: bench/gpu.sh [--smoke]" >&2; exit 2 ;;
esac
if [ $SMOKE = 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "bench/gpu.sh: no GPU here (torch sees no CUDA device): nothing run, no *_gpu.json written"
    exit 0
fi
OUT=$(mktemp -d "${TMPDIR:-/tmp}/lensdiv-gpu-XXXXXX")
# A toy cache carried in the checkout (.lensdiv-cache/, ignored by git) is used where
# LENSDIV_CACHE names none: a device machine starts without ~/.cache/lensdiv.
if [ -z "${LENSDIV_CACHE:-}" ] && [ -d .lensdiv-cache ]; then
    export LENSDIV_CACHE="$PWD/.lensdiv-cache"
fi
BUDGET=${GPU_SH_BUDGET_S:-480}
failed=()

# step NAME SECONDS COMMAND...: run it under `timeout` (its limit, or what is left of the
# budget), its output in $OUT/NAME.log; say how it went in one line.
step() {
    local name=$1 limit=$2 left rc t0=$SECONDS
    shift 2
    left=$((BUDGET - SECONDS))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        echo "  $name: skipped (the ${BUDGET} s budget is spent)"
        failed+=("$name")
        return
    fi
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    if [ $rc = 0 ]; then
        echo "  $name: done in $((SECONDS - t0)) s"
    else
        [ $rc = 124 ] && why="over its ${limit} s" || why="exit $rc"
        echo "  $name: FAILED ($why); the end of $OUT/$name.log:"
        tail -n 5 "$OUT/$name.log" | sed 's/^/      /'
        failed+=("$name")
    fi
}

if [ $SMOKE = 1 ]; then
    echo "bench/gpu.sh --smoke: every script at tiny sizes on the CPU, into $OUT"
    export LENSDIV_CACHE="$OUT/cache" LENSDIV_TOY_STEPS=20
    DEV=(--device cpu)
    TINY=(--layers 2 --d-model 64 --vocab 512)
    FLOOR=("${TINY[@]}" --dtype bfloat16 --tokens 256 --seq-len 32 --batch-size 4 --repeats 1)
    FUSED=("${FLOOR[@]}")
    STEP=("${TINY[@]}" --tokens 128 --steps 1 --repeats 1)
    LENSES=("${TINY[@]}" --prompts 8 --seq-len 32 --batch-size 4 --repeats 1)
    FAMILY=toy,toy:d2
    STUDY=(--tokens 512 --repeats 1)
    DATA=("${TINY[@]}" --tokens 20000 --overlap-tokens 2048 --seq-len 64 --repeats 1)
    TUNED_MODELS=(toy toy:d2)
    TUNED=(--preset toy --steps 4 --tokens-per-step 1024 --fast-steps 3 --eval-tokens 1024)
    BUDGET=${GPU_SH_BUDGET_S:-900}
    TOYS_LIMIT=300
else
    "$PY" -c 'import torch; print("bench/gpu.sh on", torch.cuda.get_device_name(), "into", "'"$OUT"'")'
    DEV=(--device cuda)
    FLOOR=(--dtype bfloat16 --tokens 32768 --batch-size 32 --repeats 3)
    FUSED=("${FLOOR[@]}")
    STEP=(--layers 12 --d-model 768 --vocab 50257 --tokens 2048 --steps 5 --repeats 3)
    LENSES=(--prompts 64 --repeats 2)
    FAMILY=zoo:depth
    STUDY=(--tokens 65536 --repeats 2)
    DATA=(--tokens 500000 --overlap-tokens 262144 --repeats 2)
    TUNED_MODELS=(toy:d8 toy:d4-w128)
    TUNED=(--preset cpu --fast-steps 8,16)
    TOYS_LIMIT=120
fi

# The toy models first, outside every figure's timing: read from the cache, or trained (on the
# CPU, minutes each) where not cached.
step toys "$TOYS_LIMIT" "$PY" -c '
import sys, lensdiv
from lensdiv.models.toy import cached_log, parse_toy
from lensdiv.studies.crossmodel import FAMILIES
names = dict.fromkeys([*FAMILIES.get(sys.argv[1], sys.argv[1].split(",")), *sys.argv[2:]])
missing = [m for m in names if cached_log(parse_toy(m)) is None]
print("toy models:", " ".join(names), "- not cached, trained now:", " ".join(missing) or "none")
for m in names:
    lensdiv.load_model(m, device="cpu", progress=False)
' "$FAMILY" "${TUNED_MODELS[@]}"

step floor 60 "$PY" bench/bench_floor.py "${DEV[@]}" "${FLOOR[@]}" --json "$OUT/floor_gpu.json"
step fused 45 "$PY" bench/bench_fused.py "${DEV[@]}" "${FUSED[@]}" --json "$OUT/fused_gpu.json"
TL_SRC=${TUNED_LENS_SRC:-$("$PY" -c 'import os, tuned_lens; print(os.path.dirname(os.path.dirname(tuned_lens.__file__)))' 2>/dev/null)}
if [ -n "$TL_SRC" ] && [ -d "$TL_SRC/tuned_lens" ]; then
    step tuned_step 45 "$PY" bench/bench_tuned_step.py --tuned-lens-src "$TL_SRC" "${DEV[@]}" \
        "${STEP[@]}" --json "$OUT/tuned_step_gpu.json"
else
    echo "  tuned_step: skipped (tuned-lens's source is not importable; TUNED_LENS_SRC=DIR names it)"
fi
step lenses 60 "$PY" bench/bench_lenses.py --only jacobian "${DEV[@]}" "${LENSES[@]}" --json "$OUT/lenses_gpu.json"
step study 60 "$PY" bench/bench_study.py --family "$FAMILY" "${DEV[@]}" "${STUDY[@]}" \
    --json "$OUT/study_gpu.json"
step data 50 "$PY" bench/bench_data.py "${DEV[@]}" "${DATA[@]}" --json "$OUT/data_gpu.json"
for model in "${TUNED_MODELS[@]}"; do
    step "tuned ${model}" 60 "$PY" bench/bench_tuned.py --model "$model" "${DEV[@]}" "${TUNED[@]}" \
        --json "$OUT/tuned_gpu.json" --plot "$OUT/tuned_gpu.png"
done

written=$(cd "$OUT" && ls -- *_gpu.json *_gpu.png 2>/dev/null | tr '\n' ' ')
if [ $SMOKE = 1 ]; then
    cp bench/README.md "$OUT/README.md"
    step report 30 "$PY" bench/gpu_report.py --folder "$OUT" --readme "$OUT/README.md"
    echo "bench/gpu.sh --smoke: wrote ${written:-nothing} and $OUT/README.md in $OUT (bench/ untouched)"
else
    if [ -n "$written" ]; then
        rm -f bench/*_gpu.json bench/*_gpu.png  # an earlier run's figures do not mix with these
        (cd "$OUT" && cp -- $written "$OLDPWD/bench/")
        step report 30 "$PY" bench/gpu_report.py
    fi
    echo "bench/gpu.sh: wrote ${written:-nothing} into bench/ (logs in $OUT)"
fi
if [ ${#failed[@]} -gt 0 ]; then
    echo "bench/gpu.sh: failed or skipped: ${failed[*]}"
    exit 1
fi
