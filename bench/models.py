"""Benchmark models: a qwen35 hybrid of realistic shape for a CPU, with planted
weights whose MTP acceptance is dialled by noise on the MTP head (on the rows of the
first MTP_NOISE_VOCAB tokens: a trained head guesses wrong among plausible tokens).

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
import re
from dataclasses import asdict
from pathlib import Path

from llama_mtp.tiny import TinySpec, calibrate_mtp_noise, predicted_acceptance, write_tiny_model

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("LLAMA_MTP_BENCH_CACHE") or HERE / ".cache")

WORDS = " ".join(f"word{i}" for i in range(400)) + "."
#: The MTP head's noise (what sets acceptance) lies on the first this many token rows: a
#: trained head's wrong guesses are plausible, frequent tokens, not any of the 32000.
#: (Until 2026-12-06 23:30 it lay on every row: then a reduced draft vocabulary, which cannot
#: guess the rare tokens, drafted *better* than the full head -- 0.82 vs 0.73 acceptance
#: at ~75% -- which says nothing about real models.) Within the planted words (ids < 700)
#: and DRAFT_VOCAB_AUTO, so the reduced and the full head draft the same tokens here.
MTP_NOISE_VOCAB = 4096
PROMPT = "word0 word1 word2 word3"
#: sentence pieces between the windows of one prompt's parallel sequences. Copies of one
#: prompt decoded greedily run in lockstep -- every draft accepted or rejected by all of
#: them at once, which no real batch does (and which favours fixed draft lengths: their
#: rows stay level whatever is rejected) -- so sequence j starts SPREAD * j pieces on.
SPREAD = 5


def spread(prompt: str, j: int) -> str:
    """Parallel sequence ``j``'s prompt: ``prompt`` moved ``SPREAD * j`` pieces along the planted text."""
    n = len(WORDS.split())
    return re.sub(r"word(\d+)", lambda m: f"word{(int(m.group(1)) + SPREAD * j) % n}", prompt)

#: Model sizes (shape overrides of ``base_spec``). "0.3b" is the CPU benchmark model;
#: "1.6b" a Qwen3.5-2B-like layer mix (24 layers, 18 Gated-DeltaNet + 6 attention,
#: n_embd 2048, n_ff 6144, 16 key/value heads) for GPUs, where a 0.3B model measures
#: little but kernel-launch overhead. Same vocabulary and planted sentence.
SIZES: dict[str, dict[str, object]] = {
    "0.3b": {},
    "1.6b": dict(n_embd=2048, n_layer=24, n_ff=6144, n_head=16, n_head_kv=4,
                 ssm_groups=16, ssm_rank=16, name="llama-mtp bench qwen35 1.6B"),
}


def base_spec(size: str = "0.3b", **kw: object) -> TinySpec:
    spec = dict(
        n_vocab=32000, n_embd=1024, n_layer=12, attn_interval=4, n_ff=2816,
        n_head=8, n_head_kv=2, head_dim=128,
        ssm_state=128, ssm_groups=8, ssm_rank=8, ssm_conv=4,
        n_ctx_train=8192, trunk_scale=0.02, logit_scale=14.0, dtype="f16", text=WORDS, mtp_noise_vocab=MTP_NOISE_VOCAB,
        seed=20261202, name="llama-mtp bench qwen35 0.3B",
    )
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; one of {sorted(SIZES)}")
    spec.update(SIZES[size])
    spec.update(kw)
    return TinySpec(**spec)  # type: ignore[arg-type]


def n_params(spec: TinySpec) -> int:
    """Parameters of a written model (every tensor, the MTP layer included)."""
    E, F, d = spec.n_embd, spec.n_ff, spec.head_dim
    key_dim, value_dim = spec.ssm_state * spec.ssm_groups, spec.ssm_state * spec.ssm_rank
    ffn = 3 * E * F
    attn = 2 * d * spec.n_head * E + 2 * d * spec.n_head_kv * E + E * d * spec.n_head
    gdn = (2 * key_dim + value_dim) * E + 2 * value_dim * E + 2 * spec.ssm_rank * E
    trunk = sum(ffn + (gdn if spec.is_recurrent(i) else attn) for i in range(spec.n_layer))
    mtp = (ffn + attn + 2 * E * E + spec.n_vocab * E) if spec.mtp else 0
    return 2 * spec.n_vocab * E + trunk + mtp


