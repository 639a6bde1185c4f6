/* raydl native kernels: crop + resize + flip + normalize in one pass.
 *
 * The resampling follows Pillow's separable convolution (Resample.c): for
 * every output column a window of input columns is weighted by the bilinear
 * ("triangle") filter, whose support grows with the downscale factor, which
 * is what antialiases a downscale. The weights are computed in double, then
 * quantized to Q14 fixed point (each window summing to exactly 1.0), and
 * applied with integer arithmetic, as Pillow-SIMD does:
 *
 *  - vertical pass first, one output row at a time, over the source rows it
 *    reads: uint8 x Q14 summed in int32 and kept as Q6 int16 (value * 64),
 *    so the intermediate row carries 6 bits more than Pillow's uint8 one;
 *  - horizontal pass on that row (it is small and stays in L1): Q6 x Q14
 *    summed in int32 (Q20), then rounded to uint8 or scaled to float32.
 *
 * Integer sums are exact, so the AVX2 path (pmaddwd on pairs of taps) and the
 * portable C path give the same bytes; raydl_simd() switches between them.
 * Source rows come through a callback, so the JPEG decoder can feed rows as it
 * decodes them into a small ring instead of a whole-image buffer.
 *
 * cffi releases the GIL around every call into this file.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RAYDL_X86 1
#include <immintrin.h>
#endif

#define KBITS 14 /* weights in Q14 */
#define IBITS 6  /* intermediate row in Q6 */
#define VSHIFT (KBITS - IBITS)
#define HSHIFT (KBITS + IBITS)
/* int16 after a filtered row that the AVX2 horizontal pass may read (with weight 0): it reads
 * kx_stride taps from every column's first, plus 2 */
#define ROW_SLACK(kx_stride) ((size_t)(kx_stride) * 3 + 16)

#define RAYDL_SCRATCH_SLOTS 3
#define RAYDL_SCRATCH_KEEP ((size_t)64 << 20)
static __thread void *scratch_buf[RAYDL_SCRATCH_SLOTS];
static __thread size_t scratch_cap[RAYDL_SCRATCH_SLOTS];

void *raydl_scratch(int slot, size_t need) {
    if (need > RAYDL_SCRATCH_KEEP) return malloc(need);
    if (need > scratch_cap[slot]) {
        free(scratch_buf[slot]);
        scratch_buf[slot] = malloc(need);
        scratch_cap[slot] = scratch_buf[slot] ? need : 0;
    }
    return scratch_buf[slot];
}

void raydl_scratch_release(int slot, void *p) {
    if (p != scratch_buf[slot]) free(p); /* only buffers too large to keep were malloc'ed for one call */
}

/* ---- SIMD selection ---------------------------------------------------- */

static int simd_state = -1; /* -1: not probed yet; 0: portable C; 1: AVX2; 2: AVX2 + the AVX-512 vertical pass */

/* The most this CPU can run: 2 with AVX-512 BW + VNNI (the 64-byte vertical pass), 1 with AVX2, else 0. */
static int simd_best(void) {
#ifdef RAYDL_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2")) return 0;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
        return 2;
    return 1;
#else
    return 0;
#endif
}

/* mode 0: portable; mode > 0: at most that level; mode < 0: the current one, AVX2 (or less) when not
 * chosen yet. AVX-512 is opt-in (mode 2): its vertical pass is a third faster, yet the whole program
 * measured 1-7 % more CPU with it on a 2-core VM (docs/benchmarks.md, "The worker's CPU per image"). */
int raydl_simd(int mode) {
    if (mode == 0) simd_state = 0;
    else if (mode > 0) {
        int best = simd_best();
        simd_state = mode < best ? mode : best;
    } else if (simd_state < 0) {
        int best = simd_best();
        simd_state = best < 1 ? best : 1;
    }
    return simd_state;
}

/* ---- coefficients ------------------------------------------------------ */

