#!/usr/bin/env bash
# The GPU checks: the `cuda` build, the GPU tests, the model bench against PyTorch +
# transformers on the same GPU, and a short quickstart with `model.device = "cuda"` (and the same
# run on the CPU of that machine, for the ratio).
#
#   scripts/gpu-check.sh build [DIR]   # where Rust is: builds the cuda binaries into DIR
#   scripts/gpu-check.sh run [DIR]     # on the GPU machine: runs them, logs into $OUT or DIR/out
#   scripts/gpu-check.sh [DIR]         # both, on a machine with Rust, CUDA and a GPU
#
# DIR defaults to gpu-build/ (git-ignored). `build` installs the CUDA 13.0 toolchain from PyPI
# (scripts/cuda-toolchain.sh), builds `turnwise` with `--features cuda`, the turnwise-model test
# binary (its GPU tests are the `#[ignore]`d `cuda_parity` ones) and the model bench binary, all
# in the release profile, strips them and copies them with the bench's PyTorch script into DIR:
# and packs them into DIR/bundle.tar.xz (about 20 MB: what to carry to a GPU machine that has no
# Rust toolchain; `run` unpacks it). `run` needs the
# driver, the CUDA 13 libraries (found in the Python environment's nvidia-* packages, i.e.
# PyTorch's, or LD_LIBRARY_PATH) and, for the PyTorch side of the bench, torch + transformers.
# GPU_CHECK_ONLY (e.g. "quickstart serve") runs only the stages whose names contain a word of it.
# Each stage has a time limit (scaled by GPU_CHECK_TIME_SCALE, default 1: the whole run stays
# within 8 minutes) so that one stuck stage does not take the others' logs with it; every
# stage's log is written as it runs.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
mode=all
case "${1:-}" in
    build | run) mode=$1; shift ;;
esac
dir="${1:-$here/gpu-build}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"

build() {
    set -e
    cd "$here"
    eval "$(scripts/cuda-toolchain.sh)"
    cargo build --release --locked -p turnwise --features cuda
    # The test and bench binaries of turnwise-model with the same feature set.
    local json
    json=$(cargo test --release --locked -p turnwise-model --features cuda --lib --bench model \
        --no-run --message-format=json)
    local lib bench
    lib=$(echo "$json" | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m["target"]["name"] == "turnwise_model" and m["profile"]["test"]:
        print(m["executable"])')
    bench=$(echo "$json" | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m["target"]["name"] == "model":
        print(m["executable"])')
    [ -n "$lib" ] && [ -n "$bench" ] || { echo "gpu-check: test binaries not found" >&2; exit 1; }
    cp target/release/turnwise "$dir/turnwise"
    cp "$lib" "$dir/turnwise_model_tests"
    cp "$bench" "$dir/model_bench"
    cp crates/turnwise-model/benches/model_torch.py "$dir/"
    strip "$dir/turnwise" "$dir/turnwise_model_tests" "$dir/model_bench"
    # One compressed bundle (about a quarter of the stripped size) to carry.
    tar -C "$dir" -cJf "$dir/bundle.tar.xz" turnwise turnwise_model_tests model_bench \
        model_torch.py
    ls -la "$dir"
    set +e
}

# Runs stage NAME with a limit of SECONDS (times GPU_CHECK_TIME_SCALE), its output into
# $logs/NAME.log and the terminal.
stage() {
    local name=$1 limit=$2
    shift 2
    # GPU_CHECK_ONLY="quickstart serve": run only the stages whose names contain one of these.
    if [ -n "${GPU_CHECK_ONLY:-}" ]; then
        local want=0 w
        for w in $GPU_CHECK_ONLY; do
            case "$name" in *"$w"*) want=1 ;; esac
        done
        [ "$want" = 1 ] || return 0
    fi
    limit=$(python3 -c "print(int($limit * float('${GPU_CHECK_TIME_SCALE:-1}')))")
    local t0=$SECONDS
    echo "== $name (limit $limit s)"
    timeout "$limit" "$@" 2>&1 | tee "$logs/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc, $((SECONDS - t0)) s" | tee -a "$logs/summary.txt"
}

run() {
    if [ ! -x "$dir/turnwise" ] && [ -f "$dir/bundle.tar.xz" ]; then
        tar -C "$dir" -xJf "$dir/bundle.tar.xz"
    fi
    logs="${OUT:-$dir/out}"
    mkdir -p "$logs"
    : >"$logs/summary.txt"
    # The CUDA 13 libraries: the Python environment's nvidia-* wheels (PyTorch's), if present.
    local libs
    libs=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
dirs = set()
for base in site.getsitepackages():
    for pattern in ("nvidia/*/lib", "nvidia/cu13/lib", "nvidia/cu13/lib64"):
        for d in glob.glob(os.path.join(base, pattern)):
            dirs.add(d)
print(":".join(sorted(dirs)))
PY
    )
    export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$logs/gpu.txt"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >>"$logs/gpu.txt"
    ldd "$dir/turnwise" | grep -E "cuda|cublas|curand|nvrtc|not found" | tee -a "$logs/gpu.txt"
    # The GPU tests (cuda_parity's #[ignore]d comparisons on the device).
    stage gpu-tests 90 "$dir/turnwise_model_tests" cuda_parity --include-ignored --test-threads 1
    # The model bench on the GPU against PyTorch + transformers on the same GPU (quick mode).
    TURNWISE_BENCH_DEVICE=cuda TURNWISE_BENCH_QUICK=1 TURNWISE_BENCH_TORCH_SCRIPT="$dir/model_torch.py" \
        stage bench-cuda 150 "$dir/model_bench"
    # A short quickstart on the GPU, then the same run on this machine's CPU cores.
    local short=(--set sft.steps=200 --set run.steps=4 --set run.save_every=4
        --set eval.questions=100 --set task.world.questions.test=100)
    local work
    work=$(mktemp -d)
    stage quickstart-cuda 150 "$dir/turnwise" train --preset quickstart "${short[@]}" \
        --set 'model.device="cuda"' --out "$work/cuda"
    cp "$work/cuda/metrics.jsonl" "$logs/quickstart-cuda-metrics.jsonl" 2>/dev/null
    # The trained run served from the GPU: one completion over the OpenAI route.
    stage serve-cuda 60 bash -c '
        "$1" serve --model "$2" --device cuda --addr 127.0.0.1:30111 & pid=$!
        python3 - <<PY
import json, time, urllib.request
base = "http://127.0.0.1:30111"
for _ in range(40):
    try:
        urllib.request.urlopen(base + "/health", timeout=2)
        break
    except Exception:
        time.sleep(1)
body = json.dumps({"prompt": "Who founded", "max_tokens": 16, "temperature": 0}).encode()
req = urllib.request.Request(base + "/v1/completions", body, {"content-type": "application/json"})
t0 = time.perf_counter()
print(urllib.request.urlopen(req, timeout=30).read().decode())
print(f"answered in {time.perf_counter() - t0:.3f} s")
PY
        rc=$?
        kill $pid
        exit $rc' _ "$dir/turnwise" "$work/cuda"
    stage quickstart-cpu 90 "$dir/turnwise" train --preset quickstart "${short[@]}" \
        --out "$work/cpu"
    cp "$work/cpu/metrics.jsonl" "$logs/quickstart-cpu-metrics.jsonl" 2>/dev/null
    cat "$logs/summary.txt"
}

case "$mode" in
    build) build ;;
    run) run ;;
    all) build && run ;;
esac
