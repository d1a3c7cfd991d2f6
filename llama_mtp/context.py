"""Context (target or MTP), its Memory, and per-sequence checkpoints."""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from . import _native
from ._native import calls
from .batch import Batch
from .errors import (
    AbortedError,
    ClosedError,
    ContextError,
    InvalidBatchError,
    LlamaError,
    StaleOutputError,
    check_decode,
    check_ptr,
    clear_log,
    raise_with_log,
)
from .params import ContextParams

if TYPE_CHECKING:
    from typing_extensions import Self

    from .model import Model

__all__ = ["Checkpoint", "Context", "Memory"]


@dataclass(frozen=True)
class Checkpoint:
    """A saved sequence state. ``partial`` ones hold only what cannot be rolled
    back by trimming (recurrent state, SWA KV): restoring one also trims the
    attention KV back to ``pos_max``."""

    seq: int
    pos_max: int
    partial: bool
    #: the serialized state: bytes, or (``checkpoint(reuse=True)``) a view of a buffer
    #: the context reuses for that sequence's next such checkpoint
    data: bytes | npt.NDArray[np.uint8]

    @property
    def nbytes(self) -> int:
        return len(self.data)


class Context:
    """A llama.cpp context on a :class:`Model`: the target (``mtp=False``) or the
    MTP draft head (``mtp=True``, which needs a model loaded with its MTP head).

    Outputs of the last :meth:`decode` are read with :meth:`logits` and
    :meth:`hidden` as **zero-copy, read-only numpy views, valid until the next
    decode on this context** (copy them with ``np.array(view)`` to keep them).
    Reading through the context after a newer decode is refused, and the native
    buffer is never freed under a live view.

    One context serves one thread at a time: calls are serialised by a lock.
    """

    def __init__(
        self,
        model: Model,
        params: ContextParams | None = None,
        *,
        mtp: bool = False,
        **overrides: Any,
    ) -> None:
        self._ptr: Any = None
        params = params or ContextParams()
        if overrides:
            params = params.replace(**overrides)
        self.params = params
        self.model = model
        self.is_mtp = bool(mtp)
        model_ptr = model._handle()
        if self.is_mtp:
            model.require_mtp()
        else:
            model.require_trunk()
        if model.params.vocab_only:
            raise ContextError(f"{model.path.name} was loaded vocab-only: it has no weights to run")

        _native.ensure_backend()
        _check_room(model, params, self.is_mtp)
        clear_log()
        self._abort = calls.new_abort_state()
        ptr = calls.context_new(model_ptr, params._to_c(), self.is_mtp, self._abort)
        if _native.take_interrupt():  # Ctrl-C while llama.cpp was logging
            if ptr is not None:
                calls.release(ptr)
            raise KeyboardInterrupt
        self._ptr = check_ptr(ptr, ContextError, f"could not create a{'n MTP' if mtp else ''} context on {model.path.name}"
                              f" ({_describe(params)})")
        self._info = calls.context_info(self._ptr)
        self._mem = calls.memory(self._ptr)
        self._lock = threading.RLock()
        self._keepalive: tuple[object, ...] = (self._ptr,)  # what output views hold on to
        self._views: weakref.WeakSet[calls.OutputView] = weakref.WeakSet()
        self._out_cap = self._info["n_seq_max"]  # rows the output buffer holds before it may move
        self._n_outputs_max = params.n_outputs_max or self._info["n_batch"]
        self._dropped = np.zeros(self._info["n_seq_max"], dtype=np.int8)
        self._gen = 0
        self._ckpt_bufs: dict[int, npt.NDArray[np.uint8]] = {}  # per sequence, for checkpoint(reuse=True)
        self._last_tokens = self._last_n_out = 0
        self._last_out: npt.NDArray[np.int8] | None = None
        self._last_out_idx: npt.NDArray[np.int64] | None = None
        self._hidden_mode: bool | None = None  # None: off; True: masked; False: unmasked
        self._exact_rollback = self.is_mtp or not (model.is_recurrent or model.is_hybrid)
        self.memory = Memory(self)
        if self.is_mtp:
            self.set_hidden_output(True, masked=False)
        model._register(self)

    # ------------------------------------------------------------ ownership

    def _handle(self) -> Any:
        if self._ptr is None:
            raise ClosedError("Context is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def close(self) -> None:
        """Free the context now (idempotent); deferred while output views are alive."""
        self._close()

    def _close(self, from_model: bool = False) -> bool:
        """Returns True if the native free had to wait for live views."""
        if self._ptr is None:
            return False
        lock = getattr(self, "_lock", None)
        if lock is not None and not lock.acquire(timeout=0 if from_model else -1):
            # another thread is inside a call: it finishes, then the handle goes with the last reference
            self._ptr = None
            return True
        try:
            ptr, self._ptr = self._ptr, None
            self._keepalive = ()
            deferred = len(self._views) > 0
            if not deferred:
                calls.release(ptr)
            return deferred
        finally:
            if lock is not None:
                lock.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "MTP" if self.is_mtp else "target"
        return f"<Context {kind} n_ctx={self.n_ctx} n_seq_max={self.n_seq_max}{' closed' if self.closed else ''}>"

    # ------------------------------------------------------------ properties

    n_ctx = property(lambda self: int(self._info["n_ctx"]), doc="context size (tokens, all sequences)")
    n_ctx_seq = property(lambda self: int(self._info["n_ctx_seq"]), doc="context size of one sequence")
    n_batch = property(lambda self: int(self._info["n_batch"]), doc="most entries one decode takes")
    n_ubatch = property(lambda self: int(self._info["n_ubatch"]), doc="physical batch size")
    n_seq_max = property(lambda self: int(self._info["n_seq_max"]), doc="sequence ids are 0..n_seq_max-1")
    n_rs_seq = property(lambda self: int(self._info["n_rs_seq"]),
                        doc="recurrent-state snapshots per sequence (0: no partial rollback of recurrent state)")
    n_outputs_max = property(lambda self: int(self._n_outputs_max), doc="most outputs one decode may ask for")

    @property
    def kv_unified(self) -> bool:
        """One KV stream shared by every sequence (llama.cpp's default: one per sequence)."""
        v = self.params.kv_unified
        return bool(calls.context_default_params()["kv_unified"] if v is None else v)

    @property
    def n_threads(self) -> tuple[int, int]:
        return self._info["n_threads"], self._info["n_threads_batch"]

    def set_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        for v in (n_threads, n_threads_batch):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1024):
                raise ValueError(f"thread counts must be integers in 1..1024, got {v!r}")
        with self._lock:
            nb = n_threads_batch if n_threads_batch is not None else n_threads
            calls.set_n_threads(self._handle(), n_threads, nb)
            self._info["n_threads"], self._info["n_threads_batch"] = n_threads, nb

    @property
    def hidden_dim(self) -> int:
        """Width of hidden (nextn) rows: what an MTP batch needs per entry."""
        n: int = self.model.n_embd_out
        return n

    @property
    def supports_partial_rollback(self) -> bool:
        """Whether ``seq_rm`` of a sequence tail can succeed (attention-only memory,
        or recurrent state with ``n_rs_seq`` snapshots)."""
        return self._exact_rollback or self.n_rs_seq > 0

    # ------------------------------------------------------------ decode

    def set_hidden_output(self, enabled: bool, *, masked: bool = False) -> None:
        """Make decodes also output hidden (nextn) rows: for every entry
        (``masked=False``: what MTP catch-up needs from the target, and what an MTP
        context gives by default -- the row of a draft's output) or for output entries
        only (``masked=True``, target contexts only: at the pinned llama.cpp an MTP
        decode's masked rows are the batch's *first* rows, not its outputs, so an MTP
        context refuses it)."""
        if enabled and masked and self.is_mtp:
            raise ValueError("masked hidden rows of an MTP context are the batch's first rows, not its outputs "
                             "(llama.cpp's MTP graph does not select them): use masked=False and index by entry")
        with self._lock:
            calls.set_embeddings_nextn(self._handle(), bool(enabled), bool(masked))
            self._hidden_mode = bool(masked) if enabled else None
            self._gen += 1

    def interrupt(self) -> None:
        """Abort the decode running on this context -- or the next one, if none is
        running (safe from any thread). The decode raises AbortedError."""
        if self._ptr is not None:
            calls.abort_request(self._abort, True)

    def decode(self, batch: Batch) -> None:
        """Run the model over ``batch``. Errors leave the memory as it was before
        the call (an aborted decode on recurrent memory removes the sequences of
        the batch instead; ``err.dropped`` names them)."""
        with self._lock:
            ptr = self._handle()
            n_out = batch.validate(
                n_vocab=self.model.n_vocab, n_seq_max=self.n_seq_max, n_batch=self.n_batch,
                n_outputs_max=self._n_outputs_max, hidden_dim=self.hidden_dim if self.is_mtp else 0,
            )
            if n_out > self._out_cap:
                if len(self._views):
                    raise StaleOutputError(
                        f"this decode needs a larger output buffer ({n_out} rows), which would move the memory "
                        "under numpy views of earlier outputs that are still referenced; copy them "
                        "(np.array(view)) or drop them first"
                    )
                self._out_cap = n_out
            n = batch.n_tokens
            batch._struct.set_n_tokens(n)
            clear_log()
            rc, by_signal = calls.decode(ptr, batch._struct.ptr, self._exact_rollback, self._abort, self._dropped)
            self._gen += 1
            if rc == 0:
                self._last_tokens, self._last_n_out = n, n_out
                self._last_out = batch.output[:n].copy()  # the output row of each entry: on demand
                self._last_out_idx = None
                return
            self._last_tokens = self._last_n_out = 0
            self._last_out = self._last_out_idx = None
            if rc == 2:
                calls.abort_request(self._abort, False)  # consumed
            dropped = [int(s) for s in np.flatnonzero(self._dropped)]
            self._dropped[:] = 0
        if by_signal:
            # Ctrl-C arrived during the decode: memory is consistent again, so let
            # Python's own SIGINT handler run now (KeyboardInterrupt by default)
            _native.reraise_sigint()
        try:
            check_decode(rc, "decode")
        except LlamaError as exc:
            exc.dropped = dropped  # type: ignore[attr-defined]
            if isinstance(exc, AbortedError) and by_signal:
                exc.message += " (Ctrl-C)"
            raise

    # ------------------------------------------------------------ outputs

    def _track(self, got: tuple[npt.NDArray[np.float32], calls.OutputView] | None, what: str) -> npt.NDArray[np.float32]:
        if got is None:
            raise_with_log(LlamaError, f"llama.cpp returned no {what}")
        arr, base = got
        self._views.add(base)
        return arr

    def _row(self, i: int) -> int:
        n = self._last_tokens
        if n == 0:
            raise StaleOutputError("no outputs: nothing was decoded since the context was created or changed")
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not -n <= int(i) < n:
            raise IndexError(f"batch index {i!r} out of range for the last decode ({n} entries)")
        return int(i) % n

    def n_outputs(self) -> int:
        """Number of output rows of the last decode."""
        return self._last_n_out

    def _out_row(self, row: int) -> int:
        """The output row of batch entry ``row`` of the last decode (-1: not an output)."""
        if self._last_out_idx is None:
            out = self._last_out
            assert out is not None
            self._last_out_idx = np.where(out != 0, np.cumsum(out, dtype=np.int64) - 1, -1)
        return int(self._last_out_idx[row])

    def logits(self, i: int = -1) -> npt.NDArray[np.float32]:
        """Logits (n_vocab,) of batch entry ``i`` of the last decode (must be an output)."""
        with self._lock:
            ptr = self._handle()
            row = self._row(i)
            if self._out_row(row) < 0:
                raise IndexError(f"batch entry {i} was not marked as an output")
            return self._track(calls.logits_ith(ptr, row, self.model.n_vocab, self._keepalive), "logits")

    def logits_all(self) -> npt.NDArray[np.float32]:
        """Logits of every output row of the last decode, (n_outputs, n_vocab), in batch order."""
        with self._lock:
            ptr = self._handle()
            self._row(0)
            return self._track(calls.logits_rows(ptr, self.n_outputs(), self.model.n_vocab, self._keepalive), "logits")

    def hidden(self, i: int = -1) -> npt.NDArray[np.float32]:
        """Hidden (nextn) row (n_embd_out,) of batch entry ``i`` of the last decode."""
        with self._lock:
            ptr = self._handle()
            row = self._row(i)
            if self._hidden_mode is None:
                raise LlamaError("hidden rows are off: call set_hidden_output(True) before decoding")
            if self._hidden_mode:  # masked: output rows only
                j = self._out_row(row)
                if j < 0:
                    raise IndexError(f"batch entry {i} was not marked as an output")
                got = calls.nextn_rows(ptr, self.n_outputs(), self.hidden_dim, self._keepalive)
            else:
                j = row
                got = calls.nextn_rows(ptr, self._last_tokens, self.hidden_dim, self._keepalive)
            row_j: npt.NDArray[np.float32] = self._track(got, "hidden rows")[j]
            return row_j

    def hidden_all(self) -> npt.NDArray[np.float32]:
        """Hidden rows of the last decode: every entry (unmasked) or every output (masked)."""
        with self._lock:
            ptr = self._handle()
            self._row(0)
            if self._hidden_mode is None:
                raise LlamaError("hidden rows are off: call set_hidden_output(True) before decoding")
            n = self.n_outputs() if self._hidden_mode else self._last_tokens
            return self._track(calls.nextn_rows(ptr, n, self.hidden_dim, self._keepalive), "hidden rows")

    # ------------------------------------------------------------ checkpoints

    def checkpoint(self, seq: int, *, partial: bool = False, reuse: bool = False) -> Checkpoint:
        """Save sequence ``seq``'s state (``partial``: recurrent/SWA parts only).

        ``reuse=True`` serializes into a buffer the context keeps for ``seq`` instead
        of a fresh one (several megabytes per sequence on a hybrid model: allocating
        them costs more than the copy): the checkpoint is then valid until the next
        ``reuse=True`` checkpoint of the same sequence -- what a speculative step
        needs, saving the state before each verify that might be rolled back."""
        with self._lock:
            ptr = self._handle()
            self.memory._check_seq(seq)
            clear_log()
            flags = calls.STATE_PARTIAL_ONLY if partial else calls.STATE_FULL
            data: bytes | npt.NDArray[np.uint8] | None = None
            if reuse:
                buf = self._ckpt_bufs.get(seq)
                need = calls.state_seq_size(ptr, seq, flags)
                if buf is None or buf.size < need:
                    buf = self._ckpt_bufs[seq] = np.empty(need + need // 8, dtype=np.uint8)  # room to grow
                n = calls.state_seq_get_into(ptr, seq, flags, buf, need) if need else 0
                data = buf[:n] if n else None
            else:
                data = calls.state_seq_get(ptr, seq, flags)
            if data is None:
                raise_with_log(LlamaError, f"could not save the state of sequence {seq}")
            return Checkpoint(seq=seq, pos_max=self.memory.pos_max(seq), partial=partial, data=data)

    def restore(self, ckpt: Checkpoint, seq: int | None = None) -> None:
        """Put a checkpoint back into ``seq`` (default: the sequence it came from)."""
        dest = ckpt.seq if seq is None else seq
        with self._lock:
            ptr = self._handle()
            self.memory._check_seq(dest)
            clear_log()
            flags = calls.STATE_PARTIAL_ONLY if ckpt.partial else calls.STATE_FULL
            if not ckpt.partial:
                calls.mem_seq_rm(self._mem, dest, -1, -1)
            if calls.state_seq_set(ptr, ckpt.data, dest, flags) == 0:
                raise_with_log(LlamaError, f"could not restore the checkpoint into sequence {dest}")
            if ckpt.partial and not calls.mem_seq_rm(self._mem, dest, ckpt.pos_max + 1, -1):
                raise_with_log(LlamaError, f"could not trim sequence {dest} back to position {ckpt.pos_max}")
            self._gen += 1

    def move(self, src: int, dst: int) -> None:
        """Move sequence ``src``'s whole state into ``dst`` (what ``dst`` held is dropped);
        ``src`` is left empty."""
        if self.memory.pos_max(src) >= 0:
            self.restore(self.checkpoint(src), dst)
        else:
            self.memory.seq_rm(dst, -1, -1)
        self.memory.seq_rm(src, -1, -1)

    # ------------------------------------------------------------ misc

    def perf(self) -> dict[str, float]:
        with self._lock:
            return calls.perf(self._handle())


class Memory:
    """Per-sequence memory (KV cache and recurrent state) of a context.

    Positions follow llama.cpp: ``p0 < 0`` means from the start, ``p1 < 0`` to the end.
    """

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx

    def _m(self) -> Any:
        self._ctx._handle()
        return self._ctx._mem

    def _check_seq(self, seq: int, allow_all: bool = False) -> None:
        n = self._ctx.n_seq_max
        if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)):
            raise InvalidBatchError(f"sequence id must be an integer, got {seq!r}")
        if allow_all and seq == -1:
            return
        if not 0 <= int(seq) < n:
            raise InvalidBatchError(f"sequence id {seq} is out of range [0, {n})")

    @staticmethod
    def _check_pos(*ps: int) -> None:
        for p in ps:
            if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or not -(2**31) <= int(p) < 2**31:
                raise ValueError(f"position must be a 32-bit integer, got {p!r}")

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq`` (-1: every sequence). Returns False
        when a partial removal is not possible (recurrent state beyond ``n_rs_seq``,
        or a second rollback before the next decode); removing a whole sequence
        never fails."""
        self._check_seq(seq, allow_all=True)
        self._check_pos(p0, p1)
        with self._ctx._lock:
            return calls.mem_seq_rm(self._m(), int(seq), int(p0), int(p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self._check_seq(src)
        self._check_seq(dst)
        self._check_pos(p0, p1)
        with self._ctx._lock:
            calls.mem_seq_cp(self._m(), int(src), int(dst), int(p0), int(p1))

    def seq_keep(self, seq: int) -> None:
        self._check_seq(seq)
        with self._ctx._lock:
            calls.mem_seq_keep(self._m(), int(seq))

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Shift positions [p0, p1) of ``seq`` by ``delta`` (needs a shiftable memory)."""
        self._check_seq(seq)
        self._check_pos(p0, p1, delta)
        with self._ctx._lock:
            if not calls.mem_can_shift(self._m()):
                raise LlamaError("this context's memory cannot shift positions (recurrent state)")
            calls.mem_seq_add(self._m(), int(seq), int(p0), int(p1), int(delta))

    def pos_min(self, seq: int) -> int:
        """Smallest position held for ``seq`` (-1 if empty)."""
        self._check_seq(seq)
        with self._ctx._lock:
            return calls.mem_pos_min(self._m(), int(seq))

    def pos_max(self, seq: int) -> int:
        """Largest position held for ``seq`` (-1 if empty)."""
        self._check_seq(seq)
        with self._ctx._lock:
            return calls.mem_pos_max(self._m(), int(seq))

    def clear(self, data: bool = True) -> None:
        with self._ctx._lock:
            calls.mem_clear(self._m(), data)

    @property
    def can_shift(self) -> bool:
        with self._ctx._lock:
            return calls.mem_can_shift(self._m())


