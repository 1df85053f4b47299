#!/bin/bash
# `turnwise serve` answering n samples of one prompt in one /generate request, with the prompt's
# keys and values held once (cascade attention, the default) and copied per sample
# (--shared-prefix-attention false): wall time, the server's peak resident size, and what it
# holds after the answer (docs/scaling.md, "Serving: prefixes computed once across requests").
#
#   scripts/serve-n-samples.sh MODEL [N] [PROMPT_TOKENS] [NEW_TOKENS]
#
# MODEL: anything `turnwise serve --model` takes (a GGUF file, a checkpoint, smollm2-135m-instruct).
# Defaults: 64 samples of a 500-token prompt, 64 sampled tokens each (temperature 1, EOS ignored).
# TURNWISE (default: `turnwise` on PATH) is the binary; PORT (default 30123) its port.
set -euo pipefail
model=${1:?usage: scripts/serve-n-samples.sh MODEL [N] [PROMPT_TOKENS] [NEW_TOKENS]}
n=${2:-64}
prompt_tokens=${3:-500}
new_tokens=${4:-64}
bin=${TURNWISE:-turnwise}
port=${PORT:-30123}
ids=$(python3 -c "print(','.join(str(1000 + (i * 7919 + 314187) % 40000) for i in range($prompt_tokens)))")
post() { curl -sf "127.0.0.1:$port/generate" -H 'content-type: application/json' -d "$1"; }
for shared in true false; do
  "$bin" serve --model "$model" --addr "127.0.0.1:$port" --quiet --shared-prefix-attention "$shared" &
  pid=$!
  for _ in $(seq 1 120); do curl -sf "127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  post '{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}' > /dev/null
  t0=$(date +%s.%N)
  answers=$(post "{\"input_ids\": [$ids], \"sampling_params\": {\"n\": $n, \"max_new_tokens\": $new_tokens, \"temperature\": 1.0, \"ignore_eos\": true, \"sampling_seed\": 1}}" \
    | python3 -c "import json, sys; print(len(json.load(sys.stdin)))")
  t1=$(date +%s.%N)
  sleep 2
  # The binary re-executes itself with its allocator settings: the server may be the child.
  peak=0; held=0
  for p in $pid $(pgrep -P "$pid" || true); do
    h=$(awk '/VmHWM/ {print $2}' "/proc/$p/status" 2>/dev/null || echo 0)
    r=$(awk '/VmRSS/ {print $2}' "/proc/$p/status" 2>/dev/null || echo 0)
    [ "${h:-0}" -gt "$peak" ] && peak=$h && held=$r
  done
  python3 -c "print(f'--shared-prefix-attention $shared: {$answers} answers in {$t1 - $t0:.2f} s, peak {$peak / 2**20:.2f} GiB, held after {$held / 2**20:.2f} GiB')"
  kill "$pid"; wait "$pid" 2>/dev/null || true
done
