/* Native kernels of pcvr_lib.data.convert (the "native" backend); built on first use by
   convert_native.native_library() with the system C compiler and loaded with ctypes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Whole-column kernels: each list column is given by its int32 offsets (already at the array's slice
   offset), its validity bitmap (0: no nulls) starting at bit `bit`, and its values. A null row is empty. */
static inline int64_t row_range(const int32_t *off, const uint8_t *valid, int64_t bit, int64_t b, int64_t *len) {
    int64_t s = off[b];
    *len = off[b + 1] - s;
    if (valid) {
        int64_t i = bit + b;
        if (!((valid[i >> 3] >> (i & 7)) & 1)) *len = 0;
    }
    return s;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* Contiguous tokens with AVX-512: 8 int64 -> 8 int32 per step, written with streaming stores (the batch is
   far larger than the caches; skipping the read-for-ownership of the output saves ~20%). o must be
   32-byte aligned and L a multiple of 8. Padding is written as zeros in the same loop. */
static inline int64_t put_tokens_avx512(const int64_t *x, int64_t k, int64_t L, int64_t voc, int32_t *o) {
    const __m512i zero = _mm512_setzero_si512(), vv = _mm512_set1_epi64(voc);
    int64_t n = 0;
    int64_t j = 0;
    for (; j < k && j < L; j += 8) {
        int64_t rem = k - j;
        __mmask8 in = rem >= 8 ? (__mmask8)0xFF : (__mmask8)((1u << rem) - 1);
        __m512i v = _mm512_maskz_loadu_epi64(in, (const void *)(x + j));
        __mmask8 ok = in & _mm512_cmpgt_epi64_mask(v, zero) & _mm512_cmplt_epi64_mask(v, vv);
        n += __builtin_popcount((unsigned)(in & _mm512_cmpge_epi64_mask(v, vv)));
        _mm256_stream_si256((__m256i *)(o + j), _mm512_cvtepi64_epi32(_mm512_maskz_mov_epi64(ok, v)));
    }
    /* padding: no loads (a fully masked load at an address far from the row can be slow) */
    for (; j < L; j += 8) _mm256_stream_si256((__m256i *)(o + j), _mm256_setzero_si256());
    return n;
}
#define PCVR_FENCE() _mm_sfence()
#else
#define PCVR_FENCE() ((void)0)
#endif

/* Token rules on x[0..k) into o[0..k), zeros to L; returns the out-of-vocab count. */
static inline int64_t put_tokens(const int64_t *x, int64_t k, int64_t L, int64_t voc, int32_t *o) {
    int64_t n = 0;
    if (voc <= 0) k = 0;
#if defined(__AVX512F__)
    if (voc > 0 && ((uintptr_t)o & 31) == 0 && (L & 7) == 0) return put_tokens_avx512(x, k, L, voc, o);
#endif
    for (int64_t j = 0; j < k; j++) {
        int64_t v = x[j];
        n += v >= voc;
        o[j] = (v > 0 && v < voc) ? (int32_t)v : 0;
    }
    if (k < L) memset(o + k, 0, (size_t)(L - k) * sizeof(int32_t));
    return n;
}

#if defined(__AVX512F__)
/* put_tokens_avx512 reading x backwards: o[j] = rule(x[k - 1 - j]). Lanes before x[0] are masked out of
   the load (masked lanes never fault). The blocks go from the last output block to the first, so the
   source is read in ascending addresses, the direction the hardware prefetcher follows (notes/data-convert.md
   has the descending read's cost). */
static inline int64_t put_tokens_rev_avx512(const int64_t *x, int64_t k, int64_t L, int64_t voc, int32_t *o) {
    const __m512i zero = _mm512_setzero_si512(), vv = _mm512_set1_epi64(voc);
    const __m512i rev = _mm512_set_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t n = 0;
    const int64_t filled = ((k < L ? k : L) + 7) & ~(int64_t)7;
    for (int64_t j = filled - 8; j >= 0; j -= 8) {
        int64_t rem = k - j;
        __mmask8 in = rem >= 8 ? (__mmask8)0xFF : (__mmask8)((1u << rem) - 1);
        __mmask8 load = rem >= 8 ? (__mmask8)0xFF : (__mmask8)(0xFFu << (8 - rem));
        __m512i v = _mm512_maskz_loadu_epi64(load, (const void *)(x + k - j - 8));
        v = _mm512_permutexvar_epi64(rev, v); /* lane i = x[k - 1 - j - i] */
        __mmask8 ok = in & _mm512_cmpgt_epi64_mask(v, zero) & _mm512_cmplt_epi64_mask(v, vv);
        n += __builtin_popcount((unsigned)(in & _mm512_cmpge_epi64_mask(v, vv)));
        _mm256_stream_si256((__m256i *)(o + j), _mm512_cvtepi64_epi32(_mm512_maskz_mov_epi64(ok, v)));
    }
    for (int64_t j = filled; j < L; j += 8) _mm256_stream_si256((__m256i *)(o + j), _mm256_setzero_si256());
    return n;
}
#endif

/* Token rules on x[k-1], x[k-2], ..., x[0] into o[0..k) (a newest-first list, oldest kept first), zeros to L. */
static inline int64_t put_tokens_rev(const int64_t *x, int64_t k, int64_t L, int64_t voc, int32_t *o) {
    int64_t n = 0;
    if (voc <= 0) k = 0;
#if defined(__AVX512F__)
    if (voc > 0 && ((uintptr_t)o & 31) == 0 && (L & 7) == 0) return put_tokens_rev_avx512(x, k, L, voc, o);
#endif
    for (int64_t j = k - 1; j >= 0; j--) { /* source ascending */
        int64_t v = x[k - 1 - j];
        n += v >= voc;
        o[j] = (v > 0 && v < voc) ? (int32_t)v : 0;
    }
    if (k < L) memset(o + k, 0, (size_t)(L - k) * sizeof(int32_t));
    return n;
}

/* Token rules on a span of k elements into o[0..k), unaligned (a run of kept events inside a row): forward,
   o[j] = rule(x[j]), or reversed (rev), o[j] = rule(x[k - 1 - j]); returns the out-of-vocab count. voc > 0. */
static inline int64_t put_span(const int64_t *x, int64_t k, int64_t voc, int32_t *o, int rev) {
    int64_t n = 0;
#if defined(__AVX512F__) && defined(__AVX512VL__)
    const __m512i zero = _mm512_setzero_si512(), vv = _mm512_set1_epi64(voc);
    const __m512i back = _mm512_set_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    if (!rev) {
        for (int64_t j = 0; j < k; j += 8) {
            const int64_t rem = k - j;
            const __mmask8 in = rem >= 8 ? (__mmask8)0xFF : (__mmask8)((1u << rem) - 1);
            const __m512i v = _mm512_maskz_loadu_epi64(in, (const void *)(x + j));
            const __mmask8 ok = in & _mm512_cmpgt_epi64_mask(v, zero) & _mm512_cmplt_epi64_mask(v, vv);
            n += __builtin_popcount((unsigned)(in & _mm512_cmpge_epi64_mask(v, vv)));
            _mm256_mask_storeu_epi32((void *)(o + j), in, _mm512_cvtepi64_epi32(_mm512_maskz_mov_epi64(ok, v)));
        }
        return n;
    }
    /* output [j - 8, j) from x[k - j .. k - j + 8) reversed; j from k down: the source ascending. With j < 8,
       source lanes >= j and output lanes < 8 - j lie outside: masked (masked lanes never fault) */
    for (int64_t j = k; j > 0; j -= 8) {
        const __mmask8 load = j >= 8 ? (__mmask8)0xFF : (__mmask8)((1u << j) - 1);
        const __mmask8 store = j >= 8 ? (__mmask8)0xFF : (__mmask8)(0xFFu << (8 - j));
        __m512i v = _mm512_maskz_loadu_epi64(load, (const void *)(x + k - j));
        v = _mm512_permutexvar_epi64(back, v);
        const __mmask8 ok = store & _mm512_cmpgt_epi64_mask(v, zero) & _mm512_cmplt_epi64_mask(v, vv);
        n += __builtin_popcount((unsigned)(store & _mm512_cmpge_epi64_mask(v, vv)));
        _mm256_mask_storeu_epi32((void *)(o + j - 8), store, _mm512_cvtepi64_epi32(_mm512_maskz_mov_epi64(ok, v)));
    }
    return n;
#else
    for (int64_t j = 0; j < k; j++) {
        const int64_t v = rev ? x[k - 1 - j] : x[j];
        n += v >= voc;
        o[j] = (v > 0 && v < voc) ? (int32_t)v : 0;
    }
    return n;
#endif
}

/* o[j] = x[k - 1 - j] for j < k (timestamps of a newest-first list, oldest first), reading x in ascending
   addresses (the hardware prefetcher follows ascending streams). */
static inline void copy_rev_i64(const int64_t *x, int64_t k, int64_t *o) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512i rev = _mm512_set_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    if (((uintptr_t)o & 63) == 0) {
        for (; j + 8 <= k; j += 8)
            _mm512_stream_si512((void *)(o + j), _mm512_permutexvar_epi64(rev, _mm512_loadu_si512((const void *)(x + k - j - 8))));
    }
    for (; j + 8 <= k; j += 8) /* output [j, j + 8) from x[k - j - 8 .. k - j) */
        _mm512_storeu_si512((void *)(o + j), _mm512_permutexvar_epi64(rev, _mm512_loadu_si512((const void *)(x + k - j - 8))));
#endif
    for (; j < k; j++) o[j] = x[k - 1 - j];
}

