/*
 * hearth_attention_bf16.c: prefill attention on the bfloat16 matrix units: AMX-BF16 tiles
 * (TDPBF16PS) in the `amx` build, AVX512-BF16 dot products (VDPBF16PS) in `avx512_vnni`
 * (and where the kernel refuses the AMX tile state); an empty shell below (returns 0: the
 * caller runs the float32 kernel).
 *
 * Why: under gguf-bf16 the linears of a long prompt run on the matrix units, and what is
 * left is attention, whose work grows with the square of the prompt: at 1024-4096 tokens
 * the float32 kernel (hearth_cpu.c) is most of a prefill. Here both products of a
 * prefill run (Q.K^T and P.V) are bfloat16 products with float32 sums.
 *
 * Flash-style: a work item is a tile of 16 consecutive query tokens of one run and one kv
 * head; for each head of the kv head's group it walks the run's keys in blocks of 32
 * with an online softmax (running max and sum per row, float32). Before the items, each
 * kv head's keys and values of a run are converted once to bfloat16 in the B-tile (VNNI
 * pair) layout, for all the run's tiles: a 1024-token chunk is 64 tiles over the same
 * keys. Both variants read the same repacked blocks.
 *
 * Precision contract (docs/performance.md, "Precision modes"): each query element, each
 * key and value element (as the cache holds it: float32, float16, or int8 times its row's
 * scale in float32) and each softmax
 * weight p = 2^(s - m) is rounded once to bfloat16 (nearest-even); products are exact,
 * scores, the max, the exponentials, the row sums and the output sums are float32.
 * Causal and sliding-window masks give weight exactly 0. The reference m of a row is
 * raised only when its block max exceeds it by more than LAZY_LOG2 (then the row's sums
 * are rescaled), so weights stay <= 2^LAZY_LOG2 and most blocks need no rescale.
 *
 * Invariance: every row's arithmetic depends only on its own scores (its reference max,
 * its weights, its lanes of the tile sums; a block outside a row's range adds exact
 * zeros), and key blocks are aligned to absolute key positions, so a token's output does
 * not depend on the other tokens of its tile or call, on how its prompt was chunked (as
 * long as each chunk takes this path) or on the thread count. The AMX and AVX512-BF16
 * sums run in different orders: the two variants agree to rounding, not bitwise.
 *
 * Repacked layouts (bfloat16, 1 KB tiles of 16 rows x 64 B), per (run, kv head), for key
 * block b (keys 32b .. 32b+31, counted from the run's first block):
 *   K: tile (b, half j, dim chunk c) row r = for key n of 16: (K[32b+16j+n][32c+2r],
 *      K[..][32c+2r+1]): the B operand of Q (16 x 32 dims) . K^T (-> 16 x 16 keys);
 *   V: tile (b, dim group g) row r = for dim n of 16: (V[32b+2r][16g+n], V[32b+2r+1][16g+n]):
 *      the B operand of P (16 x 32 keys) . V (-> 16 x 16 dims).
 * Keys before the window of the run's first token (their cache blocks may be freed and
 * reused) and the padding past its last key are zero, never read from the cache.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hearth_kv.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#endif

/* Which variant `hearth_attention_bf16` runs for head_dim hd: 2 = AMX-BF16 tiles, 1 =
 * AVX512-BF16, 0 = none (the float32 kernel runs). */
int hearth_attention_bf16_path(int64_t hd);

/*
 * Attention of the tokens in `runs` (num_runs [start, end) row ranges, each a run of
 * consecutive positions of one sequence) over their sequences' paged caches; the other
 * rows of the call are not touched. Arguments as hearth_paged_attention's (kind: what the
 * caches hold, the keys' kind | the values' kind << 2, each 0 float32, 1 float16, 2 int8
 * rows with their scales). Returns 1 when computed, 0 when this build cannot (no bfloat16
 * unit, an unsupported head_dim, no memory): the caller then runs the float32 kernel.
 */