#: host bytes llama.cpp keeps per KV cell besides the cache itself: position, shift, M-RoPE
#: extras and a 256-bit set of the sequences in it (~52; counted low)
CELL_BYTES = 48


def min_context_bytes(model: Model, n_ctx: int, *, mtp: bool = False, type_k: str = "f16",
                      type_v: str = "f16") -> int:
    """A lower bound of the memory a context of ``n_ctx`` cells takes: the cells' bookkeeping
    (host) and half of its attention layers' K and V (host or device) -- half, as some layers
    may hold fewer KV heads than the model's first; recurrent state and compute buffers not
    counted."""
    meta = model.metadata

    def meta_int(key: str, default: int) -> int:  # a scalar key; anything else (arrays): the default
        try:
            return int(meta.get(f"{model.arch}.{key}", default))
        except ValueError:
            return default

    if mtp:
        n_attn = model.n_layer_nextn
    elif model.is_recurrent:
        n_attn = 0
    elif model.is_hybrid:
        interval = meta_int("full_attention_interval", 0)
        n_attn = model.n_layer // interval if interval > 0 else 0  # unknown: none counted
    else:
        n_attn = model.n_layer
    head = model.n_embd // max(1, model.n_head)
    k_len = meta_int("attention.key_length", head)
    v_len = meta_int("attention.value_length", head)
    per_cell = n_attn * model.n_head_kv * (k_len * calls.type_bytes(type_k) + v_len * calls.type_bytes(type_v))
    return int(n_ctx * (CELL_BYTES + per_cell / 2))


