"""The package's typing and version: the installed package ships ``py.typed`` (PEP 561) and a
stub ``_native.pyi`` that names exactly what the native module exports, with each function's
parameters (names, defaults) as PyO3 declares them; ``turnwise.__version__`` is the crate's
version (Cargo.toml), the one version source."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import re
from pathlib import Path

import turnwise
from turnwise import _native

PACKAGE = Path(turnwise.__file__).resolve().parent
CRATE = Path(__file__).resolve().parents[2]


def _stub() -> ast.Module:
    return ast.parse((PACKAGE / "_native.pyi").read_text(encoding="utf-8"))


def _stub_names(stub: ast.Module) -> set[str]:
    names = set()
    for node in stub.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _stub_all(stub: ast.Module) -> list[str]:
    for node in stub.body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]:
            return list(ast.literal_eval(node.value))
    raise AssertionError("the stub has no __all__")


def _native_names() -> set[str]:
    names = {n for n in dir(_native) if not n.startswith("_")}
    names.add("__version__")
    return names


def test_the_wheel_ships_py_typed_and_the_stub():
    assert (PACKAGE / "py.typed").is_file()
    assert (PACKAGE / "_native.pyi").is_file()


def test_the_stub_names_exactly_the_native_modules_exports():
    stub, native = _stub_names(_stub()), _native_names()
    assert stub == native, (
        f"in the module, not the stub: {sorted(native - stub)}; "
        f"in the stub, not the module: {sorted(stub - native)}"
    )
    # PyO3 lists what it adds in the module's `__all__`: the stub's `__all__` is that list.
    assert set(_native.__all__) == native
    assert _stub_all(_stub()) == list(_native.__all__)


def test_each_stub_function_has_the_native_parameters():
    checked = 0
    for node in _stub().body:
        if not isinstance(node, ast.FunctionDef):
            continue
        func = getattr(_native, node.name)
        if getattr(func, "__text_signature__", None) is None:
            continue
        runtime = inspect.signature(func).parameters
        args = node.args
        params = args.posonlyargs + args.args + args.kwonlyargs
        assert [p.arg for p in params] == list(runtime), node.name
        # Defaults: the stub's literal equals PyO3's (`fill=0.0`, `beta=0.3`, `None`).
        positional = args.posonlyargs + args.args
        with_default = positional[len(positional) - len(args.defaults) :]
        defaults = {p.arg: d for p, d in zip(with_default, args.defaults)}
        defaults.update(
            {p.arg: d for p, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}
        )
        for name, p in runtime.items():
            if p.default is inspect.Parameter.empty:
                assert name not in defaults, f"{node.name}: {name} has no default in the module"
            else:
                assert name in defaults, f"{node.name}: {name} lacks its default in the stub"
                assert ast.literal_eval(defaults[name]) == p.default, f"{node.name}: {name}"
        checked += 1
    # Every export but `__version__` is a function with a text signature.
    assert checked == len(_native_names()) - 1


def _cargo_version() -> str:
    text = (CRATE / "Cargo.toml").read_text(encoding="utf-8")
    package = text.split("[package]", 1)[1].split("\n[", 1)[0]
    m = re.search(r'^version\s*=\s*"([^"]+)"', package, re.M)
    assert m, "Cargo.toml's [package] has no version"
    return m.group(1)


def test_the_version_has_one_source_the_crates():
    version = _cargo_version()
    assert turnwise.__version__ == version
    assert _native.__version__ == version
    assert importlib.metadata.version("turnwise") == version
    # pyproject.toml takes it from Cargo.toml (maturin) rather than stating its own.
    pyproject = (CRATE / "pyproject.toml").read_text(encoding="utf-8")
    project = pyproject.split("[project]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^dynamic\s*=\s*\[[^\]]*"version"', project, re.M), "dynamic version"
    assert not re.search(r"^version\s*=", project, re.M), "pyproject.toml states a version"
