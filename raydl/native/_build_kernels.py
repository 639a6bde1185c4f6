"""cffi builders for raydl's C kernels (API mode, out-of-line).

- `ffibuilder` -> raydl.native._kernels: crop/resize/flip/normalize and token windows (always).
- `jpeg_ffibuilder` -> raydl.native._jpeg: the same plus a libjpeg-turbo
  decoder of only the crop's region; needs jpeglib.h (Debian
  libjpeg62-turbo-dev). When it cannot be built raydl decodes JPEGs whole with
  simplejpeg instead.

setup.py builds both at install time (`cffi_modules`); by hand:
`python -m raydl.native._build_kernels` builds them in place.
"""

from cffi import FFI

_COMMON = """
#define RAYDL_OK 0
#define RAYDL_EINVAL -1
#define RAYDL_ENOMEM -2
#define RAYDL_EJPEG -3
#define RAYDL_EUNSUPPORTED -4
#define RAYDL_ETOOBIG -5
#define RAYDL_EWORK -6
#define RAYDL_OUT_U8_HWC 0
#define RAYDL_OUT_F32_CHW 1
int raydl_crop_resize(const uint8_t *src, int src_h, int src_w, int src_stride,
                      double box_x0, double box_y0, double box_x1, double box_y1,
                      int out_h, int out_w, int flip, int out_format,
                      const float *scale, const float *bias, void *dst, long long max_pixels);
double raydl_resize_bound(long long max_pixels, int out_h, int out_w);
double raydl_resize_work(int src_h, int src_w, double box_x0, double box_y0, double box_x1, double box_y1,
                         int out_h, int out_w);
int raydl_simd(int mode);
int raydl_token_windows(const void *values, int in_kind, long long n_values, const long long *starts,
                        long long n_starts, const long long *offsets, const long long *rows, int n,
                        long long n_rows, int seq, int out_kind, void *inputs, void *labels,
                        void *positions);
"""
_JPEG = """
int raydl_jpeg_crop_resize(const uint8_t *data, size_t len,
                           double box_x0, double box_y0, double box_x1, double box_y1,
                           int out_h, int out_w, int flip, int out_format,
                           const float *scale, const float *bias, void *dst,
                           int scale_denom, int fast, long long max_pixels, char *errbuf, int errbuf_len);
void raydl_jpeg_crop_resize_many(int n, const uint8_t *const *data, const size_t *len, const double *box,
                                 const int *flip, const int *scale_denom, int out_h, int out_w,
                                 int out_format, const float *scale, const float *bias, void *const *dst,
                                 int fast, long long max_pixels, int *rc, char *errbuf, int errbuf_len);
"""
# Paths relative to the project root: setup.py runs the build from there.
# -ffp-contract=off: value * scale + bias stays a multiply then an add (no FMA) in every path, so the AVX2
# and portable float outputs are the same floats.
_ARGS = dict(
    include_dirs=["raydl/native"],
    extra_compile_args=["-O3", "-std=gnu99", "-ffp-contract=off"],
    libraries=["m"],
)

ffibuilder = FFI()
ffibuilder.cdef(_COMMON)
ffibuilder.set_source(
    "raydl.native._kernels",
    '#include "kernels.h"',
    sources=["raydl/native/kernels.c", "raydl/native/tokens.c"],
    **_ARGS,
)

jpeg_ffibuilder = FFI()
jpeg_ffibuilder.cdef(_COMMON + _JPEG)
jpeg_ffibuilder.set_source(
    "raydl.native._jpeg",
    '#include "kernels.h"',
    sources=["raydl/native/jpeg.c", "raydl/native/kernels.c", "raydl/native/tokens.c"],
    **{**_ARGS, "libraries": ["jpeg", "m"]},
)

if __name__ == "__main__":
    import os
    from pathlib import Path

    os.chdir(Path(__file__).resolve().parents[2])
    ffibuilder.compile(verbose=False)
    try:
        jpeg_ffibuilder.compile(verbose=False)
    except Exception as exc:  # noqa: BLE001 - optional module
        print(f"raydl.native._jpeg not built: {exc}")