/* o[0..k) = x[0..k) and zeros to L (timestamps): streaming stores when o is 64-byte aligned (the output is far
   bigger than the caches), else memcpy / memset. */
static inline void copy_i64(const int64_t *x, int64_t k, int64_t L, int64_t *o) {
    int64_t j = 0;
#if defined(__AVX512F__)
    if (((uintptr_t)o & 63) == 0) {
        for (; j + 8 <= k; j += 8) _mm512_stream_si512((void *)(o + j), _mm512_loadu_si512((const void *)(x + j)));
        if (j < k) { /* the tail block, its padding zeros included */
            const __mmask8 in = (__mmask8)((1u << (k - j)) - 1);
            if (j + 8 <= L) {
                _mm512_stream_si512((void *)(o + j), _mm512_maskz_loadu_epi64(in, (const void *)(x + j)));
                j += 8;
            }
        }
        for (; j + 8 <= L; j += 8) _mm512_stream_si512((void *)(o + j), _mm512_setzero_si512());
    }
#endif
    if (j < k) memcpy(o + j, x + j, (size_t)(k - j) * sizeof(int64_t));
    if (j < k) j = k;
    if (j < L) memset(o + j, 0, (size_t)(L - j) * sizeof(int64_t));
}

/* The kept events given as nr runs in output order: run r covers events run_src[r], run_src[r] + step, ...
   (run_len[r] of them; step +1 or -1); events at or past lim (the column's own length) read as 0. */