static double triangle(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* Taps per window: 2 * ceil(support) + 1, or 0 when the downscale is so large that
 * it would not fit an int (callers refuse the plan then). */
static int axis_ksize(double in0, double in1, int out_size) {
    double scale = (in1 - in0) / out_size;
    double support = scale < 1.0 ? 1.0 : scale;
    if (!(support <= RAYDL_MAX_SUPPORT)) return 0;
    return (int)ceil(support) * 2 + 1;
}

/* An upper bound of the source columns [col0, col1) that axis_coeffs' windows read,
 * from the same formula (the windows' starts and ends only grow with the output index),
 * so the row buffers are sized by the box rather than by the whole source row. */
static int axis_span_bound(int in_size, double in0, double in1, int out_size) {
    double scale = (in1 - in0) / out_size;
    double support = scale < 1.0 ? 1.0 : scale;
    double lo = floor(in0 + 0.5 * scale - support + 0.5), hi = floor(in0 + (out_size - 0.5) * scale + support + 0.5);
    if (lo < 0) lo = 0;
    if (hi > in_size) hi = in_size;
    double span = hi - lo + 1; /* + 1: the one-tap window axis_coeffs keeps where a window is empty */
    if (span < 1) span = 1;
    return span > in_size ? in_size : (int)span;
}

/* Windows mapping [in0, in1) of an axis of in_size to out_size, as Pillow's
 * precompute_coeffs; weights in Q14, `stride` int16 per output index (zero-padded).
 * tmp: ksize doubles of scratch (on the heap: ksize grows with the downscale, and a
 * 10,000,000-pixel axis resized to 16 made a 10 MB stack array before). */
static void axis_coeffs(int in_size, double in0, double in1, int out_size, int ksize, int stride,
                        int *start, int *count, int16_t *k, double *tmp) {
    double scale = (in1 - in0) / out_size;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = 1.0 * filterscale;
    double ss = 1.0 / filterscale;
    for (int xx = 0; xx < out_size; xx++) {
        double center = in0 + (xx + 0.5) * scale;
        int xmin = (int)(center - support + 0.5);
        if (xmin < 0) xmin = 0;
        int xmax = (int)(center + support + 0.5);
        if (xmax > in_size) xmax = in_size;
        xmax -= xmin;
        if (xmax > ksize) xmax = ksize;
        if (xmax < 1) { /* cannot happen for a valid box; keep one tap so a window is never empty */
            xmin = xmin >= in_size ? in_size - 1 : xmin;
            xmax = 1;
        }
        double ww = 0.0;
        for (int x = 0; x < xmax; x++) {
            tmp[x] = triangle((x + xmin - center + 0.5) * ss);
            ww += tmp[x];
        }
        int16_t *kk = k + (size_t)xx * stride;
        memset(kk, 0, sizeof(int16_t) * (size_t)stride);
        int sum = 0, big = 0;
        for (int x = 0; x < xmax; x++) {
            double w = ww > 0.0 ? tmp[x] / ww : (x == 0 ? 1.0 : 0.0);
            kk[x] = (int16_t)lround(w * (1 << KBITS));
            sum += kk[x];
            if (kk[x] > kk[big]) big = x;
        }
        kk[big] = (int16_t)(kk[big] + ((1 << KBITS) - sum)); /* the window sums to exactly 1.0 */
        start[xx] = xmin;
        count[xx] = xmax;
    }
}

/* ---- the two passes ---------------------------------------------------- */

/* out[i] = round(sum_t k[t] * rows[t][i] / 2^VSHIFT), i < len (Q6); acc: len int32 of scratch.
 * Tap by tap over whole rows, which compilers vectorize. */
static void vpass_c(const uint8_t *const *rows, const int16_t *k, int n, int len, int16_t *out, int32_t *acc) {
    const uint8_t *r0 = rows[0];
    const int32_t k0 = k[0];
    for (int i = 0; i < len; i++) acc[i] = (1 << (VSHIFT - 1)) + k0 * r0[i];
    for (int t = 1; t < n; t++) {
        const uint8_t *rt = rows[t];
        const int32_t kt = k[t];
        for (int i = 0; i < len; i++) acc[i] += kt * rt[i];
    }
    for (int i = 0; i < len; i++) out[i] = (int16_t)(acc[i] >> VSHIFT);
}

/* acc[4 * x + c] = sum_t k[x][t] * in[(start[x] + t) * 3 + c] (Q20), c < 3. */
static void hpass_c(const int16_t *in, const int *start, const int *count, const int16_t *k, int kstride,
                    int out_w, int32_t *acc) {
    for (int x = 0; x < out_w; x++) {
        const int16_t *p = in + (size_t)start[x] * 3;
        const int16_t *kk = k + (size_t)x * kstride;
        int32_t r = 0, g = 0, b = 0;
        for (int t = 0; t < count[x]; t++) {
            r += (int32_t)kk[t] * p[3 * t];
            g += (int32_t)kk[t] * p[3 * t + 1];
            b += (int32_t)kk[t] * p[3 * t + 2];
        }
        acc[4 * x] = r;
        acc[4 * x + 1] = g;
        acc[4 * x + 2] = b;
    }
}

#ifdef RAYDL_X86
__attribute__((target("avx2"))) static void vpass_avx2(const uint8_t *const *rows, const int16_t *k, int n,
                                                        int len, int16_t *out) {
    const __m256i zero = _mm256_setzero_si256(), rnd = _mm256_set1_epi32(1 << (VSHIFT - 1));
    int i = 0;
    for (; i + 32 <= len; i += 32) {
        __m256i a0 = rnd, a1 = rnd, a2 = rnd, a3 = rnd;
        for (int t = 0; t < n; t += 2) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(rows[t] + i)), y = zero;
            uint32_t pair = (uint16_t)k[t];
            if (t + 1 < n) {
                y = _mm256_loadu_si256((const __m256i *)(rows[t + 1] + i));
                pair |= (uint32_t)(uint16_t)k[t + 1] << 16;
            }
            __m256i kk = _mm256_set1_epi32((int)pair);
            __m256i lo = _mm256_unpacklo_epi8(x, y), hi = _mm256_unpackhi_epi8(x, y);
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), kk));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), kk));
            a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), kk));
            a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), kk));
        }
        /* a0..a3 hold elements [0-3|16-19], [4-7|20-23], [8-11|24-27], [12-15|28-31] */
        __m256i r0 = _mm256_packs_epi32(_mm256_srai_epi32(a0, VSHIFT), _mm256_srai_epi32(a1, VSHIFT));
        __m256i r1 = _mm256_packs_epi32(_mm256_srai_epi32(a2, VSHIFT), _mm256_srai_epi32(a3, VSHIFT));
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_permute2x128_si256(r0, r1, 0x20));
        _mm256_storeu_si256((__m256i *)(out + i + 16), _mm256_permute2x128_si256(r0, r1, 0x31));
    }
    for (; i < len; i++) {
        int32_t acc = 1 << (VSHIFT - 1);
        for (int t = 0; t < n; t++) acc += (int32_t)k[t] * rows[t][i];
        out[i] = (int16_t)(acc >> VSHIFT);
    }
}

