"""Benchmark models: a qwen35 hybrid of realistic shape for a CPU, with planted
weights whose MTP acceptance is dialled by noise on the MTP head.

Shape (about 0.3B parameters, F16): 12 trunk layers (9 Gated-DeltaNet, 3 attention),
n_embd 1024, n_ff 2816, vocab 32000, one MTP layer -- a Qwen3.5-0.8B-like layer
mix at half the depth. The trunk stays almost silent (``trunk_scale`` 0.02):
louder, and the MTP head (which ignores the trunk's hidden state here) loses
track and acceptance collapses. Acceptance is set with ``mtp_noise``, calibrated
in numpy (``llama_mtp.tiny.calibrate_mtp_noise``) before the file is written.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from llama_mtp.tiny import TinySpec, calibrate_mtp_noise, predicted_acceptance, write_tiny_model

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("LLAMA_MTP_BENCH_CACHE") or HERE / ".cache")

WORDS = " ".join(f"word{i}" for i in range(400)) + "."
PROMPT = "word0 word1 word2 word3"


def base_spec(**kw: object) -> TinySpec:
    spec = dict(
        n_vocab=32000, n_embd=1024, n_layer=12, attn_interval=4, n_ff=2816,
        n_head=8, n_head_kv=2, head_dim=128,
        ssm_state=128, ssm_groups=8, ssm_rank=8, ssm_conv=4,
        n_ctx_train=8192, trunk_scale=0.02, logit_scale=14.0, dtype="f16", text=WORDS,
        seed=20261202, name="llama-mtp bench qwen35 0.3B",
    )
    spec.update(kw)
    return TinySpec(**spec)  # type: ignore[arg-type]


def bench_model(acceptance: float, draft_max: int = 3, **kw: object) -> tuple[Path, TinySpec, float]:
    """(path, spec, predicted acceptance) of the benchmark model for one acceptance level."""
    spec = base_spec(**kw)
    base_key = hashlib.sha256(json.dumps([asdict(spec), acceptance, draft_max], sort_keys=True).encode()).hexdigest()[:12]
    memo = CACHE / f"calibration-{base_key}.json"
    if memo.exists():
        noise = float(json.loads(memo.read_text())["mtp_noise"])
    else:
        noise = calibrate_mtp_noise(spec, acceptance, draft_max) if acceptance < 0.999 else 0.0
        CACHE.mkdir(parents=True, exist_ok=True)
        memo.write_text(json.dumps({"acceptance": acceptance, "draft_max": draft_max, "mtp_noise": noise}))
    spec = TinySpec(**{**asdict(spec), "mtp_noise": round(noise, 5)})
    key = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    path = _written(CACHE / f"bench-{int(round(acceptance * 100))}-{key}.gguf", spec)
    return path, spec, acceptance if memo.exists() else predicted_acceptance(spec, draft_max)


def blind_model(name: str, blind: tuple[int, int], **kw: object) -> tuple[Path, TinySpec, float]:
    """A benchmark model whose MTP head mispredicts the sentence pieces ``blind``
    (``[a, b)``): acceptance ~1 outside them, 0 inside -- ``(0, 401)`` is a 0%
    model, a range inside the generated span one whose acceptance changes
    mid-generation."""
    spec = TinySpec(**{**asdict(base_spec(**kw)), "mtp_blind": blind})
    key = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    path = _written(CACHE / f"bench-{name}-{key}.gguf", spec)
    return path, spec, predicted_acceptance(spec, 3)


def _written(path: Path, spec: TinySpec) -> Path:
    """``path``, written from ``spec`` first unless it is cached (atomically: no half files)."""
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        write_tiny_model(tmp, spec)
        os.replace(tmp, path)
    return path


if __name__ == "__main__":
    import time

    for level in (0.5, 0.75, 0.97):
        t0 = time.time()
        p, s, pred = bench_model(level)
        print(f"{level:.2f}: {p} ({p.stat().st_size / 1e6:.0f} MB, mtp_noise {s.mtp_noise}, predicted {pred:.3f}, "
              f"{time.time() - t0:.1f} s)")
