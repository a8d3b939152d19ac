/* Native kernels of pcvr_lib.data.convert (the "native" backend); built on first use by
   convert.native_library() with the system C compiler and loaded with ctypes. */
#include <stdint.h>
#include <string.h>

/* Width-1 int features: column c (values vals[c]; validity bitmap valid[c], 0 when no nulls, starting at
   bit bit[c]) into out/miss[b*stride + pos[c]]. Null or <= 0 -> 0, missing; >= vocab[c] -> 0, missing
   and counted in oob[c]; vocab[c] <= 0 -> 0, missing (not counted). */
void pcvr_scalar_ints(int64_t C, const int64_t *const *vals, const uint8_t *const *valid, const int64_t *bit,
                      const int64_t *vocab, const int64_t *pos, int64_t rows, int32_t *out, uint8_t *miss,
                      int64_t stride, int64_t *oob) {
    for (int64_t c = 0; c < C; c++) {
        const int64_t voc = vocab[c];
        const int64_t *x = vals[c];
        const uint8_t *bits = valid[c];
        int64_t n = 0;
        for (int64_t b = 0; b < rows; b++) {
            int64_t v = x[b];
            if (bits) {
                int64_t i = bit[c] + b;
                if (!((bits[i >> 3] >> (i & 7)) & 1)) v = 0;
            }
            int ok = v > 0 && v < voc;
            n += voc > 0 && v >= voc;
            out[b * stride + pos[c]] = ok ? (int32_t)v : 0;
            miss[b * stride + pos[c]] = !ok;
        }
        oob[c] = n;
    }
}

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
   source is read in ascending addresses (read descending, the hardware prefetcher lost the stream: 1.7x
   slower per batch on the 2-core VM). */
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

/* The kept events given as nr runs in output order: run r covers events run_src[r], run_src[r] + step, ...
   (run_len[r] of them; step +1 or -1); events at or past lim (the column's own length) read as 0. */