/* vpass_avx2 64 bytes at a time: the same pairs of taps, the same int32 sums (vpdpwssd adds exactly what
 * pmaddwd + paddd add), the same shift and saturating pack; the tail is a masked load and store, so
 * nothing past `len` is read or written. Only where the CPU has AVX-512 BW and VNNI (raydl_simd). */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void vpass_avx512(const uint8_t *const *rows,
                                                                                  const int16_t *k, int n,
                                                                                  int len, int16_t *out) {
    const __m512i zero = _mm512_setzero_si512(), rnd = _mm512_set1_epi32(1 << (VSHIFT - 1));
    /* qwords of the two packed vectors in output order: r0 holds 8 of every 16, r1 the other 8 */
    const __m512i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i hi_idx = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int i = 0; i < len; i += 64) {
        int left = len - i;
        __mmask64 m = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
        __m512i a0 = rnd, a1 = rnd, a2 = rnd, a3 = rnd;
        for (int t = 0; t < n; t += 2) {
            __m512i x = _mm512_maskz_loadu_epi8(m, rows[t] + i), y = zero;
            uint32_t pair = (uint16_t)k[t];
            if (t + 1 < n) {
                y = _mm512_maskz_loadu_epi8(m, rows[t + 1] + i);
                pair |= (uint32_t)(uint16_t)k[t + 1] << 16;
            }
            __m512i kk = _mm512_set1_epi32((int)pair);
            __m512i lo = _mm512_unpacklo_epi8(x, y), hi = _mm512_unpackhi_epi8(x, y);
            a0 = _mm512_dpwssd_epi32(a0, _mm512_unpacklo_epi8(lo, zero), kk);
            a1 = _mm512_dpwssd_epi32(a1, _mm512_unpackhi_epi8(lo, zero), kk);
            a2 = _mm512_dpwssd_epi32(a2, _mm512_unpacklo_epi8(hi, zero), kk);
            a3 = _mm512_dpwssd_epi32(a3, _mm512_unpackhi_epi8(hi, zero), kk);
        }
        /* per 128-bit lane L, a0..a3 hold elements 16L + [0-3], [4-7], [8-11], [12-15] */
        __m512i r0 = _mm512_packs_epi32(_mm512_srai_epi32(a0, VSHIFT), _mm512_srai_epi32(a1, VSHIFT));
        __m512i r1 = _mm512_packs_epi32(_mm512_srai_epi32(a2, VSHIFT), _mm512_srai_epi32(a3, VSHIFT));
        __m512i o0 = _mm512_permutex2var_epi64(r0, lo_idx, r1), o1 = _mm512_permutex2var_epi64(r0, hi_idx, r1);
        if (left >= 64) {
            _mm512_storeu_si512((void *)(out + i), o0);
            _mm512_storeu_si512((void *)(out + i + 32), o1);
        } else {
            __mmask32 m0 = left >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << left) - 1);
            __mmask32 m1 = left > 32 ? (((__mmask32)1 << (left - 32)) - 1) : 0;
            _mm512_mask_storeu_epi16(out + i, m0, o0);
            _mm512_mask_storeu_epi16(out + i + 32, m1, o1);
        }
    }
}