int hearth_attention_bf16(int kind, const float *q, int64_t ldq, int64_t nh, int64_t nkv, int64_t hd,
                          const void *k_cache, const void *v_cache, int64_t block_size, const int32_t *block_tables,
                          int64_t max_blocks, const int32_t *seq, const int32_t *ctx, float scale, float *out,
                          int64_t window, const int64_t *runs, int64_t num_runs);

#if !defined(__AVX512BF16__)

int hearth_attention_bf16_path(int64_t hd) {
    (void)hd;
    return 0;
}

int hearth_attention_bf16(int kind, const float *q, int64_t ldq, int64_t nh, int64_t nkv, int64_t hd,
                          const void *k_cache, const void *v_cache, int64_t block_size, const int32_t *block_tables,
                          int64_t max_blocks, const int32_t *seq, const int32_t *ctx, float scale, float *out,
                          int64_t window, const int64_t *runs, int64_t num_runs) {
    (void)kind, (void)q, (void)ldq, (void)nh, (void)nkv, (void)hd, (void)k_cache, (void)v_cache;
    (void)block_size, (void)block_tables, (void)max_blocks, (void)seq, (void)ctx, (void)scale;
    (void)out, (void)window, (void)runs, (void)num_runs;
    return 0;
}

#else

#define TM 16          /* query tokens per tile (A / C tile rows) */
#define KB 32          /* keys per block: one P tile row of bfloat16 */
#define TILE_ELEMS 512 /* bfloat16 per 1 KB tile */
#define MAX_HD 256     /* per-item stack buffers */
#define AMX_MAX_HD 64  /* O (hd / 16 tiles) + S + A + B in the 8 tile registers */
#define LAZY_LOG2 8.0f /* raise a row's reference max only past this (weights <= 256) */
#define REPACK_CAP ((size_t)16 << 20) /* bfloat16 elements (32 MB) of repacked keys per group of runs */
#define ATT_INLINE static inline __attribute__((always_inline))

#ifdef __AMX_BF16__
int hearth_q8a_amx_status(void); /* hearth_q8.c: the process's XTILEDATA permission */
#endif

int hearth_attention_bf16_path(int64_t hd) {
#ifdef __AMX_BF16__
    if (hd <= AMX_MAX_HD && hearth_q8a_amx_status() == 1) return 2;
#endif
    return hd <= MAX_HD ? 1 : 0;
}

/* -------------------------------------------------------------------- helpers */

/* The cache kinds and an int8 row's layout (KV_F16, KV_I8, kv_head_pitch, kv_row_scale): hearth_kv.h. */

/* 16 cache elements (float32, float16 or int8 times the row's scale `s`) from element `idx`
 * as float32. */
ATT_INLINE __m512 load16(const void *base, int64_t idx, const int kind, float s) {
    if (kind == KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx)));
    if (kind == KV_I8)
        return _mm512_mul_ps(_mm512_set1_ps(s), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                    _mm_loadu_si128((const __m128i *)((const int8_t *)base + idx)))));
    return _mm512_loadu_ps((const float *)base + idx);
}

/* 2^x in float32 for finite x <= ~LAZY_LOG2: 2^n * p(f), n = round(x), |f| <= 1/2, p a degree-5
 * fit of 2^f (relative error < 1.6e-7 on [-1/2, 1/2]); below -150 it is exactly 0. Masked
 * lanes are zeroed by the caller, not here. */
ATT_INLINE __m512 exp2_ps(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.327483681961894e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.67552699148655e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550718307495117e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022120237350464e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469440460205e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
    return _mm512_scalef_ps(p, n);
}

/* A run's view of the call: its rows, its sequence's block table, its repacked keys. */
typedef struct {
    int64_t r0, len;      /* rows r0 .. r0 + len - 1 of the call */
    const int32_t *table; /* the sequence's block table */
    int64_t kb0, nkb;     /* key blocks kb0 .. kb0 + nkb - 1 (absolute, 32 keys each) are repacked */
    int64_t read_lo, n;   /* cache keys read_lo .. n - 1 are read; the rest of the blocks is zero */
    uint16_t *kv;         /* repacked K then V of kv head 0, 1, ...: 2 * per_head each */
    int64_t per_head;     /* bfloat16 elements of one kv head's K (and as many of V) */
} att_run;

