#!/usr/bin/env bash
# The verl integration (crates/turnwise-py/python/turnwise/verl) against the released verl, in
# its own virtual env: verl 0.9.1 pins transformers < 5.11 (the TRL check pins 5.24), and pulls
# ray, wandb and tensorboard. Installs verl==0.9.1 (plus cachetools, uvicorn and fastapi, which
# verl 0.9.1 imports without declaring them), CPU-usable torch, pytest and the `turnwise`
# wheel, then runs crates/turnwise-py/python/tests/verl on CPU: verl's compute_advantage and
# policy-loss registries on verl's DataProto batches, IGPO's information-gain probes through
# verl's RayPPOTrainer._compute_old_log_prob, and the recipe of examples/verl (its search tool
# through verl's function-tool loader against `turnwise serve-retriever`, its overrides
# composed with verl's hydra config). Any failure fails the script.
#
# Environment:
#   PYTHON             interpreter that creates the venv (default: python3; verl needs 3.10+)
#   TURNWISE_VERL_VENV the venv directory (default: target/verl-venv; deleted and recreated)
#   TURNWISE_WHEEL     a built turnwise wheel (default: target/py-wheels/turnwise-*.whl as
#                      scripts/python-package.sh leaves it, else maturin builds one)
#   TURNWISE_VENV_SYSTEM_SITE=1  create the venv with --system-site-packages and install torch
#                      only when the interpreter has none (CI sets it: two torch installs do not
#                      fit its disk); verl's pins install into the venv and shadow the system's
#   TURNWISE_BIN       the turnwise binary for the retrieval server (default: target/debug/
#                      turnwise, else target/release/turnwise, else `cargo build` builds it)
set -euo pipefail
cd "$(dirname "$0")/.."

# The versions the integration was written and tested against (turnwise.verl.TESTED_VERL_VERSION).
verl_pins=(verl==0.9.1 cachetools uvicorn fastapi)

python="${PYTHON:-python3}"
venv="${TURNWISE_VERL_VENV:-target/verl-venv}"
case "$venv" in /*) ;; *) venv="$(pwd)/$venv" ;; esac
pip_flags=(--quiet --disable-pip-version-check)

echo "== verl check: fresh venv at $venv"
start=$(date +%s)
rm -rf "$venv"
venv_flags=()
if [[ "${TURNWISE_VENV_SYSTEM_SITE:-0}" == 1 ]]; then venv_flags=(--system-site-packages); fi
"$python" -m venv "${venv_flags[@]}" "$venv"
vpy="$venv/bin/python"
"$vpy" -m pip install "${pip_flags[@]}" --upgrade pip

wheel="${TURNWISE_WHEEL:-}"
if [[ -z "$wheel" ]]; then
    wheel=$(ls target/py-wheels/turnwise-*.whl 2>/dev/null | head -1 || true)
fi
if [[ -z "$wheel" ]]; then
    echo "== verl check: no turnwise wheel; maturin build --release"
    "$vpy" -m pip install "${pip_flags[@]}" "maturin>=1.9,<2"
    "$venv/bin/maturin" build --release --locked -m crates/turnwise-py/Cargo.toml --interpreter "$vpy" \
        --out target/py-wheels
    wheel=$(ls target/py-wheels/turnwise-*.whl | head -1)
fi

torch_req=(torch)
if "$vpy" -c "import torch" 2>/dev/null; then torch_req=(); fi
echo "== verl check: install ${verl_pins[*]}, ${torch_req[*]:-(torch from the system site)} pytest and $wheel"
"$vpy" -m pip install "${pip_flags[@]}" "${verl_pins[@]}" "${torch_req[@]}" pytest "$wheel"
"$vpy" -c "import verl, turnwise.verl as tv; assert verl.__version__ == tv.TESTED_VERL_VERSION, verl.__version__"
echo "installed in $(($(date +%s) - start)) s"

bin="${TURNWISE_BIN:-}"
if [[ -z "$bin" ]]; then
    for b in target/debug/turnwise target/release/turnwise; do
        if [[ -x "$b" ]]; then bin="$(pwd)/$b"; break; fi
    done
fi
if [[ -z "$bin" ]]; then
    echo "== verl check: no turnwise binary; cargo build --locked -p turnwise"
    cargo build --locked -p turnwise
    bin="$(pwd)/target/debug/turnwise"
fi
echo "retrieval server binary: $bin"

echo "== verl check: pytest crates/turnwise-py/python/tests/verl"
tests="$(pwd)/crates/turnwise-py/python/tests/verl"
start=$(date +%s)
# From outside the source tree so that `import turnwise` is the installed wheel; the tests must
# not skip (TURNWISE_VERL_REQUIRED).
(cd "$venv" && TURNWISE_VERL_REQUIRED=1 TURNWISE_BIN="$bin" CUDA_VISIBLE_DEVICES="" RAY_USAGE_STATS_ENABLED=0 \
    "$vpy" -m pytest -q -p no:cacheprovider --import-mode=importlib -W ignore::UserWarning \
    -W ignore::DeprecationWarning -W ignore::FutureWarning "$tests")
echo "verl tests: $(($(date +%s) - start)) s; venv $(du -sh "$venv" | cut -f1)"
