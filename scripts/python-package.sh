#!/usr/bin/env bash
# Builds the `turnwise` Python package (crates/turnwise-py: a PyO3 + maturin abi3 wheel) in a
# fresh virtual env, installs it with numpy, pytest, mypy and CPU torch, checks the native
# module's type stub with mypy's stubtest and runs its Python tests
# (crates/turnwise-py/python/tests). Any failure fails the script.
#
# Environment:
#   PYTHON               interpreter that creates the venv (default: python3; 3.9 or newer)
#   TURNWISE_PY_VENV     the venv directory (default: target/py-venv; deleted and recreated)
#   TURNWISE_TORCH_INDEX torch wheel index (default: PyTorch's CPU index; PyPI if unreachable)
#   TURNWISE_VENV_SYSTEM_SITE=1  create the venv with --system-site-packages, so that a torch
#                        the interpreter already has is used rather than installed a second time
#                        (CI sets it: two torch installs do not fit its disk)
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
venv="${TURNWISE_PY_VENV:-target/py-venv}"
case "$venv" in /*) ;; *) venv="$(pwd)/$venv" ;; esac
wheels="target/py-wheels"
torch_index="${TURNWISE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
pip_flags=(--quiet --disable-pip-version-check)

echo "== python package: fresh venv at $venv"
rm -rf "$venv" "$wheels"
venv_flags=()
if [[ "${TURNWISE_VENV_SYSTEM_SITE:-0}" == 1 ]]; then venv_flags=(--system-site-packages); fi
"$python" -m venv "${venv_flags[@]}" "$venv"
vpy="$venv/bin/python"
"$vpy" -m pip install "${pip_flags[@]}" --upgrade pip
"$vpy" -m pip install "${pip_flags[@]}" "maturin>=1.9,<2"

echo "== python package: maturin build --release"
start=$(date +%s)
"$venv/bin/maturin" build --release --locked -m crates/turnwise-py/Cargo.toml --interpreter "$vpy" \
    --out "$wheels"
wheel=$(ls "$wheels"/turnwise-*.whl)
echo "built $wheel ($(du -h "$wheel" | cut -f1), $(($(date +%s) - start)) s)"

echo "== python package: install the wheel, numpy, pytest, mypy and CPU torch"
"$vpy" -m pip install "${pip_flags[@]}" "$wheel" numpy pytest "mypy==2.4.1"
if "$vpy" -c "import torch" 2>/dev/null; then
    echo "torch $("$vpy" -c "import torch; print(torch.__version__)") is already there (system site)"
elif ! "$vpy" -m pip install "${pip_flags[@]}" --retries 1 --timeout 30 torch \
    --index-url "$torch_index"; then
    echo "torch from $torch_index failed; trying PyPI"
    "$vpy" -m pip install "${pip_flags[@]}" torch
fi

echo "== python package: mypy stubtest (python/turnwise/_native.pyi against the built module)"
# The wheel ships `py.typed` and the native module's stub; stubtest checks every name, parameter
# and default of the stub against the installed module (python/tests/test_typing.py checks the
# names and parameters too, without mypy). Run outside the source tree, as pytest below is.
(cd "$venv" && "$vpy" -m mypy.stubtest turnwise._native)

echo "== python package: pytest"
# Run from outside the source tree so that `import turnwise` is the installed wheel (the
# source package python/turnwise has no native module).
tests="$(pwd)/crates/turnwise-py/python/tests"
(cd "$venv" && "$vpy" -m pytest -q -p no:cacheprovider --import-mode=importlib "$tests")