static inline int64_t put_runs(const int64_t *x, const int64_t *run_src, const int64_t *run_len, int64_t nr,
                               int64_t step, int64_t lim, int64_t L, int64_t voc, int32_t *o) {
    int64_t n = 0, p = 0;
    if (nr == 1 && voc > 0) { /* the common case (one contiguous run): the vectorised copies */
        const int64_t e = run_src[0], len = run_len[0];
        if (step == 1) {
            int64_t inside = lim - e < len ? lim - e : len;
            return put_tokens(x + e, inside > 0 ? inside : 0, L, voc, o);
        }
        if (e < lim) return put_tokens_rev(x + e - len + 1, len, L, voc, o);
    }
    if (voc > 0) {
        for (int64_t r = 0; r < nr; p += run_len[r++]) {
            const int64_t e = run_src[r], len = run_len[r];
            int32_t *d = o + p;
            if (step == 1) {
                int64_t inside = lim - e < len ? lim - e : len;
                if (inside < 0) inside = 0;
                n += put_span(x + e, inside, voc, d, 0);
                for (int64_t j = inside; j < len; j++) d[j] = 0;
            } else { /* events e, e - 1, ...: the first ones may lie past the column's end */
                int64_t outside = e - lim + 1 < len ? e - lim + 1 : len;
                if (outside < 0) outside = 0;
                for (int64_t j = 0; j < outside; j++) d[j] = 0;
                n += put_span(x + e - len + 1, len - outside, voc, d + outside, 1);
            }
        }
    }
    if (p < L) memset(o + p, 0, (size_t)(L - p) * sizeof(int32_t));
    return n;
}