def mtp_noise_for(acceptance: float, draft_max: int = 3, size: str = "0.3b", **kw: object) -> tuple[float, float]:
    """(mtp_noise, predicted acceptance) for one acceptance level, calibrated once and cached
    (``calibration-<key>.json`` in the cache: a few seconds for the 0.3B model, a minute at 1.6B)."""
    spec = base_spec(size, **kw)
    base_key = hashlib.sha256(json.dumps([asdict(spec), acceptance, draft_max], sort_keys=True).encode()).hexdigest()[:12]
    memo = CACHE / f"calibration-{base_key}.json"
    if memo.exists():
        got = json.loads(memo.read_text())
        return float(got["mtp_noise"]), float(got.get("predicted", acceptance))
    noise = calibrate_mtp_noise(spec, acceptance, draft_max) if acceptance < 0.999 else 0.0
    predicted = predicted_acceptance(TinySpec(**{**asdict(spec), "mtp_noise": round(noise, 5)}), draft_max)
    CACHE.mkdir(parents=True, exist_ok=True)
    memo.write_text(json.dumps({"acceptance": acceptance, "draft_max": draft_max, "mtp_noise": noise,
                                "predicted": predicted}))
    return noise, predicted


def bench_model(acceptance: float, draft_max: int = 3, size: str = "0.3b",
                **kw: object) -> tuple[Path, TinySpec, float]:
    """(path, spec, predicted acceptance) of the benchmark model for one acceptance level."""
    noise, predicted = mtp_noise_for(acceptance, draft_max, size, **kw)
    spec = TinySpec(**{**asdict(base_spec(size, **kw)), "mtp_noise": round(noise, 5)})
    key = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    tag = "" if size == "0.3b" else f"{size}-"
    path = _written(CACHE / f"bench-{tag}{int(round(acceptance * 100))}-{key}.gguf", spec)
    return path, spec, predicted


def blind_model(name: str, blind: tuple[int, int], size: str = "0.3b", **kw: object) -> tuple[Path, TinySpec, float]:
    """A benchmark model whose MTP head mispredicts the sentence pieces ``blind``
    (``[a, b)``): acceptance ~1 outside them, 0 inside -- ``(0, 401)`` is a 0%
    model, a range inside the generated span one whose acceptance changes
    mid-generation."""
    spec = TinySpec(**{**asdict(base_spec(size, **kw)), "mtp_blind": blind})
    key = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    tag = "" if size == "0.3b" else f"{size}-"
    path = _written(CACHE / f"bench-{tag}{name}-{key}.gguf", spec)
    return path, spec, predicted_acceptance(spec, 3)


#: the adaptive benchmark's models whose MTP head mispredicts a span of the sentence:
#: everywhere ("0": acceptance 0), or pieces 40..89 ("shift": ~1, then 0, then ~1 again)
BLIND = {"0": (0, 401), "shift": (40, 90)}


def _written(path: Path, spec: TinySpec) -> Path:
    """``path``, written from ``spec`` first unless it is cached (atomically: no half files)."""
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        write_tiny_model(tmp, spec)
        os.replace(tmp, path)
    return path


if __name__ == "__main__":
    import argparse
    import time

    ap = argparse.ArgumentParser(description="write (or find cached) the benchmark models")
    ap.add_argument("--size", default="0.3b", choices=sorted(SIZES))
    ap.add_argument("--levels", default="50,75,97",
                    help="acceptance levels in percent; 0 and shift: the adaptive benchmark's blind models")
    ap.add_argument("--calibrate-only", action="store_true", help="compute the MTP noise of each level, write no model")
    a = ap.parse_args()
    print(f"size {a.size}: {n_params(base_spec(a.size)) / 1e9:.2f}B parameters")
    for name in a.levels.split(","):
        t0 = time.time()
        if name in BLIND:
            if not a.calibrate_only:
                p, s, pred = blind_model(name, BLIND[name], size=a.size)
                print(f"{name}: {p} ({p.stat().st_size / 1e6:.0f} MB, {time.time() - t0:.1f} s)")
            continue
        level = int(name) / 100
        if a.calibrate_only:
            noise, pred = mtp_noise_for(level, size=a.size)
            print(f"{level:.2f}: mtp_noise {noise:.5f}, predicted {pred:.3f} ({time.time() - t0:.1f} s)")
            continue
        p, s, pred = bench_model(level, size=a.size)
        print(f"{level:.2f}: {p} ({p.stat().st_size / 1e6:.0f} MB, mtp_noise {s.mtp_noise}, predicted {pred:.3f}, "
              f"{time.time() - t0:.1f} s)")
