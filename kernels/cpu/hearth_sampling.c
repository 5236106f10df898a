/* Sampling kernels of hearth's CPU path.
 *
 * hearth_top_p: each row's top-p cut (the probability of the last token kept) without
 * sorting the vocabulary. A row of 49,152 probabilities is read three times (its largest
 * value; a histogram of eighth-of-an-octave buckets below it; the tokens of the buckets
 * down to the cut), and only those tokens are sorted (a radix sort of their bits). The
 * count of kept tokens is then taken exactly as the plain method takes it (torch's sort,
 * cumsum, `cumsum - value < top_p`): float32 partial sums accumulated in double (torch's
 * CPU cumsum does so), each token's "mass before it" rounded to float32 and compared with
 * the float32 top_p, so the set is the plain method's token for token.
 *
 * hearth_argmax: each row's greedy token, torch's `max(dim=-1).indices` to the index.
 *
 * hearth_min_p: each row's min-p filter, torch's `probs.masked_fill(probs < max * min_p, 0)`
 * to the bit, in two passes over the row (its largest value, then the masked copy) where
 * torch made five (max, product, comparison, a byte mask, the fill).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define BUCKETS 256 /* 8 an octave over 32 octaves; the last holds everything lower */
#define MARGIN 1e-3 /* the candidates' mass passes top_p by this much: tokens past them
                       cannot be kept whatever the rounding of the sums */

static inline int32_t key_of(float v) {
    int32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return bits >> 20; /* sign, exponent, 3 mantissa bits: grows with a non-negative v */
}

/* `a` (m float32 bit patterns) sorted descending by value, in 3 counting passes of 11 bits
 * (a probability's bits, read as an unsigned integer, grow with it; NaN and negative bits
 * count as 0). Returns the buffer that holds the result (`a` or `tmp`). */
static uint32_t *radix_descending(uint32_t *a, uint32_t *tmp, int64_t m) {
    for (int64_t i = 0; i < m; i++) a[i] = a[i] > 0x7f800000u ? ~0u : ~a[i]; /* ascending ~a */
    for (int shift = 0; shift < 32; shift += 11) {
        int64_t count[2049] = {0};
        for (int64_t i = 0; i < m; i++) count[((a[i] >> shift) & 2047) + 1]++;
        for (int k = 0; k < 2048; k++) count[k + 1] += count[k];
        for (int64_t i = 0; i < m; i++) tmp[count[(a[i] >> shift) & 2047]++] = a[i];
        uint32_t *t = a;
        a = tmp;
        tmp = t;
    }
    for (int64_t i = 0; i < m; i++) a[i] = ~a[i];
    return a;
}

static float row_cut(const float *p, int64_t vocab, float top_p, uint32_t *buf, uint32_t *tmp) {
    int32_t top = INT32_MIN;
    for (int64_t j = 0; j < vocab; j++) {
        int32_t k = key_of(p[j]);
        top = k > top ? k : top;
    }
    /* Four interleaved histograms: consecutive tokens mostly share a bucket, and one
       running sum would make each add wait for the one before. */
    double mass[4][BUCKETS] = {{0}};
    for (int64_t j = 0; j < vocab; j++) { /* branch-free: the last bucket's sum is not read */
        int64_t b = (int64_t)top - key_of(p[j]);
        mass[j & 3][b < BUCKETS - 1 ? b : BUCKETS - 1] += p[j];
    }
    int64_t last = BUCKETS - 1;
    double acc = 0.0;
    for (int64_t b = 0; b < BUCKETS - 1; b++) {
        acc += mass[0][b] + mass[1][b] + mass[2][b] + mass[3][b];
        if (acc >= (double)top_p + MARGIN) {
            last = b;
            break;
        }
    }
    int64_t m = 0;
    const int32_t floor_key = last == BUCKETS - 1 ? INT32_MIN : (int32_t)(top - last);
    for (int64_t j = 0; j < vocab; j += 8) {
        const int64_t n = vocab - j < 8 ? vocab - j : 8;
        int any = 0;
        for (int64_t q = 0; q < n; q++) any |= key_of(p[j + q]) >= floor_key;
        if (!any) continue; /* most of a confident row: nothing near the cut */
        for (int64_t q = 0; q < n; q++) { /* branch-free: written, then kept or not */
            memcpy(&buf[m], &p[j + q], 4);
            m += key_of(p[j + q]) >= floor_key;
        }
    }
    const uint32_t *sorted = radix_descending(buf, tmp, m);
    double sum = 0.0;
    int64_t kept = 0;
    for (int64_t i = 0; i < m; i++) {
        float v;
        memcpy(&v, &sorted[i], 4);
        sum += v;
        kept += (float)sum - v < top_p; /* counted over all, as the plain method counts */
    }
    float cut;
    memcpy(&cut, &sorted[(kept < 1 ? 1 : kept) - 1], 4);
    return cut;
}

