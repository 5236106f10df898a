/*
 * hearth_attention_f32.c: the float32 attention of prefill runs in the AVX2 build, bitwise
 * the result of the float32 loops in hearth_cpu.c, in GEMM-shaped loops.
 *
 * Why: on a host without a bfloat16 unit, a long prompt's attention runs hearth_cpu.c's
 * float32 kernel, built for decodes (one key row read for all of a tile's query vectors,
 * a horizontal reduction per score, a cache element widened per use): at 4096 tokens it
 * reached ~80 GFLOP/s, half the FMA peak, and was more of a prefill than the linears.
 * Here a prefill run's keys and values are widened once per call into float32 buffers
 * laid out for register-blocked products, and every tile of the run reads those:
 *   scores: lanes are 8 keys (keys transposed: for each dimension, 8 keys' elements in a
 *           row), a query element is broadcast, no horizontal sums;
 *   values: lanes are 8 output dimensions of a value row, a softmax weight is broadcast.
 *
 * Same bits as hearth_cpu.c (which is what keeps a token's output independent of the run,
 * tile, call or thread it lands in, so no threshold here changes a result):
 *  - hearth_cpu.c's score of (vector, key) is 8 lane chains, lane l the FMA chain over
 *    dims l, l+8, ... in order from 0, summed ((x0+x1)+(x2+x3)) + ((x4+x5)+(x6+x7)) and
 *    times `scale` (an int8 key: times scale * its row scale). Here class l of a score is
 *    the same chain, computed for 8 keys at once, and the classes are summed in the same
 *    tree (each sum is one rounded addition, and a + b == b + a bitwise).
 *  - the softmax is hearth_softmax_row on the same score rows;
 *  - each output dimension is one FMA chain over the keys in position order from 0 of
 *    weight p (an int8 value row: p * its row scale, one rounded product) times the
 *    value, then times 1 / sum: the same chain, from a value widened exactly (float16 and
 *    int8 convert exactly to float32). Keys a pass's vector gives weight 0 add exact zeros.
 * That is why the AVX-512 builds do not use it: their float32 kernel sums 16 lanes (a
 * different order), and they have bfloat16 or 32 registers anyway.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hearth_kv.h" /* the cache rows, the softmax and this file's entry points */

/* Runs of at least this many tokens take the kernel below where the build has it (0: none).
 * Only speed depends on it: widening a run's keys is paid once per call, and from ~8 tokens
 * on the products gain more than that (bench_cpu_attention.py --prefill on a Zen 3 host:
 * 2 tokens at 4096 keys 0.84x, 4 1.19x, 8 1.20x, 512 1.6x; at 64-256 keys ~1x). Process-wide;
 * benchmarks and tests set it (`ops.f32_prefill_min_run`) to run both kernels on one call. */
int64_t hearth_attention_f32_min_run = 8;

/* Runs this kernel has computed since the library was loaded: tests read it to know the
 * calls they compare took both kernels (the results alone could not tell: same bits). */
int64_t hearth_attention_f32_runs_done = 0;

#if !defined(__AVX2__) || defined(__AVX512F__)

int hearth_attention_f32_path(void) { return 0; }

int hearth_attention_f32(int kk, int kv, const float *q, int64_t ldq, int64_t nh, int64_t nkv, int64_t hd,
                         const void *k_cache, const void *v_cache, int64_t block_size, const int32_t *block_tables,
                         int64_t max_blocks, const int32_t *seq, const int32_t *ctx, float scale, float *out,
                         float *scratch, int64_t scratch_per_thread, int64_t window, const int64_t *runs,
                         int64_t num_runs) {
    (void)kk, (void)kv, (void)q, (void)ldq, (void)nh, (void)nkv, (void)hd, (void)k_cache, (void)v_cache;
    (void)block_size, (void)block_tables, (void)max_blocks, (void)seq, (void)ctx, (void)scale, (void)out;
    (void)scratch, (void)scratch_per_thread, (void)window, (void)runs, (void)num_runs;
    return 0;
}

