/* The C prelude of the cffi module: the real headers, checked by the compiler
 * against every declaration in llama.cdef.h. */
#include "llama.h"
#include "ggml-backend.h"
#include "shim.h"
