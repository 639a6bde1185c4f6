/* raydl native kernels: crop + resize + flip + normalize in one pass.
 *
 * The resampling follows Pillow's separable convolution (Resample.c): for
 * every output column a window of input columns is weighted by the bilinear
 * ("triangle") filter, whose support grows with the downscale factor, which
 * is what antialiases a downscale. Coefficients are computed in double and
 * the accumulation is done in float, so results agree with Pillow's
 * fixed-point code to within a grey level or two.
 *
 * cffi releases the GIL around every call into this file.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

typedef float v4f __attribute__((vector_size(16)));

typedef struct {
    int *start;   /* first input index of each output index */
    int *count;   /* number of taps of each output index */
    float *w;     /* weights, ksize per output index */
    int ksize;
} coeffs_t;

#define RAYDL_SCRATCH_SLOTS 2
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

static double triangle(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

static void coeffs_free(coeffs_t *c) {
    free(c->start);
    free(c->count);
    free(c->w);
}

/* Coefficients mapping [in0, in1) of an axis of in_size to out_size. */
static int coeffs_make(coeffs_t *c, int in_size, double in0, double in1, int out_size) {
    double scale = (in1 - in0) / out_size;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = 1.0 * filterscale;
    int ksize = (int)ceil(support) * 2 + 1;
    c->ksize = ksize;
    c->start = malloc(sizeof(int) * out_size);
    c->count = malloc(sizeof(int) * out_size);
    c->w = calloc((size_t)out_size * ksize, sizeof(float));
    if (!c->start || !c->count || !c->w) {
        coeffs_free(c);
        return RAYDL_ENOMEM;
    }
    double ss = 1.0 / filterscale;
    double tmp[ksize];
    for (int xx = 0; xx < out_size; xx++) {
        double center = in0 + (xx + 0.5) * scale;
        int xmin = (int)(center - support + 0.5);
        if (xmin < 0) xmin = 0;
        int xmax = (int)(center + support + 0.5);
        if (xmax > in_size) xmax = in_size;
        xmax -= xmin;
        if (xmax > ksize) xmax = ksize;
        double ww = 0.0;
        for (int x = 0; x < xmax; x++) {
            double w = triangle((x + xmin - center + 0.5) * ss);
            tmp[x] = w;
            ww += w;
        }
        float *k = c->w + (size_t)xx * ksize;
        for (int x = 0; x < xmax; x++) k[x] = (float)(ww != 0.0 ? tmp[x] / ww : tmp[x]);
        c->start[xx] = xmin;
        c->count[xx] = xmax;
    }
    return RAYDL_OK;
}

/* On x86-64 an AVX2+FMA copy is compiled beside the baseline one and picked at
 * load time, so one wheel runs everywhere and uses the wider units where present. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define RAYDL_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define RAYDL_CLONES
#endif

RAYDL_CLONES
int raydl_crop_resize(const uint8_t *src, int src_h, int src_w, int src_stride,
                      double box_x0, double box_y0, double box_x1, double box_y1,
                      int out_h, int out_w, int flip, int out_format,
                      const float *scale, const float *bias, void *dst) {
    if (!src || !dst || src_h <= 0 || src_w <= 0 || out_h <= 0 || out_w <= 0)
        return RAYDL_EINVAL;
    /* Written as what must hold, so that NaN (every comparison false) is refused too. */
    if (!(box_x0 >= 0 && box_y0 >= 0 && box_x1 <= src_w && box_y1 <= src_h &&
          box_x1 > box_x0 && box_y1 > box_y0))
        return RAYDL_EINVAL;

    coeffs_t cx, cy;
    if (coeffs_make(&cx, src_w, box_x0, box_x1, out_w) != RAYDL_OK) return RAYDL_ENOMEM;
    if (coeffs_make(&cy, src_h, box_y0, box_y1, out_h) != RAYDL_OK) {
        coeffs_free(&cx);
        return RAYDL_ENOMEM;
    }
    /* Vertical pass first: it runs over whole contiguous rows, which the
     * compiler vectorizes, and only over the columns some output column reads. */
    int col0 = cx.start[0];
    int col1 = cx.start[out_w - 1] + cx.count[out_w - 1];
    int span = (col1 - col0) * 3;
    float *tmp = raydl_scratch(0, sizeof(float) * ((size_t)out_h * span + 1));
    if (!tmp) {
        coeffs_free(&cx);
        coeffs_free(&cy);
        return RAYDL_ENOMEM;
    }
    for (int yy = 0; yy < out_h; yy++) {
        const float *k = cy.w + (size_t)yy * cy.ksize;
        float *acc = tmp + (size_t)yy * span;
        const uint8_t *row = src + (size_t)cy.start[yy] * src_stride + (size_t)col0 * 3;
        for (int i = 0; i < span; i++) acc[i] = k[0] * row[i];
        for (int t = 1; t < cy.count[yy]; t++) {
            const float kt = k[t];
            row += src_stride;
            for (int i = 0; i < span; i++) acc[i] += kt * row[i];
        }
    }

    /* Horizontal pass, flipped when asked, straight into the caller's slot.
     * Each tap is one 4-float vector load (R, G, B and the next pixel's R,
     * ignored), so a tap costs one multiply-add; tmp has one float of slack. */
    size_t plane = (size_t)out_h * out_w;
    for (int yy = 0; yy < out_h; yy++) {
        const float *in = tmp + (size_t)yy * span;
        for (int xx = 0; xx < out_w; xx++) {
            const float *k = cx.w + (size_t)xx * cx.ksize;
            const float *p = in + (size_t)(cx.start[xx] - col0) * 3;
            v4f acc = {0.f, 0.f, 0.f, 0.f};
            for (int t = 0; t < cx.count[xx]; t++) {
                v4f px;
                memcpy(&px, p + 3 * t, sizeof px);
                acc += k[t] * px;
            }
            int ox = flip ? out_w - 1 - xx : xx;
            if (out_format == RAYDL_OUT_U8_HWC) {
                uint8_t *o = (uint8_t *)dst + ((size_t)yy * out_w + ox) * 3;
                for (int c = 0; c < 3; c++) {
                    float v = acc[c] + 0.5f;
                    o[c] = v <= 0.f ? 0 : (v >= 255.f ? 255 : (uint8_t)v);
                }
            } else {
                float *o = (float *)dst + (size_t)yy * out_w + ox;
                for (int c = 0; c < 3; c++) {
                    float v = acc[c];
                    v = v < 0.f ? 0.f : (v > 255.f ? 255.f : v);
                    o[c * plane] = v * scale[c] + bias[c];
                }
            }
        }
    }
    raydl_scratch_release(0, tmp);
    coeffs_free(&cx);
    coeffs_free(&cy);
    return RAYDL_OK;
}