#else

#include <omp.h>

#define KG 16          /* keys per score micro-tile: two groups of 8 (one register each) */
#define VALUE_BYTES (16 << 10) /* bytes of value rows per block of a value pass: they stay in L1 */
#define MAX_HD 256     /* per-pass stack buffer of the output sums */
#define WIDEN_CAP ((int64_t)8 << 20) /* floats (32 MB) of widened kv heads at a time, or one head */
#define ATT_INLINE static inline __attribute__((always_inline))
/* Loops over a register tile's vectors and chunks: unrolled, so its accumulators stay in
 * registers (gcc otherwise may keep the array in memory and store it every key). */
#define UNROLL _Pragma("GCC unroll 4")

int hearth_attention_f32_path(void) { return 1; }

/* A run's view of the call and its widened keys and values, per kv head:
 *   kt:  key group g (keys k0 + 8g .. + 7): hd rows of 8 floats, row d = the 8 keys' dim d;
 *   fac: each key's score factor, scale (float kinds) or scale * its row scale (int8);
 *   v:   each key's value row, hd floats;  vs: each key's value row scale (int8 values).
 * Keys outside [read_lo, n) are zero (never read from the cache: a block before the
 * window may be freed and reused). */
typedef struct {
    int64_t r0, len;      /* rows r0 .. r0 + len - 1 of the call */
    const int32_t *table; /* the sequence's block table */
    int64_t k0, nk;       /* keys k0 .. k0 + nk - 1 are widened (k0 % KG == 0, nk % KG == 0) */
    int64_t read_lo, n;   /* of them, keys read_lo .. n - 1 come from the cache */
    float *buf;           /* kv head h's kt, fac, v, vs at buf + (h - h0) * per_head */
    int64_t h0;           /* the first kv head in buf */
    int64_t per_head;     /* floats per kv head: nk * (2 hd + 2) */
} f32_run;

ATT_INLINE float *run_kt(const f32_run *r, int64_t h) { return r->buf + (h - r->h0) * r->per_head; }
ATT_INLINE float *run_fac(const f32_run *r, int64_t h, int64_t hd) { return run_kt(r, h) + r->nk * hd; }
ATT_INLINE float *run_v(const f32_run *r, int64_t h, int64_t hd) { return run_fac(r, h, hd) + r->nk; }
ATT_INLINE float *run_vs(const f32_run *r, int64_t h, int64_t hd) { return run_v(r, h, hd) + r->nk * hd; }

/* Thread-local buffer of the widened runs, grown on demand and reused (a fresh multi-MB
 * malloc per layer would be a fresh mmap whose pages fault in every call). */
static __thread float *widen_buf;
static __thread size_t widen_cap;

static float *widen_space(size_t floats) {
    if (floats > widen_cap) {
        free(widen_buf);
        const size_t cap = floats + floats / 4;
        widen_buf = (float *)aligned_alloc(64, (cap * sizeof(float) + 63) / 64 * 64);
        widen_cap = widen_buf ? cap : 0;
    }
    return widen_buf;
}

