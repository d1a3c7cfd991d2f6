"""A cache of the adaptive policy's calibration: what decodes of each shape cost on this
machine, with this model and these settings.

An engine with ``draft_max="auto"`` times its decode shapes once at birth (target decodes
of 1 .. draft_max + 1 rows, MTP draft decodes, checkpoint saves, the other rollback mode's
tax) -- on a 2-core CPU with a 0.3B model 2.0 s for one sequence and 5.2 s for four, more
than a 128-token generation takes. The shapes of those curves belong to the hardware, the
model file and the settings, so they are kept on disk (``<cache dir>/calibration/``, see
:func:`llama_mtp.demo.cache_dir`) under a key of everything that shapes them, and a later
engine with the same key starts from them at once. The running policy still refreshes
every cost from the decodes it runs (and follows the machine's speed: a shared factor
rescales every curve), exactly as after a fresh calibration.

Beside each calibration the engine keeps its *memory* (``<key>.memory.json``): what its
drafts last measured -- the pooled per-position acceptance evidence, the probe backoff, the
rollback mode it ended in -- written when the engine closes and read by the next engine with
the same key, which then starts where the last one stopped instead of from a blind prior (a
new engine otherwise spends a short run, e.g. one ``llama-mtp generate`` call, learning what
the last one knew). It is a prior, not a setting: a sequence's own evidence outweighs it
within a few drafts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["CALIBRATION_FORMAT", "cache_root", "calibration_path", "file_identity", "load", "load_memory", "machine",
           "memory_path", "store", "store_memory", "valid", "valid_memory"]

_log = logging.getLogger("llama_mtp")

#: bumped whenever what is measured, or how, changes: older files are then measured again
CALIBRATION_FORMAT = 1


@functools.lru_cache(maxsize=1)
def machine() -> dict[str, Any]:
    """What identifies this machine's speed: the build (package version, llama.cpp commit,
    CPU features, backends), its devices (by name and size, not free memory), the CPU."""
    from ..info import build_info

    info = build_info()
    cpu = platform.processor() or platform.machine()
    try:  # platform.processor() is empty or generic on Linux
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "llama_mtp": info["llama_mtp"],
        "llama_cpp_commit": info["llama_cpp_commit"],
        "system_info": info["system_info"],
        "devices": [(d["name"], d["description"], d["kind"], d["memory_total"]) for d in info["devices"]],
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
    }


def file_identity(path: Path) -> dict[str, Any]:
    """A model file by where it is, its size and when it last changed."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def cache_root() -> Path:
    """Where calibrations are kept: ``calibration/`` in :func:`llama_mtp.demo.cache_dir`
    (``$LLAMA_MTP_CACHE_DIR`` or the user cache)."""
    from ..demo import cache_dir

    return cache_dir() / "calibration"


def _canonical(material: dict[str, Any]) -> str:
    """The key material as the file holds it (sorted keys, anything not JSON as its str)."""
    return json.dumps(material, sort_keys=True, default=str)


def _stem(material: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(material).encode()).hexdigest()[:20]


def calibration_path(material: dict[str, Any]) -> Path:
    """The cache file for this key material."""
    return cache_root() / f"{_stem(material)}.json"


def memory_path(material: dict[str, Any]) -> Path:
    """The engine memory kept beside the calibration of this key material."""
    return cache_root() / f"{_stem(material)}.memory.json"


def _points(x: Any) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool) and p[0] > 0
        and _nonneg(p[1]) and p[1] > 0 for p in x)