/* Thread-local repack buffer, grown on demand and reused: a fresh multi-MB malloc per layer
 * is a fresh mmap, and faulting its pages in costs as much as the attention of a short run. */
static __thread uint16_t *repack_buf;
static __thread size_t repack_cap;

static uint16_t *repack_space(size_t elems) {
    if (elems > repack_cap) {
        free(repack_buf);
        size_t cap = elems + elems / 4;
        repack_buf = (uint16_t *)aligned_alloc(64, (cap * 2 + 63) / 64 * 64);
        repack_cap = repack_buf ? cap : 0;
    }
    return repack_buf;
}

/* Key block kb (absolute) of kv head kvh of run `run`, K and V, into its repacked tiles. */
ATT_INLINE void repack_block(const int kind, const att_run *run, int64_t kvh, int64_t kb, const void *k_cache,
                             const void *v_cache, int64_t block_size, int64_t nkv, int64_t hd) {
    const int kk = kind & 3, kv = kind >> 2; /* the key and value caches' kinds */
    const int64_t pk = kv_head_pitch(kk, hd), pv = kv_head_pitch(kv, hd);
    const int64_t chunks = hd / 32, groups = hd / 16, b = kb - run->kb0;
    uint16_t *kt = run->kv + kvh * 2 * run->per_head + b * KB * hd;
    uint16_t *vt = kt + run->per_head;
    int64_t src[KB]; /* slot of each key; -1: zero */
    for (int n = 0; n < KB; n++) {
        const int64_t key = kb * KB + n;
        src[n] = key >= run->read_lo && key < run->n
                     ? (int64_t)run->table[key / block_size] * block_size + key % block_size
                     : -1;
    }
    const __m512i kidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    for (int n = 0; n < KB; n++) {
        uint32_t *tile_col = (uint32_t *)(kt + (n / 16) * chunks * TILE_ELEMS) + n % 16;
        for (int64_t c = 0; c < chunks; c++) {
            __m512i row = _mm512_setzero_si512();
            if (src[n] >= 0) {
                const int64_t e = (src[n] * nkv + kvh) * pk; /* the key's row of this kv head */
                const float ks = kv_row_scale(k_cache, e, hd, kk);
                const __m512 lo = load16(k_cache, e + 32 * c, kk, ks);
                const __m512 hi = load16(k_cache, e + 32 * c + 16, kk, ks);
                row = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
            }
            /* dim pair r of this key -> row r, column n of the tile */
            _mm512_i32scatter_epi32(tile_col + c * (TILE_ELEMS / 2), kidx, row, 4);
        }
    }
    /* interleave two keys' 16 dims: out[2n] = first key's dim n, out[2n + 1] = second's */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int r = 0; r < KB / 2; r++) {
        const int64_t s0 = src[2 * r] >= 0 ? (src[2 * r] * nkv + kvh) * pv : -1;
        const int64_t s1 = src[2 * r + 1] >= 0 ? (src[2 * r + 1] * nkv + kvh) * pv : -1;
        const float vs0 = s0 >= 0 ? kv_row_scale(v_cache, s0, hd, kv) : 0.0f;
        const float vs1 = s1 >= 0 ? kv_row_scale(v_cache, s1, hd, kv) : 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            const __m512 a = s0 >= 0 ? load16(v_cache, s0 + 16 * g, kv, vs0) : _mm512_setzero_ps();
            const __m512 b1 = s1 >= 0 ? load16(v_cache, s1 + 16 * g, kv, vs1) : _mm512_setzero_ps();
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b1, a);
            _mm512_store_si512(vt + g * TILE_ELEMS + r * 32, _mm512_permutexvar_epi16(pairs, both));
        }
    }
}

