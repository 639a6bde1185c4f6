/* Token windows of a language-model corpus: rows of input ids, labels and document positions, copied
 * out of one unit's token values (a memory-mapped .bin, a decoded row group) in one pass. */
#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

/* The last document starting at or before token t: starts[] ascending, starts[0] <= t. */
static long long doc_of(const long long *starts, long long n_starts, long long t)
{
    long long lo = 0, hi = n_starts; /* starts[lo] <= t < starts[hi] (hi == n_starts: past the end) */
    while (hi - lo > 1) {
        long long mid = lo + (hi - lo) / 2;
        if (starts[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

#define COPY_ROWS(IN_T, OUT_T)                                                                        \
    do {                                                                                              \
        const IN_T *v = (const IN_T *)values + off;                                                   \
        OUT_T *in = (OUT_T *)inputs + row * (size_t)seq, *lab = (OUT_T *)labels + row * (size_t)seq; \
        for (int j = 0; j < seq; j++) {                                                               \
            in[j] = (OUT_T)v[j];                                                                      \
            lab[j] = (OUT_T)v[j + 1];                                                                 \
        }                                                                                             \
    } while (0)

#define COPY_OUT(IN_T)                  \
    do {                                \
        if (out_kind == RAYDL_TOK_I64)  \
            COPY_ROWS(IN_T, int64_t);   \
        else                            \
            COPY_ROWS(IN_T, int32_t);   \
    } while (0)

#define FILL_POSITIONS(OUT_T)                                                   \
    do {                                                                        \
        OUT_T *p = (OUT_T *)positions + row * (size_t)seq;                      \
        long long d = doc_of(starts, n_starts, off);                            \
        int j = 0;                                                              \
        while (j < seq) {                                                       \
            long long t = off + j;                                              \
            while (d + 1 < n_starts && starts[d + 1] <= t)                      \
                d++;                                                            \
            long long next = d + 1 < n_starts ? starts[d + 1] : LLONG_MAX;      \
            int end = next - off < (long long)seq ? (int)(next - off) : seq;    \
            long long base = starts[d] - off;                                   \
            for (; j < end; j++)                                                \
                p[j] = (OUT_T)(j - base);                                       \
        }                                                                       \
    } while (0)

int raydl_token_windows(const void *values, int in_kind, long long n_values, const long long *starts,
                        long long n_starts, const long long *offsets, const long long *rows, int n,
                        long long n_rows, int seq, int out_kind, void *inputs, void *labels,
                        void *positions)
{
    if (!values || !starts || !offsets || !rows || !inputs || !labels || !positions || n < 0 || seq < 1 ||
        n_starts < 1 || starts[0] != 0 || (out_kind != RAYDL_TOK_I32 && out_kind != RAYDL_TOK_I64) ||
        in_kind < RAYDL_TOK_I8 || in_kind > RAYDL_TOK_I64)
        return RAYDL_EINVAL;
    for (int r = 0; r < n; r++) /* every row inside the values and the output before anything is written */
        if (offsets[r] < 0 || offsets[r] > n_values - seq - 1 || rows[r] < 0 || rows[r] >= n_rows)
            return RAYDL_EINVAL;
    for (int r = 0; r < n; r++) {
        long long off = offsets[r];
        size_t row = (size_t)rows[r];
        switch (in_kind) {
        case RAYDL_TOK_I8: COPY_OUT(int8_t); break;
        case RAYDL_TOK_U8: COPY_OUT(uint8_t); break;
        case RAYDL_TOK_I16: COPY_OUT(int16_t); break;
        case RAYDL_TOK_U16: COPY_OUT(uint16_t); break;
        case RAYDL_TOK_I32: COPY_OUT(int32_t); break;
        case RAYDL_TOK_U32: COPY_OUT(uint32_t); break;
        default: COPY_OUT(int64_t); break;
        }
        if (out_kind == RAYDL_TOK_I64)
            FILL_POSITIONS(int64_t);
        else
            FILL_POSITIONS(int32_t);
    }
    return RAYDL_OK;
}
