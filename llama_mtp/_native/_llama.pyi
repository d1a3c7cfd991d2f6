from typing import Any

import cffi

ffi: cffi.FFI
lib: Any
