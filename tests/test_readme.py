"""Every ```python block of the README runs as written (on the built-in demo model)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_example_runs(i: int, tmp_path: Path) -> None:
    script = tmp_path / f"example_{i}.py"
    script.write_text(BLOCKS[i], encoding="utf-8")
    env = {"LLAMA_MTP_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    # where the package and its GPU runtime were put by hand (pip --target, a CUDA toolkit)
    env.update({k: os.environ[k] for k in ("PYTHONPATH", "LD_LIBRARY_PATH") if k in os.environ})
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()
