"""A fast, read-only scan of a GGUF header: metadata keys and the tensor table.

llama.cpp loads what it is given, and a few valid-looking files make it abort
the whole process later (a target context on an MTP-only sidecar; an F16 GDN
conv kernel, which ggml's ssm_conv asserts is F32). :class:`Model` scans the
header first to refuse those with a clear error. The scan never rejects a file
on its own account: if the header cannot be parsed, llama.cpp gets the file
and reports what is wrong with it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["GGUFInfo", "TensorInfo", "scan"]

# GGUF value types
_U8, _I8, _U16, _I16, _U32, _I32, _F32, _BOOL, _STR, _ARR, _U64, _I64, _F64 = range(13)
_FIXED = {_U8: "<B", _I8: "<b", _U16: "<H", _I16: "<h", _U32: "<I", _I32: "<i", _F32: "<f", _BOOL: "<?",
          _U64: "<Q", _I64: "<q", _F64: "<d"}
_MAX_STR = 1 << 26
_MAX_COUNT = 1 << 24
GGML_F32 = 0


class _Bad(Exception):
    pass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order (ne0 first)
    ggml_type: int
    offset: int


@dataclass
class GGUFInfo:
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)  # scalars and short arrays; long arrays as their length
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    data_offset: int = 0  # where the tensor data section starts in the file
    duplicate_tokens: list[str] = field(default_factory=list)  # tokenizer.ggml.tokens listed twice

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)


class _Cursor:
    """Sequential reads from a memory map (no copies for what is skipped)."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise _Bad("truncated")
        self.pos = start + n
        return start

    def unpack(self, fmt: str) -> Any:
        start = self.take(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, start)[0]

    def u32(self) -> int:
        return int(self.unpack("<I"))

    def u64(self) -> int:
        return int(self.unpack("<Q"))

    def string(self) -> str:
        n = self.u64()
        if n > _MAX_STR:
            raise _Bad("string too long")
        start = self.take(n)
        return bytes(self.buf[start:start + n]).decode("utf-8", "replace")

    def skip_string(self) -> None:
        n = self.u64()
        if n > _MAX_STR:
            raise _Bad("string too long")
        self.take(n)


def _value(c: _Cursor, vtype: int, keep_array: bool) -> Any:
    if vtype in _FIXED:
        return c.unpack(_FIXED[vtype])
    if vtype == _STR:
        return c.string()
    if vtype == _ARR:
        sub = c.u32()
        n = c.u64()
        if n > _MAX_COUNT:
            raise _Bad("array too long")
        keep = keep_array and n <= 64
        if sub in _FIXED:
            fmt = _FIXED[sub]
            start = c.take(struct.calcsize(fmt) * n)
            return list(struct.unpack_from("<" + fmt[1] * n, c.buf, start)) if keep else n
        if sub == _STR and not keep:
            for _ in range(n):
                c.skip_string()
            return n
        items = [_value(c, sub, keep_array) for _ in range(n)]
        return items if keep else n
    raise _Bad(f"unknown value type {vtype}")


def _token_list(c: _Cursor, info: GGUFInfo) -> int:
    """Skip the vocabulary, noting tokens listed twice (llama.cpp asserts they are unique)."""
    sub = c.u32()
    n = c.u64()
    if sub != _STR or n > _MAX_COUNT:
        for _ in range(n if n <= _MAX_COUNT else 0):
            _value(c, sub, False)
        if n > _MAX_COUNT:
            raise _Bad("array too long")
        return n
    seen: set[bytes] = set()
    buf = c.buf
    for _ in range(n):
        ln = c.u64()
        if ln > _MAX_STR:
            raise _Bad("string too long")
        start = c.take(ln)
        tok = bytes(buf[start:start + ln]).split(b"\0", 1)[0]  # llama.cpp reads them as C strings
        if tok in seen and len(info.duplicate_tokens) < 3:
            info.duplicate_tokens.append(tok.decode("utf-8", "replace"))
        seen.add(tok)
    return n


