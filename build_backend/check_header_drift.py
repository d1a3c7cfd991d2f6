"""Compare the functions llama.h declares with those our cdef binds.

    python build_backend/check_header_drift.py [path/to/llama.cpp]

Prints how many llama.h functions are bound, lists the unbound ones with -v,
and fails (exit 1) if the cdef names a llama_* function llama.h no longer has --
run it after bumping the pin.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUNC = re.compile(r"\b(llama_\w+)\s*\(")


def header_functions(llama_cpp: Path) -> set[str]:
    text = (llama_cpp / "include" / "llama.h").read_text(encoding="utf-8")
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
    names: set[str] = set()
    for decl in re.findall(r"LLAMA_API[^;]*;", text, flags=re.S):
        if "DEPRECATED" in decl:
            continue
        m = FUNC.search(decl)
        if m:
            names.add(m.group(1))
    return names


def cdef_functions() -> set[str]:
    text = (ROOT / "build_backend" / "cffi" / "llama.cdef.h").read_text(encoding="utf-8")
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
    return {n for n in FUNC.findall(text) if not n.startswith("llama_progress")}


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    args = [a for a in argv if a != "-v"]
    llama_cpp = Path(args[0]) if args else ROOT / "vendor" / "llama.cpp"
    header, bound = header_functions(llama_cpp), cdef_functions()
    vanished = sorted(bound - header)
    print(f"llama.h declares {len(header)} functions; the cdef binds {len(bound & header)}")
    if verbose:
        for name in sorted(header - bound):
            print(f"  unbound: {name}")
    for name in vanished:
        print(f"  VANISHED from llama.h: {name}")
    return 1 if vanished else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
