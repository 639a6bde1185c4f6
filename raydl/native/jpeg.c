/* Decode only the part of a JPEG that a crop needs, then resample it.
 *
 * libjpeg-turbo can skip the IDCT, upsampling and colour conversion of rows
 * above the crop (jpeg_skip_scanlines) and of columns left and right of it
 * (jpeg_crop_scanline), stop after the last row the crop reads, and scale by
 * 1/2, 1/4 or 1/8 in the DCT domain. What it decodes, with a margin of rows
 * and columns around the box so the filter sees exactly the pixels it would
 * see in a full decode, goes row by row into the resampler (kernels.c). The caller
 * picks the DCT scale (raydl.decode.dct_factor); `fast` trades exactness for
 * speed (IFAST IDCT, no fancy upsampling).
 *
 * libjpeg reports fatal errors through error_exit, which must not return:
 * we longjmp back here and turn it into RAYDL_EJPEG with the message.
 * Warnings (corrupt or truncated data that libjpeg patches over) are errors
 * too, as in simplejpeg's strict mode.
 *
 * Hostile files (raydl's trust boundary: data is untrusted):
 *  - the frame header's width x height is checked against max_pixels right
 *    after jpeg_read_header, before jpeg_start_decompress allocates anything
 *    (a progressive file makes it buffer every coefficient of the image), and
 *    libjpeg's own memory is capped by what that many pixels need, a second
 *    guard (RAYDL_ETOOBIG for both);
 *  - truncation is decided from the bytes, not from the rows the crop happens
 *    to decode: a file with no end-of-image marker after its first scan header
 *    is refused before any row is decoded, whatever the crop (a crop that
 *    missed the damage used to decode "ok").
 */
#define _GNU_SOURCE /* memrchr */
#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

#include "kernels.h"

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char msg[JMSG_LENGTH_MAX];
} err_mgr_t;

static void on_error_exit(j_common_ptr cinfo) {
    err_mgr_t *err = (err_mgr_t *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->msg);
    longjmp(err->jump, 1);
}

static void on_emit_message(j_common_ptr cinfo, int level) {
    err_mgr_t *err = (err_mgr_t *)cinfo->err;
    if (level < 0) { /* a warning: keep the first one */
        if (cinfo->err->num_warnings == 0) (*cinfo->err->format_message)(cinfo, err->msg);
        cinfo->err->num_warnings++;
    }
}

static void copy_msg(char *dst, int dst_len, const char *src) {
    if (dst && dst_len > 0) {
        strncpy(dst, src, (size_t)dst_len - 1);
        dst[dst_len - 1] = '\0';
    }
}

static int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* Whether an EOI marker (FF D9) lies in [from, end). Inside entropy-coded data every
 * FF byte is followed by 00 (stuffing) or a marker, so FF D9 there is the end of the
 * image, never data; a truncated file lost it. Searched from the end: O(1) for a whole
 * file (EOI is its last two bytes), O(trailing bytes) for one with bytes after EOI. */
static int has_eoi(const uint8_t *from, const uint8_t *end) {
    for (const uint8_t *p = end; p > from + 1;) {
        const uint8_t *d = memrchr(from + 1, 0xD9, (size_t)(p - (from + 1)));
        if (!d) return 0;
        if (d[-1] == 0xFF) return 1;
        p = d;
    }
    return 0;
}

/* libjpeg's memory for an image of max_pixels: 3 full-resolution components' coefficients
 * at 2 bytes (what a progressive or multi-scan file buffers), block padding, and 64 MiB for
 * tables, rows and small images. Past it libjpeg fails with JERR_NO_BACKING_STORE. */
static long memory_cap(long long max_pixels) {
    double cap = 8.0 * (double)max_pixels + (double)(64 << 20);
    return cap >= (double)LONG_MAX ? LONG_MAX : (long)cap;
}

