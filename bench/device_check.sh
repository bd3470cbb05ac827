#!/usr/bin/env bash
# The GPU check on a lent device machine, which has PyTorch and no network (README, "The GPU check on a
# lent machine"). Two calls in a row, while the machine stays warm; `make devkit` packs what they carry:
#   bash bench/device_check.sh stage   # carry .devkit/a: installs the project offline, keeps model part 1
#   bash bench/device_check.sh run     # carry .devkit/b: joins the model, then what `check` does
#   bash bench/device_check.sh check   # (make gpu-check) builds the engine, runs bench.harness --device cuda,
#                                      # then bench/gpu_check.py (the HTTP suite against a server on CUDA)
# What they print and write lands in $OUT (the device tool's; bench/out/device elsewhere).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
KIT=${DEVKIT:-.devkit}  # what `make devkit` wrote
STASH=${DEVKIT_STASH:-${HOME:-/root}/trtserver-devkit}  # outside the checkout: it outlives a call on a warm machine
OUT=${OUT:-$PWD/bench/out/device}
# RUN_S seconds in all from the script's start (a device command may run 600 s); the harness stops
# starting scenarios after HARNESS_MIN whole minutes; the HTTP suite gets what is left. A limit reached
# sends SIGINT first, so servers are stopped and what was measured is printed.
RUN_S=${RUN_S:-540} START_S=${START_S:-120} HARNESS_MIN=${HARNESS_MIN:-3}
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
    "$PY" -c 'import trtserver, msgspec, openai, pytest_asyncio, pytest
print("stage: installed trtserver from", trtserver.__file__, "; pytest", pytest.__version__)' || return 1
    echo "stage: done; now call 2 with .devkit/b: bash bench/device_check.sh run"
}

run() {
    [ -f "$STASH/kit.json" ] || { echo "run: nothing staged in $STASH; this is a fresh machine: stage again"; return 3; }
    [ -f "$KIT/b/kit.json" ] || { echo "run: no $KIT/b here: carry it"; return 2; }
    "$PY" -m bench.device_kit join --stash "$STASH" --part "$KIT/b" --dest .cache/wheels || return 1
    TRTSERVER_REVISION=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["revision"])' "$KIT/b/kit.json")
    export TRTSERVER_REVISION
    check
}

# The check itself (also `make gpu-check`): the engine, then the issue's figures (bench.harness --device cuda:
# tokens/s at 1, 16 and 64 streams, the batch-1 roofline), then the HTTP suite, within RUN_S of the start.
check() {
    local code=0 cuda left
    timeout 180 "$PY" -m trtserver.cli build 2>&1 | tail -3 || { echo "check: the engine build failed"; return 1; }
    cuda=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))')
    if [ "$cuda" = 1 ]; then
        timeout -s INT -k 30 $((HARNESS_MIN * 60 + 90)) "$PY" -u -m bench.harness --device cuda --no-profile \
            --max-minutes "$HARNESS_MIN" --results "$OUT/RESULTS-gpu.md" 2>&1 | tee "$OUT/harness.log" || code=1
        tar czf "$OUT/harness-servers.tgz" bench/out/*.log 2>/dev/null
    else
        echo "check: NO CUDA DEVICE: bench.harness --device cuda skipped, the HTTP suite runs on the CPU; rc 1"
        code=1
    fi
    left=$((RUN_S - SECONDS))
    if [ $left -lt $((START_S + 60)) ]; then
        echo "check: ${left}s left of RUN_S=${RUN_S}: not enough for the HTTP suite"
        return 1
    fi
    timeout -s INT -k 20 "$left" "$PY" -u bench/gpu_check.py --skip-build --start-timeout "$START_S" \
        --budget $((left - 15)) 2>&1 | tee "$OUT/gpu_check.log" || code=1
    cp "$(grep -o '/[^ ]*gpu-check-server-[^ ]*\.log' "$OUT/gpu_check.log" | tail -1)" "$OUT/server.log" 2>/dev/null
    return $code
}

case "${1:-}" in
    stage) stage 2>&1 | tee "$OUT/stage.log" ;;
    run) run ;;
    check) check ;;
    *) echo "usage: bash bench/device_check.sh stage|run|check"; exit 2 ;;
esac
