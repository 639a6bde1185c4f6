"""cffi builder for raydl's C kernels (API mode, out-of-line).

Used by setup.py (`cffi_modules`) at install time, and runnable by hand:
`python -m raydl.native._build_kernels` builds `raydl/native/_kernels*.so` in place.
"""
from pathlib import Path

from cffi import FFI

_HERE = Path(__file__).resolve().parent

CDEF = """
#define RAYDL_OK 0
#define RAYDL_EINVAL -1
#define RAYDL_ENOMEM -2
#define RAYDL_OUT_U8_HWC 0
#define RAYDL_OUT_F32_CHW 1
int raydl_crop_resize(const uint8_t *src, int src_h, int src_w, int src_stride,
                      double box_x0, double box_y0, double box_x1, double box_y1,
                      int out_h, int out_w, int flip, int out_format,
                      const float *scale, const float *bias, void *dst);
"""

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "raydl.native._kernels",
    '#include "kernels.h"',
    # Paths relative to the project root: setup.py runs the build from there.
    sources=["raydl/native/kernels.c"],
    include_dirs=["raydl/native"],
    extra_compile_args=["-O3", "-std=c99"],
    libraries=["m"],
)

if __name__ == "__main__":
    import os

    os.chdir(_HERE.parent.parent)
    ffibuilder.compile(verbose=True)
