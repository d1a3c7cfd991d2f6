"""Frozen parameter groups. ``None`` always means "llama.cpp's own default".

Each group validates itself on construction (a bad value raises ``ValueError``
before anything reaches C) and translates itself into the overrides applied on
top of ``llama_*_default_params()`` (never a zero-filled struct).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from ._native import calls

__all__ = ["ContextParams", "ModelParams", "SamplingParams", "SpecParams", "default_threads"]

FlashAttn = Literal["auto", "on", "off"]


def default_threads() -> int:
    """Cores this process may run on (llama.cpp's own default is a fixed 4)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - macOS / Windows
        return max(1, os.cpu_count() or 1)


def _check_int(name: str, value: int | None, lo: int | None = None, hi: int | None = None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, not {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _check_float(name: str, value: float | None, lo: float | None = None, hi: float | None = None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, not {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


class _Params:
    def replace(self, **changes: Any) -> Any:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)  # type: ignore[type-var]

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class ModelParams(_Params):
    """How a GGUF is loaded.

    ``mtp``: ``None`` loads the MTP head when the file has one, ``True`` requires
    it (``MTPUnavailableError`` if absent), ``False`` skips its tensors.
    """

    mtp: bool | None = None
    n_gpu_layers: int | None = None
    split_mode: Literal["none", "layer", "row"] | None = None
    main_gpu: int | None = None
    mmap: bool = True
    mlock: bool = False
    check_tensors: bool = False
    vocab_only: bool = False

    def __post_init__(self) -> None:
        _check_int("n_gpu_layers", self.n_gpu_layers, lo=-1)
        _check_int("main_gpu", self.main_gpu, lo=0)
        if self.split_mode is not None and self.split_mode not in calls.SPLIT_MODE:
            raise ValueError(f"split_mode must be one of {sorted(calls.SPLIT_MODE)}, got {self.split_mode!r}")
        if self.mtp not in (None, True, False):
            raise ValueError(f"mtp must be None, True or False, got {self.mtp!r}")

    def _to_c(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "load_mtp": self.mtp is not False,
            "vocab_only": self.vocab_only,
            "check_tensors": self.check_tensors,
        }
        if self.n_gpu_layers is not None:
            out["n_gpu_layers"] = self.n_gpu_layers
        if self.split_mode is not None:
            out["split_mode"] = calls.SPLIT_MODE[self.split_mode]
        if self.main_gpu is not None:
            out["main_gpu"] = self.main_gpu
        mode = ("mmap" if self.mmap else "none") if not self.mlock else ("mmap+mlock" if self.mmap else "mlock")
        if not self.mmap or self.mlock:
            out["load_mode"] = calls.LOAD_MODE[mode]
        return out


@dataclass(frozen=True)
class ContextParams(_Params):
    """Sizes and runtime options of a context (target or MTP).

    ``n_threads=None`` uses every core this process may run on.
    ``type_k``/``type_v`` are ggml type names (``"f16"``, ``"q8_0"``, ...).
    """

    n_ctx: int | None = 4096
    n_batch: int | None = None
    n_ubatch: int | None = None
    n_seq_max: int | None = None
    n_rs_seq: int | None = None
    n_outputs_max: int | None = None
    n_threads: int | None = None
    n_threads_batch: int | None = None
    flash_attn: FlashAttn | None = None
    type_k: str | None = None
    type_v: str | None = None
    offload_kqv: bool | None = None
    kv_unified: bool | None = None
    swa_full: bool | None = None
    no_perf: bool | None = None

    def __post_init__(self) -> None:
        _check_int("n_ctx", self.n_ctx, lo=0, hi=2**31 - 1)
        _check_int("n_batch", self.n_batch, lo=1, hi=2**31 - 1)
        _check_int("n_ubatch", self.n_ubatch, lo=1, hi=2**31 - 1)
        _check_int("n_seq_max", self.n_seq_max, lo=1, hi=calls.capabilities()["max_parallel_sequences"])
        _check_int("n_rs_seq", self.n_rs_seq, lo=0, hi=1024)
        _check_int("n_outputs_max", self.n_outputs_max, lo=0, hi=2**31 - 1)
        _check_int("n_threads", self.n_threads, lo=1, hi=1024)
        _check_int("n_threads_batch", self.n_threads_batch, lo=1, hi=1024)
        if self.flash_attn is not None and self.flash_attn not in calls.FLASH_ATTN:
            raise ValueError(f"flash_attn must be one of {sorted(calls.FLASH_ATTN)}, got {self.flash_attn!r}")
        for name in ("type_k", "type_v"):
            value = getattr(self, name)
            if value is not None and str(value).lower() not in calls.GGML_TYPES:
                raise ValueError(f"{name} must be a ggml type name such as 'f16' or 'q8_0', got {value!r}")

    def _to_c(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_rs_seq", "n_outputs_max",
                     "offload_kqv", "kv_unified", "swa_full", "no_perf"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        threads = self.n_threads if self.n_threads is not None else default_threads()
        out["n_threads"] = threads
        out["n_threads_batch"] = self.n_threads_batch if self.n_threads_batch is not None else threads
        if self.flash_attn is not None:
            out["flash_attn_type"] = calls.FLASH_ATTN[self.flash_attn]
        if self.type_k is not None:
            out["type_k"] = calls.GGML_TYPES[self.type_k.lower()]
        if self.type_v is not None:
            out["type_v"] = calls.GGML_TYPES[self.type_v.lower()]
        return out


@dataclass(frozen=True)
class SamplingParams(_Params):
    """Token sampling, with llama.cpp's names and defaults (``temperature=0`` is greedy).

    ``seed=None`` draws a fresh seed per sequence. ``logit_bias`` maps token ids
    to additive biases (``-inf`` bans a token).
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_float("temperature", self.temperature, lo=0.0)
        _check_int("top_k", self.top_k, lo=0)
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_float("repeat_penalty", self.repeat_penalty, lo=0.0)
        _check_float("presence_penalty", self.presence_penalty)
        _check_float("frequency_penalty", self.frequency_penalty)
        _check_int("penalty_last_n", self.penalty_last_n, lo=0)
        _check_int("seed", self.seed, lo=0, hi=2**64 - 1)
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must be a dict {token_id: bias}")
        for tok, bias in self.logit_bias.items():
            _check_int("logit_bias token", tok, lo=0)
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias) or bias == math.inf:
                raise ValueError(f"logit_bias[{tok}] must be a number or -inf, got {bias!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def greedy_params(cls) -> SamplingParams:
        """Greedy decoding (argmax): deterministic, and what the lossless tests compare."""
        return cls(temperature=0.0)


Verify = Literal["auto", "greedy", "match", "rejection"]


@dataclass(frozen=True)
class SpecParams(_Params):
    """How a sequence speculates.

    ``draft_max``: the most tokens drafted per step (0 turns drafting off for the
    sequence, ``"auto"`` chooses per step). ``draft_min``: drafts shorter than this
    are dropped. ``p_min``: stop drafting once the drafter's top probability falls
    below it. ``verify``: ``"match"`` samples the target and accepts while it equals
    the draft (exact at any temperature); ``"rejection"`` is speculative sampling
    with the drafter's probabilities (exact, higher acceptance at T > 0);
    ``"auto"`` = greedy at T = 0, rejection otherwise -- except with an adaptive
    draft length *and* a seed, where it is match: rejection sampling draws per
    draft, so timing-chosen draft lengths would make a seeded run irreproducible. ``ngram``: also draft by
    prompt lookup (n-gram match in the sequence so far), preferred when it finds
    a match, MTP otherwise.
    """

    draft_max: int | Literal["auto"] = "auto"
    draft_min: int = 0
    p_min: float = 0.0
    verify: Verify = "auto"
    ngram: bool = False
    ngram_n: int = 3
    ngram_max: int = 8

    def __post_init__(self) -> None:
        if self.draft_max != "auto":
            _check_int("draft_max", self.draft_max, lo=0, hi=64)
        _check_int("draft_min", self.draft_min, lo=0, hi=64)
        _check_float("p_min", self.p_min, lo=0.0, hi=1.0)
        if self.verify not in ("auto", "greedy", "match", "rejection"):
            raise ValueError(f"verify must be auto, greedy, match or rejection, got {self.verify!r}")
        _check_int("ngram_n", self.ngram_n, lo=1, hi=64)
        _check_int("ngram_max", self.ngram_max, lo=1, hi=64)
