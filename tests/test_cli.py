"""The click CLI: every command, its JSON, and its error paths."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from llama_mtp.cli import main

JSON_KEYS = {"text", "tokens", "finish_reason", "stats", "timings"}
STATS_KEYS = {"draft_n", "draft_n_accepted", "acceptance_rate", "mean_accepted_length", "accepted_per_position", "steps"}
TIMING_KEYS = {"prompt_ms", "predicted_ms", "predicted_per_second"}


def run(*args: str, input: str | None = None):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False, standalone_mode=False)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the real entry point, so exit codes and stderr are what a user sees."""
    return subprocess.run([sys.executable, "-m", "llama_mtp", *args], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.fixture
def demo_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLAMA_MTP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_generate_on_the_demo_model(demo_cache: Path) -> None:
    out = cli("generate", "-p", "Multi-token prediction", "-n", "24", "--temp", "0", cwd=demo_cache)
    assert out.returncode == 0, out.stderr
    assert "drafts several tokens ahead" in out.stdout
    assert "built-in demo model" in out.stderr
    assert "tok/s" in out.stderr and "drafts accepted" in out.stderr and "mean accepted length" in out.stderr


def test_generate_json_schema(model_path, tmp_path: Path) -> None:
    out = cli("generate", "-m", str(model_path("planted")), "-p", "the model", "-n", "12", "--temp", "0", "--json",
              "--draft-max", "3", cwd=tmp_path)  # fixed k: 'auto' may rightly not draft on a tiny model
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(lines) == 1
    d = lines[0]
    assert JSON_KEYS <= set(d) and STATS_KEYS <= set(d["stats"]) and TIMING_KEYS <= set(d["timings"])
    assert len(d["tokens"]) == 12 and d["finish_reason"] == "length"
    assert d["stats"]["acceptance_rate"] == 1.0


def test_generate_parallel_and_file(model_path, tmp_path: Path) -> None:
    f = tmp_path / "prompts.txt"
    f.write_text("Multi-token prediction\nthe model\n\none pass\n")
    out = cli("generate", "-m", str(model_path("trunk")), "-f", str(f), "-n", "10", "--temp", "0", "--json",
              "--parallel", "2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2] and all(len(r["tokens"]) == 10 for r in rows)
    assert "3 sequences" in out.stderr
    out = cli("generate", "-m", str(model_path("trunk")), "-p", "one", "-n", "6", "--parallel", "3", "--seed", "4",
              cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.count("--- [") == 3


def test_generate_with_a_draft_vocabulary(model_path, tmp_path: Path) -> None:
    """--draft-vocab N drafts from the first N ids (plus the text's tokens): same text as
    --draft-vocab all, and drafts still land on the planted model."""
    outs = []
    for dv in ("400", "all"):  # the planted pieces are ids 269..394
        out = cli("generate", "-m", str(model_path("planted")), "-p", "the model", "-n", "20", "--temp", "0",
                  "--json", "--draft-max", "3", "--draft-vocab", dv, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        outs.append(json.loads(out.stdout))
    assert outs[0]["tokens"] == outs[1]["tokens"]
    assert outs[0]["stats"]["acceptance_rate"] == outs[1]["stats"]["acceptance_rate"] == 1.0


def test_stream_equals_no_stream(model_path, tmp_path: Path) -> None:
    args = ["generate", "-m", str(model_path("trunk")), "-p", "Multi-token prediction", "-n", "30", "--seed", "3"]
    a = cli(*args, "--stream", cwd=tmp_path)
    b = cli(*args, "--no-stream", cwd=tmp_path)
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout and a.stdout.strip()


def test_no_mtp_and_ngram(model_path, tmp_path: Path) -> None:
    out = cli("generate", "-m", str(model_path("trunk")), "-p", "one", "-n", "8", "--no-mtp", cwd=tmp_path)
    assert out.returncode == 0 and "plain decoding" in out.stderr
    out = cli("generate", "-m", str(model_path("trunk")), "-p", "one", "-n", "40", "--ngram", "--temp", "0", cwd=tmp_path)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["generate", "-m", "missing.gguf", "-p", "x"], 1, "model file not found"),
        (["generate", "-m", ".", "-p", "x"], 1, "is a directory"),
        (["generate", "-m", "{notgguf}", "-p", "x"], 1, "not a GGUF file"),
        (["generate", "-m", "{nomtp}", "-p", "x"], 1, "--no-mtp"),
        (["generate", "-n", "0"], 2, "max-tokens"),
        (["generate", "-n", "lots"], 2, "max-tokens"),
        (["generate", "--temp", "-1"], 2, "temp"),
        (["generate", "--top-p", "1.5"], 2, "top-p"),
        (["generate", "--draft-max", "-2"], 2, "draft-max"),
        (["generate", "--verify", "maybe"], 2, "verify"),
        (["generate", "--draft-vocab", "0"], 2, "draft-vocab"),
        (["generate", "--draft-vocab", "some"], 2, "draft-vocab"),
        (["generate", "-m", "{nomtp}"], 2, "give a prompt"),
        (["bench", "--draft-max", "3-1"], 2, "draft-max"),
        (["bench", "--verify", "nope"], 2, "verify"),
        (["bench", "--draft-vocab", "auto,none"], 2, "draft-vocab"),
        (["info", "-m", "missing.gguf"], 1, "model file not found"),
        (["frobnicate"], 2, "No such command"),
    ],
)
def test_error_paths(args: list[str], code: int, needle: str, model_path, tmp_path: Path) -> None:
    notgguf = tmp_path / "notgguf.gguf"
    notgguf.write_bytes(b"PK\x03\x04 definitely a zip")
    args = [a.format(notgguf=notgguf, nomtp=model_path("nomtp")) for a in args]
    out = cli(*args, cwd=tmp_path)
    assert out.returncode == code, (out.stdout, out.stderr)
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.count("\n") <= 2  # one clear line (plus the demo-model note at most)


def test_info(model_path, tmp_path: Path) -> None:
    out = cli("info", "--json", cwd=tmp_path)
    assert out.returncode == 0
    d = json.loads(out.stdout)
    assert d["llama_cpp_commit"].startswith("0c1e570") and "CPU" in d["backends"]
    out = cli("info", "-m", str(model_path("planted")), "--json", cwd=tmp_path)
    m = json.loads(out.stdout)["model"]
    assert m["arch"] == "qwen35" and m["mtp"] is True and m["n_layer_nextn"] == 1
    assert m["memory"].startswith("hybrid") and m["partial_rollback"] == "n_rs_seq snapshots"
    out = cli("info", "-m", str(model_path("nomtp")), cwd=tmp_path)
    assert out.returncode == 0 and "no MTP" in out.stdout


def test_bench(model_path, tmp_path: Path) -> None:
    out = cli("bench", "-m", str(model_path("planted")), "--draft-max", "1,3", "--parallel", "1,2", "-n", "16",
              "-r", "1", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert [(r["mode"], r["draft_max"], r["parallel"]) for r in rows] == [
        ("plain", 0, 1), ("mtp", 1, 1), ("mtp", 3, 1), ("plain", 0, 2), ("mtp", 1, 2), ("mtp", 3, 2)]
    assert all(r["tok_s"] > 0 for r in rows)
    assert rows[0]["speedup"] == 1.0 and rows[2]["acceptance"] == 1.0 and rows[2]["mean_len"] > 3
    out = cli("bench", "-m", str(model_path("planted")), "--draft-max", "2", "-n", "8", "-r", "1", cwd=tmp_path)
    assert out.returncode == 0 and "speedup" in out.stdout
    out = cli("bench", "-m", str(model_path("planted")), "--draft-max", "3", "--draft-vocab", "400,all", "-n", "12",
              "-r", "1", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert [(r["mode"], r["draft_vocab"]) for r in rows] == [("plain", "-"), ("mtp", "400"), ("mtp", "all")]
    assert rows[1]["acceptance"] == rows[2]["acceptance"] == 1.0


def test_bench_plot(model_path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "b.png"
    out = cli("bench", "-m", str(model_path("planted")), "--draft-max", "1-2", "-n", "8", "-r", "1", "--plot", str(png),
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_make_demo_model(tmp_path: Path) -> None:
    out = tmp_path / "demo.gguf"
    r = run("make-demo-model", str(out))
    assert r.exit_code == 0 and out.read_bytes()[:4] == b"GGUF"


def test_version(tmp_path: Path) -> None:
    out = cli("--version", cwd=tmp_path)
    assert out.returncode == 0 and "llama-mtp" in out.stdout