/* One item's rows and per-row softmax state. */
typedef struct {
    int64_t rows;           /* valid rows (tokens) of the tile, <= TM */
    int32_t lo[TM], hi[TM]; /* row m sees keys lo[m] .. hi[m] - 1; empty for padding rows */
    float mref[TM];         /* reference max (log2 units; -inf before the row's first key) */
    float thr[TM];          /* raw-score threshold of a raise: (mref + LAZY_LOG2) / (scale log2 e) */
    float ref[TM];          /* mref, or 0 while it is -inf (every lane is masked then) */
    float sbuf[TM * KB] __attribute__((aligned(64)));     /* raw scores of a block */
    uint16_t pbuf[TM * KB] __attribute__((aligned(64)));  /* bfloat16 weights: the P A tile */
    float lsum[TM * 16] __attribute__((aligned(64)));     /* lane-wise row sums of the weights */
    float obuf[TM * MAX_HD] __attribute__((aligned(64))); /* output rows (AMX: when spilled) */
    uint16_t qa[MAX_HD / 32 * TILE_ELEMS] __attribute__((aligned(64))); /* Q A tiles, chunk by chunk */
} att_item;

/* Q rows of head h of the tile as bfloat16 A tiles (chunk c: 16 rows x 32 dims; padding rows zero). */
static void load_q(att_item *it, const float *q, int64_t ldq, int64_t row0, int64_t h, int64_t hd) {
    for (int64_t m = 0; m < TM; m++)
        for (int64_t c = 0; c < hd / 32; c++) {
            __m512i v = _mm512_setzero_si512();
            if (m < it->rows) {
                const float *src = q + (row0 + m) * ldq + h * hd + 32 * c;
                v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
            }
            _mm512_store_si512(it->qa + c * TILE_ELEMS + m * 32, v);
        }
}

/*
 * The softmax weights of one block: row m's scores in log2 units (x = s * scale * log2 e)
 * outside its range [lo, hi) get weight exactly 0; p = 2^(x - ref) is rounded to bfloat16
 * into pbuf (the P A tile) and added to the row's lane sums in float32. A row whose
 * unmasked x passes ref + LAZY_LOG2 (a vector compare: no horizontal max on the common
 * path) first raises ref to its block max; alpha[m] = 2^(old - new) is then the factor its
 * sums so far need (lsum here, its O row by the caller: `rescale_o`). Returns whether any
 * row was raised.
 */
static int block_weights(att_item *it, int64_t key0, int full, float scale_log2, float *alpha) {
    const __m512 c2 = _mm512_set1_ps(scale_log2);
    const __m512i keys0 = _mm512_add_epi32(_mm512_set1_epi32((int32_t)key0),
                                           _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const __m512i keys1 = _mm512_add_epi32(keys0, _mm512_set1_epi32(16));
    int raised = 0;
    for (int m = 0; m < it->rows; m++) {
        const __m512 s0 = _mm512_load_ps(it->sbuf + m * KB), s1 = _mm512_load_ps(it->sbuf + m * KB + 16);
        __mmask16 k0 = 0xFFFF, k1 = 0xFFFF;
        if (!full) {
            const __m512i lo = _mm512_set1_epi32(it->lo[m]), hi = _mm512_set1_epi32(it->hi[m]);
            k0 = _mm512_cmpge_epi32_mask(keys0, lo) & _mm512_cmplt_epi32_mask(keys0, hi);
            k1 = _mm512_cmpge_epi32_mask(keys1, lo) & _mm512_cmplt_epi32_mask(keys1, hi);
        }
        /* x > mref + LAZY_LOG2 as s > thr (c2 > 0) */
        const __m512 thr = _mm512_set1_ps(it->thr[m]);
        alpha[m] = 1.0f;
        if (_mm512_mask_cmp_ps_mask(k0, s0, thr, _CMP_GT_OQ) | _mm512_mask_cmp_ps_mask(k1, s1, thr, _CMP_GT_OQ)) {
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            const float bm = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_blend_ps(k0, ninf, _mm512_mul_ps(s0, c2)),
                                                                _mm512_mask_blend_ps(k1, ninf, _mm512_mul_ps(s1, c2))));
            alpha[m] = it->mref[m] == -INFINITY ? 0.0f : exp2f(it->mref[m] - bm);
            _mm512_store_ps(it->lsum + m * 16, _mm512_mul_ps(_mm512_set1_ps(alpha[m]), _mm512_load_ps(it->lsum + m * 16)));
            it->mref[m] = it->ref[m] = bm;
            it->thr[m] = (bm + LAZY_LOG2) / scale_log2;
            raised = 1;
        }
        const __m512 ref = _mm512_set1_ps(it->ref[m]);
        const __m512 p0 = _mm512_maskz_mov_ps(k0, exp2_ps(_mm512_fmsub_ps(s0, c2, ref)));
        const __m512 p1 = _mm512_maskz_mov_ps(k1, exp2_ps(_mm512_fmsub_ps(s1, c2, ref)));
        _mm512_store_ps(it->lsum + m * 16, _mm512_add_ps(_mm512_load_ps(it->lsum + m * 16), _mm512_add_ps(p0, p1)));
        _mm512_store_si512(it->pbuf + m * KB, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    /* padding rows keep zero weights (set once per head) */
    return raised;
}

/* O rows times their alpha (rows raised by this block's weights). */
static void rescale_o(att_item *it, const float *alpha, int64_t hd) {
    for (int m = 0; m < it->rows; m++) {
        if (alpha[m] == 1.0f) continue;
        const __m512 va = _mm512_set1_ps(alpha[m]);
        for (int64_t d = 0; d < hd; d += 16)
            _mm512_store_ps(it->obuf + m * hd + d, _mm512_mul_ps(va, _mm512_load_ps(it->obuf + m * hd + d)));
    }
}

/* out rows of head h: obuf / row sum. */
static void finish_rows(const att_item *it, float *out, int64_t ldo, int64_t row0, int64_t h, int64_t hd) {
    for (int m = 0; m < it->rows; m++) {
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(it->lsum + m * 16)));
        float *o = out + (row0 + m) * ldo + h * hd;
        for (int64_t d = 0; d < hd; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(inv, _mm512_load_ps(it->obuf + m * hd + d)));
    }
}