/* Across a run of times <= 0 starting at p (t[p - 1] > 0): compare t[p - 1] with the next positive time. */
static inline void bridge(const int64_t *t, int64_t p, int64_t n, int *up, int *down) {
    int64_t q = p + 1;
    while (q < n && t[q] <= 0) q++;
    if (q < n) {
        *up |= t[q] > t[p - 1];
        *down |= t[q] < t[p - 1];
    }
}

/* List order of one row: bit 0 some positive time follows a smaller one, bit 1 a larger one (times <= 0
   ignored). Adjacent positive pairs are compared 8 at a time; runs of times <= 0 (rare) are bridged. */
static inline int row_order(const int64_t *t, int64_t n) {
    int up = 0, down = 0;
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512i zero = _mm512_setzero_si512();
    __mmask8 upm = 0, downm = 0;
    for (; j + 8 < n; j += 8) {
        __m512i a = _mm512_loadu_si512((const void *)(t + j)), b = _mm512_loadu_si512((const void *)(t + j + 1));
        __mmask8 pa = _mm512_cmpgt_epi64_mask(a, zero), both = pa & _mm512_cmpgt_epi64_mask(b, zero);
        upm |= both & _mm512_cmpgt_epi64_mask(b, a);
        downm |= both & _mm512_cmplt_epi64_mask(b, a);
        for (unsigned m = (unsigned)(__mmask8)~pa; m; m &= m - 1) { /* times <= 0 at j + lane */
            int64_t p = j + __builtin_ctz(m);
            if (p > 0 && t[p - 1] > 0) bridge(t, p, n, &up, &down);
        }
    }
    up |= upm != 0;
    down |= downm != 0;
#endif
    for (; j + 1 < n; j++) {
        const int64_t a = t[j], b = t[j + 1];
        if (a > 0 && b > 0) {
            up |= b > a;
            down |= b < a;
        } else if (a <= 0 && j > 0 && t[j - 1] > 0) {
            bridge(t, j, n, &up, &down);
        }
    }
    return up | (down << 1);
}

/* List order of each row from its event timestamps, ignoring times <= 0: 1 newest last (never decreasing,
   not all equal), 2 newest first (never increasing, not all equal), 3 neither (not monotonic), 0 fewer
   than two distinct positive times (too short to tell). */
void pcvr_list_order(int64_t rows, const int32_t *ts_off, const uint8_t *ts_valid, int64_t ts_bit,
                     const int64_t *ts_src, uint8_t *cls) {
    for (int64_t b = 0; b < rows; b++) {
        int64_t n;
        const int64_t *t = ts_src + row_range(ts_off, ts_valid, ts_bit, b, &n);
        cls[b] = (uint8_t)row_order(t, n);
    }
}


/* ---- one call per batch: pcvr_convert_batch walks the RecordBatch through the Arrow C data interface ---- */

/* The Arrow C data interface's array (arrow/c/abi.h); a RecordBatch is exported as a struct array whose
   children are its columns. */
struct ArrowArray {
    int64_t length, null_count, offset, n_buffers, n_children;
    const void **buffers;
    struct ArrowArray **children;
    struct ArrowArray *dictionary;
    void (*release)(struct ArrowArray *);
    void *private_data;
};

static const int64_t no_values[8]; /* a readable address for list columns without values */

/* A list column (int32 offsets) of the batch: offsets at the row's slice offset, validity (0: no nulls),
   its bit offset, and the child's values. Marks child_nulls[index] when the child has null elements (the
   caller checks that no row uses one). */
typedef struct {
    const int32_t *off;
    const uint8_t *valid;
    int64_t bit;
    const void *vals;
} ListCol;

static ListCol list_col(const struct ArrowArray *rb, int64_t index, int64_t itemsize, int8_t *child_nulls) {
    const struct ArrowArray *a = rb->children[index], *v = a->children[0];
    const int64_t off = rb->offset + a->offset;
    ListCol c;
    c.off = (const int32_t *)a->buffers[1] + off;
    c.valid = a->null_count != 0 ? (const uint8_t *)a->buffers[0] : 0;
    c.bit = off;
    c.vals = v->buffers[1] ? (const void *)((const char *)v->buffers[1] + itemsize * v->offset) : (const void *)no_values;
    if (v->null_count != 0 && v->buffers[0]) child_nulls[index] = 1;
    return c;
}

static inline int64_t col_range(const ListCol *c, int64_t b, int64_t *len) { return row_range(c->off, c->valid, c->bit, b, len); }