def _available_memory(offload: bool) -> int | None:
    """Free host memory (Linux: MemAvailable; elsewhere the physical size), plus the GPUs'
    free memory where layers may offload; None when it cannot be told."""
    try:
        with open("/proc/meminfo") as f:
            host = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        try:
            host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            return None
    gpu = sum(d.memory_free for d in calls.devices() if d.kind != "cpu") if offload else 0
    return host + gpu


def _check_room(model: Model, params: ContextParams, mtp: bool) -> None:
    """Refuse a context that cannot fit before llama.cpp tries: its bookkeeping of KV cells
    is allocated on the host and zero-filled, so a huge n_ctx is not a failed allocation
    there but a process the kernel kills for lack of memory (seen on a 128 GiB GPU machine
    with n_ctx = 2**30 on a tiny model)."""
    n_ctx = params.n_ctx if params.n_ctx else model.n_ctx_train
    n_ctx = -(-n_ctx // 256) * 256  # llama.cpp pads it
    need = min_context_bytes(model, n_ctx, mtp=mtp, type_k=params.type_k or "f16", type_v=params.type_v or "f16")
    avail = _available_memory(model.offloads)
    if avail is not None and need > avail:
        raise ContextError(
            f"a context of {n_ctx} tokens needs at least {need / 2**30:.1f} GiB (its KV cache and the bookkeeping of "
            f"its cells), more than is free here ({avail / 2**30:.1f} GiB); lower n_ctx")


def _describe(p: ContextParams) -> str:
    items = [f"{k}={v}" for k, v in p.as_dict().items() if v is not None]
    return ", ".join(items)