def _nonneg(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _save_restore(d: dict[str, Any]) -> bool:
    """Checkpoint save and restore seconds: both, or neither (None)."""
    save, restore = d.get("save"), d.get("restore")
    return (save is None and restore is None) or (_nonneg(save) and _nonneg(restore))


def _verify(x: Any) -> bool:
    return isinstance(x, dict) and len(x) > 0 and all(
        isinstance(k, str) and k.isdigit() and int(k) > 0 and _points(v) for k, v in x.items())


def valid(costs: Any) -> bool:
    """Whether ``costs`` is a calibration an engine can start from (what
    ``SpeculativeEngine`` measures: target verify curves by sequence count, draft decode
    points, checkpoint save and restore seconds, and the same for the other rollback
    mode, or None)."""
    if not isinstance(costs, dict) or not _verify(costs.get("verify")) or not _points(costs.get("draft")):
        return False
    if not _save_restore(costs):
        return False
    alt = costs.get("alt")
    return alt is None or (isinstance(alt, dict) and _verify(alt.get("verify")) and _save_restore(alt))


def _read(path: Path, material: dict[str, Any], field: str, check: Callable[[Any], bool], what: str) -> Any:
    """``doc[field]`` of the cache file at ``path`` if it is of this format and key material
    and passes ``check``; else None (logged where the file is there but unusable)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        _log.info("ignoring the %s %s (%s)", what, path, e)
        return None
    if not isinstance(doc, dict) or doc.get("format") != CALIBRATION_FORMAT:
        return None
    # the key is a hash: the material itself must match too (and tells a reader what it is of)
    if json.loads(_canonical(material)) != doc.get("material"):
        return None
    got = doc.get(field)
    if not check(got):
        _log.info("ignoring the %s %s (not one an engine can use)", what, path)
        return None
    return got


def _write(path: Path, material: dict[str, Any], field: str, value: Any, what: str) -> Path | None:
    """Write ``{format, created, material, field: value}`` to ``path`` atomically (a reader
    sees the old file or the new one); None where it cannot be written (logged, not raised)."""
    doc = {"format": CALIBRATION_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "material": json.loads(_canonical(material)), field: value}
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".part", dir=path.parent)
        with open(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        _log.info("could not write the %s %s (%s)", what, path, e)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return None
    return path


def load(material: dict[str, Any]) -> dict[str, Any] | None:
    """The cached calibration for this key material, or None (none, unreadable, another
    format, or not one an engine can use: it is measured again and overwritten)."""
    return _read(calibration_path(material), material, "costs", valid, "calibration cache")  # type: ignore[no-any-return]


def store(material: dict[str, Any], costs: dict[str, Any]) -> Path | None:
    """Write a calibration for this key material (atomically: a reader sees the old file
    or the new one); None where the cache cannot be written (logged, not raised: the
    engine runs on what it measured)."""
    return _write(calibration_path(material), material, "costs", costs, "calibration cache")


def valid_memory(memory: Any) -> bool:
    """Whether ``memory`` is an engine memory (:meth:`SpeculativeEngine` writes it):
    ``hits`` and ``tries`` per draft position (finite, ``0 <= hits <= tries``), ``fails``
    (a count), ``rollback`` ("snapshots", "checkpoint"), ``idle`` (a count; optional)."""
    if not isinstance(memory, dict):
        return False
    hits, tries, fails = memory.get("hits"), memory.get("tries"), memory.get("fails")
    return (isinstance(hits, list) and isinstance(tries, list) and len(hits) == len(tries) > 0
            and all(_nonneg(h) and _nonneg(t) and h <= t for h, t in zip(hits, tries, strict=True))
            and _count(fails) and _count(memory.get("idle", 0))
            and memory.get("rollback") in ("snapshots", "checkpoint"))


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def load_memory(material: dict[str, Any]) -> dict[str, Any] | None:
    """The engine memory kept for this key material, or None (none, or unusable)."""
    return _read(memory_path(material), material, "memory", valid_memory, "engine memory")  # type: ignore[no-any-return]


def store_memory(material: dict[str, Any], memory: dict[str, Any]) -> Path | None:
    """Write the engine memory for this key material (atomically); None where it cannot be."""
    return _write(memory_path(material), material, "memory", memory, "engine memory")
