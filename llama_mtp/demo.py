"""The built-in demo model: a small qwen35 MTP model the package writes itself.

Its weights are planted (see :mod:`llama_mtp.tiny`): the trunk continues a fixed
sentence about MTP, and the MTP head predicts the same, so drafts are almost all
accepted and the machinery can be tried without downloading anything. The
``bench`` variant has a heavier trunk, so that verifying several tokens in one
decode visibly pays off (as it does on real models). A trained tiny model may
replace it later.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Literal

from .tiny import TinySpec, write_tiny_model

__all__ = ["DEMO_SPECS", "cache_dir", "demo_model_path", "write_demo_model"]

Variant = Literal["small", "bench"]

DEMO_SPECS: dict[str, TinySpec] = {
    # a few MB: what `llama-mtp generate` uses without -m
    "small": TinySpec(n_vocab=512, n_embd=128, n_layer=4, n_ff=256, head_dim=32, n_head=4, n_head_kv=2,
                      trunk_scale=0.05, mtp_noise=0.02, logit_scale=14.0, dtype="f16", seed=20261202,
                      name="llama-mtp demo (small)"),
    # ~250 MB of F16 weights: big enough to be memory-bound on a CPU, as real
    # models are -- there, verifying 4 tokens costs little more than decoding 1
    "bench": TinySpec(n_vocab=4096, n_embd=1024, n_layer=8, n_ff=2816, head_dim=64, n_head=16, n_head_kv=4,
                      ssm_state=64, ssm_groups=4, ssm_rank=16, trunk_scale=0.02, mtp_noise=0.02,
                      logit_scale=14.0, dtype="f16", seed=20261203, name="llama-mtp demo (bench)"),
}


def cache_dir() -> Path:
    """Where the demo models live (``$LLAMA_MTP_CACHE_DIR`` or the user cache)."""
    if os.environ.get("LLAMA_MTP_CACHE_DIR"):
        return Path(os.environ["LLAMA_MTP_CACHE_DIR"]).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "llama-mtp"


def _key(spec: TinySpec) -> str:
    return hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]


def write_demo_model(path: str | os.PathLike[str], variant: Variant = "small") -> Path:
    """Write the demo model to ``path`` (deterministic: same bytes every time)."""
    if variant not in DEMO_SPECS:
        raise ValueError(f"variant must be one of {sorted(DEMO_SPECS)}, got {variant!r}")
    return write_tiny_model(path, DEMO_SPECS[variant])


def demo_model_path(variant: Variant = "small") -> Path:
    """The demo model's path, writing it into the cache on first use."""
    if variant not in DEMO_SPECS:
        raise ValueError(f"variant must be one of {sorted(DEMO_SPECS)}, got {variant!r}")
    spec = DEMO_SPECS[variant]
    path = cache_dir() / "models" / f"demo-{variant}-{_key(spec)}.gguf"
    if not path.is_file():
        tmp = path.with_name(path.name + f".{os.getpid()}.part")
        write_tiny_model(tmp, spec)
        os.replace(tmp, path)
    return path