/* r[0..7] = the columns of the 8 x 8 block whose rows are r[0..7] (the usual AVX transpose). */
ATT_INLINE void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20), r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20), r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31), r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31), r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* Keys g * 8 .. g * 8 + 7 (from k0) of kv head h of run r into kt, fac, v and vs. */
static void widen_group(const int kk, const int kv, const f32_run *r, int64_t h, int64_t g, const void *k_cache,
                        const void *v_cache, int64_t block_size, int64_t nkv, int64_t hd, float scale) {
    const int64_t pk = kv_head_pitch(kk, hd), pv = kv_head_pitch(kv, hd);
    float *kt = run_kt(r, h) + g * 8 * hd, *fac = run_fac(r, h, hd) + g * 8;
    float *v = run_v(r, h, hd) + g * 8 * hd, *vs = run_vs(r, h, hd) + g * 8;
    int64_t ke[8], ve[8]; /* each key's row in the caches; -1: zero */
    for (int x = 0; x < 8; x++) {
        const int64_t key = r->k0 + g * 8 + x;
        if (key < r->read_lo || key >= r->n) {
            ke[x] = ve[x] = -1;
            memset(v + x * hd, 0, (size_t)hd * sizeof(float));
            fac[x] = scale, vs[x] = 0.0f;
            continue;
        }
        const int64_t slot = (int64_t)r->table[key / block_size] * block_size + key % block_size;
        ke[x] = (slot * nkv + h) * pk, ve[x] = (slot * nkv + h) * pv;
        for (int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(v + x * hd + d, kv_load8(v_cache, ve[x] + d, kv));
        /* hearth_cpu.c: scale * the key's row scale, one rounded product */
        fac[x] = kk == KV_I8 ? scale * kv_row_scale(k_cache, ke[x], hd, kk) : scale;
        vs[x] = kv_row_scale(v_cache, ve[x], hd, kv);
    }
    for (int64_t d0 = 0; d0 < hd; d0 += 8) {
        __m256 rows[8];
        for (int x = 0; x < 8; x++) rows[x] = ke[x] >= 0 ? kv_load8(k_cache, ke[x] + d0, kk) : _mm256_setzero_ps();
        transpose8(rows);
        for (int d = 0; d < 8; d++) _mm256_store_ps(kt + (d0 + d) * 8, rows[d]);
    }
}

/*
 * Scores of U (1..3) vectors (q: vector u at q + u * hd) over the 16 keys of groups kt,
 * kt + 8 hd, into dst + u * ld: class l (dims l, l + 8, ...) of each as its own FMA chain,
 * two classes at a time (12 independent chains for U = 3: enough to cover the FMA
 * latency), summed in hearth_cpu.c's tree, times the keys' factors. Bases and strides
 * rather than arrays of pointers: the loops then keep every address in a register.
 */
ATT_INLINE void scores16(const int U, const float *q, const float *kt, const float *fac, int64_t hd, float *dst,
                         int64_t ld) {
    const float *kt1 = kt + 8 * hd;
    __m256 s01[3][2], s0123[3][2], s45[3][2];
    UNROLL
    for (int pair = 0; pair < 4; pair++) {
        const int64_t l = 2 * pair;
        __m256 a[3][2], b[3][2];
        UNROLL
        for (int u = 0; u < U; u++) a[u][0] = a[u][1] = b[u][0] = b[u][1] = _mm256_setzero_ps();
        for (int64_t c = l; c < hd; c += 8) {
            const __m256 ka0 = _mm256_load_ps(kt + c * 8), ka1 = _mm256_load_ps(kt1 + c * 8);
            UNROLL
            for (int u = 0; u < U; u++) {
                const __m256 qa = _mm256_broadcast_ss(q + u * hd + c);
                a[u][0] = _mm256_fmadd_ps(qa, ka0, a[u][0]);
                a[u][1] = _mm256_fmadd_ps(qa, ka1, a[u][1]);
            }
            const __m256 kb0 = _mm256_load_ps(kt + c * 8 + 8), kb1 = _mm256_load_ps(kt1 + c * 8 + 8);
            UNROLL
            for (int u = 0; u < U; u++) {
                const __m256 qb = _mm256_broadcast_ss(q + u * hd + c + 1);
                b[u][0] = _mm256_fmadd_ps(qb, kb0, b[u][0]);
                b[u][1] = _mm256_fmadd_ps(qb, kb1, b[u][1]);
            }
        }
        UNROLL
        for (int u = 0; u < U; u++)
            UNROLL
            for (int h = 0; h < 2; h++) {
                const __m256 s = _mm256_add_ps(a[u][h], b[u][h]); /* x_l + x_(l+1) */
                if (pair == 0)
                    s01[u][h] = s;
                else if (pair == 1)
                    s0123[u][h] = _mm256_add_ps(s01[u][h], s);
                else if (pair == 2)
                    s45[u][h] = s;
                else
                    _mm256_storeu_ps(dst + u * ld + 8 * h,
                                     _mm256_mul_ps(_mm256_add_ps(s0123[u][h], _mm256_add_ps(s45[u][h], s)),
                                                   _mm256_loadu_ps(fac + 8 * h)));
            }
    }
}

/* acc[u * hd + d0 .. + 32) += sum over keys i0 .. i1 - 1 in order of w[u * ld + i] * v_i[d0 ..]
 * for U (1..3) vectors; v: value rows of hd floats, indexed by absolute key. */
ATT_INLINE void values32(const int U, const float *w, int64_t ld, const float *v, int64_t hd, int64_t i0, int64_t i1,
                         float *acc, int64_t d0) {
    __m256 a[3][4];
    UNROLL
    for (int u = 0; u < U; u++)
        UNROLL
        for (int c = 0; c < 4; c++) a[u][c] = _mm256_load_ps(acc + u * hd + d0 + 8 * c);
    const float *row = v + i0 * hd + d0;
    for (int64_t i = i0; i < i1; i++, row += hd) {
        const __m256 x0 = _mm256_loadu_ps(row), x1 = _mm256_loadu_ps(row + 8);
        const __m256 x2 = _mm256_loadu_ps(row + 16), x3 = _mm256_loadu_ps(row + 24);
        UNROLL
        for (int u = 0; u < U; u++) {
            const __m256 wu = _mm256_broadcast_ss(w + u * ld + i);
            a[u][0] = _mm256_fmadd_ps(wu, x0, a[u][0]);
            a[u][1] = _mm256_fmadd_ps(wu, x1, a[u][1]);
            a[u][2] = _mm256_fmadd_ps(wu, x2, a[u][2]);
            a[u][3] = _mm256_fmadd_ps(wu, x3, a[u][3]);
        }
    }
    UNROLL
    for (int u = 0; u < U; u++)
        UNROLL
        for (int c = 0; c < 4; c++) _mm256_store_ps(acc + u * hd + d0 + 8 * c, a[u][c]);
}

/* One function per register tile (U = 1, 2, 3), not inlined: inlined into the pass, whose
 * many live values crowd the 16 general registers, the tile reloaded its addresses from the
 * stack every key (bench_cpu_attention.py --prefill, 4096 tokens: ~290 -> ~160 ms). */
#define TILE_FNS(U)                                                                                      \
    static __attribute__((noinline)) void scores16_##U(const float *q, const float *kt, const float *fac, \
                                                      int64_t hd, float *dst, int64_t ld) {             \
        scores16(U, q, kt, fac, hd, dst, ld);                                                            \
    }                                                                                                    \
    static __attribute__((noinline)) void values32_##U(const float *w, int64_t ld, const float *v,      \
                                                      int64_t hd, int64_t i0, int64_t i1, float *acc,    \
                                                      int64_t d0) {                                      \
        values32(U, w, ld, v, hd, i0, i1, acc, d0);                                                      \
    }