/* Four taps per step: pixels t, t+1 in the low lane and t+2, t+3 in the high
 * lane, shuffled to (r r g g b b 0 0) and multiplied by weight pairs. kv holds,
 * per output column, nq vectors of (k[4q], k[4q+1]) x4 | (k[4q+2], k[4q+3]) x4,
 * zero past the column's taps. Every column takes the same nq steps (callers
 * pass a constant for the common 1 and 2, so the loop unrolls).
 * Returns the column's (r, g, b, 0) sums in Q20. */
__attribute__((target("avx2"), always_inline)) static inline __m128i hsum_avx2(const int16_t *in, int start,
                                                                                int nq, const __m256i *kk) {
    const __m256i shuf = _mm256_setr_epi8(0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11, -1, -1, -1, -1,
                                          0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11, -1, -1, -1, -1);
    const int16_t *p = in + (size_t)start * 3;
    __m256i s = _mm256_setzero_si256();
    for (int q = 0; q < nq; q++, p += 12) {
        __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                            _mm_loadu_si128((const __m128i *)(p + 6)), 1);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_shuffle_epi8(v, shuf), _mm256_loadu_si256(kk + q)));
    }
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

/* Instantiate `body` (which uses HSUM(x)) with nq = 1, 2 or any. */
#define HPASS_BY_NQ(body)                                                            \
    switch (nq) {                                                                    \
    case 1: {                                                                        \
        enum { NQ = 1 };                                                             \
        body;                                                                        \
    } break;                                                                         \
    case 2: {                                                                        \
        enum { NQ = 2 };                                                             \
        body;                                                                        \
    } break;                                                                         \
    default: {                                                                       \
        const int NQ = nq;                                                           \
        body;                                                                        \
    }                                                                                \
    }
#define HSUM(x) hsum_avx2(in, start[x], NQ, kv + (size_t)(x) * nq)

/* The horizontal pass of one uint8 row, written straight to its output row.
 * Output pixels go in increasing address order (a flipped row reads its
 * columns from the right), so each pixel can be stored as 4 bytes, the fourth
 * overwritten by the next pixel; the last one is stored as 3. */
__attribute__((target("avx2"))) static void hpass_u8_avx2(const int16_t *in, const int *start, const __m256i *kv,
                                                           int nq, int out_w, int flip, uint8_t *o) {
    const __m128i rnd = _mm_set1_epi32(1 << (HSHIFT - 1));
    HPASS_BY_NQ(for (int ox = 0; ox < out_w; ox++) {
        int x = flip ? out_w - 1 - ox : ox;
        __m128i v = _mm_srai_epi32(_mm_add_epi32(HSUM(x), rnd), HSHIFT);
        v = _mm_packus_epi16(_mm_packs_epi32(v, v), v);
        uint32_t px = (uint32_t)_mm_cvtsi128_si32(v);
        memcpy(o + (size_t)ox * 3, &px, ox + 1 < out_w ? 4 : 3);
    })
}

/* The horizontal pass into acc (4 int32 per column); write_row_f32_avx2 then
 * makes float planes of it (measured faster than transposing each column's sums
 * as they come out of hsum_avx2). */
__attribute__((target("avx2"))) static void hpass_avx2(const int16_t *in, const int *start, const __m256i *kv,
                                                        int nq, int out_w, int32_t *acc) {
    HPASS_BY_NQ(for (int x = 0; x < out_w; x++) _mm_storeu_si128((__m128i *)(acc + 4 * x), HSUM(x)))
}

/* One float32 CHW output row from acc (r, g, b, 0 per pixel, Q20): value * s[c] + b[c]
 * for 8 pixels at a time, de-interleaved into the three planes (mirrored when flip).
 * The same multiply then add as write_row_c (no FMA), so the same floats. */