/* cuts[i] = the top-p cut of row i of `probs` ([rows, vocab], vocab >= 1, non-negative) for
 * top_ps[i] (a token is kept iff its probability is >= the cut), and `out` = `probs` with every
 * token below its row's cut set to 0 (torch's masked_fill(probs < cut, 0): a NaN stays),
 * written while the row is still in cache. `scratch` holds 2 * vocab words for each of
 * `threads` threads (at most that many run): the caller allocates it, so there is no
 * allocation here that could fail and leave a row unmasked. */
void hearth_top_p(const float *probs, int64_t rows, int64_t vocab, const float *top_ps, float *cuts, float *out,
                  uint32_t *scratch, int64_t threads) {
#pragma omp parallel num_threads((int)threads)
    {
        uint32_t *buf = scratch + (size_t)omp_get_thread_num() * 2 * (size_t)vocab;
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < rows; i++) {
            const float *p = probs + i * vocab;
            const float cut = row_cut(p, vocab, top_ps[i], buf, buf + vocab);
            float *o = out + i * vocab;
            for (int64_t j = 0; j < vocab; j++) o[j] = p[j] < cut ? 0.0f : p[j];
            cuts[i] = cut;
        }
    }
}

/* out[i] = the index of row i's largest value: the first one on ties, the first NaN where
 * the row holds one (torch's `max(dim=-1).indices`, which greedy decoding takes). Eight
 * lanes keep their own running maximum and its index; a lane only moves to a strictly
 * larger value, so each keeps its first maximum, and the lanes are merged by value, then
 * index. A NaN anywhere sends the row to a scalar pass for its first NaN. */
void hearth_argmax(const float *x, int64_t rows, int64_t vocab, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * vocab > 65536)
    for (int64_t i = 0; i < rows; i++) {
        const float *p = x + i * vocab;
        float bv = p[0];
        int64_t best = 0, j = 1;
        int nan = p[0] != p[0];
        if (vocab >= 8) {
            __m256 vmax = _mm256_loadu_ps(p);
            __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            __m256i cur = vidx;
            const __m256i eight = _mm256_set1_epi32(8);
            __m256 unordered = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
            for (j = 8; j + 8 <= vocab; j += 8) {
                const __m256 v = _mm256_loadu_ps(p + j);
                cur = _mm256_add_epi32(cur, eight);
                const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
                unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                vmax = _mm256_blendv_ps(vmax, v, gt);
                vidx = _mm256_castps_si256(
                    _mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
            }
            nan = _mm256_movemask_ps(unordered) != 0;
            float m[8];
            int32_t idx[8];
            _mm256_storeu_ps(m, vmax);
            _mm256_storeu_si256((__m256i *)idx, vidx);
            bv = m[0], best = idx[0];
            for (int l = 1; l < 8; l++)
                if (m[l] > bv || (m[l] == bv && idx[l] < best)) bv = m[l], best = idx[l];
        }
        for (; j < vocab; j++) { /* the tail past the lanes, or a row narrower than them */
            nan |= p[j] != p[j];
            if (p[j] > bv) bv = p[j], best = j;
        }
        if (nan)
            for (j = 0; j < vocab; j++)
                if (p[j] != p[j]) {
                    best = j;
                    break;
                }
        out[i] = best;
    }
}

/* out = `probs` with every value below `min_ps[i]` times its row's largest set to 0: the
 * threshold is rounded to float32 as torch rounds `max * min_p`; a row holding a NaN has a
 * NaN largest value (torch's `max` propagates it), so nothing in it is below the threshold
 * and the row is copied as it is. `out` may be `probs`. */
void hearth_min_p(const float *probs, int64_t rows, int64_t vocab, const float *min_ps, float *out) {
#pragma omp parallel for schedule(static) if (rows * vocab > 65536)
    for (int64_t i = 0; i < rows; i++) {
        const float *p = probs + i * vocab;
        float *o = out + i * vocab;
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        __m256 unordered = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= vocab; j += 8) {
            const __m256 v = _mm256_loadu_ps(p + j);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            vmax = _mm256_max_ps(vmax, v);
        }
        float m[8], top = -INFINITY;
        int nan = _mm256_movemask_ps(unordered) != 0;
        _mm256_storeu_ps(m, vmax);
        for (int l = 0; l < 8; l++) top = m[l] > top ? m[l] : top;
        for (; j < vocab; j++) {
            nan |= p[j] != p[j];
            top = p[j] > top ? p[j] : top;
        }
        if (nan) {
            if (o != p) memcpy(o, p, (size_t)vocab * sizeof *o);
            continue;
        }
        const float threshold = top * min_ps[i];
        const __m256 vt = _mm256_set1_ps(threshold);
        for (j = 0; j + 8 <= vocab; j += 8) { /* v < t: ordered, so a NaN threshold keeps all */
            const __m256 v = _mm256_loadu_ps(p + j);
            _mm256_storeu_ps(o + j, _mm256_andnot_ps(_mm256_cmp_ps(v, vt, _CMP_LT_OQ), v));
        }
        for (; j < vocab; j++) o[j] = p[j] < threshold ? 0.0f : p[j];
    }
}
