"""The only code that touches cffi's ``ffi``/``lib`` (ruff TID251 enforces it).

Loading and the stale-binary check, process-wide backend init (once), the log
bridge (llama.cpp's log -> :mod:`logging`, with the last warning/error lines kept
per thread so exceptions can say *why*), and the callbacks C calls back into.
Typed 1:1 wrappers over the C functions live in :mod:`.calls`.
"""

from __future__ import annotations

import atexit
import collections
import importlib.metadata
import logging
import signal
import threading
from typing import Any

# The C module under `signal`: the same calls without the enum conversions, ~10x cheaper
# (deferred_sigint runs on every engine step).
try:
    import _signal as _sig  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - not CPython
    _sig = signal

#: runtime libraries a GPU build links (CUDA, ROCm, Vulkan, BLAS): found by the system's
#: loader, not shipped in the wheel
_GPU_RUNTIME = ("libcuda", "libcudart", "libcublas", "libhip", "libamdhip", "libroc", "libvulkan", "libopenblas",
                "libblas", "libmkl")


def _load_error(exc: ImportError) -> str:
    """What to do when the extension does not load: a GPU runtime library the build links is
    missing (the build is fine), or the extension is not for this Python / machine."""
    msg = str(exc)
    missing = msg.split(":", 1)[0].strip() if "cannot open shared object file" in msg else ""
    if missing.startswith(_GPU_RUNTIME):
        return (f"llama_mtp's compiled extension needs {missing}, which the system's loader does not find. "
                "This installation was built for a GPU backend: install that runtime (the CUDA toolkit, "
                "the NVIDIA driver, ...), or add the folder that holds it to LD_LIBRARY_PATH; or reinstall "
                "for the CPU: `pip install --force-reinstall --no-cache-dir llama-mtp -C llama_mtp.backend=cpu`.")
    return (f"llama_mtp's compiled extension could not be loaded ({exc}). "
            "Reinstall the package so it is compiled for this Python: "
            "`pip install --force-reinstall --no-cache-dir llama-mtp` (or `pip install .` in a checkout).")


try:
    from ._llama import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(_load_error(exc)) from exc

__all__ = ["ffi", "lib", "ensure_backend", "take_log_lines", "clear_log_lines", "refresh_log_level"]

log = logging.getLogger("llama_mtp.native")


def _check_version() -> None:
    built = ffi.string(lib.lmtp_version()).decode()
    try:
        installed = importlib.metadata.version("llama-mtp")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
        return
    if built != installed:
        raise ImportError(
            f"llama_mtp's compiled extension is from version {built}, but the installed package is "
            f"{installed}: the binary is stale. Rebuild it: `pip install --force-reinstall --no-cache-dir .` "
            "(developers: rerun `pip install --no-build-isolation -e .`)."
        )


_check_version()

# --------------------------------------------------------------------------
# logging: C filters by level, Python keeps the last warning/error lines
# --------------------------------------------------------------------------

_LEVELS = {
    int(lib.GGML_LOG_LEVEL_DEBUG): logging.DEBUG,
    int(lib.GGML_LOG_LEVEL_INFO): logging.INFO,
    int(lib.GGML_LOG_LEVEL_WARN): logging.WARNING,
    int(lib.GGML_LOG_LEVEL_ERROR): logging.ERROR,
}
_KEEP = 24


class _ThreadLog(threading.local):
    def __init__(self) -> None:
        self.recent: collections.deque[str] = collections.deque(maxlen=_KEEP)
        self.partial = ""


_tlog = _ThreadLog()


_interrupt = threading.Event()  # a KeyboardInterrupt that fired inside a C callback


@ffi.def_extern()  # type: ignore[untyped-decorator]
def _lmtp_on_log(level: int, text: Any, user_data: Any) -> None:
    try:
        _log_line(level, text)
    except KeyboardInterrupt:  # cffi would swallow it: keep it for the caller
        _interrupt.set()


def _log_line(level: int, text: Any) -> None:
    try:
        chunk = ffi.string(text).decode("utf-8", "replace")
        buf = _tlog.partial + chunk
        lines = buf.split("\n")
        _tlog.partial = lines.pop()  # an unterminated line waits for its continuation
        pylevel = _LEVELS.get(int(level), logging.DEBUG)
        for line in lines:
            if not line.strip():
                continue
            if pylevel >= logging.WARNING:
                _tlog.recent.append(line.strip())
            log.log(pylevel, "%s", line)
    except Exception:  # pragma: no cover - never let a log line break a decode
        pass


