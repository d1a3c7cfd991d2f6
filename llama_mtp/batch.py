"""Batch: Python-owned arrays handed to ``llama_decode`` without copying.

A batch entry is a token id at a position in one (or a few) sequences, with an
output flag, and -- for an MTP context -- the hidden-state row it is paired with.
:meth:`Context.decode` validates the batch against the context before C sees it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from ._native import calls
from .errors import InvalidBatchError

__all__ = ["Batch"]

Outputs = Literal["last", "all", "none"]


class Batch:
    """Up to ``capacity`` entries; ``hidden_dim > 0`` adds a hidden row per entry (MTP).

    >>> b = Batch(8)                               # doctest: +SKIP
    >>> b.extend([1, 2, 3], pos0=0, seq=0)         # last one is an output
    >>> ctx.decode(b); ctx.logits(-1)
    """

    def __init__(self, capacity: int, *, hidden_dim: int = 0, seqs_per_token: int = 1) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        if not isinstance(hidden_dim, int) or hidden_dim < 0:
            raise ValueError(f"hidden_dim must be >= 0, got {hidden_dim!r}")
        if not isinstance(seqs_per_token, int) or seqs_per_token < 1:
            raise ValueError(f"seqs_per_token must be >= 1, got {seqs_per_token!r}")
        self.capacity = capacity
        self.hidden_dim = hidden_dim
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros((capacity, seqs_per_token), dtype=np.int32)
        self.output = np.zeros(capacity, dtype=np.int8)
        self.hidden: npt.NDArray[np.float32] | None = (
            np.zeros((capacity, hidden_dim), dtype=np.float32) if hidden_dim else None
        )
        self._struct = calls.BatchStruct(self.token, self.hidden, self.pos, self.n_seq_id, self.seq, self.output)
        self.n_tokens = 0

    def __len__(self) -> int:
        return self.n_tokens

    def clear(self) -> None:
        self.n_tokens = 0

    @property
    def n_outputs(self) -> int:
        return int(np.count_nonzero(self.output[: self.n_tokens]))

    def _room(self, n: int) -> int:
        start = self.n_tokens
        if start + n > self.capacity:
            raise InvalidBatchError(f"batch is full: {start} + {n} entries > capacity {self.capacity}")
        return start

    def add(
        self,
        token: int,
        pos: int,
        seq: int | Sequence[int] = 0,
        *,
        output: bool = False,
        hidden: npt.ArrayLike | None = None,
    ) -> int:
        """Append one entry; returns its index in the batch."""
        i = self._room(1)
        self.token[i] = token
        self.pos[i] = pos
        seqs = (seq,) if isinstance(seq, (int, np.integer)) else tuple(seq)
        if not 1 <= len(seqs) <= self.seq.shape[1]:
            raise InvalidBatchError(f"an entry belongs to 1..{self.seq.shape[1]} sequences, got {len(seqs)}")
        self.n_seq_id[i] = len(seqs)
        self.seq[i, : len(seqs)] = seqs
        self.output[i] = 1 if output else 0
        self._set_hidden(i, 1, hidden)
        self.n_tokens = i + 1
        return i

    def extend(
        self,
        tokens: Iterable[int] | npt.NDArray[np.integer],
        pos0: int,
        seq: int = 0,
        *,
        outputs: Outputs | Sequence[bool] | npt.NDArray[np.bool_] = "last",
        hidden: npt.ArrayLike | None = None,
    ) -> slice:
        """Append consecutive tokens of one sequence at ``pos0, pos0+1, ...``.

        ``outputs``: ``"last"`` (default), ``"all"``, ``"none"`` or one flag per token.
        ``hidden``: one row per token (MTP contexts). Returns the batch slice.
        """
        arr = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens))
        n = int(arr.size)
        if n == 0:
            return slice(self.n_tokens, self.n_tokens)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise InvalidBatchError("tokens must be a flat sequence of integers")
        i = self._room(n)
        sl = slice(i, i + n)
        self.token[sl] = arr
        self.pos[sl] = np.arange(pos0, pos0 + n, dtype=np.int64)
        self.n_seq_id[sl] = 1
        self.seq[sl, 0] = seq
        if isinstance(outputs, str):
            if outputs not in ("last", "all", "none"):
                raise ValueError(f"outputs must be 'last', 'all', 'none' or flags, got {outputs!r}")
            self.output[sl] = 1 if outputs == "all" else 0
            if outputs == "last":
                self.output[i + n - 1] = 1
        else:
            flags = np.asarray(outputs, dtype=bool)
            if flags.shape != (n,):
                raise InvalidBatchError(f"need one output flag per token ({n}), got shape {flags.shape}")
            self.output[sl] = flags
        self._set_hidden(i, n, hidden)
        self.n_tokens = i + n
        return sl

    def _set_hidden(self, i: int, n: int, hidden: npt.ArrayLike | None) -> None:
        if hidden is None:
            if self.hidden is not None:
                raise InvalidBatchError("this batch pairs every entry with a hidden-state row; pass hidden=")
            return
        if self.hidden is None:
            raise InvalidBatchError("this batch has no hidden rows (create it with hidden_dim=n_embd_out)")
        rows = np.asarray(hidden, dtype=np.float32)
        if rows.shape == (self.hidden_dim,) and n == 1:
            rows = rows[None, :]
        if rows.shape != (n, self.hidden_dim):
            raise InvalidBatchError(f"hidden rows must have shape ({n}, {self.hidden_dim}), got {rows.shape}")
        self.hidden[i : i + n] = rows

    # ------------------------------------------------------------ validation

    def validate(self, *, n_vocab: int, n_seq_max: int, n_batch: int, n_outputs_max: int,
                 hidden_dim: int) -> int:
        """Raise InvalidBatchError for anything llama.cpp would reject or abort on; returns
        the number of outputs. (Run before every decode: cheap for the few entries of a
        speculative step.)"""
        n = self.n_tokens
        if n == 0:
            raise InvalidBatchError("the batch is empty")
        if n > n_batch:
            raise InvalidBatchError(f"the batch has {n} entries, more than the context's n_batch={n_batch}")
        tok = self.token[:n]
        lo, hi = _lohi(tok)
        if lo < 0 or hi >= n_vocab:
            bad = int(tok[(tok < 0) | (tok >= n_vocab)][0])
            raise InvalidBatchError(f"token id {bad} is out of range [0, {n_vocab})")
        if _lohi(self.pos[:n])[0] < 0:
            raise InvalidBatchError("positions must be >= 0")
        nsid = self.n_seq_id[:n]
        lo, hi = _lohi(nsid)
        if lo < 1 or hi > self.seq.shape[1]:
            raise InvalidBatchError("each entry must belong to at least one sequence")
        seqs = self.seq[:n]
        if self.seq.shape[1] == 1:
            lo, hi = _lohi(seqs[:, 0])
        else:
            lo, hi = _lohi(np.concatenate([seqs[i, : nsid[i]] for i in range(n)]))
        if lo < 0 or hi >= n_seq_max:
            raise InvalidBatchError(f"sequence id {lo if lo < 0 else hi} is out of range [0, {n_seq_max})")
        n_out = self.n_outputs
        if n_out > n_outputs_max:
            raise InvalidBatchError(f"the batch asks for {n_out} outputs, the context allows {n_outputs_max}")
        if hidden_dim and self.hidden is None:
            raise InvalidBatchError(f"an MTP context needs a hidden-state row per entry (Batch(hidden_dim={hidden_dim}))")
        if not hidden_dim and self.hidden is not None:
            raise InvalidBatchError("this context takes token ids only; the batch carries hidden rows")
        if self.hidden is not None and self.hidden_dim != hidden_dim:
            raise InvalidBatchError(f"hidden rows are {self.hidden_dim} wide, the context needs {hidden_dim}")
        return n_out


def _lohi(a: npt.NDArray[np.integer]) -> tuple[int, int]:
    """(min, max) of a non-empty 1-D integer array: through a list for the few entries of a
    speculative step (two numpy reductions cost ~6x more there), numpy for long ones."""
    if a.size <= 64:
        v = a.tolist()
        return min(v), max(v)
    return int(a.min()), int(a.max())