__attribute__((target("avx2"))) static void write_row_f32_avx2(const int32_t *acc, int out_w, int flip,
                                                                const float *s, const float *b,
                                                                float *o0, float *o1, float *o2) {
    const __m256 s0 = _mm256_set1_ps(s[0]), s1 = _mm256_set1_ps(s[1]), s2 = _mm256_set1_ps(s[2]);
    const __m256 b0 = _mm256_set1_ps(b[0]), b1 = _mm256_set1_ps(b[1]), b2 = _mm256_set1_ps(b[2]);
    /* after the in-lane transpose a plane vector holds pixels (0 2 4 6 | 1 3 5 7) */
    const __m256i order = flip ? _mm256_setr_epi32(7, 3, 6, 2, 5, 1, 4, 0)
                               : _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int x = 0;
    for (; x + 8 <= out_w; x += 8) {
        const __m256i *a = (const __m256i *)(acc + 4 * x);
        __m256 v0 = _mm256_cvtepi32_ps(_mm256_loadu_si256(a));     /* px 0 | 1 */
        __m256 v1 = _mm256_cvtepi32_ps(_mm256_loadu_si256(a + 1)); /* px 2 | 3 */
        __m256 v2 = _mm256_cvtepi32_ps(_mm256_loadu_si256(a + 2)); /* px 4 | 5 */
        __m256 v3 = _mm256_cvtepi32_ps(_mm256_loadu_si256(a + 3)); /* px 6 | 7 */
        __m256 t0 = _mm256_unpacklo_ps(v0, v1), t1 = _mm256_unpackhi_ps(v0, v1); /* r0 r2 g0 g2 | b0 b2 . . */
        __m256 t2 = _mm256_unpacklo_ps(v2, v3), t3 = _mm256_unpackhi_ps(v2, v3);
        __m256 r = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(t0, t2, 0x44), order);
        __m256 g = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(t0, t2, 0xEE), order);
        __m256 bl = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(t1, t3, 0x44), order);
        size_t at = flip ? (size_t)(out_w - 8 - x) : (size_t)x;
        _mm256_storeu_ps(o0 + at, _mm256_add_ps(_mm256_mul_ps(r, s0), b0));
        _mm256_storeu_ps(o1 + at, _mm256_add_ps(_mm256_mul_ps(g, s1), b1));
        _mm256_storeu_ps(o2 + at, _mm256_add_ps(_mm256_mul_ps(bl, s2), b2));
    }
    for (; x < out_w; x++) {
        size_t at = flip ? (size_t)(out_w - 1 - x) : (size_t)x;
        o0[at] = (float)acc[4 * x] * s[0] + b[0];
        o1[at] = (float)acc[4 * x + 1] * s[1] + b[1];
        o2[at] = (float)acc[4 * x + 2] * s[2] + b[2];
    }
}
#endif

/* ---- plan and run ------------------------------------------------------ */

struct raydl_resize {
    int out_w, out_h, flip, out_format;
    int col0, span;       /* source columns [col0, col0 + span) feed the output */
    int kx_stride, nq, ky_stride, simd;
    int *xstart, *xcount; /* relative to col0 */
    int *ystart, *ycount;
    int16_t *kx, *ky;
    void *kv;             /* 32-byte vectors for hpass_avx2 */
    int16_t *row;         /* one vertically filtered row */
    int32_t *acc;         /* one horizontally filtered row, 4 int32 per pixel */
    int32_t *vacc;        /* the portable vertical pass's sums (span * 3), NULL with AVX2 */
    const uint8_t **rows; /* the source rows of one output row */
    const uint8_t **win;  /* the caller's pointers to those rows (raydl_resize_rows) */
    double *tmp;          /* axis_coeffs' weights of one window */
    const float *scale, *bias;
    float fscale[3];      /* scale[c] / 2^HSHIFT: acc is Q20 */
    void *dst;
    void *mem;            /* the scratch block holding all of the above */
};

static size_t align32(size_t n) { return (n + 31) & ~(size_t)31; }

double raydl_resize_bound(long long max_pixels, int out_h, int out_w) {
    return 4.0 * (double)max_pixels + 8.0 * (double)out_h * (double)out_w;
}

/* What a plan costs, known before anything is allocated: the taps both passes read (each
 * output row's window of rows across the span, each output pixel's window of columns; a
 * window is never longer than its axis) and the bytes of the plan itself, whose weights
 * take 10 bytes a horizontal tap with AVX2 (a 1 x 89 M image resized to 1 x 1 would
 * need 1.8 GB of them). */