def scan(path: str | Path) -> GGUFInfo | None:
    """Header, metadata and tensor table of a GGUF file; None if it cannot be parsed."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            c = _Cursor(buf)
            if bytes(buf[:4]) != b"GGUF":
                return None
            c.take(4)
            version = c.u32()
            n_tensors, n_kv = c.u64(), c.u64()
            if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
                return None
            info = GGUFInfo(version=version)
            for _ in range(n_kv):
                key = c.string()
                vtype = c.u32()
                if key == "tokenizer.ggml.tokens" and vtype == _ARR:
                    info.metadata[key] = _token_list(c, info)
                    continue
                info.metadata[key] = _value(c, vtype, keep_array=not key.startswith("tokenizer."))
            for _ in range(n_tensors):
                name = c.string()
                n_dims = c.u32()
                if n_dims > 8:
                    return None
                shape = tuple(c.u64() for _ in range(n_dims))
                gtype = c.u32()
                info.tensors[name] = TensorInfo(name, shape, gtype, c.u64())
            align = info.metadata.get("general.alignment", 32)
            align = align if isinstance(align, int) and align > 0 else 32
            info.data_offset = -(-c.pos // align) * align
            return info
    except (OSError, ValueError, _Bad, struct.error, MemoryError):
        return None


# archs whose graphs share qwen35's tensor layout (trunk, GDN, MTP block)
QWEN35_FAMILY = frozenset({"qwen35", "qwen35moe", "qwen3next"})


def problems(info: GGUFInfo, max_layers: int = 512) -> list[str]:
    """What in this file would make llama.cpp abort the process (at load or run time)."""
    out = []
    if info.duplicate_tokens:
        out.append(f"the vocabulary lists the token {info.duplicate_tokens[0]!r} more than once "
                   "(llama.cpp asserts every token is unique)")
    def num(key: str) -> int | None:
        v = info.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    n_all, nextn = num("block_count"), num("nextn_predict_layers")
    if n_all is not None and not 0 < n_all <= max_layers:
        out.append(f"block_count must be in 1..{max_layers}, got {n_all}")
    if n_all is not None and nextn is not None and nextn > n_all:
        out.append(f"nextn_predict_layers ({nextn}) exceeds block_count ({n_all})")
    if info.arch in QWEN35_FAMILY:
        interval = num("full_attention_interval")
        if interval is not None and interval < 1:
            out.append(f"full_attention_interval must be >= 1, got {interval} (llama.cpp divides by it)")
        state, rank, inner = num("ssm.state_size"), num("ssm.time_step_rank"), num("ssm.inner_size")
        if state is not None and rank is not None and inner is not None and inner != state * rank:
            out.append(f"ssm.inner_size ({inner}) must equal ssm.state_size x ssm.time_step_rank ({state} x {rank})")
        sections = info.get("rope.dimension_sections")
        head = num("attention.key_length")
        if head is None and num("embedding_length") and num("attention.head_count"):
            head = num("embedding_length") // max(1, num("attention.head_count") or 1)  # type: ignore[operator]
        n_rot = num("rope.dimension_count")
        if n_rot is not None and (n_rot <= 0 or n_rot % 2 or (head is not None and n_rot > head)):
            out.append(f"rope.dimension_count must be even and in 2..head size ({head}), got {n_rot}")
        limit = n_rot if n_rot is not None else head
        if isinstance(sections, list) and any(int(x) < 0 for x in sections):
            out.append(f"rope.dimension_sections {sections} must not be negative")
        elif isinstance(sections, list) and limit is not None and sum(int(x) for x in sections) > limit:
            out.append(f"rope.dimension_sections {sections} add up to more than the rotated dimensions ({limit})")
        if isinstance(sections, list) and len(sections) >= 3 and not any(int(x) > 0 for x in sections[:3]):
            out.append(f"rope.dimension_sections {sections} needs a positive section among the first three")
        vec = next((t for t in info.tensors.values() if len(t.shape) == 1 and t.ggml_type != GGML_F32), None)
        if vec is not None:
            out.append(f"tensor {vec.name} (a norm, bias or gate vector) must be F32 (ggml's CPU ops assert it), "
                       f"the file stores type {vec.ggml_type}")
        conv = next((t for t in info.tensors.values()
                     if t.name.endswith("ssm_conv1d.weight") and t.ggml_type != GGML_F32), None)
        if conv is not None:
            out.append(f"tensor {conv.name} must be F32 (ggml's ssm_conv asserts it), the file stores type {conv.ggml_type}")
    return out


def is_mtp_only(info: GGUFInfo) -> bool:
    """An MTP sidecar (``convert_hf_to_gguf.py --mtp``): the MTP block without the trunk."""
    nextn = info.get("nextn_predict_layers", 0)
    return bool(nextn) and "blk.0.attn_norm.weight" not in info.tensors