TILE_FNS(1)
TILE_FNS(2)
TILE_FNS(3)
#undef TILE_FNS

/* Groups of 3 vectors (the last group 1 or 2): the register tiles' best shape. */
#define BY_THREES(nv, CALL)                          \
    do {                                             \
        int64_t u_ = 0;                              \
        for (; u_ + 3 <= (nv); u_ += 3) CALL(3, u_); \
        if ((nv) - u_ == 2)                          \
            CALL(2, u_);                             \
        else if ((nv) - u_ == 1)                     \
            CALL(1, u_);                             \
    } while (0)

/* One pass: nv vectors (queries qs, vector u at qs + u * hd; score rows `rows` + u * row;
 * outputs ov[u]; vector u sees keys lo[u] .. len[u] - 1) of kv head h of run r. Keys from
 * `from` (a multiple of KG) to n = the longest len: scores 16 keys at a time (their
 * transposed keys read once for all the vectors), then each row's softmax, then the value
 * sums block by block (each output dimension's chain carried across blocks in acc). kv:
 * the value cache's kind. */
static void run_pass(const int kv, const f32_run *r, int64_t h, int64_t hd, int64_t nv, const float *qs, float *rows,
                     int64_t row, float *const *ov, const int64_t *lo, const int64_t *len, int64_t from, int64_t n) {
    const float *kt = run_kt(r, h) - r->k0 * hd, *fac = run_fac(r, h, hd) - r->k0; /* by absolute key */
    const float *v = run_v(r, h, hd) - r->k0 * hd, *vs = run_vs(r, h, hd) - r->k0;
    for (int64_t i = from; i < n; i += KG) {
#define SCORES(U, u) scores16_##U(qs + (u) * hd, kt + i * hd, fac + i, hd, rows + (u) * row + i, row)
        BY_THREES(nv, SCORES);
#undef SCORES
    }
    float inv[ATT_MAXV];
    for (int64_t u = 0; u < nv; u++) inv[u] = hearth_softmax_row(rows + u * row, from, lo[u], len[u], n);
    if (kv == KV_I8) /* each weight times its value row's scale: hearth_cpu.c's p * sv */
        for (int64_t u = 0; u < nv; u++) {
            float *p = rows + u * row;
            int64_t i = from;
            for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, _mm256_mul_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(vs + i)));
            for (; i < n; i++) p[i] *= vs[i];
        }
    float acc[ATT_MAXV * MAX_HD] __attribute__((aligned(32)));
    memset(acc, 0, (size_t)(nv * hd) * sizeof(float));
    /* every vector and dimension over one block before the next: its rows are read from L2
     * once and from L1 for the rest (over all n, each pass would stream them from L2) */
    const int64_t vblock = VALUE_BYTES / (hd * (int64_t)sizeof(float));
    for (int64_t b = from; b < n; b += vblock) {
        const int64_t e = b + vblock < n ? b + vblock : n;
        for (int64_t d0 = 0; d0 < hd; d0 += 32) {
#define VALUES(U, u) values32_##U(rows + (u) * row, row, v, hd, b, e, acc + (u) * hd, d0)
            BY_THREES(nv, VALUES);
#undef VALUES
        }
    }
    for (int64_t u = 0; u < nv; u++) {
        const __m256 vi = _mm256_set1_ps(inv[u]);
        for (int64_t d = 0; d < hd; d += 8)
            _mm256_storeu_ps(ov[u] + d, _mm256_mul_ps(_mm256_load_ps(acc + u * hd + d), vi));
    }
}
#undef BY_THREES