/* Width-1 int feature (int64 column `index`) into out/miss[b*stride + pos]. Null or <= 0 -> 0, missing;
   >= voc -> 0, missing, counted (the return value); voc <= 0 -> 0, missing, not counted. */
static int64_t scalar_int(const struct ArrowArray *rb, int64_t index, int64_t voc, int64_t pos, int64_t rows,
                          int32_t *out, uint8_t *miss, int64_t stride) {
    const struct ArrowArray *a = rb->children[index];
    const int64_t off = rb->offset + a->offset;
    const int64_t *x = (const int64_t *)a->buffers[1] + off;
    const uint8_t *bits = a->null_count != 0 ? (const uint8_t *)a->buffers[0] : 0;
    int64_t n = 0;
    for (int64_t b = 0; b < rows; b++) {
        int64_t v = x[b];
        if (bits) {
            int64_t i = off + b;
            if (!((bits[i >> 3] >> (i & 7)) & 1)) v = 0;
        }
        int ok = v > 0 && v < voc;
        n += voc > 0 && v >= voc;
        out[b * stride + pos] = ok ? (int32_t)v : 0;
        miss[b * stride + pos] = !ok;
    }
    return n;
}

/* Width>1 int feature: the first dim elements at out/miss[b*stride + pos + j]. <= 0 and padding -> 0,
   missing; >= voc -> 0, missing, counted (returned); voc <= 0 -> all 0, missing. */
static int64_t int_list(const ListCol *c, int64_t dim, int64_t voc, int64_t pos, int64_t rows, int32_t *out,
                        uint8_t *miss, int64_t stride) {
    int64_t cnt = 0;
    for (int64_t b = 0; b < rows; b++) {
        int64_t n;
        const int64_t *x = (const int64_t *)c->vals + col_range(c, b, &n);
        int32_t *o = out + b * stride + pos;
        uint8_t *m = miss + b * stride + pos;
        int64_t k = voc <= 0 ? 0 : (n < dim ? n : dim);
        for (int64_t j = 0; j < k; j++) {
            int64_t v = x[j];
            int ok = v > 0 && v < voc;
            cnt += v >= voc;
            o[j] = ok ? (int32_t)v : 0;
            m[j] = !ok;
        }
        for (int64_t j = k; j < dim; j++) { o[j] = 0; m[j] = 1; }
    }
    return cnt;
}

/* Dense feature: the first dim floats; non-finite and padding -> 0, missing. */
static void dense_list(const ListCol *c, int64_t dim, int64_t pos, int64_t rows, float *out, uint8_t *miss,
                       int64_t stride) {
    for (int64_t b = 0; b < rows; b++) {
        int64_t n;
        const float *x = (const float *)c->vals + col_range(c, b, &n);
        float *o = out + b * stride + pos;
        uint8_t *m = miss + b * stride + pos;
        int64_t k = n < dim ? n : dim;
        for (int64_t j = 0; j < k; j++) {
            float v = x[j];
            int ok = (v - v) == 0.0f; /* false for NaN and +-inf */
            o[j] = ok ? v : 0.0f;
            m[j] = !ok;
        }
        for (int64_t j = k; j < dim; j++) { o[j] = 0.0f; m[j] = 1; }
    }
}

/* One sequence domain: its timestamp column, F side columns with their vocabularies, outputs
   timestamps [rows, L] (raw), values [rows, F, L] (token rules), lengths [rows]; run scratch [2L]. */
typedef struct {
    ListCol ts;
    const ListCol *side;
    const int64_t *vocab;
    int64_t F, L, strict;
    const int64_t *request;
    int32_t *values;
    int64_t *timestamps;
    int32_t *lengths;
    int64_t *run_src, *run_len, *oob;
} Domain;

/* Row b of a domain, its events taken in chronological order dir: 1 newest last (the list as stored),
   -1 newest first (the list reversed), 2 the permutation pm (a non-monotonic row sorted by time). The newest
   events are kept, left-aligned, oldest first.
   Non-strict, dir 1 / -1: every column keeps its own newest min(len, L) elements; length = max over side
   columns (the timestamp column's when F == 0). Strict, and sorted rows: the kept events are the newest L
   (strict: with 0 < ts < request[b]) in the timestamp column's order, found as runs of consecutive events;
   side columns take the same events (0 past their own end), run by run; length = the number kept. */
