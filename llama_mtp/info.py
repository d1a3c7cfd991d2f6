"""What this installation was built with: package version, llama.cpp commit, backends, devices."""

from __future__ import annotations

from typing import Any

from . import __version__, _native
from ._native import calls

__all__ = ["build_info"]


def build_info() -> dict[str, Any]:
    """Version, pinned llama.cpp commit, compiled backends, devices, CPU features."""
    _native.ensure_backend()
    return {
        "llama_mtp": __version__,
        "llama_cpp_commit": calls.llama_commit(),
        "backends": calls.backends(),
        "devices": [d.__dict__ for d in calls.devices()],
        "system_info": calls.system_info().strip(),
        "capabilities": calls.capabilities(),
    }