/* Tile `tile` (of tile_tokens tokens) of run r, the query vectors of kv head h's heads. */
static void run_item(const int kv, const f32_run *r, int64_t tile, int64_t h, int64_t tile_tokens, int64_t group,
                     const float *q, int64_t ldq, int64_t nh, int64_t hd, const int32_t *ctx, int64_t window,
                     float *out, float *rows, int64_t row) {
    const int64_t t0 = r->r0 + tile * tile_tokens;
    const int64_t t1 = t0 + tile_tokens < r->r0 + r->len ? t0 + tile_tokens : r->r0 + r->len;
    const int64_t num_vecs = (t1 - t0) * group;
    for (int64_t v0 = 0; v0 < num_vecs; v0 += ATT_MAXV) {
        const int64_t nv = num_vecs - v0 < ATT_MAXV ? num_vecs - v0 : ATT_MAXV;
        float qs[ATT_MAXV * MAX_HD] __attribute__((aligned(32))); /* the pass's queries, one after the other */
        float *ov[ATT_MAXV];
        int64_t len[ATT_MAXV], lo[ATT_MAXV], n = 0, first = INT64_MAX;
        for (int64_t u = 0; u < nv; u++) {
            const int64_t t = t0 + (v0 + u) / group, head = h * group + (v0 + u) % group;
            memcpy(qs + u * hd, q + t * ldq + head * hd, (size_t)hd * sizeof(float));
            ov[u] = out + t * nh * hd + head * hd;
            len[u] = ctx[t];
            n = len[u] > n ? len[u] : n;
            lo[u] = window > 0 && len[u] > window ? len[u] - window : 0;
            first = lo[u] < first ? lo[u] : first;
        }
        run_pass(kv, r, h, hd, nv, qs, rows, row, ov, lo, len, first / KG * KG, n);
    }
}