typedef struct {
    int kxs, kys, span_max;
    double work;
    size_t bytes;
} plan_cost_t;

static int plan_cost(int src_h, int src_w, double box_x0, double box_y0, double box_x1, double box_y1,
                     int out_h, int out_w, int simd, plan_cost_t *c, size_t sizes[12]) {
    int kxs = axis_ksize(box_x0, box_x1, out_w), kys = axis_ksize(box_y0, box_y1, out_h);
    if (kxs == 0 || kys == 0) return RAYDL_EINVAL; /* a downscale past 2^28: far over any work bound */
    if (kxs > src_w) kxs = src_w;                  /* axis_coeffs never fills more: same weights */
    if (kys > src_h) kys = src_h;
    int kx_stride = (kxs + 3) & ~3, nq = kx_stride / 4;
    int span_max = axis_span_bound(src_w, box_x0, box_x1, out_w); /* what the row buffers are sized for */
    sizes[0] = align32(sizeof(raydl_resize_t));
    sizes[1] = align32(sizeof(int) * (size_t)out_w);                          /* xstart, xcount */
    sizes[2] = align32(sizeof(int) * (size_t)out_h);                          /* ystart, ycount */
    sizes[3] = align32(sizeof(int16_t) * (size_t)out_w * kx_stride);          /* kx */
    sizes[4] = align32(sizeof(int16_t) * (size_t)out_h * kys);                /* ky */
    sizes[5] = simd ? align32((size_t)32 * out_w * nq) : 0;                   /* kv */
    sizes[6] = align32(sizeof(int16_t) * ((size_t)span_max * 3 + ROW_SLACK(kx_stride))); /* row */
    sizes[7] = align32(sizeof(int32_t) * 4 * (size_t)out_w);                  /* acc */
    sizes[8] = align32(sizeof(uint8_t *) * (size_t)kys);                      /* rows, win */
    sizes[9] = align32(sizeof(double) * (size_t)(kxs > kys ? kxs : kys));     /* tmp */
    sizes[10] = simd ? 0 : align32(sizeof(int32_t) * (size_t)span_max * 3);  /* vacc */
    sizes[11] = 0;
    c->kxs = kxs;
    c->kys = kys;
    c->span_max = span_max;
    c->bytes = sizes[0] + 2 * sizes[1] + 2 * sizes[2] + sizes[3] + sizes[4] + sizes[5] + sizes[6] + sizes[7] +
               2 * sizes[8] + sizes[9] + sizes[10] + 32;
    c->work = (double)out_h * kys * span_max + (double)out_h * out_w * kxs;
    return RAYDL_OK;
}

/* RAYDL_EWORK past the bound on taps, or on the plan's bytes: 4 per pixel of the limit
 * (more than the decoded image's 3) and 64 MiB. */
static int over_bound(const plan_cost_t *c, long long max_pixels, int out_h, int out_w) {
    if (max_pixels <= 0) return 0;
    return c->work > raydl_resize_bound(max_pixels, out_h, out_w) ||
           (double)c->bytes > 4.0 * (double)max_pixels + (double)(64 << 20);
}

