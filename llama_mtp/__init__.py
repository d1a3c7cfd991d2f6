"""llama_mtp: MTP (multi-token prediction) speculative decoding from Python.

cffi bindings to a pinned llama.cpp, a Pythonic Model/Context/Batch layer, and
a lossless draft -> verify -> accept -> rollback engine for many sequences.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("llama-mtp")
except PackageNotFoundError:  # pragma: no cover - running from an uninstalled tree
    __version__ = "0+unknown"

# a library stays quiet unless the application configures logging
logging.getLogger("llama_mtp").addHandler(logging.NullHandler())

from .batch import Batch
from .context import Checkpoint, Context, Memory
from .draft_head import DraftHead
from .errors import (
    AbortedError,
    ClosedError,
    ContextError,
    DecodeError,
    InUseError,
    InvalidBatchError,
    KVCacheFullError,
    LlamaError,
    ModelLoadError,
    MTPUnavailableError,
    StaleOutputError,
    TokenizeError,
)
from .generate import LLM, GenerationResult
from .info import build_info
from .model import Model
from .params import ContextParams, ModelParams, SamplingParams, SpecParams
from .speculative import ContextLengthError, SpeculativeEngine

__all__ = [
    "AbortedError",
    "Batch",
    "Checkpoint",
    "ClosedError",
    "Context",
    "ContextError",
    "ContextLengthError",
    "ContextParams",
    "DecodeError",
    "DraftHead",
    "GenerationResult",
    "InUseError",
    "InvalidBatchError",
    "KVCacheFullError",
    "LLM",
    "LlamaError",
    "MTPUnavailableError",
    "Memory",
    "Model",
    "ModelLoadError",
    "ModelParams",
    "SamplingParams",
    "SpecParams",
    "SpeculativeEngine",
    "StaleOutputError",
    "TokenizeError",
    "__version__",
    "build_info",
]
