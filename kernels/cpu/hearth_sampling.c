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
 */
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