int raydl_resize_plan(raydl_resize_t **out_plan, int src_h, int src_w,
                      double box_x0, double box_y0, double box_x1, double box_y1,
                      int out_h, int out_w, int flip, int out_format,
                      const float *scale, const float *bias, void *dst, long long max_pixels) {
    *out_plan = NULL;
    if (!dst || src_h <= 0 || src_w <= 0 || out_h <= 0 || out_w <= 0) return RAYDL_EINVAL;
    /* Written as what must hold, so that NaN (every comparison false) is refused too. */
    if (!(box_x0 >= 0 && box_y0 >= 0 && box_x1 <= src_w && box_y1 <= src_h && box_x1 > box_x0 &&
          box_y1 > box_y0))
        return RAYDL_EINVAL;
    if (out_format == RAYDL_OUT_F32_CHW && (!scale || !bias)) return RAYDL_EINVAL;
    if (out_format != RAYDL_OUT_U8_HWC && out_format != RAYDL_OUT_F32_CHW) return RAYDL_EINVAL;
    int simd = raydl_simd(-1);
    plan_cost_t cost;
    size_t sz[12];
    int rc = plan_cost(src_h, src_w, box_x0, box_y0, box_x1, box_y1, out_h, out_w, simd, &cost, sz);
    if (rc != RAYDL_OK) return rc;
    if (over_bound(&cost, max_pixels, out_h, out_w)) return RAYDL_EWORK; /* before any allocation */
    int kxs = cost.kxs, kys = cost.kys, span_max = cost.span_max;
    int kx_stride = (kxs + 3) & ~3, nq = kx_stride / 4;
    size_t sz_plan = sz[0], sz_xi = sz[1], sz_yi = sz[2], sz_kx = sz[3], sz_ky = sz[4], sz_kv = sz[5];
    size_t sz_row = sz[6], sz_acc = sz[7], sz_rows = sz[8], sz_tmp = sz[9];
    void *mem = raydl_scratch(0, cost.bytes);
    if (!mem) return RAYDL_ENOMEM;
    char *p = (char *)(((uintptr_t)mem + 31) & ~(uintptr_t)31);
    raydl_resize_t *r = (raydl_resize_t *)p;
    p += sz_plan;
    r->xstart = (int *)p; p += sz_xi;
    r->xcount = (int *)p; p += sz_xi;
    r->ystart = (int *)p; p += sz_yi;
    r->ycount = (int *)p; p += sz_yi;
    r->kx = (int16_t *)p; p += sz_kx;
    r->ky = (int16_t *)p; p += sz_ky;
    r->kv = simd ? (void *)p : NULL; p += sz_kv;
    r->row = (int16_t *)p; p += sz_row;
    r->acc = (int32_t *)p; p += sz_acc;
    r->rows = (const uint8_t **)p; p += sz_rows;
    r->win = (const uint8_t **)p; p += sz_rows;
    r->tmp = (double *)p; p += sz_tmp;
    r->vacc = simd ? NULL : (int32_t *)p;
    r->out_w = out_w; r->out_h = out_h; r->flip = flip; r->out_format = out_format;
    r->kx_stride = kx_stride; r->nq = nq; r->ky_stride = kys; r->simd = simd;
    r->scale = scale; r->bias = bias; r->dst = dst; r->mem = mem;
    for (int c = 0; c < 3; c++) r->fscale[c] = scale ? scale[c] * (1.0f / (float)(1 << HSHIFT)) : 0.0f;
    axis_coeffs(src_w, box_x0, box_x1, out_w, kxs, kx_stride, r->xstart, r->xcount, r->kx, r->tmp);
    axis_coeffs(src_h, box_y0, box_y1, out_h, kys, kys, r->ystart, r->ycount, r->ky, r->tmp);
    r->col0 = r->xstart[0];
    int col1 = r->xstart[0] + r->xcount[0];
    for (int x = 0; x < out_w; x++) {
        if (r->xstart[x] < r->col0) r->col0 = r->xstart[x];
        if (r->xstart[x] + r->xcount[x] > col1) col1 = r->xstart[x] + r->xcount[x];
    }
    r->span = col1 - r->col0;
    if (r->span > span_max) { /* cannot happen (axis_span_bound follows axis_coeffs); never overrun the rows */
        raydl_scratch_release(0, mem);
        return RAYDL_EINVAL;
    }
    int maxc = 1;
    for (int x = 0; x < out_w; x++) {
        r->xstart[x] -= r->col0;
        if (r->xcount[x] > maxc) maxc = r->xcount[x];
    }
    r->nq = (maxc + 3) / 4; /* often fewer than ksize taps are used: 2-3 for a 1.3x downscale */
    memset(r->row + (size_t)r->span * 3, 0, sizeof(int16_t) * ROW_SLACK(kx_stride));
#ifdef RAYDL_X86
    if (simd) {
        int32_t *kv = (int32_t *)r->kv;
        for (int x = 0; x < out_w; x++) {
            const int16_t *kk = r->kx + (size_t)x * kx_stride;
            for (int q = 0; q < r->nq; q++, kv += 8) {
                uint32_t lo = (uint16_t)kk[4 * q] | (uint32_t)(uint16_t)kk[4 * q + 1] << 16;
                uint32_t hi = (uint16_t)kk[4 * q + 2] | (uint32_t)(uint16_t)kk[4 * q + 3] << 16;
                for (int j = 0; j < 4; j++) {
                    kv[j] = (int32_t)lo;
                    kv[4 + j] = (int32_t)hi;
                }
            }
        }
    }
#endif
    *out_plan = r;
    return RAYDL_OK;
}

void raydl_resize_window(const raydl_resize_t *r, int yy, int *first, int *count) {
    *first = r->ystart[yy];
    *count = r->ycount[yy];
}

int raydl_resize_max_taps(const raydl_resize_t *r) { return r->ky_stride; }