/* Start of head h's pass: state reset. */
static void start_head(att_item *it, int64_t hd) {
    for (int m = 0; m < TM; m++) it->mref[m] = it->thr[m] = -INFINITY, it->ref[m] = 0.0f;
    memset(it->lsum, 0, sizeof it->lsum);
    memset(it->obuf, 0, (size_t)(TM * hd) * sizeof(float));
    memset(it->pbuf, 0, sizeof it->pbuf);
}

/* ------------------------------------------------------- AVX512-BF16 (VDPBF16PS) */

/* sbuf = raw Q.K^T of the tile's rows over key block b's 32 keys: 8 rows x 2 key halves
 * per register tile, each a chain over the dims in order. */
static void vec_scores(att_item *it, const uint16_t *kt, int64_t hd) {
    const int64_t chunks = hd / 32;
    for (int m0 = 0; m0 < it->rows; m0 += 8) {
        __m512 acc[8][2];
        for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++) {
            const uint16_t *k0 = kt + c * TILE_ELEMS, *k1 = kt + (chunks + c) * TILE_ELEMS;
            const uint32_t *qc = (const uint32_t *)(it->qa + c * TILE_ELEMS);
            for (int r = 0; r < 16; r++) {
                const __m512bh b0 = (__m512bh)_mm512_load_si512(k0 + r * 32);
                const __m512bh b1 = (__m512bh)_mm512_load_si512(k1 + r * 32);
                for (int i = 0; i < 8; i++) {
                    const __m512bh a = (__m512bh)_mm512_set1_epi32((int)qc[(m0 + i) * 16 + r]);
                    acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
                    acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
                }
            }
        }
        for (int i = 0; i < 8; i++) {
            _mm512_store_ps(it->sbuf + (m0 + i) * KB, acc[i][0]);
            _mm512_store_ps(it->sbuf + (m0 + i) * KB + 16, acc[i][1]);
        }
    }
}

/* obuf += P . V over key block b for NG (2 or 4) dim groups from g0: 4 rows x NG groups per
 * register tile, each a chain over the keys in order. */
