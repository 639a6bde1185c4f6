/* Declarations shared by kernels.c and the cffi builder (_build_kernels.py). */
#ifndef RAYDL_KERNELS_H
#define RAYDL_KERNELS_H
#include <stdint.h>

#define RAYDL_OK 0
#define RAYDL_EINVAL -1
#define RAYDL_ENOMEM -2
#define RAYDL_EJPEG -3
#define RAYDL_EUNSUPPORTED -4
#define RAYDL_ETOOBIG -5 /* over the pixel limit, or over the memory it allows libjpeg */
#define RAYDL_EWORK -6   /* the resize would read more filter taps than the pixel limit allows */

/* The largest filter support (source pixels per output pixel) a plan takes, so the tap
 * count fits an int; raydl's callers bound the resampling work far below it. */
#define RAYDL_MAX_SUPPORT ((double)(1 << 28))

#define RAYDL_OUT_U8_HWC 0
#define RAYDL_OUT_F32_CHW 1

/* A per-thread scratch buffer of at least `need` bytes, reused across calls
 * (slot 0: the resampler's plan and rows, slot 1: the JPEG rows). Fresh memory costs
 * a page fault per 4 KiB on first touch, which here costs as much as the
 * resampling and serializes threads; buffers above 64 MiB are not kept.
 * Release with raydl_scratch_release. NULL when out of memory. */
void *raydl_scratch(int slot, size_t need);
void raydl_scratch_release(int slot, void *p);

/* Resample the box [x0, x1) x [y0, y1) of an RGB uint8 image (rows src_stride
 * bytes apart) to out_h x out_w with an antialiased bilinear filter (fixed point), mirror it
 * left-right when flip is set, and write it to dst: uint8 HWC, or float32 CHW
 * computed as value * scale[c] + bias[c]. Returns RAYDL_OK or a negative code:
 * RAYDL_EWORK when the filter would read more taps than raydl_resize_bound(max_pixels, ...)
 * (checked once the windows are known, before any pixel is read). */
int raydl_crop_resize(const uint8_t *src, int src_h, int src_w, int src_stride,
                      double box_x0, double box_y0, double box_x1, double box_y1,
                      int out_h, int out_w, int flip, int out_format,
                      const float *scale, const float *bias, void *dst, long long max_pixels);

/* The most filter taps one resize may read under a pixel limit: 4 per pixel of the limit
 * (a whole-image downscale reads about 2 per source pixel) and 8 per output pixel (an
 * upscale reads at most 6). What it refuses are images thousands of times wider than tall
 * (or taller than wide) resized to square outputs, where every output row re-reads the
 * whole span: 20,000,000 x 1 pixels to 224 x 224 took 13 s of CPU. */
double raydl_resize_bound(long long max_pixels, int out_h, int out_w);

/* The filter taps resizing the box of a src_h x src_w image to out_h x out_w reads (the
 * plan's exact count), or -1 for arguments a plan refuses. */
double raydl_resize_work(int src_h, int src_w, double box_x0, double box_y0, double box_x1, double box_y1,
                         int out_h, int out_w);

/* The resampler in steps, for callers that produce source rows one at a time
 * (the JPEG decoder): plan once, then for each output row yy in order ask for
 * its window of source rows and pass pointers to those rows (column 0).
 * Windows only move down, and none holds more than raydl_resize_max_taps rows.
 * The plan lives in scratch slot 0 of this thread; release it when done. */
typedef struct raydl_resize raydl_resize_t;
int raydl_resize_plan(raydl_resize_t **plan, int src_h, int src_w,
                      double box_x0, double box_y0, double box_x1, double box_y1,
                      int out_h, int out_w, int flip, int out_format,
                      const float *scale, const float *bias, void *dst, long long max_pixels);
void raydl_resize_window(const raydl_resize_t *r, int yy, int *first, int *count);
int raydl_resize_max_taps(const raydl_resize_t *r);
/* Room for raydl_resize_max_taps row pointers, owned by the plan (heap, not the caller's stack). */
const uint8_t **raydl_resize_rows(raydl_resize_t *r);
void raydl_resize_row(raydl_resize_t *r, int yy, const uint8_t *const *src_rows);
void raydl_resize_release(raydl_resize_t *r);

/* Which resampling path runs: mode 0 forces the portable C one, 1 picks AVX2
 * when the CPU has it, -1 only asks. Returns the path now in use (1 = AVX2).
 * Both give the same bytes; this exists so tests can compare them. */
int raydl_simd(int mode);

/* Decode only the rows/columns of JPEG `data` that the box (in full-resolution
 * pixels) needs, downscaled by 1/scale_denom (1, 2, 4 or 8) in the DCT domain,
 * then raydl_crop_resize it into dst. fast: IFAST IDCT and no fancy upsampling
 * (faster, different pixels).
 * RAYDL_EJPEG: corrupt or truncated data (message in errbuf); RAYDL_EUNSUPPORTED:
 * a JPEG this path does not convert (CMYK), to be decoded another way;
 * RAYDL_ETOOBIG: the frame header gives more than max_pixels pixels (checked
 * before anything is allocated), or libjpeg needed more memory than that many
 * pixels allow; RAYDL_EWORK: the resize is over raydl_resize_bound(max_pixels). */
int raydl_jpeg_crop_resize(const uint8_t *data, size_t len,
                           double box_x0, double box_y0, double box_x1, double box_y1,
                           int out_h, int out_w, int flip, int out_format,
                           const float *scale, const float *bias, void *dst,
                           int scale_denom, int fast, long long max_pixels, char *errbuf, int errbuf_len);

/* raydl_jpeg_crop_resize for n samples of one batch, one after the other in
 * the calling thread (one call from Python, the GIL released once). Slot i:
 * data[i] (len[i] bytes), box[4i .. 4i+3], flip[i], scale_denom[i], dst[i];
 * the output size, format, scale, bias, fast and max_pixels are shared. rc[i] gets slot
 * i's code and errbuf + i * errbuf_len its message: one slot's failure never
 * stops the others. */
void raydl_jpeg_crop_resize_many(int n, const uint8_t *const *data, const size_t *len, const double *box,
                                 const int *flip, const int *scale_denom, int out_h, int out_w, int out_format,
                                 const float *scale, const float *bias, void *const *dst, int fast,
                                 long long max_pixels, int *rc, char *errbuf, int errbuf_len);
/* Token kinds of raydl_token_windows: the values' integer type in, the rows' type out. */
#define RAYDL_TOK_I8 0
#define RAYDL_TOK_U8 1
#define RAYDL_TOK_I16 2
#define RAYDL_TOK_U16 3
#define RAYDL_TOK_I32 4
#define RAYDL_TOK_U32 5
#define RAYDL_TOK_I64 6

/* n windows of seq + 1 tokens of `values` (n_values of in_kind), window r starting at offsets[r]: its
 * first seq tokens into row rows[r] of `inputs`, its last seq into `labels`, and into `positions` each
 * of its first seq tokens' offset from the latest document start at or before it (starts: the n_starts
 * ascending document starts, starts[0] == 0). The outputs are C-contiguous (n_rows, seq) of out_kind
 * (RAYDL_TOK_I32 or RAYDL_TOK_I64), values cast as C casts them (numpy's unsafe cast). RAYDL_EINVAL,
 * with nothing written, when a window or row is out of bounds. */
int raydl_token_windows(const void *values, int in_kind, long long n_values, const long long *starts,
                        long long n_starts, const long long *offsets, const long long *rows, int n,
                        long long n_rows, int seq, int out_kind, void *inputs, void *labels,
                        void *positions);

#endif