static void domain_row(const Domain *d, int64_t b, int64_t dir, const int64_t *pm) {
    const int64_t L = d->L, F = d->F;
    int64_t *run_src = d->run_src, *run_len = d->run_len, nr = 0;
    int64_t n, length = 0;
    const int64_t *t = (const int64_t *)d->ts.vals + col_range(&d->ts, b, &n);
    int64_t *ts_out = d->timestamps + b * L;
    const int64_t step = dir == -1 ? -1 : 1;
    const int runs = d->strict || dir == 2;
    int64_t k;
    if (runs) {
        const int64_t req = d->request[b];
        /* one pass back from the newest event (chronological position c = n-1, n-2, ...) until L kept
           ones: the kept events as runs (run r is events run_src[r], + step, ...), newest run first */
        k = 0;
        for (int64_t c = n - 1; c >= 0 && k < L; c--) {
#if defined(__AVX512F__)
            /* strict, stored order: 8 events at a time while all 8 are valid (the common case); they extend
               the current run (or start one) exactly as 8 single steps would */
            if (d->strict && dir != 2 && c >= 7 && k + 8 <= L) {
                const int64_t newest = dir == 1 ? c : n - 1 - c, oldest = dir == 1 ? c - 7 : n - 1 - c + 7;
                const __m512i v = _mm512_loadu_si512((const void *)(t + (dir == 1 ? c - 7 : n - 1 - c)));
                const __mmask8 ok = _mm512_cmpgt_epi64_mask(v, _mm512_setzero_si512()) &
                                    _mm512_cmplt_epi64_mask(v, _mm512_set1_epi64(req));
                if (ok == 0xFF) {
                    if (nr && run_src[nr - 1] == newest + step) {
                        run_src[nr - 1] = oldest;
                        run_len[nr - 1] += 8;
                    } else {
                        run_src[nr] = oldest;
                        run_len[nr++] = 8;
                    }
                    k += 8;
                    c -= 7; /* and the loop's c-- */
                    continue;
                }
            }
#endif
            const int64_t e = dir == 1 ? c : (dir == -1 ? n - 1 - c : pm[c]);
            if (d->strict && !(t[e] > 0 && t[e] < req)) continue;
            k++;
            if (nr && run_src[nr - 1] == e + step) {
                run_src[nr - 1] = e;
                run_len[nr - 1]++;
            } else {
                run_src[nr] = e;
                run_len[nr++] = 1;
            }
        }
        for (int64_t r = 0; r < nr / 2; r++) { /* oldest run first */
            int64_t a = run_src[r], c = run_len[r];
            run_src[r] = run_src[nr - 1 - r];
            run_len[r] = run_len[nr - 1 - r];
            run_src[nr - 1 - r] = a;
            run_len[nr - 1 - r] = c;
        }
        if (nr == 1 && step == 1) {
            copy_i64(t + run_src[0], k, L, ts_out); /* with its padding */
        } else {
            for (int64_t r = 0, p = 0; r < nr; p += run_len[r++]) {
                if (step == 1) {
                    memcpy(ts_out + p, t + run_src[r], (size_t)run_len[r] * sizeof(int64_t));
                } else {
                    copy_rev_i64(t + run_src[r] - run_len[r] + 1, run_len[r], ts_out + p);
                }
            }
            if (k < L) memset(ts_out + k, 0, (size_t)(L - k) * sizeof(int64_t));
        }
        length = k;
    } else {
        k = n < L ? n : L;
        if (step == 1) {
            copy_i64(t + n - k, k, L, ts_out);
        } else {
            copy_rev_i64(t, k, ts_out);
            if (k < L) memset(ts_out + k, 0, (size_t)(L - k) * sizeof(int64_t));
        }
        if (F == 0) length = k;
    }
    for (int64_t f = 0; f < F; f++) {
        int64_t fn;
        const int64_t *x = (const int64_t *)d->side[f].vals + col_range(&d->side[f], b, &fn);
        int32_t *o = d->values + (b * F + f) * L;
        if (runs) {
            d->oob[f] += put_runs(x, run_src, run_len, nr, step, fn, L, d->vocab[f], o);
        } else {
            int64_t fk = fn < L ? fn : L;
            if (step == 1)
                d->oob[f] += put_tokens(x + fn - fk, fk, L, d->vocab[f], o);
            else
                d->oob[f] += put_tokens_rev(x, fk, L, d->vocab[f], o);
            if (fk > length) length = fk;
        }
    }
    d->lengths[b] = (int32_t)length;
}

