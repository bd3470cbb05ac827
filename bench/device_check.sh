#!/usr/bin/env bash
# The GPU check on a lent device machine, which has PyTorch and no network (README, "The GPU check on a
# lent machine"). Two calls in a row, while the machine stays warm; `make devkit` packs what they carry:
#   bash bench/device_check.sh stage   # carry .devkit/a: installs the project offline, keeps model part 1
#   bash bench/device_check.sh run     # carry .devkit/b: joins the model, builds the engine, runs
#                                      # bench/gpu_check.py (HTTP suite) and bench.harness --device cuda
# What they print and write lands in $OUT (the device tool's; bench/out/device elsewhere).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
KIT=${DEVKIT:-.devkit}  # what `make devkit` wrote
STASH=${DEVKIT_STASH:-${HOME:-/root}/trtserver-devkit}  # outside the checkout: it outlives a call on a warm machine
OUT=${OUT:-$PWD/bench/out/device}
BUILD_S=${BUILD_S:-150} START_S=${START_S:-120} TESTS_S=${TESTS_S:-210} HARNESS_MIN=${HARNESS_MIN:-3}
mkdir -p "$OUT"

stage() {
    [ -f "$KIT/a/kit.json" ] || { echo "stage: no $KIT/a here: carry it (make devkit packs it)"; return 2; }
    rm -rf "$STASH" && mkdir -p "$STASH" && cp -r "$KIT/a/." "$STASH/" || return 2
    (nvidia-smi -L || echo "no nvidia-smi") 2>&1
    "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'
    local args=() line
    while IFS= read -r line; do
        if [[ $line == "-e "* ]]; then args+=(-e "${line#-e }"); elif [ -n "$line" ]; then args+=("$line"); fi
    done <"$STASH/install.txt"
    local pip=("$PY" -m pip install -q --no-index --find-links "$STASH/wheels" --disable-pip-version-check)
    "${pip[@]}" "setuptools>=68" && "${pip[@]}" --no-build-isolation "${args[@]}" || {
        echo "stage: the offline install failed (a need the kit lacks is named above)"; return 1; }
    "$PY" -m pip check || echo "stage: pip check reports the conflicts above (the run may still work)"
    "$PY" -c 'import trtserver, msgspec, openai; print("stage: installed trtserver from", trtserver.__file__)'
    echo "stage: done; now call 2 with .devkit/b: bash bench/device_check.sh run"
}

run() {
    [ -f "$STASH/kit.json" ] || { echo "run: nothing staged in $STASH; this is a fresh machine: stage again"; return 3; }
    [ -f "$KIT/b/kit.json" ] || { echo "run: no $KIT/b here: carry it"; return 2; }
    "$PY" -m bench.device_kit join --stash "$STASH" --part "$KIT/b" --dest .cache/wheels || return 1
    local code=0 cuda
    cuda=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))')
    timeout $((BUILD_S + START_S + TESTS_S + 60)) "$PY" -u bench/gpu_check.py --build-timeout "$BUILD_S" \
        --start-timeout "$START_S" --test-timeout "$TESTS_S" 2>&1 | tee "$OUT/gpu_check.log" || code=1
    cp "$(grep -o '/[^ ]*gpu-check-server-[^ ]*\.log' "$OUT/gpu_check.log" | tail -1)" "$OUT/server.log" 2>/dev/null
    if [ "$cuda" = 1 ]; then
        timeout $((HARNESS_MIN * 60 + 120)) "$PY" -u -m bench.harness --device cuda --no-profile \
            --max-minutes "$HARNESS_MIN" --results "$OUT/RESULTS-gpu.md" 2>&1 | tee "$OUT/harness.log" || code=1
    else
        echo "run: no CUDA device: bench.harness --device cuda skipped (the rest ran on the CPU)"
    fi
    return $code
}

case "${1:-}" in
    stage) stage 2>&1 | tee "$OUT/stage.log" ;;
    run) run ;;
    *) echo "usage: bash bench/device_check.sh stage|run"; exit 2 ;;
esac