def _noop() -> None:
    return None


def reraise_sigint() -> None:
    """Deliver a SIGINT that arrived during a C call to Python's handler, now."""
    if _sig.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.SIG_DFL, None):
        signal.raise_signal(signal.SIGINT)
        _noop()  # entering a Python function runs pending handlers (KeyboardInterrupt here)


class deferred_sigint:
    """Hold Ctrl-C while a multi-step operation updates its state (main thread only).

    A SIGINT that arrives inside still aborts a running llama.cpp decode at once
    (the C hook sees it first); Python's own handler runs on exit, when the
    operation has left everything consistent -- so KeyboardInterrupt is raised
    there, never half-way through bookkeeping.
    """

    __slots__ = ("_prev", "fired", "_active")

    def __init__(self) -> None:
        self._prev: Any = None
        self.fired = False
        self._active = False

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.fired = True

    def __enter__(self) -> deferred_sigint:
        if threading.current_thread() is not threading.main_thread():
            return self
        prev = _sig.getsignal(signal.SIGINT)
        if prev in (signal.SIG_IGN, signal.SIG_DFL, None) or isinstance(getattr(prev, "__self__", None), deferred_sigint):
            return self  # the user's choice, or already deferred by an outer operation
        self._prev = prev
        _sig.signal(signal.SIGINT, self._on_sigint)
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._active:
            return
        self._active = False
        _sig.signal(signal.SIGINT, self._prev)
        if self.fired:
            self.fired = False
            self._prev(signal.SIGINT, None)  # default: raises KeyboardInterrupt (chained to any error in flight)


def take_interrupt() -> bool:
    """True once if a KeyboardInterrupt was caught inside a C callback."""
    if _interrupt.is_set():
        _interrupt.clear()
        return True
    return False


def take_log_lines() -> list[str]:
    """The warning/error lines llama.cpp logged on this thread since the last clear."""
    lines = list(_tlog.recent)
    if _tlog.partial.strip():
        lines.append(_tlog.partial.strip())
    _tlog.recent.clear()
    _tlog.partial = ""
    return lines


def clear_log_lines() -> None:
    _tlog.recent.clear()
    _tlog.partial = ""


def _c_min_level() -> int:
    """Always forward warnings (for error messages); more only if someone listens."""
    if log.isEnabledFor(logging.DEBUG):
        return int(lib.GGML_LOG_LEVEL_DEBUG)
    if log.isEnabledFor(logging.INFO):
        return int(lib.GGML_LOG_LEVEL_INFO)
    return int(lib.GGML_LOG_LEVEL_WARN)


def refresh_log_level() -> None:
    """Re-read the ``llama_mtp.native`` logger's level (cheap; called at load/creation)."""
    lib.lmtp_log_set_min_level(_c_min_level())


# --------------------------------------------------------------------------
# process-wide init, once
# --------------------------------------------------------------------------


def _init_backend() -> None:
    lib.lmtp_log_install(lib._lmtp_on_log, _c_min_level())
    lib.llama_backend_init()


def ensure_backend() -> None:
    """Install the log bridge and initialise llama.cpp's backends (first call only)."""
    ffi.init_once(_init_backend, "llama_mtp.backend")
    refresh_log_level()


@atexit.register
def _quiet_at_exit() -> None:  # pragma: no cover - interpreter shutdown
    # contexts freed during finalisation must not call back into Python
    lib.lmtp_log_install(ffi.NULL, 1 << 30)


# --------------------------------------------------------------------------
# model-load progress: the callback returns False to stop (Ctrl-C, exceptions)
# --------------------------------------------------------------------------


class LoadProgress:
    """State shared with ``_lmtp_on_progress`` through an ``ffi.new_handle``."""

    def __init__(self, callback: Any = None) -> None:
        self.callback = callback
        self.error: BaseException | None = None
        self.handle = ffi.new_handle(self)


def _progress_error(exc_type: Any, exc_value: BaseException, tb: Any) -> bool:
    return False


@ffi.def_extern(onerror=_progress_error)  # type: ignore[untyped-decorator]
def _lmtp_on_progress(progress: float, user_data: Any) -> bool:
    state: LoadProgress = ffi.from_handle(user_data)
    try:
        if take_interrupt():
            raise KeyboardInterrupt
        if state.callback is not None and state.callback(float(progress)) is False:
            return False
    except BaseException as exc:  # KeyboardInterrupt included: stop loading, re-raise later
        state.error = exc
        return False
    return True
