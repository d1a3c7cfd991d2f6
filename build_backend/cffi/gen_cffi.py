"""Emit the cffi API-mode C source: gen_cffi.py CDEF CSRC OUT (run by CMake)."""

import sys
from pathlib import Path

import cffi


def main(cdef_path: str, csrc_path: str, out_path: str) -> None:
    ffi = cffi.FFI()
    ffi.cdef(Path(cdef_path).read_text(encoding="utf-8"))
    ffi.set_source("llama_mtp._native._llama", Path(csrc_path).read_text(encoding="utf-8"))
    out = Path(out_path)
    tmp = out.with_suffix(".tmp.c")
    ffi.emit_c_code(str(tmp))
    tmp.replace(out)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: gen_cffi.py CDEF CSRC OUT")
    main(*sys.argv[1:])