int raydl_jpeg_crop_resize(const uint8_t *data, size_t len,
                           double box_x0, double box_y0, double box_x1, double box_y1,
                           int out_h, int out_w, int flip, int out_format,
                           const float *scale, const float *bias, void *dst,
                           int scale_denom, int fast, long long max_pixels, char *errbuf, int errbuf_len) {
    struct jpeg_decompress_struct cinfo;
    err_mgr_t err;
    /* volatile: these change after setjmp and are read after a longjmp */
    uint8_t *volatile buf = NULL;
    raydl_resize_t *volatile plan = NULL;
    volatile int started = 0;

    memset(&cinfo, 0, sizeof cinfo);
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error_exit;
    err.pub.emit_message = on_emit_message;
    err.msg[0] = '\0';
    if (setjmp(err.jump)) {
        copy_msg(errbuf, errbuf_len, err.msg);
        int code = err.pub.msg_code == JERR_NO_BACKING_STORE ? RAYDL_ETOOBIG : RAYDL_EJPEG;
        jpeg_destroy_decompress(&cinfo);
        raydl_scratch_release(1, buf);
        raydl_resize_release(plan);
        return code;
    }
    jpeg_create_decompress(&cinfo);
    cinfo.mem->max_memory_to_use = memory_cap(max_pixels);
    jpeg_mem_src(&cinfo, data, (unsigned long)len);
    jpeg_read_header(&cinfo, TRUE);
    if ((long long)cinfo.image_width * (long long)cinfo.image_height > max_pixels) {
        jpeg_destroy_decompress(&cinfo);
        copy_msg(errbuf, errbuf_len, "JPEG frame header over the pixel limit");
        return RAYDL_ETOOBIG;
    }
    /* jpeg_read_header stopped just past the first scan header */
    if (!has_eoi(cinfo.src->next_input_byte, data + len)) {
        jpeg_destroy_decompress(&cinfo);
        copy_msg(errbuf, errbuf_len, "truncated: no end-of-image marker after the scan header");
        return RAYDL_EJPEG;
    }
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
        jpeg_destroy_decompress(&cinfo);
        copy_msg(errbuf, errbuf_len, "CMYK/YCCK JPEG: not converted here");
        return RAYDL_EUNSUPPORTED;
    }
    int full_w = (int)cinfo.image_width, full_h = (int)cinfo.image_height;
    if (!(box_x0 >= 0 && box_y0 >= 0 && box_x1 <= full_w && box_y1 <= full_h && box_x1 > box_x0 &&
          box_y1 > box_y0)) { /* NaN-proof */
        jpeg_destroy_decompress(&cinfo);
        copy_msg(errbuf, errbuf_len, "crop box outside the image");
        return RAYDL_EINVAL;
    }
    if (scale_denom != 1 && scale_denom != 2 && scale_denom != 4 && scale_denom != 8) {
        jpeg_destroy_decompress(&cinfo);
        copy_msg(errbuf, errbuf_len, "scale_denom must be 1, 2, 4 or 8");
        return RAYDL_EINVAL;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)scale_denom;
    if (fast) { /* opt-in shortcuts that change pixels: fast integer IDCT, no fancy upsampling */
        cinfo.dct_method = JDCT_IFAST;
        cinfo.do_fancy_upsampling = FALSE;
    }
    jpeg_start_decompress(&cinfo);
    started = 1;
    if (err.pub.num_warnings > 0) { /* a progressive file's scans were all read here: fail before any row */
        copy_msg(errbuf, errbuf_len, err.msg);
        jpeg_abort_decompress(&cinfo);
        jpeg_destroy_decompress(&cinfo);
        return RAYDL_EJPEG;
    }

    /* The box in the (possibly scaled) output, and the rows/columns the filter reads. */
    int ow = (int)cinfo.output_width, oh = (int)cinfo.output_height;
    double sx = (double)ow / full_w, sy = (double)oh / full_h;
    double bx0 = box_x0 * sx, by0 = box_y0 * sy;
    double bx1 = fmin(box_x1 * sx, ow), by1 = fmin(box_y1 * sy, oh);
    double sup_x = fmax(1.0, (bx1 - bx0) / out_w), sup_y = fmax(1.0, (by1 - by0) / out_h);
    int col0 = clampi((int)floor(bx0 - sup_x) - 1, 0, ow);
    int col1 = clampi((int)ceil(bx1 + sup_x) + 1, 0, ow);
    int row0 = clampi((int)floor(by0 - sup_y) - 1, 0, oh);
    int row1 = clampi((int)ceil(by1 + sup_y) + 1, 0, oh);

    JDIMENSION xoff = (JDIMENSION)col0, cw = (JDIMENSION)(col1 - col0);
    if (cw < (JDIMENSION)ow) jpeg_crop_scanline(&cinfo, &xoff, &cw); /* widens to iMCU bounds */
    if (row0 > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)row0);
    int rows = row1 - row0;
    size_t stride = (size_t)cinfo.output_width * 3; /* output_width == cw after cropping */

    /* Rows are resampled as they are decoded, through a ring of as many rows
     * as one output row reads, so they are still in cache when the filter
     * reads them and no buffer of the whole region is written to memory. */
    raydl_resize_t *r;
    int rc = raydl_resize_plan(&r, rows, (int)cw, bx0 - (double)xoff, by0 - row0, bx1 - (double)xoff,
                               by1 - row0, out_h, out_w, flip, out_format, scale, bias, dst, max_pixels);
    if (rc != RAYDL_OK) {
        jpeg_abort_decompress(&cinfo);
        jpeg_destroy_decompress(&cinfo);
        copy_msg(errbuf, errbuf_len, rc == RAYDL_EWORK ? "resize over the work bound" : "bad crop box or output size");
        return rc;
    }
    plan = r;
    int cap = raydl_resize_max_taps(r);
    buf = raydl_scratch(1, stride * (size_t)cap);
    if (!buf) {
        jpeg_abort_decompress(&cinfo);
        jpeg_destroy_decompress(&cinfo);
        raydl_resize_release(r);
        return RAYDL_ENOMEM;
    }
    const uint8_t **win = raydl_resize_rows(r); /* cap pointers on the heap (cap grows with the downscale) */
    int have = 0; /* rows decoded so far, row i in ring slot i % cap */
    for (int yy = 0; yy < out_h; yy++) {
        int first, n;
        raydl_resize_window(r, yy, &first, &n);
        while (have < first + n) {
            JSAMPROW row = buf + stride * (size_t)(have % cap);
            if (jpeg_read_scanlines(&cinfo, &row, 1) == 0) {
                copy_msg(errbuf, errbuf_len, "JPEG data ended before the crop's last row");
                jpeg_abort_decompress(&cinfo);
                jpeg_destroy_decompress(&cinfo);
                raydl_scratch_release(1, buf);
                raydl_resize_release(r);
                return RAYDL_EJPEG;
            }
            have++;
        }
        for (int t = 0; t < n; t++) win[t] = buf + stride * (size_t)((first + t) % cap);
        raydl_resize_row(r, yy, win);
    }
    int warned = err.pub.num_warnings > 0;
    if (warned) copy_msg(errbuf, errbuf_len, err.msg);
    (void)started;
    jpeg_abort_decompress(&cinfo); /* the rows below the crop are never decoded */
    jpeg_destroy_decompress(&cinfo);
    raydl_scratch_release(1, buf);
    raydl_resize_release(r);
    return warned ? RAYDL_EJPEG : RAYDL_OK;
}

void raydl_jpeg_crop_resize_many(int n, const uint8_t *const *data, const size_t *len, const double *box,
                                 const int *flip, const int *scale_denom, int out_h, int out_w, int out_format,
                                 const float *scale, const float *bias, void *const *dst, int fast,
                                 long long max_pixels, int *rc, char *errbuf, int errbuf_len) {
    for (int i = 0; i < n; i++) {
        char *err = errbuf ? errbuf + (size_t)i * (size_t)errbuf_len : NULL;
        if (err && errbuf_len > 0) err[0] = '\0';
        rc[i] = raydl_jpeg_crop_resize(data[i], len[i], box[4 * i], box[4 * i + 1], box[4 * i + 2], box[4 * i + 3],
                                       out_h, out_w, flip[i], out_format, scale, bias, dst[i], scale_denom[i], fast,
                                       max_pixels, err, errbuf_len);
    }
}
