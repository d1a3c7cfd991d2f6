"""Model: a loaded GGUF (weights, vocabulary, metadata), owned from birth."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _native, gguf_scan
from ._native import calls
from .errors import ClosedError, ContextError, ModelLoadError, MTPUnavailableError, TokenizeError, check_ptr, clear_log
from .params import ModelParams

if TYPE_CHECKING:
    from typing_extensions import Self

    from .context import Context

__all__ = ["Model"]

# archs whose MTP graph chains several NextN heads; every other arch asserts exactly one
_CHAIN_HEAD_ARCHS = frozenset({"step35", "mimo2", "hy-v3", "hy_v3"})
_GGUF_MAGIC = b"GGUF"


class Model:
    """A GGUF model loaded by llama.cpp.

    >>> with Model("model.gguf") as m:          # doctest: +SKIP
    ...     print(m.arch, m.n_vocab, m.has_mtp)

    ``params`` (or keyword overrides of :class:`ModelParams`) choose GPU layers,
    mmap/mlock, and whether the MTP head is loaded (by default: when present).
    ``progress`` is called with a fraction in [0, 1] while loading; returning
    ``False`` cancels the load. Ctrl-C during a load raises ``KeyboardInterrupt``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        params: ModelParams | None = None,
        *,
        progress: Callable[[float], bool | None] | None = None,
        **overrides: Any,
    ) -> None:
        self._ptr: Any = None
        self._metadata: dict[str, str] | None = None
        self._children: weakref.WeakSet[Context] = weakref.WeakSet()
        params = (params or ModelParams()).replace(**overrides) if overrides else (params or ModelParams())
        self.params = params
        self.path = Path(os.fspath(path))
        _check_file(self.path)
        header = gguf_scan.scan(self.path)  # None: unparseable here; llama.cpp will say why
        if header is not None:
            bad = gguf_scan.problems(header, max_layers=calls.MAX_LAYERS)
            if bad:
                raise ModelLoadError(f"refusing {self.path.name}: {bad[0]}")
        self.mtp_only = header is not None and gguf_scan.is_mtp_only(header)

        _native.ensure_backend()
        clear_log()
        state = _native.LoadProgress(progress)
        ptr = calls.model_load(self.path, params._to_c(), state)
        if state.error is None and _native.take_interrupt():
            state.error = KeyboardInterrupt()
        if state.error is not None:
            if ptr is not None:
                calls.release(ptr)
            raise state.error
        self._ptr = check_ptr(ptr, ModelLoadError, f"could not load model from {self.path}")
        self._vocab = calls.model_vocab(self._ptr)
        self._info = calls.model_info(self._ptr)
        self._vinfo = calls.vocab_info(self._vocab)
        if params.mtp is True and not self.has_mtp:
            self.close()
            raise MTPUnavailableError(
                f"{self.path.name} has no MTP (nextn) layers; load it with mtp=False (plain decoding), "
                "or use a GGUF converted with its MTP head"
            )

    # ------------------------------------------------------------ ownership

    def _handle(self) -> Any:
        if self._ptr is None:
            raise ClosedError("Model is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def close(self) -> None:
        """Free the model now (idempotent). Live contexts on it are closed first.

        If a context still has outputs viewed by numpy arrays, the native memory
        is freed only once those arrays are gone (never under a live view).
        """
        if self._ptr is None:
            return
        deferred = False
        for child in list(self._children):
            deferred |= child._close(from_model=True)
        ptr, self._ptr = self._ptr, None
        if not deferred:
            calls.release(ptr)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._ptr is None else f"{self.arch}, {self.n_params / 1e6:.1f}M params, mtp={self.has_mtp}"
        return f"<Model {self.path.name}: {state}>"

    def _register(self, ctx: Context) -> None:
        self._children.add(ctx)

    # ------------------------------------------------------------ properties

    @property
    def metadata(self) -> dict[str, str]:
        """GGUF metadata (scalar values as strings, as llama.cpp reports them); read once,
        and like every other accessor refused once the model is closed."""
        handle = self._handle()
        if self._metadata is None:
            self._metadata = calls.model_meta(handle)
        return self._metadata

    @property
    def arch(self) -> str:
        return self.metadata.get("general.architecture", "unknown")

    @property
    def name(self) -> str:
        return self.metadata.get("general.name", self.path.stem)

    @property
    def description(self) -> str:
        return str(self._info["description"])

    n_ctx_train = property(lambda self: int(self._info["n_ctx_train"]), doc="training context length")
    n_embd = property(lambda self: int(self._info["n_embd"]), doc="embedding width")
    n_embd_out = property(lambda self: int(self._info["n_embd_out"]), doc="width of the hidden (nextn) rows")
    n_layer = property(lambda self: int(self._info["n_layer"]), doc="trunk layers (without MTP layers)")
    n_head = property(lambda self: int(self._info["n_head"]), doc="attention heads")
    n_head_kv = property(lambda self: int(self._info["n_head_kv"]), doc="KV heads")
    size = property(lambda self: int(self._info["size"]), doc="bytes of all tensors")
    n_params = property(lambda self: int(self._info["n_params"]), doc="number of parameters")
    positions_may_jump = property(lambda self: bool(self._info["positions_may_jump"]),
                                  doc="a sequence's positions may skip ahead (multi-section RoPE)")
    is_recurrent = property(lambda self: bool(self._info["is_recurrent"]), doc="purely recurrent (Mamba, RWKV)")
    is_hybrid = property(lambda self: bool(self._info["is_hybrid"]), doc="recurrent + attention (Qwen3.5)")

    @property
    def offloads(self) -> bool:
        """Whether its layers may run on a GPU: a GPU build with a device, layers not kept
        on the CPU (``n_gpu_layers=0``)."""
        return bool(calls.capabilities()["gpu_offload"]) and self.params.n_gpu_layers != 0

    @property
    def n_layer_nextn(self) -> int:
        """MTP (nextn) layers in the file, loaded or not."""
        return int(self._info["n_layer_nextn"])

    @property
    def mtp_loaded(self) -> bool:
        """Whether the MTP tensors were loaded (``mtp`` was not ``False``)."""
        return self.params.mtp is not False and self.n_layer_nextn > 0

    @property
    def has_mtp(self) -> bool:
        """An MTP context can be created on this model as loaded."""
        return self.mtp_loaded and not self.params.vocab_only

    def require_trunk(self) -> None:
        """Refuse what would abort llama.cpp: running the trunk of an MTP-only sidecar."""
        if self.mtp_only:
            raise ContextError(
                f"{self.path.name} holds only an MTP head (an MTP sidecar GGUF): use it as the MTP model "
                "of an engine (mtp_model=...) next to the full target model"
            )

    def mtp_unavailable_reason(self) -> str | None:
        """Why an MTP context cannot be made on this model, or None if it can."""
        if self.n_layer_nextn == 0:
            return (f"{self.path.name} ({self.arch}) has no MTP (nextn) layers; use plain decoding (mtp=False) "
                    "or a GGUF converted with its MTP head")
        if self.params.mtp is False:
            return f"{self.path.name} was loaded with mtp=False; load it again with mtp=None or True"
        if self.params.vocab_only:
            return f"{self.path.name} was loaded vocab-only"
        if self.n_layer_nextn > 1 and self.arch not in _CHAIN_HEAD_ARCHS:
            return f"{self.arch} supports exactly one MTP layer, the file has {self.n_layer_nextn}"
        return None

    def require_mtp(self) -> None:
        reason = self.mtp_unavailable_reason()
        if reason is not None:
            raise MTPUnavailableError(reason)

    @property
    def chat_template(self) -> str | None:
        return calls.model_chat_template(self._handle())

    # ------------------------------------------------------------ vocabulary

    @property
    def n_vocab(self) -> int:
        return int(self._vinfo["n_tokens"])

    @property
    def vocab_type(self) -> str:
        return str(self._vinfo["type"])

    def _special(self, key: str) -> int | None:
        tok = int(self._vinfo[key])
        return None if tok == calls.TOKEN_NULL else tok

    @property
    def bos(self) -> int | None:
        return self._special("bos")

    @property
    def eos(self) -> int | None:
        return self._special("eos")

    @property
    def eot(self) -> int | None:
        return self._special("eot")

    @property
    def nl(self) -> int | None:
        return self._special("nl")

    @property
    def add_bos(self) -> bool:
        return bool(self._vinfo["add_bos"])

    @cached_property
    def eog_mask(self) -> np.ndarray:
        """Boolean mask over the vocabulary: end-of-generation tokens."""
        return calls.vocab_eog_mask(self._vocab_handle(), self.n_vocab)

    def is_eog(self, token: int) -> bool:
        self._check_token(token)
        return bool(self.eog_mask[token])

    def _vocab_handle(self) -> Any:
        self._handle()
        if self._vinfo["type"] == "none":
            raise TokenizeError(f"{self.path.name} has no vocabulary (tokenizer.ggml.model = none)")
        return self._vocab

    def _check_token(self, token: int) -> None:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= int(token) < self.n_vocab:
            raise TokenizeError(f"token id {token!r} is out of range [0, {self.n_vocab})")

    def tokenize(self, text: str | bytes, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text to token ids (``add_special`` adds BOS/EOS as the model asks)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if len(data) >= 2**31 - 16:
            raise TokenizeError("text too long to tokenize (over 2 GiB)")
        if add_special and ((self.add_bos and self.bos is None) or (bool(self._vinfo["add_eos"]) and self.eos is None)):
            # llama.cpp asserts here: the file asks for a BOS/EOS token it does not define
            raise TokenizeError(f"{self.path.name} asks to add a BOS/EOS token it does not define; "
                                "tokenize with add_special=False")
        out = calls.tokenize(self._vocab_handle(), data, add_special, parse_special)
        if out is None:
            raise TokenizeError("tokenization overflowed (more than 2**31 tokens)")
        ids: list[int] = out.tolist()
        return ids

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character)."""
        self._check_token(token)
        return calls.token_to_piece(self._vocab_handle(), int(token), special)

    def detokenize(self, tokens: Iterable[int], *, remove_special: bool = False, unparse_special: bool = False) -> str:
        """Token ids to text (invalid UTF-8 is replaced)."""
        return self.detokenize_bytes(tokens, remove_special=remove_special,
                                     unparse_special=unparse_special).decode("utf-8", "replace")

    def detokenize_bytes(self, tokens: Iterable[int], *, remove_special: bool = False,
                         unparse_special: bool = False) -> bytes:
        arr = self.check_tokens(tokens)
        out = calls.detokenize(self._vocab_handle(), arr, remove_special, unparse_special)
        if out is None:
            raise TokenizeError("detokenization overflowed")
        return out

    def check_tokens(self, tokens: Iterable[int]) -> np.ndarray:
        """Validate token ids (integers in [0, n_vocab)); returns them as int32."""
        seq = tokens if isinstance(tokens, np.ndarray) else list(tokens)
        try:
            arr = np.asarray(seq)
        except (TypeError, ValueError) as exc:
            raise TokenizeError(f"tokens must be integers: {exc}") from exc
        if arr.size == 0:
            return np.zeros(0, dtype=np.int32)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise TokenizeError("tokens must be a flat sequence of integers")
        bad = (arr < 0) | (arr >= self.n_vocab)
        if bad.any():
            raise TokenizeError(f"token id {int(arr[bad][0])} is out of range [0, {self.n_vocab})")
        return arr.astype(np.int32)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]] | Sequence[tuple[str, str]],
        *,
        add_generation_prompt: bool = True,
        template: str | None = None,
    ) -> str:
        """Format a chat with the model's template (llama.cpp's built-in template matcher)."""
        pairs: list[tuple[str, str]] = []
        for m in messages:
            role, content = (m["role"], m["content"]) if isinstance(m, dict) else m
            if not isinstance(role, str) or not isinstance(content, str):
                raise ValueError("each message needs a string role and content")
            pairs.append((role, content))
        tmpl = template or self.chat_template or "chatml"
        out = calls.chat_apply_template(tmpl, pairs, add_generation_prompt)
        if out is None:
            raise ValueError(f"llama.cpp does not support this chat template: {tmpl[:80]!r}")
        return out


def _check_file(path: Path) -> None:
    """Refuse what llama.cpp would only fail on (or worse) with a clear message."""
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory, not a GGUF file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from exc
    if len(magic) < 4:
        raise ModelLoadError(f"{path} is empty or truncated (no GGUF header)")
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
