"""Typed wrappers over the C functions the package uses (PyNaCl-bindings style).

Everything here takes and returns Python values, numpy arrays or opaque
``CData`` handles; nothing above this module sees ``ffi`` or ``lib``. Pointers
that Python owns are wrapped with ``ffi.gc`` at birth; ``release`` frees them
deterministically. No return code is interpreted here: that is
:mod:`llama_mtp.errors`' job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from . import LoadProgress, ffi, lib

CData = Any  # an opaque cffi pointer

NULL = ffi.NULL
STATE_FULL = int(lib.LLAMA_STATE_SEQ_FLAGS_NONE)
STATE_PARTIAL_ONLY = int(lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
DEFAULT_SEED = int(lib.LLAMA_DEFAULT_SEED)
TOKEN_NULL = int(lib.LLAMA_TOKEN_NULL)
INT32_MIN = -(2**31)

MAX_LAYERS = int(lib.lmtp_max_layers())
CONTEXT_DEFAULT = int(lib.LLAMA_CONTEXT_TYPE_DEFAULT)
CONTEXT_MTP = int(lib.LLAMA_CONTEXT_TYPE_MTP)

FLASH_ATTN = {
    "auto": int(lib.LLAMA_FLASH_ATTN_TYPE_AUTO),
    "on": int(lib.LLAMA_FLASH_ATTN_TYPE_ENABLED),
    "off": int(lib.LLAMA_FLASH_ATTN_TYPE_DISABLED),
}
SPLIT_MODE = {
    "none": int(lib.LLAMA_SPLIT_MODE_NONE),
    "layer": int(lib.LLAMA_SPLIT_MODE_LAYER),
    "row": int(lib.LLAMA_SPLIT_MODE_ROW),
}
LOAD_MODE = {
    "auto": int(lib.LLAMA_LOAD_MODE_AUTO),
    "none": int(lib.LLAMA_LOAD_MODE_NONE),
    "mmap": int(lib.LLAMA_LOAD_MODE_MMAP),
    "mlock": int(lib.LLAMA_LOAD_MODE_MLOCK),
    "mmap+mlock": int(lib.LLAMA_LOAD_MODE_MMAP_MLOCK),
}
VOCAB_TYPE = {
    int(lib.LLAMA_VOCAB_TYPE_NONE): "none",
    int(lib.LLAMA_VOCAB_TYPE_SPM): "spm",
    int(lib.LLAMA_VOCAB_TYPE_BPE): "bpe",
    int(lib.LLAMA_VOCAB_TYPE_WPM): "wpm",
    int(lib.LLAMA_VOCAB_TYPE_UGM): "ugm",
    int(lib.LLAMA_VOCAB_TYPE_RWKV): "rwkv",
    int(lib.LLAMA_VOCAB_TYPE_PLAMO2): "plamo2",
    int(lib.LLAMA_VOCAB_TYPE_TEST): "test",
}
DEVICE_TYPE = {
    int(lib.GGML_BACKEND_DEVICE_TYPE_CPU): "cpu",
    int(lib.GGML_BACKEND_DEVICE_TYPE_GPU): "gpu",
    int(lib.GGML_BACKEND_DEVICE_TYPE_IGPU): "igpu",
    int(lib.GGML_BACKEND_DEVICE_TYPE_ACCEL): "accel",
}


def _ggml_types() -> dict[str, int]:
    out: dict[str, int] = {}
    for i in range(int(lib.GGML_TYPE_COUNT)):
        name = lib.ggml_type_name(i)
        if name != NULL:
            text = ffi.string(name).decode()
            if text and " " not in text and text != "NONE":
                out[text.lower()] = i
    return out


GGML_TYPES = _ggml_types()


def type_bytes(name: str) -> float:
    """Bytes per element of a ggml type (``"f16"``: 2.0, ``"q4_0"``: 0.5625)."""
    t = GGML_TYPES[name]
    return int(lib.ggml_type_size(t)) / int(lib.ggml_blck_size(t))


def _str(p: CData) -> str | None:
    return None if p == NULL else ffi.string(p).decode("utf-8", "replace")


# ---------------------------------------------------------------- process


def version() -> str:
    return ffi.string(lib.lmtp_version()).decode()


def llama_commit() -> str:
    return ffi.string(lib.lmtp_llama_commit()).decode()


def system_info() -> str:
    return _str(lib.llama_print_system_info()) or ""


def time_us() -> int:
    return int(lib.llama_time_us())


def capabilities() -> dict[str, Any]:
    return {
        "mmap": bool(lib.llama_supports_mmap()),
        "mlock": bool(lib.llama_supports_mlock()),
        "gpu_offload": bool(lib.llama_supports_gpu_offload()),
        "rpc": bool(lib.llama_supports_rpc()),
        "max_devices": int(lib.llama_max_devices()),
        "max_parallel_sequences": int(lib.llama_max_parallel_sequences()),
    }


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    description: str
    kind: str
    backend: str
    memory_free: int
    memory_total: int


def devices() -> list[DeviceInfo]:
    out = []
    free = ffi.new("size_t *")
    total = ffi.new("size_t *")
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        lib.ggml_backend_dev_memory(dev, free, total)
        reg = lib.ggml_backend_dev_backend_reg(dev)
        out.append(
            DeviceInfo(
                name=_str(lib.ggml_backend_dev_name(dev)) or "?",
                description=_str(lib.ggml_backend_dev_description(dev)) or "",
                kind=DEVICE_TYPE.get(int(lib.ggml_backend_dev_type(dev)), "other"),
                backend=(_str(lib.ggml_backend_reg_name(reg)) or "?") if reg != NULL else "?",
                memory_free=int(free[0]),
                memory_total=int(total[0]),
            )
        )
    return out


def backends() -> list[str]:
    return [_str(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i))) or "?" for i in range(int(lib.ggml_backend_reg_count()))]


def release(ptr: CData) -> None:
    """Run an ``ffi.gc`` destructor now (idempotent in cffi)."""
    ffi.release(ptr)


# ---------------------------------------------------------------- params


_MODEL_FIELDS = ("n_gpu_layers", "split_mode", "load_mode", "main_gpu", "vocab_only", "check_tensors", "load_mtp")
_CONTEXT_FIELDS = (
    "n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_rs_seq", "n_outputs_max", "n_outputs_max_per_seq",
    "n_threads", "n_threads_batch", "flash_attn_type", "type_k", "type_v", "offload_kqv", "no_perf",
    "op_offload", "swa_full", "kv_unified",
)


def model_default_params() -> dict[str, Any]:
    p = lib.llama_model_default_params()
    return {f: getattr(p, f) for f in _MODEL_FIELDS}


def context_default_params() -> dict[str, Any]:
    p = lib.llama_context_default_params()
    return {f: getattr(p, f) for f in _CONTEXT_FIELDS}


# ---------------------------------------------------------------- model


def model_load(path: str | os.PathLike[str], overrides: dict[str, Any], progress: LoadProgress) -> CData | None:
    params = lib.llama_model_default_params()  # llama.cpp's defaults, then ours on top
    for key, value in overrides.items():
        setattr(params, key, value)
    params.progress_callback = lib._lmtp_on_progress
    params.progress_callback_user_data = progress.handle
    ptr = lib.llama_model_load_from_file(os.fsencode(path), params)
    if ptr == NULL:
        return None
    return ffi.gc(ptr, lib.llama_model_free)


def model_info(model: CData) -> dict[str, Any]:
    buf = ffi.new("char[]", 256)
    lib.llama_model_desc(model, buf, 256)
    n_layers = int(lib.llama_model_n_layer(model)) + int(lib.llama_model_n_layer_nextn(model))
    # llama_model_n_head(_kv) read layer 0 and GGML_ABORT when there is none (vocab-only files)
    has_layers = n_layers > 0
    return {
        "n_ctx_train": int(lib.llama_model_n_ctx_train(model)),
        "n_embd": int(lib.llama_model_n_embd(model)),
        "n_embd_inp": int(lib.llama_model_n_embd_inp(model)),
        "n_embd_out": int(lib.llama_model_n_embd_out(model)),
        "n_layer": int(lib.llama_model_n_layer(model)),
        "n_layer_nextn": int(lib.llama_model_n_layer_nextn(model)),
        "n_head": int(lib.llama_model_n_head(model)) if has_layers else 0,
        "n_head_kv": int(lib.llama_model_n_head_kv(model)) if has_layers else 0,
        "size": int(lib.llama_model_size(model)),
        "n_params": int(lib.llama_model_n_params(model)),
        "description": ffi.string(buf).decode("utf-8", "replace"),
        "is_recurrent": bool(lib.llama_model_is_recurrent(model)),
        "is_hybrid": bool(lib.llama_model_is_hybrid(model)),
        # multi-section RoPE (Qwen3.5's IMROPE and kin): a sequence's positions may jump forward
        "positions_may_jump": int(lib.llama_model_rope_type(model)) in (
            lib.LLAMA_ROPE_TYPE_MROPE, lib.LLAMA_ROPE_TYPE_IMROPE, lib.LLAMA_ROPE_TYPE_VISION),
        "has_encoder": bool(lib.llama_model_has_encoder(model)),
    }


def _two_pass_str(fn: Any, *args: Any) -> str | None:
    size = 256
    while True:
        buf = ffi.new("char[]", size)
        n = int(fn(*args, buf, size))
        if n < 0:
            return None
        if n < size:
            return bytes(ffi.buffer(buf, n)).decode("utf-8", "replace")
        size = n + 1


def model_meta(model: CData) -> dict[str, str]:
    out: dict[str, str] = {}
    for i in range(int(lib.llama_model_meta_count(model))):
        key = _two_pass_str(lib.llama_model_meta_key_by_index, model, i)
        val = _two_pass_str(lib.llama_model_meta_val_str_by_index, model, i)
        if key is not None and val is not None:
            out[key] = val
    return out


def model_meta_get(model: CData, key: str) -> str | None:
    return _two_pass_str(lib.llama_model_meta_val_str, model, key.encode())


def model_chat_template(model: CData, name: str | None = None) -> str | None:
    return _str(lib.llama_model_chat_template(model, name.encode() if name else NULL))


# ---------------------------------------------------------------- vocab


def model_vocab(model: CData) -> CData:
    return lib.llama_model_get_vocab(model)


def vocab_info(vocab: CData) -> dict[str, Any]:
    return {
        "n_tokens": int(lib.llama_vocab_n_tokens(vocab)),
        "type": VOCAB_TYPE.get(int(lib.llama_vocab_type(vocab)), "unknown"),
        "bos": int(lib.llama_vocab_bos(vocab)),
        "eos": int(lib.llama_vocab_eos(vocab)),
        "eot": int(lib.llama_vocab_eot(vocab)),
        "nl": int(lib.llama_vocab_nl(vocab)),
        "pad": int(lib.llama_vocab_pad(vocab)),
        "add_bos": bool(lib.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(lib.llama_vocab_get_add_eos(vocab)),
    }


def vocab_eog_mask(vocab: CData, n_tokens: int) -> npt.NDArray[np.bool_]:
    return np.fromiter((bool(lib.llama_vocab_is_eog(vocab, t)) for t in range(n_tokens)), dtype=bool, count=n_tokens)


def vocab_is_control(vocab: CData, token: int) -> bool:
    return bool(lib.llama_vocab_is_control(vocab, token))


def vocab_text(vocab: CData, token: int) -> str | None:
    return _str(lib.llama_vocab_get_text(vocab, token))


def tokenize(vocab: CData, text: bytes, add_special: bool, parse_special: bool) -> npt.NDArray[np.int32] | None:
    """Two passes: guess, then exactly the size llama.cpp asks for; None on overflow."""
    n_max = len(text) + 8
    for _ in range(2):
        out = np.empty(n_max, dtype=np.int32)
        n = int(lib.llama_tokenize(vocab, text, len(text), ffi.from_buffer("llama_token[]", out), n_max,
                                   add_special, parse_special))
        if n == INT32_MIN:
            return None
        if n >= 0:
            return out[:n].copy()
        n_max = -n
    return None


def token_to_piece(vocab: CData, token: int, special: bool) -> bytes:
    size = 32
    while True:
        buf = ffi.new("char[]", size)
        n = int(lib.llama_token_to_piece(vocab, token, buf, size, 0, special))
        if n >= 0:
            return bytes(ffi.buffer(buf, n))
        size = -n


def detokenize(vocab: CData, tokens: npt.NDArray[np.int32], remove_special: bool, unparse_special: bool) -> bytes | None:
    arr = np.ascontiguousarray(tokens, dtype=np.int32)
    size = max(64, 8 * len(arr))
    for _ in range(2):
        buf = ffi.new("char[]", size)
        n = int(lib.llama_detokenize(vocab, ffi.from_buffer("llama_token[]", arr), len(arr), buf, size,
                                     remove_special, unparse_special))
        if n == INT32_MIN:
            return None
        if n >= 0:
            return bytes(ffi.buffer(buf, n))
        size = -n
    return None


def chat_apply_template(template: str, messages: list[tuple[str, str]], add_assistant: bool) -> str | None:
    keep = []
    chat = ffi.new("llama_chat_message[]", len(messages))
    total = 0
    for i, (role, content) in enumerate(messages):
        r = ffi.new("char[]", role.encode())
        c = ffi.new("char[]", content.encode())
        keep += [r, c]
        chat[i].role = r
        chat[i].content = c
        total += len(role) + len(content)
    tmpl = ffi.new("char[]", template.encode())
    size = max(256, 2 * total + 256)
    for _ in range(2):
        buf = ffi.new("char[]", size)
        n = int(lib.llama_chat_apply_template(tmpl, chat, len(messages), add_assistant, buf, size))
        if n < 0:
            return None
        if n <= size:
            return bytes(ffi.buffer(buf, n)).decode("utf-8", "replace")
        size = n + 1
    return None


# ---------------------------------------------------------------- context


def new_abort_state() -> CData:
    return ffi.new("struct lmtp_abort_state *")


def abort_request(state: CData, value: bool) -> None:
    state.requested = 1 if value else 0


def context_new(model: CData, overrides: dict[str, Any], mtp: bool, abort_state: CData) -> CData | None:
    params = lib.llama_context_default_params()
    for key, value in overrides.items():
        setattr(params, key, value)
    params.ctx_type = CONTEXT_MTP if mtp else CONTEXT_DEFAULT
    params.abort_callback = ffi.addressof(lib, "lmtp_abort_cb")
    params.abort_callback_data = abort_state
    ptr = lib.llama_init_from_model(model, params)
    if ptr == NULL:
        return None
    free = lib.llama_free

    def destroy(p: CData, _model: CData = model, _state: CData = abort_state) -> None:
        free(p)  # the closure keeps the model (and the abort flag) alive until the context is gone

    return ffi.gc(ptr, destroy)


def context_info(ctx: CData) -> dict[str, int]:
    return {
        "n_ctx": int(lib.llama_n_ctx(ctx)),
        "n_ctx_seq": int(lib.llama_n_ctx_seq(ctx)),
        "n_batch": int(lib.llama_n_batch(ctx)),
        "n_ubatch": int(lib.llama_n_ubatch(ctx)),
        "n_seq_max": int(lib.llama_n_seq_max(ctx)),
        "n_rs_seq": int(lib.llama_n_rs_seq(ctx)),
        "n_threads": int(lib.llama_n_threads(ctx)),
        "n_threads_batch": int(lib.llama_n_threads_batch(ctx)),
    }


def set_n_threads(ctx: CData, n_threads: int, n_threads_batch: int) -> None:
    lib.llama_set_n_threads(ctx, n_threads, n_threads_batch)


def set_embeddings_nextn(ctx: CData, value: bool, masked: bool) -> None:
    lib.lmtp_set_embeddings_nextn(ctx, value, masked)


def set_nextn_layer_offset(ctx: CData, offset: int) -> None:
    lib.lmtp_set_nextn_layer_offset(ctx, offset)


def decode(ctx: CData, batch: CData, exact_rollback: bool, abort_state: CData,
           dropped: npt.NDArray[np.int8]) -> tuple[int, bool]:
    """``lmtp_decode``; returns (llama_decode's code, whether a SIGINT arrived)."""
    lib.lmtp_sigint_arm()
    rc = int(lib.lmtp_decode(ctx, batch[0], exact_rollback, abort_state,
                             ffi.from_buffer("int8_t[]", dropped)))
    return rc, bool(abort_state.by_signal)


class OutputView:
    """The numpy ``base`` of a zero-copy view into a context's output buffer.

    It holds the context's (and so the model's) native handle: the buffer it
    points into cannot be freed while any array built on it is alive.
    """

    __slots__ = ("__array_interface__", "owner", "__weakref__")

    def __init__(self, ptr: CData, shape: tuple[int, ...], owner: object) -> None:
        self.__array_interface__ = {
            "data": (int(ffi.cast("uintptr_t", ptr)), True),  # read-only
            "shape": shape,
            "typestr": "<f4",
            "version": 3,
        }
        self.owner = owner


def _view(ptr: CData, shape: tuple[int, ...], owner: object) -> tuple[npt.NDArray[np.float32], OutputView]:
    base = OutputView(ptr, shape, owner)
    return np.asarray(base), base


def logits_rows(ctx: CData, n_rows: int, n_vocab: int, owner: object) -> tuple[npt.NDArray[np.float32], OutputView] | None:
    ptr = lib.llama_get_logits(ctx)
    return None if ptr == NULL else _view(ptr, (n_rows, n_vocab), owner)


def logits_ith(ctx: CData, i: int, n_vocab: int, owner: object) -> tuple[npt.NDArray[np.float32], OutputView] | None:
    ptr = lib.llama_get_logits_ith(ctx, i)
    return None if ptr == NULL else _view(ptr, (n_vocab,), owner)


def nextn_rows(ctx: CData, n_rows: int, n_embd: int, owner: object) -> tuple[npt.NDArray[np.float32], OutputView] | None:
    ptr = lib.lmtp_get_embeddings_nextn(ctx)
    return None if ptr == NULL else _view(ptr, (n_rows, n_embd), owner)


def nextn_ith(ctx: CData, i: int, n_embd: int, owner: object) -> tuple[npt.NDArray[np.float32], OutputView] | None:
    ptr = lib.lmtp_get_embeddings_nextn_ith(ctx, i)
    return None if ptr == NULL else _view(ptr, (n_embd,), owner)


def perf(ctx: CData) -> dict[str, float]:
    p = lib.llama_perf_context(ctx)
    return {"t_load_ms": p.t_load_ms, "t_p_eval_ms": p.t_p_eval_ms, "t_eval_ms": p.t_eval_ms,
            "n_p_eval": p.n_p_eval, "n_eval": p.n_eval, "n_reused": p.n_reused}


def perf_reset(ctx: CData) -> None:
    lib.llama_perf_context_reset(ctx)


# ---------------------------------------------------------------- memory


def memory(ctx: CData) -> CData:
    return lib.llama_get_memory(ctx)


def mem_clear(mem: CData, data: bool) -> None:
    lib.llama_memory_clear(mem, data)


def mem_seq_rm(mem: CData, seq: int, p0: int, p1: int) -> bool:
    return bool(lib.llama_memory_seq_rm(mem, seq, p0, p1))


def mem_seq_cp(mem: CData, src: int, dst: int, p0: int, p1: int) -> None:
    lib.llama_memory_seq_cp(mem, src, dst, p0, p1)


def mem_seq_keep(mem: CData, seq: int) -> None:
    lib.llama_memory_seq_keep(mem, seq)


def mem_seq_add(mem: CData, seq: int, p0: int, p1: int, delta: int) -> None:
    lib.llama_memory_seq_add(mem, seq, p0, p1, delta)


def mem_pos_min(mem: CData, seq: int) -> int:
    return int(lib.llama_memory_seq_pos_min(mem, seq))


def mem_pos_max(mem: CData, seq: int) -> int:
    return int(lib.llama_memory_seq_pos_max(mem, seq))


def mem_can_shift(mem: CData) -> bool:
    return bool(lib.llama_memory_can_shift(mem))


def state_seq_size(ctx: CData, seq: int, flags: int) -> int:
    return int(lib.llama_state_seq_get_size_ext(ctx, seq, flags))


def state_seq_get_into(ctx: CData, seq: int, flags: int, buf: npt.NDArray[np.uint8], size: int) -> int:
    """Serialize a sequence's state (``size`` bytes, from :func:`state_seq_size`) into ``buf``;
    the bytes written, 0 on failure."""
    return int(lib.llama_state_seq_get_data_ext(ctx, ffi.from_buffer("uint8_t[]", buf), size, seq, flags))


def state_seq_get(ctx: CData, seq: int, flags: int) -> bytes | None:
    size = state_seq_size(ctx, seq, flags)
    if size == 0:
        return None
    buf = np.empty(size, dtype=np.uint8)
    n = state_seq_get_into(ctx, seq, flags, buf, size)
    return None if n == 0 else buf[:n].tobytes()


def state_seq_set(ctx: CData, data: bytes | npt.NDArray[np.uint8], seq: int, flags: int) -> int:
    return int(lib.llama_state_seq_set_data_ext(ctx, ffi.from_buffer("uint8_t[]", data), len(data), seq, flags))


# ---------------------------------------------------------------- batch


class BatchStruct:
    """A ``llama_batch`` whose arrays are Python-owned numpy buffers.

    The caller fills the numpy arrays; ``n_tokens`` is set per decode. The
    ``seq_id`` pointer table points into the rows of ``seq`` once, at birth.
    """

    __slots__ = ("ptr", "_keep")

    def __init__(
        self,
        token: npt.NDArray[np.int32],
        embd: npt.NDArray[np.float32] | None,
        pos: npt.NDArray[np.int32],
        n_seq_id: npt.NDArray[np.int32],
        seq: npt.NDArray[np.int32],
        logits: npt.NDArray[np.int8],
    ) -> None:
        capacity = len(pos)
        ptr = ffi.new("llama_batch *")
        seq_table = ffi.new("llama_seq_id *[]", capacity)
        base = ffi.cast("llama_seq_id *", ffi.from_buffer(seq))
        stride = seq.shape[1]
        for i in range(capacity):
            seq_table[i] = base + i * stride
        ptr.token = ffi.from_buffer("llama_token[]", token)
        ptr.embd = ffi.from_buffer("float[]", embd) if embd is not None else NULL
        ptr.pos = ffi.from_buffer("llama_pos[]", pos)
        ptr.n_seq_id = ffi.from_buffer("int32_t[]", n_seq_id)
        ptr.seq_id = seq_table
        ptr.logits = ffi.from_buffer("int8_t[]", logits)
        ptr.n_tokens = 0
        self.ptr = ptr
        self._keep = (token, embd, pos, n_seq_id, seq, logits, seq_table, base)

    def set_n_tokens(self, n: int) -> None:
        self.ptr.n_tokens = n


# ---------------------------------------------------------------- draft head


def head_new(model: CData, capacity: int) -> CData | None:
    ptr = lib.lmtp_head_new(model, capacity)
    if ptr == NULL:
        return None
    return ffi.gc(ptr, lib.lmtp_head_free)


def head_add(head: CData, ids: npt.NDArray[np.int32]) -> int:
    """Append the rows of ``ids`` (contiguous int32): the new row count, or -1."""
    return int(lib.lmtp_head_add(head, ffi.from_buffer("int32_t[]", ids), len(ids)))


def head_rows(head: CData) -> int:
    return int(lib.lmtp_head_rows(head))


def head_logits(head: CData, x: npt.NDArray[np.float32], out: npt.NDArray[np.float32], n_threads: int) -> int:
    """``out[r, j] = row j . x[r]`` (both C-contiguous float32); 0, or -1."""
    return int(lib.lmtp_head_logits(head, ffi.from_buffer("float[]", x), x.shape[0],
                                    ffi.from_buffer("float[]", out, require_writable=True), n_threads))
