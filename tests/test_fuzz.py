"""GGUF fuzzing: thousands of mutated files, each loaded and used in a subprocess
harness. Zero crashes; every load failure is a ModelLoadError."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llama_mtp.tiny import write_tiny_model

HERE = Path(__file__).resolve().parent


def fuzz(model: Path, n_cases: int, seed: int, work: Path) -> dict:  # type: ignore[type-arg]
    outcomes: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    crashes: list[dict] = []  # type: ignore[type-arg]
    case = 0
    while case < n_cases:
        env = {**os.environ, "GGML_NO_BACKTRACE": "1"}  # a crash should not spend time attaching gdb
        proc = subprocess.run([sys.executable, str(HERE / "gguf_fuzz.py"), str(model), str(case), str(n_cases),
                               str(seed), str(work)], capture_output=True, text=True, timeout=1800, cwd=work, env=env)
        # (a hang would show up as this timeout: a finding, like a crash)
        started: dict[int, str] = {}
        for line in proc.stdout.splitlines():
            if not re.match(r"^\d+ ", line):
                continue
            num, rest = line.split(" ", 1)
            if rest.startswith("start "):
                started[int(num)] = rest[6:]
            else:
                outcomes[rest] += 1
                kinds[started.pop(int(num), "?")] += 1
                case = int(num) + 1
        if proc.returncode != 0:
            dead = min(started) if started else case
            crashes.append({"case": dead, "kind": started.get(dead, "?"), "returncode": proc.returncode,
                            "stderr": proc.stderr[-500:]})
            case = dead + 1
    return {"cases": n_cases, "outcomes": dict(outcomes), "kinds": dict(kinds), "crashes": crashes}


def _run(tmp_path: Path, n_cases: int, record_property) -> None:  # type: ignore[no-untyped-def]
    model = write_tiny_model(tmp_path / "seed.gguf", n_vocab=300, n_embd=32, head_dim=16, n_ff=64, text="fuzz me, please.")
    report = fuzz(model, n_cases, seed=20261202, work=tmp_path)
    record_property("fuzz", json.dumps(report)[:2000])
    (tmp_path / "fuzz-report.json").write_text(json.dumps(report, indent=2))
    assert report["crashes"] == [], report["crashes"][:3]
    untyped = {k: v for k, v in report["outcomes"].items() if k.startswith("untyped")}
    assert untyped == {}, untyped
    assert sum(report["outcomes"].values()) == n_cases
    assert report["outcomes"].get("load-error", 0) > n_cases // 10  # the mutations do break files


def test_fuzz_reduced(tmp_path: Path, record_property) -> None:  # type: ignore[no-untyped-def]
    _run(tmp_path, 400, record_property)


@pytest.mark.slow
def test_fuzz_full(tmp_path: Path, record_property) -> None:  # type: ignore[no-untyped-def]
    _run(tmp_path, 3000, record_property)
