"""The exception hierarchy, and the one place that translates C results into it.

Every failure inside llama.cpp is explained only in its log; the translators
attach the warning/error lines llama.cpp logged during the failing call
(``.log``), so a message says *why*, not just "returned NULL".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from . import _native

__all__ = [
    "AbortedError",
    "ClosedError",
    "ContextError",
    "DecodeError",
    "InUseError",
    "InvalidBatchError",
    "KVCacheFullError",
    "LlamaError",
    "MTPUnavailableError",
    "ModelLoadError",
    "StaleOutputError",
    "TokenizeError",
    "check_decode",
    "check_ptr",
    "clear_log",
]


class LlamaError(Exception):
    """Base of every error raised by llama_mtp.

    ``code`` is llama.cpp's return code where there is one; ``log`` holds the
    warning/error lines llama.cpp logged while the failing call ran.
    """

    code: int | None = None

    def __init__(self, message: str, *, code: int | None = None, log: Sequence[str] = ()) -> None:
        self.message = message
        self.code = code
        self.log = list(log)
        detail = "\nllama.cpp said:\n  " + "\n  ".join(self.log[-8:]) if self.log else ""
        super().__init__(message + detail)


class ModelLoadError(LlamaError, OSError):
    """A model file could not be loaded (missing, not GGUF, truncated, unsupported)."""


class ContextError(LlamaError):
    """A context could not be created (bad parameters, out of memory)."""


class MTPUnavailableError(LlamaError):
    """MTP was asked for, but the model (as loaded) has no usable MTP head."""


class DecodeError(LlamaError):
    """``llama_decode`` failed."""


class KVCacheFullError(DecodeError):
    """No memory slot for the batch (llama_decode returned 1): context full."""


class AbortedError(DecodeError):
    """The decode was aborted (llama_decode returned 2) by ``interrupt()``."""


class InvalidBatchError(DecodeError, ValueError):
    """The batch was rejected before anything ran (bad token ids, positions, seq ids, sizes)."""


class TokenizeError(LlamaError, ValueError):
    """Text could not be tokenized (or tokens detokenized)."""


class ClosedError(LlamaError, ValueError):
    """The object (model, context, engine) was closed."""


class InUseError(LlamaError):
    """The object is still in use (a model with live contexts, a context another thread holds)."""


class StaleOutputError(LlamaError):
    """Outputs of an earlier decode were read after a newer decode replaced them."""


def clear_log() -> None:
    """Forget earlier log lines, so an error reports only what the failing call logged."""
    _native.clear_log_lines()


def check_ptr(ptr: Any, exc: type[LlamaError], message: str) -> Any:
    """Raise ``exc(message)`` with llama.cpp's log if ``ptr`` is None (a NULL handle)."""
    if ptr is None:
        raise exc(message, log=_native.take_log_lines())
    return ptr


def raise_with_log(exc: type[LlamaError], message: str, code: int | None = None) -> NoReturn:
    raise exc(message, code=code, log=_native.take_log_lines())


_DECODE = {
    1: (KVCacheFullError, "no memory slot for the batch: the context is full (raise n_ctx, or free sequences)"),
    2: (AbortedError, "decode aborted"),
    -1: (InvalidBatchError, "llama.cpp rejected the batch"),
}


def check_decode(rc: int, what: str = "decode") -> None:
    """Map llama_decode's return code to an exception (0 passes)."""
    if rc == 0:
        return
    exc, text = _DECODE.get(rc, (DecodeError, f"fatal error in llama_decode (code {rc})"))
    raise exc(f"{what}: {text}", code=rc, log=_native.take_log_lines())
