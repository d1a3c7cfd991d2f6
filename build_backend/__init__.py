"""In-tree PEP 517 backend: scikit-build-core, after the pinned llama.cpp is in place.

Every hook is scikit-build-core's own; the wheel, editable and sdist hooks first
make sure the llama.cpp source exists (see ``source.py``) and check the declared
``llama_mtp.*`` config-settings, so a typo fails in one clear line instead of
deep inside CMake.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from .source import SETTING_DIR, SourceError, ensure_source, needs_fetch

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]

BACKENDS = ("auto", "cpu", "cuda", "metal", "vulkan", "blas", "hip", "rpc")
ENV_BACKEND = "LLAMA_MTP_BACKEND"
SETTING_BACKEND = "llama_mtp.backend"


def _backend_choice(config_settings: Mapping[str, Any] | None) -> str:
    raw: Any = os.environ.get(ENV_BACKEND)
    if raw is None and config_settings:
        raw = config_settings.get(SETTING_BACKEND)
        if isinstance(raw, list):
            raw = raw[-1]
    value = str(raw or "auto").strip().lower()
    parts = [p.strip() for p in value.split(",") if p.strip()]
    bad = [p for p in parts if p not in BACKENDS]
    if bad or not parts:
        raise SourceError(
            f"unknown llama_mtp.backend {value!r}; choose from {', '.join(BACKENDS)} "
            "(comma-separate to combine, e.g. cuda,rpc)"
        )
    if "cpu" in parts and len(parts) > 1:
        raise SourceError("llama_mtp.backend=cpu turns every GPU backend off; do not combine it")
    return ",".join(parts)


def _skb() -> Any:
    # imported lazily: the helpers above are importable (and tested) without it
    from scikit_build_core import build

    return build


def _prepare(config_settings: Mapping[str, Any] | None) -> None:
    _backend_choice(config_settings)
    ensure_source(config_settings)


def _extra_requires(config_settings: Mapping[str, Any] | None) -> list[str]:
    # pip is not importable inside an isolated build environment unless asked for,
    # and it is what fetches the pinned source with the user's own configuration.
    return ["pip"] if needs_fetch(config_settings) else []


def get_requires_for_build_wheel(config_settings: Mapping[str, Any] | None = None) -> list[str]:
    return [*_skb().get_requires_for_build_wheel(config_settings), *_extra_requires(config_settings)]


def get_requires_for_build_editable(config_settings: Mapping[str, Any] | None = None) -> list[str]:
    return [*_skb().get_requires_for_build_editable(config_settings), *_extra_requires(config_settings)]


def get_requires_for_build_sdist(config_settings: Mapping[str, Any] | None = None) -> list[str]:
    return [*_skb().get_requires_for_build_sdist(config_settings), *_extra_requires(config_settings)]


def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: Mapping[str, Any] | None = None) -> str:
    return _skb().prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory: str, config_settings: Mapping[str, Any] | None = None) -> str:
    return _skb().prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(
    wheel_directory: str,
    config_settings: Mapping[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    _prepare(config_settings)
    return _skb().build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(
    wheel_directory: str,
    config_settings: Mapping[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    _prepare(config_settings)
    return _skb().build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory: str, config_settings: Mapping[str, Any] | None = None) -> str:
    # The sdist embeds the llama.cpp source, so installing from it needs no fetch.
    if config_settings and config_settings.get(SETTING_DIR):
        raise SourceError("an sdist always embeds the pinned vendor/llama.cpp; unset llama_mtp.llama-cpp-dir")
    os.environ.pop("LLAMA_MTP_LLAMA_CPP_DIR", None)
    _prepare(config_settings)
    return _skb().build_sdist(sdist_directory, config_settings)