/* Asks for the first cache lines of row b's kept windows (newest last: the list's tail; else its head), so
   the loads of the next row start while this one is converted. */
static inline void prefetch_row(const Domain *d, int64_t b, int64_t dir) {
    int64_t tn;
    const int64_t *t = (const int64_t *)d->ts.vals + col_range(&d->ts, b, &tn);
    __builtin_prefetch(t);
    __builtin_prefetch(t + 8);
    __builtin_prefetch(t + 16);
    for (int64_t f = 0; f < d->F; f++) {
        int64_t n;
        const int64_t *x = (const int64_t *)d->side[f].vals + col_range(&d->side[f], b, &n);
        if (dir == 1 && n > d->L) x += n - d->L;
        __builtin_prefetch(x);
        __builtin_prefetch(x + 8);
        __builtin_prefetch(x + 16);
    }
}

typedef struct {
    int64_t t, i;
} TimeIndex;

static int by_time_then_index(const void *a, const void *b) {
    const TimeIndex *x = (const TimeIndex *)a, *y = (const TimeIndex *)b;
    if (x->t != y->t) return x->t < y->t ? -1 : 1;
    return x->i < y->i ? -1 : (x->i > y->i);
}

/* The events of a row sorted by time, ties in list order (numpy's stable argsort): perm[0..n). */
static int sort_row(const int64_t *t, int64_t n, int64_t *perm) {
    TimeIndex *tmp = (TimeIndex *)malloc((size_t)(n > 0 ? n : 1) * sizeof(TimeIndex));
    if (!tmp) return -1;
    for (int64_t i = 0; i < n; i++) { tmp[i].t = t[i]; tmp[i].i = i; }
    qsort(tmp, (size_t)n, sizeof(TimeIndex), by_time_then_index);
    for (int64_t i = 0; i < n; i++) perm[i] = tmp[i].i;
    free(tmp);
    return 0;
}

/* The whole batch in one call. rb: the RecordBatch exported through the Arrow C data interface.
   feat, per side (user, item): nS, nS x (column, vocab, pos) width-1 ints; nI, nI x (column, dim, vocab, pos)
   width>1 int lists; nD, nD x (column, dim, pos) dense lists; the int and dense output widths.
   dom: D, per domain (timestamp column, L, F, F x (side column, vocab)).
   outs: per side int_values, int_missing, dense_values, dense_missing; per domain values, timestamps,
   lengths. oob: out-of-vocab count per vocabulary column in the order above (user ints, user lists, item
   ints, item lists, every domain's side columns). mode: 0 tell each row's order from its event times (the
   order check is fused into the row loop: the row's timestamps are then in cache for its conversion),
   1 every row newest last, -1 every row newest first. classes [D x 4]: rows per order class (mode 0).
   Rows too short to tell wait until the domain's other rows are done and take its majority order (newest
   last on a tie); not-monotonic rows are sorted by time (sort_nonmono) or rejected: then bad = (domain, first
   such row, such rows in the domain) and the call returns 1 (the domain's rows are only counted).
   child_nulls [columns]: set for list columns whose values hold nulls. Returns 0, 1 (rejected row) or -1
   (out of memory). */
