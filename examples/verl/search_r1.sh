#!/usr/bin/env bash
# Search-R1-style multi-turn RL in verl with turnwise's A2TGPO and turnwise's retrieval server.
#
#   examples/verl/search_r1.sh MODEL [WORK] [verl overrides ...]
#
# 1. `turnwise data world` writes a multi-hop world (corpus and question splits, Search-R1's
#    formats); `turnwise index` + `turnwise serve-retriever` serve its corpus on
#    127.0.0.1:$PORT (default 8000) with Search-R1's protocol.
# 2. `python -m turnwise.verl.data` turns the splits into verl's parquet rows (chat prompt,
#    ground truths, verl's tool agent loop).
# 3. `python -m turnwise.verl.trainer` runs verl's PPO trainer with the overrides of
#    examples/verl/search_r1_a2tgpo.overrides, then yours: the search tool of
#    examples/verl/search_tool.py (a verl function tool calling the retrieval server), the EM
#    reward of examples/verl/reward.py, turnwise_a2tgpo's estimator and loss, and IGPO's
#    information-gain probes through verl's actor workers.
#
# Needs a verl 0.9.1 environment with its rollout engine (SGLang by default) on GPUs
# (trainer.n_gpus_per_node=8 by default; override it), the `turnwise` wheel installed there
# (scripts/python-package.sh builds it) and the turnwise binary ($TURNWISE, default `turnwise`
# on PATH). Environment: PORT, TURNWISE, PYTHON (default python3).
set -euo pipefail

if [[ $# -lt 1 ]]; then
    sed -n '2,20p' "$0"
    exit 2
fi
here="$(cd "$(dirname "$0")" && pwd)"
model="$1"
work="${2:-runs/verl-search-r1}"
shift $(($# >= 2 ? 2 : 1))
bin="${TURNWISE:-turnwise}"
py="${PYTHON:-python3}"
port="${PORT:-8000}"
mkdir -p "$work"
work="$(cd "$work" && pwd)"

echo "== world, index and retrieval server (127.0.0.1:$port)"
"$bin" -q data world --out "$work/world"
"$bin" -q index --corpus "$work/world/corpus.jsonl" --out "$work/index"
"$bin" -q serve-retriever --index "$work/index" --addr "127.0.0.1:$port" --topk 3 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
    if "$py" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null; then
        break
    fi
    sleep 0.2
done

echo "== verl data"
for split in train validation; do
    "$py" -m turnwise.verl.data "$work/world/$split.jsonl" "$work/data/$split.parquet"
done

echo "== verl + turnwise"
overrides=()
while IFS= read -r line; do
    [[ -z "$line" || "$line" == \#* ]] && continue
    line="${line//\{DATA\}/$work/data}"
    line="${line//\{MODEL\}/$model}"
    line="${line//\{EXAMPLES\}/$here}"
    overrides+=("$line")
done < "$here/search_r1_a2tgpo.overrides"
export TURNWISE_RETRIEVER_URL="http://127.0.0.1:$port/retrieve"
"$py" -m turnwise.verl.trainer "${overrides[@]}" "trainer.default_local_dir=$work/checkpoints" "$@"