static inline int64_t put_runs(const int64_t *x, const int64_t *run_src, const int64_t *run_len, int64_t nr,
                               int64_t step, int64_t lim, int64_t L, int64_t voc, int32_t *o) {
    int64_t n = 0, p = 0;
    if (voc > 0) {
        for (int64_t r = 0; r < nr; p += run_len[r++]) {
            const int64_t e = run_src[r], len = run_len[r];
            int32_t *d = o + p;
            if (step == 1) {
                int64_t inside = lim - e < len ? lim - e : len;
                if (inside < 0) inside = 0;
                const int64_t *xe = x + e;
                for (int64_t j = 0; j < inside; j++) {
                    int64_t v = xe[j];
                    n += v >= voc;
                    d[j] = (v > 0 && v < voc) ? (int32_t)v : 0;
                }
                for (int64_t j = inside; j < len; j++) d[j] = 0;
            } else { /* events e, e - 1, ...: the first ones may lie past the column's end */
                int64_t outside = e - lim + 1 < len ? e - lim + 1 : len;
                if (outside < 0) outside = 0;
                const int64_t *xe = x + e;
                for (int64_t j = 0; j < outside; j++) d[j] = 0;
                for (int64_t j = len - 1; j >= outside; j--) { /* source ascending */
                    int64_t v = xe[-j];
                    n += v >= voc;
                    d[j] = (v > 0 && v < voc) ? (int32_t)v : 0;
                }
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

/* One sequence domain, row by row: timestamps [rows, L] (raw), values [rows, F, L] (token rules),
   lengths [rows]. Each row's events are taken in its chronological order, given by order[b]: 1 newest last
   (the list as stored), -1 newest first (the list reversed), 2 the permutation perm[perm_start[b] ..]
   (a non-monotonic row sorted by time); order NULL: every row newest last. The newest events are kept,
   left-aligned, oldest first.
   Non-strict, rows 1 / -1: every column keeps its own newest min(len, L) elements; length = max over side
   columns (the timestamp column's when F == 0). Strict, and sorted rows: the kept events are the newest L
   (strict: with 0 < ts < request[b]) in the timestamp column's order, found as runs of consecutive events
   in the scratch rel [2L]; side columns take the same events (0 past their own end), run by run; length =
   the number kept. */
void pcvr_domain(int64_t F, const int32_t *const *offs, const uint8_t *const *valids, const int64_t *bits,
                 const int64_t *const *srcs, const int64_t *vocab, const int32_t *ts_off, const uint8_t *ts_valid,
                 int64_t ts_bit, const int64_t *ts_src, const int64_t *request, int64_t strict, const int8_t *order,
                 const int64_t *perm_start, const int64_t *perm, int64_t rows, int64_t L, int32_t *values,
                 int64_t *timestamps, int32_t *lengths, int64_t *rel, int64_t *oob) {
    int64_t *run_src = rel, *run_len = rel + L, nr = 0;
    for (int64_t f = 0; f < F; f++) oob[f] = 0;
    for (int64_t b = 0; b < rows; b++) {
        int64_t n, length = 0;
        const int64_t s = row_range(ts_off, ts_valid, ts_bit, b, &n);
        const int64_t *t = ts_src + s;
        int64_t *ts_out = timestamps + b * L;
        const int64_t dir = order ? order[b] : 1;
        const int64_t step = dir == -1 ? -1 : 1;
        const int64_t *pm = dir == 2 ? perm + perm_start[b] : 0;
        const int runs = strict || dir == 2;
        int64_t k;
        if (runs) {
            const int64_t req = request[b];
            /* one pass back from the newest event (chronological position c = n-1, n-2, ...) until L kept
               ones: the kept events as runs (run r is events run_src[r], + step, ...), newest run first */
            k = 0;
            nr = 0;
            for (int64_t c = n - 1; c >= 0 && k < L; c--) {
                const int64_t e = dir == 1 ? c : (dir == -1 ? n - 1 - c : pm[c]);
                if (strict && !(t[e] > 0 && t[e] < req)) continue;
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
            for (int64_t r = 0, p = 0; r < nr; p += run_len[r++]) {
                if (step == 1) {
                    memcpy(ts_out + p, t + run_src[r], (size_t)run_len[r] * sizeof(int64_t));
                } else {
                    for (int64_t j = run_len[r] - 1; j >= 0; j--) ts_out[p + j] = t[run_src[r] - j];
                }
            }
            length = k;
        } else {
            k = n < L ? n : L;
            if (step == 1) {
                memcpy(ts_out, t + n - k, (size_t)k * sizeof(int64_t));
            } else {
                for (int64_t j = k - 1; j >= 0; j--) ts_out[j] = t[k - 1 - j]; /* source ascending */
            }
            if (F == 0) length = k;
        }
        if (k < L) memset(ts_out + k, 0, (size_t)(L - k) * sizeof(int64_t));
        for (int64_t f = 0; f < F; f++) {
            int64_t fn;
            const int64_t fs = row_range(offs[f], valids[f], bits[f], b, &fn);
            int32_t *o = values + (b * F + f) * L;
            if (runs) {
                oob[f] += put_runs(srcs[f] + fs, run_src, run_len, nr, step, fn, L, vocab[f], o);
            } else {
                int64_t fk = fn < L ? fn : L;
                if (step == 1)
                    oob[f] += put_tokens(srcs[f] + fs + fn - fk, fk, L, vocab[f], o);
                else
                    oob[f] += put_tokens_rev(srcs[f] + fs, fk, L, vocab[f], o);
                if (fk > length) length = fk;
            }
        }
        lengths[b] = (int32_t)length;
    }
    PCVR_FENCE(); /* order the streaming stores before the caller reads the output */
}

/* Width>1 int features: column c keeps its first dims[c] elements at out/miss[b*stride + pos[c] + j].
   <= 0 and padding -> 0, missing; >= vocab -> 0, missing, counted in oob[c]; vocab <= 0 -> all 0, missing. */
void pcvr_int_lists(int64_t C, const int32_t *const *offs, const uint8_t *const *valids, const int64_t *bits,
                    const int64_t *const *srcs, const int64_t *dims, const int64_t *vocab, const int64_t *pos,
                    int64_t rows, int32_t *out, uint8_t *miss, int64_t stride, int64_t *oob) {
    for (int64_t c = 0; c < C; c++) {
        const int64_t voc = vocab[c], dim = dims[c];
        int64_t cnt = 0;
        for (int64_t b = 0; b < rows; b++) {
            int64_t n;
            const int64_t *x = srcs[c] + row_range(offs[c], valids[c], bits[c], b, &n);
            int32_t *o = out + b * stride + pos[c];
            uint8_t *m = miss + b * stride + pos[c];
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
        oob[c] = cnt;
    }
}

/* Dense features: the first dims[c] floats; non-finite and padding -> 0, missing. */
void pcvr_dense_lists(int64_t C, const int32_t *const *offs, const uint8_t *const *valids, const int64_t *bits,
                      const float *const *srcs, const int64_t *dims, const int64_t *pos, int64_t rows, float *out,
                      uint8_t *miss, int64_t stride) {
    for (int64_t c = 0; c < C; c++) {
        const int64_t dim = dims[c];
        for (int64_t b = 0; b < rows; b++) {
            int64_t n;
            const float *x = srcs[c] + row_range(offs[c], valids[c], bits[c], b, &n);
            float *o = out + b * stride + pos[c];
            uint8_t *m = miss + b * stride + pos[c];
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
}