int64_t pcvr_convert_batch(const struct ArrowArray *rb, const int64_t *feat, const int64_t *dom, void *const *outs,
                           const int64_t *request, int64_t strict, int64_t mode, int64_t sort_nonmono,
                           int64_t *oob, int64_t *classes, int8_t *child_nulls, int64_t *bad) {
    const int64_t rows = rb->length;
    const int64_t *p = feat;
    int64_t slot = 0, o = 0;
    for (int side = 0; side < 2; side++) {
        int32_t *iv = (int32_t *)outs[o];
        uint8_t *im = (uint8_t *)outs[o + 1];
        float *dv = (float *)outs[o + 2];
        uint8_t *dm = (uint8_t *)outs[o + 3];
        o += 4;
        const int64_t nS = *p++, *S = p;
        p += 3 * nS;
        const int64_t nI = *p++, *I = p;
        p += 4 * nI;
        const int64_t nD = *p++, *Dn = p;
        p += 3 * nD;
        const int64_t istride = *p++, dstride = *p++;
        for (int64_t c = 0; c < nS; c++) oob[slot++] = scalar_int(rb, S[3 * c], S[3 * c + 1], S[3 * c + 2], rows, iv, im, istride);
        for (int64_t c = 0; c < nI; c++) {
            ListCol l = list_col(rb, I[4 * c], 8, child_nulls);
            oob[slot++] = int_list(&l, I[4 * c + 1], I[4 * c + 2], I[4 * c + 3], rows, iv, im, istride);
        }
        for (int64_t c = 0; c < nD; c++) {
            ListCol l = list_col(rb, Dn[3 * c], 4, child_nulls);
            dense_list(&l, Dn[3 * c + 1], Dn[3 * c + 2], rows, dv, dm, dstride);
        }
    }
    p = dom;
    const int64_t D = *p++;
    int64_t status = 0;
    int64_t *deferred = (int64_t *)malloc((size_t)(rows > 0 ? rows : 1) * sizeof(int64_t));
    if (!deferred) return -1;
    for (int64_t di = 0; di < D && status == 0; di++) {
        const int64_t ts_col = p[0], L = p[1], F = p[2], *cols = p + 3;
        p += 3 + 2 * F;
        ListCol side[F > 0 ? F : 1];
        int64_t vocab[F > 0 ? F : 1];
        for (int64_t f = 0; f < F; f++) {
            side[f] = list_col(rb, cols[2 * f], 8, child_nulls);
            vocab[f] = cols[2 * f + 1];
            oob[slot + f] = 0;
        }
        int64_t *scratch = (int64_t *)malloc((size_t)(2 * L > 0 ? 2 * L : 1) * sizeof(int64_t));
        if (!scratch) { status = -1; break; }
        Domain d = {list_col(rb, ts_col, 8, child_nulls), side, vocab, F, L, strict, request,
                    (int32_t *)outs[o], (int64_t *)outs[o + 1], (int32_t *)outs[o + 2], scratch, scratch + L, oob + slot};
        o += 3;
        slot += F;
        int64_t *cnt = classes + 4 * di, ndeferred = 0, first_bad = -1;
        for (int64_t b = 0; b < rows; b++) {
            if (mode != 0) {
                if (b + 1 < rows) prefetch_row(&d, b + 1, mode);
                domain_row(&d, b, mode, 0);
                continue;
            }
            int64_t n;
            const int64_t *t = (const int64_t *)d.ts.vals + col_range(&d.ts, b, &n);
            const int cls = row_order(t, n);
            cnt[cls]++;
            if (cls == 3 && !sort_nonmono && first_bad < 0) first_bad = b;
            if (first_bad >= 0) continue; /* a rejected batch: the rest is only counted */
            if (cls == 1 || cls == 2) {
                if (b + 1 < rows) prefetch_row(&d, b + 1, cls == 1 ? 1 : -1);
                domain_row(&d, b, cls == 1 ? 1 : -1, 0);
            }
            else
                deferred[ndeferred++] = 4 * b + cls;
        }
        if (first_bad >= 0) {
            bad[0] = di;
            bad[1] = first_bad;
            bad[2] = cnt[3];
            status = 1;
        }
        const int64_t majority = cnt[2] > cnt[1] ? -1 : 1;
        for (int64_t i = 0; i < ndeferred && status == 0; i++) {
            const int64_t b = deferred[i] >> 2;
            if ((deferred[i] & 3) == 3) {
                int64_t n;
                const int64_t *t = (const int64_t *)d.ts.vals + col_range(&d.ts, b, &n);
                int64_t *perm = (int64_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
                if (!perm || sort_row(t, n, perm)) {
                    free(perm);
                    status = -1;
                    break;
                }
                domain_row(&d, b, 2, perm);
                free(perm);
            } else {
                domain_row(&d, b, majority, 0);
            }
        }
        free(scratch);
    }
    free(deferred);
    PCVR_FENCE(); /* order the streaming stores before the caller reads the output */
    return status;
}

/* Releases an array exported through the C data interface (drops its references to the Arrow buffers). */
void pcvr_release(struct ArrowArray *a) {
    if (a->release) a->release(a);
}