ATT_INLINE void vec_values_ng(const int NG, att_item *it, const uint16_t *vt, int64_t hd, int64_t g0) {
    const uint32_t *pp = (const uint32_t *)it->pbuf;
    for (int m0 = 0; m0 < it->rows; m0 += 4) {
        __m512 acc[4][4];
        for (int i = 0; i < 4; i++)
            for (int g = 0; g < NG; g++) acc[i][g] = _mm512_load_ps(it->obuf + (m0 + i) * hd + (g0 + g) * 16);
        for (int r = 0; r < 16; r++) {
            __m512bh b[4];
            for (int g = 0; g < NG; g++) b[g] = (__m512bh)_mm512_load_si512(vt + (g0 + g) * TILE_ELEMS + r * 32);
            for (int i = 0; i < 4; i++) {
                const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pp[(m0 + i) * 16 + r]);
                for (int g = 0; g < NG; g++) acc[i][g] = _mm512_dpbf16_ps(acc[i][g], a, b[g]);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int g = 0; g < NG; g++) _mm512_store_ps(it->obuf + (m0 + i) * hd + (g0 + g) * 16, acc[i][g]);
    }
}

static void vec_values(att_item *it, const uint16_t *vt, int64_t hd) {
    const int64_t groups = hd / 16; /* even: hd % 32 == 0 */
    int64_t g0 = 0;
    for (; g0 + 4 <= groups; g0 += 4) vec_values_ng(4, it, vt, hd, g0);
    if (g0 < groups) vec_values_ng(2, it, vt, hd, g0);
}

/* ------------------------------------------------------------ AMX-BF16 tiles */
#ifdef __AMX_BF16__
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) att_tile_config;

/* tmm0-3: O (16 rows x 16 dims each), tmm4-5: S (two halves of 16 keys), tmm6: A (Q or P),
 * tmm7: B (K or V). */
static void amx_config(void) {
    att_tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.rows[i] = 16, c.colsb[i] = 64;
    _tile_loadconfig(&c);
}

static void amx_spill(att_item *it, int64_t hd) {
    float *o = it->obuf;
    const int64_t ld = hd * 4;
    if (hd > 0) _tile_stored(0, o, ld);
    if (hd > 16) _tile_stored(1, o + 16, ld);
    if (hd > 32) _tile_stored(2, o + 32, ld);
    if (hd > 48) _tile_stored(3, o + 48, ld);
}

static void amx_fill(att_item *it, int64_t hd) {
    float *o = it->obuf;
    const int64_t ld = hd * 4;
    if (hd > 0) _tile_loadd(0, o, ld);
    if (hd > 16) _tile_loadd(1, o + 16, ld);
    if (hd > 32) _tile_loadd(2, o + 32, ld);
    if (hd > 48) _tile_loadd(3, o + 48, ld);
}

/* S = Q.K^T of a block into tmm4 (keys 0-15) and tmm5 (16-31), not yet stored: the caller
 * issues the next block's scores before this block's softmax, so the tile unit computes
 * them while the vector units run the exponentials, and stores them after (`amx_scores_store`). */
static void amx_scores(att_item *it, const uint16_t *kt, int64_t hd) {
    const int64_t chunks = hd / 32;
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t c = 0; c < chunks; c++) {
        _tile_loadd(6, it->qa + c * TILE_ELEMS, 64);
        _tile_loadd(7, kt + c * TILE_ELEMS, 64);
        _tile_dpbf16ps(4, 6, 7);
        _tile_loadd(7, kt + (chunks + c) * TILE_ELEMS, 64);
        _tile_dpbf16ps(5, 6, 7);
    }
}

static void amx_scores_store(att_item *it) {
    _tile_stored(4, it->sbuf, KB * 4);
    _tile_stored(5, it->sbuf + 16, KB * 4);
}

/* O tiles += P . V over the block (A = P in tmm6, B = V in tmm7). */
static void amx_values(att_item *it, const uint16_t *vt, int64_t hd) {
    _tile_loadd(6, it->pbuf, 64);
    _tile_loadd(7, vt, 64);
    _tile_dpbf16ps(0, 6, 7);
    if (hd > 16) {
        _tile_loadd(7, vt + TILE_ELEMS, 64);
        _tile_dpbf16ps(1, 6, 7);
    }
    if (hd > 32) {
        _tile_loadd(7, vt + 2 * TILE_ELEMS, 64);
        _tile_dpbf16ps(2, 6, 7);
    }
    if (hd > 48) {
        _tile_loadd(7, vt + 3 * TILE_ELEMS, 64);
        _tile_dpbf16ps(3, 6, 7);
    }
}
#endif

