"""A reduced draft vocabulary: the MTP head's logits for some tokens only.

An MTP draft decode ends in the LM head, a matrix of ``n_vocab`` rows that dwarfs the
MTP block itself (on a 1024-wide model with 32000 tokens, 2/3 of a one-token draft
decode on a 2-core CPU; Qwen3.5's 248k vocabulary makes the head ~8x larger still). A draft only needs
the most likely next token, and the target verifies every draft anyway: drafting from a
subset of the vocabulary is lossless, and costs acceptance only where the target's next
token lies outside it. :class:`DraftHead` holds a copy of the head's rows for the chosen
tokens (in the weights' own type) and multiplies them on the CPU with ggml.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ._native import calls
from .errors import ClosedError, LlamaError, MTPUnavailableError, check_ptr, clear_log, raise_with_log

if TYPE_CHECKING:
    from typing_extensions import Self

    from .model import Model

__all__ = ["DraftHead"]


class DraftHead:
    """Rows of ``model``'s MTP LM head for the tokens ``ids`` (room for ``capacity`` in all;
    :meth:`add` appends more). :meth:`logits` gives each row's logit for hidden rows of
    the MTP context (its ``h_nextn``: the normed state the full head multiplies).

    Raises :class:`MTPUnavailableError` where the head cannot be copied (no LM head, a
    scaled head, weights repacked for this CPU), with llama.cpp's reason in the log.
    """

    def __init__(self, model: Model, ids: Iterable[int], *, capacity: int | None = None,
                 n_threads: int = 1) -> None:
        self._ptr: Any = None
        first = self._unique(model.check_tokens(list(ids)))
        cap = len(first) if capacity is None else capacity
        if isinstance(cap, bool) or not isinstance(cap, int) or not len(first) <= cap <= model.n_vocab or cap < 1:
            raise ValueError(f"capacity must be an integer in {max(1, len(first))}..{model.n_vocab}, got {capacity!r}")
        if isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1:
            raise ValueError(f"n_threads must be a positive integer, got {n_threads!r}")
        self.model = model
        self.n_vocab = model.n_vocab
        self.n_embd = model.n_embd_out
        self.n_threads = n_threads
        self.capacity = cap
        clear_log()
        self._ptr = check_ptr(calls.head_new(model._handle(), cap), MTPUnavailableError,
                              f"cannot build a draft head for {model.path.name}")
        self._ids = np.empty(cap, dtype=np.int32)
        self._col = np.full(model.n_vocab, -1, dtype=np.int32)  # token -> row, -1: not held
        self._n = 0
        self._lock = threading.Lock()
        self.add(first)

    @staticmethod
    def _unique(arr: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
        _, first = np.unique(arr, return_index=True)
        return np.ascontiguousarray(arr[np.sort(first)], dtype=np.int32)

    def _handle(self) -> Any:
        if self._ptr is None:
            raise ClosedError("DraftHead is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def close(self) -> None:
        """Free the copied rows now (idempotent)."""
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            calls.release(ptr)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return self._n

    def __contains__(self, token: object) -> bool:
        return isinstance(token, (int, np.integer)) and 0 <= int(token) < self.n_vocab and bool(self._col[int(token)] >= 0)

    @property
    def ids(self) -> npt.NDArray[np.int32]:
        """The token of each row, in row order (a read-only view)."""
        v = self._ids[: self._n]
        v.flags.writeable = False
        return v

    @property
    def room(self) -> int:
        return self.capacity - self._n

    def add(self, tokens: Iterable[int] | npt.NDArray[np.int32]) -> int:
        """Append rows for those of ``tokens`` not held yet, while there is room; returns
        how many were added (fewer than new tokens only when the head is full)."""
        arr = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens))
        if arr.size == 0:
            return 0
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError("tokens must be a 1-d sequence of integers")
        if arr.min() < 0 or arr.max() >= self.n_vocab:
            raise ValueError(f"token ids must be in 0..{self.n_vocab - 1}")
        with self._lock:
            new = self._unique(arr[self._col[arr] < 0].astype(np.int32))[: self.room]
            if new.size == 0:
                return 0
            if self.model.closed:
                raise ClosedError("the model of this DraftHead is closed")
            clear_log()
            got = calls.head_add(self._handle(), new)
            if got != self._n + new.size:
                raise_with_log(LlamaError, f"could not copy {new.size} head rows")
            self._ids[self._n: got] = new
            self._col[new] = np.arange(self._n, got, dtype=np.int32)
            self._n = got
            return int(new.size)

    def logits(self, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """Logits ``(len(x), len(self))`` of each row for each hidden row of ``x``
        (``(n, n_embd)``, or one row ``(n_embd,)`` giving ``(len(self),)``)."""
        self._handle()
        xs = np.ascontiguousarray(x, dtype=np.float32)
        one = xs.ndim == 1
        if one:
            xs = xs[None, :]
        if xs.ndim != 2 or xs.shape[1] != self.n_embd or xs.shape[0] < 1:
            raise ValueError(f"x must have shape (n, {self.n_embd}), got {np.shape(x)}")
        with self._lock:
            out = np.empty((xs.shape[0], self._n), dtype=np.float32)
            if self._n == 0:  # nothing to multiply (an empty head waiting for add())
                return out[0] if one else out
            clear_log()
            if calls.head_logits(self._handle(), xs, out, self.n_threads) != 0:
                raise_with_log(LlamaError, "draft head multiplication failed")
        return out[0] if one else out

    def column(self, token: int) -> int:
        """The row of ``token`` (-1 where the head does not hold it)."""
        return int(self._col[token])

    def to_ids(self, rows: npt.NDArray[np.integer[Any]] | int) -> Any:
        """Token ids of row indices (what an argmax over :meth:`logits` returns)."""
        return self._ids[rows]

    def __repr__(self) -> str:
        state = "closed" if self._ptr is None else f"{self._n}/{self.capacity} rows of {self.n_vocab}"
        return f"<DraftHead {state}>"