const uint8_t **raydl_resize_rows(raydl_resize_t *r) { return r->win; }

static void write_row(const raydl_resize_t *r, int yy) {
    const int32_t *acc = r->acc;
    int out_w = r->out_w, flip = r->flip;
    if (r->out_format == RAYDL_OUT_U8_HWC) {
        uint8_t *o = (uint8_t *)r->dst + (size_t)yy * out_w * 3;
        for (int ox = 0; ox < out_w; ox++) {
            const int32_t *a = acc + 4 * (flip ? out_w - 1 - ox : ox);
            for (int c = 0; c < 3; c++) {
                int32_t v = (a[c] + (1 << (HSHIFT - 1))) >> HSHIFT;
                o[3 * ox + c] = (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
            }
        }
    } else {
        size_t plane = (size_t)r->out_h * out_w;
        float *o = (float *)r->dst + (size_t)yy * out_w;
#ifdef RAYDL_X86
        if (r->simd) {
            write_row_f32_avx2(acc, out_w, flip, r->fscale, r->bias, o, o + plane, o + 2 * plane);
            return;
        }
#endif
        for (int c = 0; c < 3; c++) {
            const float s = r->fscale[c], b = r->bias[c];
            float *oc = o + c * plane;
            if (flip)
                for (int x = 0; x < out_w; x++) oc[out_w - 1 - x] = (float)acc[4 * x + c] * s + b;
            else
                for (int x = 0; x < out_w; x++) oc[x] = (float)acc[4 * x + c] * s + b;
        }
    }
}

void raydl_resize_row(raydl_resize_t *r, int yy, const uint8_t *const *src_rows) {
    int n = r->ycount[yy];
    const int16_t *k = r->ky + (size_t)yy * r->ky_stride;
    for (int t = 0; t < n; t++) r->rows[t] = src_rows[t] + (size_t)r->col0 * 3;
#ifdef RAYDL_X86
    if (r->simd) {
        if (r->simd >= 2) vpass_avx512(r->rows, k, n, r->span * 3, r->row);
        else vpass_avx2(r->rows, k, n, r->span * 3, r->row);
        if (r->out_format == RAYDL_OUT_U8_HWC) {
            hpass_u8_avx2(r->row, r->xstart, (const __m256i *)r->kv, r->nq, r->out_w, r->flip,
                          (uint8_t *)r->dst + (size_t)yy * r->out_w * 3);
        } else {
            hpass_avx2(r->row, r->xstart, (const __m256i *)r->kv, r->nq, r->out_w, r->acc);
            write_row(r, yy);
        }
        return;
    }
#endif
    vpass_c(r->rows, k, n, r->span * 3, r->row, r->vacc);
    hpass_c(r->row, r->xstart, r->xcount, r->kx, r->kx_stride, r->out_w, r->acc);
    write_row(r, yy);
}

void raydl_resize_release(raydl_resize_t *r) {
    if (r) raydl_scratch_release(0, r->mem); /* frees only a plan too large to keep */
}

double raydl_resize_work(int src_h, int src_w, double box_x0, double box_y0, double box_x1, double box_y1,
                         int out_h, int out_w) {
    plan_cost_t cost;
    size_t sz[12];
    if (src_h <= 0 || src_w <= 0 || out_h <= 0 || out_w <= 0 ||
        plan_cost(src_h, src_w, box_x0, box_y0, box_x1, box_y1, out_h, out_w, raydl_simd(-1), &cost, sz) != RAYDL_OK)
        return -1.0;
    return cost.work;
}

int raydl_crop_resize(const uint8_t *src, int src_h, int src_w, int src_stride,
                      double box_x0, double box_y0, double box_x1, double box_y1,
                      int out_h, int out_w, int flip, int out_format,
                      const float *scale, const float *bias, void *dst, long long max_pixels) {
    if (!src) return RAYDL_EINVAL;
    raydl_resize_t *r;
    int rc = raydl_resize_plan(&r, src_h, src_w, box_x0, box_y0, box_x1, box_y1, out_h, out_w, flip,
                               out_format, scale, bias, dst, max_pixels);
    if (rc != RAYDL_OK) return rc;
    const uint8_t **rows = raydl_resize_rows(r);
    for (int yy = 0; yy < out_h; yy++) {
        int first = r->ystart[yy];
        for (int t = 0; t < r->ycount[yy]; t++) rows[t] = src + (size_t)(first + t) * src_stride;
        raydl_resize_row(r, yy, rows);
    }
    raydl_resize_release(r);
    return RAYDL_OK;
}