/* ------------------------------------------------------------------- driver */

/* Head h of tile `tile` of `run`: the flash loop over the run's key blocks. */
ATT_INLINE void item_head(const int amx, att_item *it, const att_run *run, int64_t kvh, int64_t row0, int64_t h,
                          const float *q, int64_t ldq, int64_t hd, float scale_log2, float *out, int64_t ldo) {
    load_q(it, q, ldq, row0, h, hd);
    start_head(it, hd);
#ifdef __AMX_BF16__
    if (amx) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
#else
    (void)amx;
#endif
    /* blocks touching any row's range; the first row has the lowest window start and the
     * last the highest context */
    int32_t lo_min = it->lo[0], hi_max = it->hi[it->rows - 1], hi_min = it->hi[0], lo_max = it->lo[it->rows - 1];
    int64_t kb_lo = lo_min / KB, kb_hi = (hi_max + KB - 1) / KB;
    if (kb_lo < run->kb0) kb_lo = run->kb0;
    const uint16_t *kbase = run->kv + kvh * 2 * run->per_head;
    float alpha[TM];
#ifdef __AMX_BF16__
    if (amx) {
        amx_scores(it, kbase + (kb_lo - run->kb0) * KB * hd, hd);
        amx_scores_store(it);
    }
#endif
    for (int64_t kb = kb_lo; kb < kb_hi; kb++) {
        const uint16_t *kt = kbase + (kb - run->kb0) * KB * hd, *vt = kt + run->per_head;
        const int64_t key0 = kb * KB;
        const int full = key0 >= lo_max && key0 + KB <= hi_min, next = kb + 1 < kb_hi;
        (void)next; /* AMX only */
#ifdef __AMX_BF16__
        if (amx) {
            if (next) amx_scores(it, kt + KB * hd, hd); /* the next block's K */
        } else
#endif
            vec_scores(it, kt, hd);
        if (block_weights(it, key0, full, scale_log2, alpha)) {
#ifdef __AMX_BF16__
            if (amx) amx_spill(it, hd);
#endif
            rescale_o(it, alpha, hd);
#ifdef __AMX_BF16__
            if (amx) amx_fill(it, hd);
#endif
        }
#ifdef __AMX_BF16__
        if (amx) {
            amx_values(it, vt, hd);
            if (next) amx_scores_store(it);
        } else
#endif
            vec_values(it, vt, hd);
    }
#ifdef __AMX_BF16__
    if (amx) amx_spill(it, hd);
#endif
    finish_rows(it, out, ldo, row0, h, hd);
}

/* The runs rs[0 .. num_runs): repack their keys into buf, then every (tile, kv head) item. */
static void attend_runs(const int kind, const int amx, att_run *rs, int64_t num_runs, uint16_t *buf, att_item *states,
                        int threads, const float *q, int64_t ldq, int64_t nh, int64_t nkv, int64_t hd,
                        const void *k_cache, const void *v_cache, int64_t block_size, const int32_t *ctx,
                        float scale, float *out, int64_t window) {
    const int64_t group = nh / nkv;
    int64_t items = 0, blocks = 0;
    for (int64_t i = 0, at = 0; i < num_runs; i++) {
        rs[i].kv = buf + at;
        at += 2 * nkv * rs[i].per_head;
        items += (rs[i].len + TM - 1) / TM * nkv;
        blocks += rs[i].nkb * nkv;
    }
    const float scale_log2 = scale * 1.44269504088896341f;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < blocks; i++) {
            int64_t rest = i, r = 0;
            while (rest >= rs[r].nkb * nkv) rest -= rs[r++].nkb * nkv;
            repack_block(kind, rs + r, rest / rs[r].nkb, rs[r].kb0 + rest % rs[r].nkb, k_cache, v_cache, block_size,
                         nkv, hd);
        }
