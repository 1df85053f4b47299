"""The API example of crates/turnwise-py/README.md runs as written."""

import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})