int hearth_attention_f32(int kk, int kv, const float *q, int64_t ldq, int64_t nh, int64_t nkv, int64_t hd,
                         const void *k_cache, const void *v_cache, int64_t block_size, const int32_t *block_tables,
                         int64_t max_blocks, const int32_t *seq, const int32_t *ctx, float scale, float *out,
                         float *scratch, int64_t scratch_per_thread, int64_t window, const int64_t *runs,
                         int64_t num_runs) {
    if (hd % 32 || hd > MAX_HD || nkv <= 0 || nh % nkv) return 0;
    const int64_t group = nh / nkv, row = scratch_per_thread / ATT_MAXV;
    const int64_t tile_tokens = group >= ATT_MAXV ? 1 : ATT_MAXV / group;
    for (int64_t i = 0; i < num_runs; i++) { /* every run fits the score rows, or none is done */
        const int64_t n = ctx[runs[2 * i + 1] - 1];
        if ((n + KG - 1) / KG * KG > row) return 0;
    }
    for (int64_t i = 0; i < num_runs; i++) {
        f32_run r;
        r.r0 = runs[2 * i];
        r.len = runs[2 * i + 1] - r.r0;
        r.table = block_tables + (int64_t)seq[r.r0] * max_blocks;
        r.n = ctx[r.r0 + r.len - 1];
        const int64_t c0 = ctx[r.r0];
        r.read_lo = window > 0 && c0 > window ? c0 - window : 0;
        r.k0 = r.read_lo / KG * KG;
        r.nk = (r.n + KG - 1) / KG * KG - r.k0;
        r.per_head = r.nk * (2 * hd + 2);
        /* kv heads in groups of at most WIDEN_CAP floats (long contexts of wide models would
         * otherwise hold every head's keys and values at once) */
        const int64_t per_group = WIDEN_CAP / r.per_head > 1 ? WIDEN_CAP / r.per_head : 1;
        const int64_t heads = per_group < nkv ? per_group : nkv;
        r.buf = widen_space((size_t)(heads * r.per_head));
        if (!r.buf) return 0; /* the caller redoes every run: the same bits */
        const int64_t groups = r.nk / 8, tiles = (r.len + tile_tokens - 1) / tile_tokens;
        for (r.h0 = 0; r.h0 < nkv; r.h0 += heads) {
            const int64_t nhg = nkv - r.h0 < heads ? nkv - r.h0 : heads;
#pragma omp parallel
            {
#pragma omp for schedule(static)
                for (int64_t j = 0; j < nhg * groups; j++)
                    widen_group(kk, kv, &r, r.h0 + j / groups, j % groups, k_cache, v_cache, block_size, nkv, hd,
                                scale);
                float *rows = scratch + (int64_t)omp_get_thread_num() * scratch_per_thread;
                /* the last tiles (the longest contexts) first, for the balance */
#pragma omp for schedule(dynamic, 1)
                for (int64_t j = 0; j < tiles * nhg; j++)
                    run_item(kv, &r, tiles - 1 - j / nhg, r.h0 + j % nhg, tile_tokens, group, q, ldq, nh, hd, ctx,
                             window, out, rows, row);
            }
        }
    }
    hearth_attention_f32_runs_done += num_runs;
    return 1;
}

#endif