#ifdef __AMX_BF16__
        if (amx) amx_config();
#endif
        att_item *it = states + omp_get_thread_num();
        /* items from the last tile of each run down: the longest first, for the balance */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            int64_t rest = i, r = 0;
            while (rest >= (rs[r].len + TM - 1) / TM * nkv) rest -= (rs[r++].len + TM - 1) / TM * nkv;
            const att_run *run = rs + r;
            const int64_t ntiles = (run->len + TM - 1) / TM;
            const int64_t tile = ntiles - 1 - rest / nkv, kvh = rest % nkv;
            const int64_t row0 = run->r0 + tile * TM;
            it->rows = run->len - tile * TM < TM ? run->len - tile * TM : TM;
            for (int m = 0; m < TM; m++) {
                if (m < it->rows) {
                    const int32_t c = ctx[row0 + m];
                    it->hi[m] = c;
                    it->lo[m] = window > 0 && c > window ? (int32_t)(c - window) : 0;
                } else {
                    it->hi[m] = it->lo[m] = 0;
                }
            }
            for (int64_t g = 0; g < group; g++)
                item_head(amx, it, run, kvh, row0, kvh * group + g, q, ldq, hd, scale_log2, out, nh * hd);
        }
#ifdef __AMX_BF16__
        if (amx) _tile_release();
#endif
    }
}

int hearth_attention_bf16(int kind, const float *q, int64_t ldq, int64_t nh, int64_t nkv, int64_t hd,
                          const void *k_cache, const void *v_cache, int64_t block_size, const int32_t *block_tables,
                          int64_t max_blocks, const int32_t *seq, const int32_t *ctx, float scale, float *out,
                          int64_t window, const int64_t *runs, int64_t num_runs) {
    const int path = hearth_attention_bf16_path(hd);
    if (path == 0 || hd % 32 || nkv <= 0 || nh % nkv) return 0;
    att_run *rs = (att_run *)malloc((size_t)num_runs * sizeof(att_run));
    if (!rs) return 0;
    size_t largest = 0, total = 0;
    for (int64_t i = 0; i < num_runs; i++) {
        att_run *r = rs + i;
        r->r0 = runs[2 * i];
        r->len = runs[2 * i + 1] - r->r0;
        r->table = block_tables + (int64_t)seq[r->r0] * max_blocks;
        const int64_t c0 = ctx[r->r0];
        r->n = ctx[r->r0 + r->len - 1];
        const int64_t lo = window > 0 && c0 > window ? c0 - window : 0;
        r->read_lo = lo;
        r->kb0 = lo / KB;
        r->nkb = (r->n + KB - 1) / KB - r->kb0;
        r->per_head = r->nkb * KB * hd;
        const size_t need = (size_t)(2 * nkv * r->per_head);
        largest = need > largest ? need : largest;
        total += need;
    }
    /* Runs go in groups of at most REPACK_CAP repacked elements (or one run): a step of many
     * chunks over long contexts would otherwise hold every chunk's keys at once. */
    const size_t cap = total < REPACK_CAP ? total : largest > REPACK_CAP ? largest : REPACK_CAP;
    const int threads = omp_get_max_threads();
    uint16_t *buf = repack_space(cap);
    att_item *states = (att_item *)aligned_alloc(64, (size_t)threads * sizeof(att_item));
    if (!buf || !states) {
        free(rs);
        free(states);
        return 0;
    }
    for (int64_t i0 = 0; i0 < num_runs;) {
        size_t used = (size_t)(2 * nkv * rs[i0].per_head);
        int64_t i1 = i0 + 1;
        while (i1 < num_runs && used + (size_t)(2 * nkv * rs[i1].per_head) <= cap) used += (size_t)(2 * nkv * rs[i1++].per_head);
        attend_runs(kind, path == 2, rs + i0, i1 - i0, buf, states, threads, q, ldq, nh, nkv, hd, k_cache, v_cache,
                    block_size, ctx, scale, out, window);
        i0 = i1;
    }
    free(rs);
    free(states);
    return 1;
}

#endif /* __AVX512BF16__ */
