#!/usr/bin/env bash
# SmolLM2-135M training throughput, turnwise against PyTorch + transformers on the same GGUF
# weights (4 x 128 tokens: forward, backward, global-norm clip, AdamW), in alternating runs of
# one session: the figures of README ("Scaling") and docs/scaling.md ("Every core trains").
#
#   scripts/train-side-by-side.sh [RUNS [TORCH_RUNS]]     # default 5 and 3
#
# Each run is a fresh process: turnwise's model bench with TURNWISE_BENCH_FILTER="SmolLM2 train",
# then (for the first TORCH_RUNS) benches/model_torch.py --train-only. Both use
# RAYON_NUM_THREADS threads (default: the core count). Prints each run and the medians.
#
# An AVX2 CPU's code path on an AVX-512 machine: AVX2=1 builds the bench without the `avx512`
# feature (into target-avx2/), sets TURNWISE_KERNEL_ISA=avx2 for turnwise's own kernels and
# caps PyTorch's (ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2,
# ONEDNN_MAX_CPU_ISA=AVX2).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
torch_runs=${2:-3}
gguf=${TURNWISE_CACHE:-$HOME/.cache/turnwise}/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$gguf" ] || { echo "no $gguf: run \`turnwise eval --model smollm2-135m-instruct\` once to fetch it" >&2; exit 1; }
# transformers loads the GGUF file only with the gguf and accelerate packages; without them every
# PyTorch run would fail with its error hidden below.
if [ "$torch_runs" -gt 0 ] && ! python3 -c "import torch, transformers, gguf, accelerate" 2>/dev/null; then
    echo "the PyTorch side needs: python3 -m pip install torch transformers gguf accelerate" >&2
    exit 1
fi
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-$(nproc)} OMP_WAIT_POLICY=PASSIVE
flags=(--locked)
if [ "${AVX2:-0}" = 1 ]; then
    export CARGO_TARGET_DIR=target-avx2 TURNWISE_KERNEL_ISA=avx2
    export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
    flags+=(--no-default-features)
fi
bench=$(cargo bench -p turnwise-model --bench model --no-run "${flags[@]}" --message-format=json 2>/dev/null \
    | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "model":
        print(m["executable"])')
ours=() theirs=()
for i in $(seq 1 "$runs"); do
    t=$(TURNWISE_BENCH_FILTER="SmolLM2 train" "$bench" --bench 2>&1 | sed -n 's/.*train \([0-9.]*\) tok\/s.*/\1/p')
    echo "turnwise run $i: $t tokens/s"
    ours+=("$t")
    if [ "$i" -le "$torch_runs" ]; then
        j=$(python3 crates/turnwise-model/benches/model_torch.py --smollm2 "$gguf" --train-only 2>/dev/null | tail -1)
        t=$(echo "$j" | python3 -c 'import json,sys; print("%.1f" % json.load(sys.stdin)["SmolLM2"]["train"])')
        echo "PyTorch run $i: $t tokens/s ($(echo "$j" | python3 -c 'import json,sys; print(json.load(sys.stdin)["info"])'))"
        theirs+=("$t")
    fi
done
python3 - "${#ours[@]}" "${ours[@]}" "${theirs[@]}" <<'PY'
import statistics, sys
n = int(sys.argv[1]); ours = [float(x) for x in sys.argv[2:2 + n]]; theirs = [float(x) for x in sys.argv[2 + n:]]
a = statistics.median(ours)
print(f"median: turnwise {a:.0f} tokens/s", end="")
if theirs:
    b = statistics.median(theirs)
    print(f", PyTorch {b:.1f} tokens/s, ratio {a / b:.2f}x")
else:
    print()
PY
