#!/usr/bin/env bash
# End-to-end check of the TRL integration (crates/turnwise-py/python/turnwise/trl.py): builds
# the `turnwise` wheel into a fresh virtual env with scripts/python-package.sh (which also runs
# the package's own tests there), adds the released TRL with pinned transformers, accelerate and
# datasets, and runs crates/turnwise-py/python/tests/trl on CPU: a tiny Llama and word-level
# tokenizer built by the tests, multi-turn Search-R1 rollouts against `turnwise
# serve-retriever`, a few TurnwiseGRPOTrainer steps. Any failure fails the script.
#
# Environment:
#   PYTHON            interpreter that creates the venv (default: python3; TRL 1.16 needs 3.11+)
#   TURNWISE_TRL_VENV the venv directory (default: target/trl-venv; deleted and recreated)
#   TURNWISE_TRL_REUSE_VENV=1  use TURNWISE_TRL_VENV as it is, as scripts/python-package.sh
#                     left it (the wheel, numpy, pytest, torch), and only add TRL to it: CI runs
#                     it so on target/py-venv right after scripts/python-package.sh
#   TURNWISE_BIN      the turnwise binary serving the retrieval index (default: target/debug/
#                     turnwise, else target/release/turnwise, else `cargo build` builds the debug one)
#   plus TURNWISE_TORCH_INDEX, as scripts/python-package.sh reads it
set -euo pipefail
cd "$(dirname "$0")/.."

# The versions the integration was written and tested against (turnwise.trl.TESTED_TRL_VERSION).
trl_pins=(trl==1.16.0 transformers==5.24.0 accelerate==1.15.0 datasets==5.2.0)

venv="${TURNWISE_TRL_VENV:-target/trl-venv}"
case "$venv" in /*) ;; *) venv="$(pwd)/$venv" ;; esac

if [[ "${TURNWISE_TRL_REUSE_VENV:-0}" == 1 ]]; then
    echo "== trl check: reusing $venv (the turnwise wheel, numpy, pytest and torch)"
    "$venv/bin/python" -c "import turnwise, torch"
else
    echo "== trl check: the turnwise wheel, numpy, pytest and torch in $venv (scripts/python-package.sh)"
    TURNWISE_PY_VENV="$venv" scripts/python-package.sh
fi

echo "== trl check: install ${trl_pins[*]}"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${trl_pins[@]}"

bin="${TURNWISE_BIN:-}"
if [[ -z "$bin" ]]; then
    for b in target/debug/turnwise target/release/turnwise; do
        if [[ -x "$b" ]]; then bin="$(pwd)/$b"; break; fi
    done
fi
if [[ -z "$bin" ]]; then
    echo "== trl check: no turnwise binary; cargo build --locked -p turnwise"
    cargo build --locked -p turnwise
    bin="$(pwd)/target/debug/turnwise"
fi
echo "retrieval server binary: $bin"

echo "== trl check: pytest crates/turnwise-py/python/tests/trl"
tests="$(pwd)/crates/turnwise-py/python/tests/trl"
start=$(date +%s)
# From outside the source tree so that `import turnwise` is the installed wheel. The tests must
# not skip (TURNWISE_TRL_REQUIRED) and must use turnwise's retrieval server, not the Python
# stand-in (TURNWISE_TRL_REQUIRE_BINARY).
(cd "$venv" && TURNWISE_TRL_REQUIRED=1 TURNWISE_TRL_REQUIRE_BINARY=1 TURNWISE_BIN="$bin" \
    TRL_EXPERIMENTAL_SILENCE=1 CUDA_VISIBLE_DEVICES="" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider --import-mode=importlib -W ignore::FutureWarning "$tests")
echo "trl tests: $(($(date +%s) - start)) s; venv $(du -sh "$venv" | cut -f1)"
