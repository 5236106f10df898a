/*
 * hearth's quantized-activation GEMMs ("q8 activations", the scheme llama.cpp uses for
 * its Q4_1 x Q8_1 and Q8_0 x Q8_0 dot products), built into the same library as
 * hearth_cpu.c for every ISA variant:
 *
 *   avx2 / avx512   _mm256_maddubs_epi16 (u8 x s8 -> s16 pairs) + _mm256_madd_epi16
 *   avx512_vnni     _mm512_dpbusd_epi32 (u8 x s8, four products per int32 lane)
 *   amx             _tile_dpbsud / _tile_dpbssd on 16x16 int32 tiles, K = 32 (one block)
 *                   for calls of at least `amx_min_t` tokens; the VNNI code below that.
 *
 * Why int8: the matrix units multiply bytes, not floats, and a Q4_1 weight is a byte
 * (its nibble) times a per-block scale. Quantizing each token's 32-column blocks to int8
 * once per call makes every block's dot product an exact integer.
 *
 * Arithmetic (the same in every variant; this file is compiled with -ffp-contract=off and
 * every fused multiply-add is an explicit fma intrinsic):
 *  - Activations, per token and 32-column block (hearth_quantize_q8):
 *      amax = max |x|;  d = amax / 127 (IEEE division);  q = rne(x / d) (IEEE division,
 *      round half to even) clamped to [-127, 127], all 0 when d == 0;  s = d * (float)sum(q).
 *    llama.cpp multiplies by 1/d instead; dividing is what makes a torch reference
 *    (`torch.round(x / d)`) bitwise equal. Inputs are assumed finite.
 *  - isum = the exact int32 sum of q_w * q_x over the block's 32 columns (|isum| < 2^20,
 *    so (float)isum is exact).
 *  - Per (token, output row), blocks in column order, from acc = 0:
 *      Q4_1: acc = fma(d_w * d_x, (float)isum, acc);  acc = fma(m_w, s_x, acc)
 *      Q8_0: acc = fma(d_w * d_x, (float)isum, acc)
 *    then out = acc + bias[n] (no addition at all without a bias). d_w, m_w are the
 *    file's f16 values, converted exactly.
 * Integers are exact and the float steps are the same operations in the same order for
 * every variant, tile shape, token count and thread count, so every result is bitwise
 * the same across all of them: the batch-invariance contract.
 */
#include <errno.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <omp.h>

#define QK 32 /* columns per quant block */
#define QG 16 /* output rows per packed group: one 512-bit int32 lane each, one AMX tile row */
#define Q4A_BLOCK 320 /* packed bytes per (group, block), Q4_1 */
#define Q8A_BLOCK 544 /* packed bytes per (group, block), Q8_0 */
#define INLINE static inline __attribute__((always_inline))

#ifndef Q8A_AMX_MIN_T
/* Default: calls with at least this many tokens use AMX tiles. An AMX item is 16 tokens,
 * so fewer pay for 16; measured on a Sapphire Rapids VM (tools/bench_q8_gemm.py), AMX ties
 * or beats VNNI from 16 tokens on (1.0-1.5x at 16, up to ~1.3x above) and loses below. */
#define Q8A_AMX_MIN_T 16
#endif

/* -------------------------------------------------------------------------- packing */
/*
 * One layout for every variant (packing does not depend on the ISA). An [N, K] weight
 * (N % 8 == 0, K % 32 == 0) is cut into groups of 16 output rows; when N % 16 == 8 the
 * last group is padded with 8 zero rows that are computed and never stored. Group g =
 * rows 16g..16g+15, block b = columns 32b..32b+31, groups one after the other and blocks
 * in column order inside a group:
 *   Q4_1: d[16] f16 | m[16] f16 | q[4][16][4] bytes                           320 B
 *         byte (j, r, c) = row r's GGUF qs[4j + c]: low nibble = column 4j + c, high
 *         nibble = column 16 + 4j + c.
 *   Q8_0: d[16] f16 | q[8][16][4] int8, byte (j, r, c) = row r, column 4j + c    544 B
 * A 64-byte row (j) is what one dpbusd multiplies: 16 int32 lanes (output rows) of four
 * consecutive columns each. Q8_0's q[8][16][4] is exactly an AMX B tile (8 rows x 64 B);
 * Q4_1's nibbles split into one (low: tile rows 0-3, high: rows 4-7).
 */
INLINE int64_t block_bytes(int32_t kind) { return kind == 0 ? Q4A_BLOCK : Q8A_BLOCK; }

int64_t hearth_q8a_packed_bytes(int32_t kind, int64_t n, int64_t k) {
    return ((n + QG - 1) / QG) * (k / QK) * block_bytes(kind);
}

/* src: GGUF rows, row-major: Q4_1 (kind 0) 20 B per block (f16 d, f16 m, 16 B qs), Q8_0
 * (kind 1) 34 B per block (f16 d, 32 int8). */
void hearth_q8a_pack(int32_t kind, const uint8_t *src, int64_t n, int64_t k, uint8_t *dst) {
    const int64_t nb = k / QK, groups = (n + QG - 1) / QG, bb = block_bytes(kind);
    const int64_t raw = kind == 0 ? 20 : 34, row_bytes = nb * raw;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *out = dst + (g * nb + b) * bb;
            memset(out, 0, (size_t)bb);
            for (int r = 0; r < QG && g * QG + r < n; r++) {
                const uint8_t *blk = src + (g * QG + r) * row_bytes + b * raw;
                memcpy(out + 2 * r, blk, 2); /* d */
                if (kind == 0) {
                    memcpy(out + 32 + 2 * r, blk + 2, 2); /* m */
                    for (int i = 0; i < 16; i++) out[64 + (i / 4) * 64 + r * 4 + i % 4] = blk[4 + i];
                } else {
                    for (int i = 0; i < 32; i++) out[32 + (i / 4) * 64 + r * 4 + i % 4] = blk[2 + i];
                }
            }
        }
    }
}

/* ----------------------------------------------------------------- quantization */
/* AVX2 instructions only, so every variant runs this very code. */
static void quant_block(const float *x, int8_t *q, float *d_out, float *s_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    *d_out = d;
    if (d == 0.0f) {
        memset(q, 0, QK);
        *s_out = 0.0f;
        return;
    }
    const __m256 vd = _mm256_set1_ps(d), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i qi[4];
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], vd), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
        qi[i] = _mm256_cvtps_epi32(r); /* exact: r is already an integer */
        sum = _mm256_add_epi32(sum, qi[i]);
    }
    /* packs work per 128-bit lane: the permute puts the four 8-column runs back in order */
    const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *s_out = d * (float)_mm_cvtsi128_si32(s4);
}

/* q: [t, k] int8 rows; d, s: [t, k / 32]. x rows are `ldx` floats apart. */
void hearth_quantize_q8(const float *x, int64_t t, int64_t ldx, int64_t k, int8_t *q, float *d, float *s) {
    const int64_t nb = k / QK;
#pragma omp parallel for schedule(static) if (t * nb > 4096)
    for (int64_t i = 0; i < t * nb; i++) {
        const int64_t r = i / nb, b = i % nb;
        quant_block(x + r * ldx + b * QK, q + r * k + b * QK, d + i, s + i);
    }
}

/* Scratch of one call: q [tpad, k] | d [tpad, nb] | s [tpad, nb], tpad = t rounded up to
 * 16 (zero rows, so AMX tiles of 16 tokens never read past it). */
INLINE int64_t round16(int64_t v) { return (v + 15) & ~(int64_t)15; }
INLINE int64_t align64(int64_t v) { return (v + 63) & ~(int64_t)63; }

int64_t hearth_q8a_scratch_bytes(int64_t t, int64_t k) {
    const int64_t tp = round16(t);
    return align64(tp * k) + 2 * tp * (k / QK) * (int64_t)sizeof(float) + 64;
}

INLINE int32_t load32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---------------------------------------------------------- vector kernels (no AMX) */
/*
 * A register tile is VG groups (16 output rows each, lanes = rows) by NT tokens. Per
 * block, each (token, row) lane sums its 32 exact products in an int32, then folds the
 * block into its float accumulator with the formula at the top of the file.
 */
#ifdef __AVX512VNNI__
#define VG 2
#define VT 4
typedef __m512 vacc;

INLINE void vec_tile(const int kind, const int G, const int NT, const int8_t *q, int64_t k,
                     const float *dx, const float *sx, int64_t nb, const uint8_t *wg, int64_t gbytes,
                     vacc *out) {
    __m512 acc[VG][VT];
    const int64_t bb = block_bytes(kind);
#pragma GCC unroll 2
    for (int g = 0; g < G; g++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[g][t] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F), k80 = _mm512_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *xb = q + b * QK;
        __m512i is[VG][VT], corr[VG];
#pragma GCC unroll 2
        for (int g = 0; g < G; g++) {
            corr[g] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) is[g][t] = _mm512_setzero_si512();
        }
        if (kind == 0) {
            /* u4 weights (unsigned operand) x s8 activations (signed operand) */
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m512i lo[VG], hi[VG];
#pragma GCC unroll 2
                for (int g = 0; g < G; g++) {
                    const __m512i v = _mm512_loadu_si512(wg + g * gbytes + b * bb + 64 + 64 * j);
                    lo[g] = _mm512_and_si512(v, m4);
                    hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                }
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) {
                    const __m512i xl = _mm512_set1_epi32(load32(xb + t * k + 4 * j));
                    const __m512i xh = _mm512_set1_epi32(load32(xb + t * k + 16 + 4 * j));
#pragma GCC unroll 2
                    for (int g = 0; g < G; g++) {
                        is[g][t] = _mm512_dpbusd_epi32(is[g][t], lo[g], xl);
                        is[g][t] = _mm512_dpbusd_epi32(is[g][t], hi[g], xh);
                    }
                }
            }
        } else {
            /* s8 x s8: the activation is the unsigned operand, offset by +128 (q ^ 0x80),
             * and 128 * sum(q_w) (one dpbusd of 0x80 bytes by the weights) comes off. */
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                __m512i wv[VG];
#pragma GCC unroll 2
                for (int g = 0; g < G; g++) {
                    wv[g] = _mm512_loadu_si512(wg + g * gbytes + b * bb + 32 + 64 * j);
                    corr[g] = _mm512_dpbusd_epi32(corr[g], k80, wv[g]);
                }
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) {
                    const __m512i xu = _mm512_xor_si512(_mm512_set1_epi32(load32(xb + t * k + 4 * j)), k80);
#pragma GCC unroll 2
                    for (int g = 0; g < G; g++) is[g][t] = _mm512_dpbusd_epi32(is[g][t], xu, wv[g]);
                }
            }
        }
#pragma GCC unroll 2
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = wg + g * gbytes + b * bb;
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
            const __m512 mw = kind == 0 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                                        : _mm512_setzero_ps();
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const __m512i isum = kind == 0 ? is[g][t] : _mm512_sub_epi32(is[g][t], corr[g]);
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[t * nb + b]));
                acc[g][t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum), acc[g][t]);
                if (kind == 0) acc[g][t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[t * nb + b]), acc[g][t]);
            }
        }
    }
#pragma GCC unroll 2
    for (int g = 0; g < G; g++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) out[g * VT + t] = acc[g][t];
}

/* Stores token rows t0.. of groups g0.. (rows past n, i.e. a padded half group, skipped). */
INLINE void vec_store(const vacc *acc, int ng, int nt, int64_t g0, int64_t t0, int64_t n,
                      const float *bias, float *out, int64_t ldo) {
    for (int g = 0; g < ng; g++) {
        const int64_t row0 = (g0 + g) * QG;
        const __mmask16 mask = (n - row0) >= QG ? 0xFFFF : 0x00FF;
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + row0) : _mm512_setzero_ps();
        for (int t = 0; t < nt; t++) {
            const __m512 v = bias ? _mm512_add_ps(acc[g * VT + t], bv) : acc[g * VT + t];
            _mm512_mask_storeu_ps(out + (t0 + t) * ldo + row0, mask, v);
        }
    }
}
#else
/* AVX2 (also the avx512 build without VNNI): 8-lane halves of a group, one group per tile. */
#define VG 1
#ifdef __AVX512F__
#define VT 4 /* 32 vector registers */
#else
#define VT 2 /* 16 vector registers */
#endif
typedef __m256 vacc; /* out[(half) * VT + t] */

INLINE void vec_tile(const int kind, const int G, const int NT, const int8_t *q, int64_t k,
                     const float *dx, const float *sx, int64_t nb, const uint8_t *wg, int64_t gbytes,
                     vacc *out) {
    (void)G;
    (void)gbytes;
    __m256 acc[2][VT];
    const int64_t bb = block_bytes(kind);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[h][t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *xb = q + b * QK;
        const uint8_t *blk = wg + b * bb;
        __m256i is[2][VT];
        if (kind == 0) {
            /* maddubs: u4 x s8 pairs, |2 * 15 * 127| = 3810; eight of them summed in int16
             * stay under 30480 < 2^15, so neither the pairs nor the sums saturate. */
            __m256i s16[2][VT];
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) s16[h][t] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m256i lo[2], hi[2];
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 + 64 * j + 32 * h));
                    lo[h] = _mm256_and_si256(v, m4);
                    hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                }
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) {
                    const __m256i xl = _mm256_set1_epi32(load32(xb + t * k + 4 * j));
                    const __m256i xh = _mm256_set1_epi32(load32(xb + t * k + 16 + 4 * j));
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        s16[h][t] = _mm256_add_epi16(s16[h][t], _mm256_maddubs_epi16(lo[h], xl));
                        s16[h][t] = _mm256_add_epi16(s16[h][t], _mm256_maddubs_epi16(hi[h], xh));
                    }
                }
            }
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) is[h][t] = _mm256_madd_epi16(s16[h][t], ones);
        } else {
            /* s8 x s8 as |w| (unsigned) x sign(x, w): pairs <= 2 * 128 * 127 = 32512 (x is
             * never -128), widened to int32 at once. |-128| reads as 128 unsigned: exact. */
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) is[h][t] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                __m256i wv[2], aw[2];
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    wv[h] = _mm256_loadu_si256((const __m256i *)(blk + 32 + 64 * j + 32 * h));
                    aw[h] = _mm256_sign_epi8(wv[h], wv[h]);
                }
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) {
                    const __m256i xv = _mm256_set1_epi32(load32(xb + t * k + 4 * j));
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        const __m256i p = _mm256_maddubs_epi16(aw[h], _mm256_sign_epi8(xv, wv[h]));
                        is[h][t] = _mm256_add_epi32(is[h][t], _mm256_madd_epi16(p, ones));
                    }
                }
            }
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
            const __m256 mw = kind == 0 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)))
                                        : _mm256_setzero_ps();
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(dx[t * nb + b]));
                acc[h][t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(is[h][t]), acc[h][t]);
                if (kind == 0) acc[h][t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[t * nb + b]), acc[h][t]);
            }
        }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) out[h * VT + t] = acc[h][t];
}

INLINE void vec_store(const vacc *acc, int ng, int nt, int64_t g0, int64_t t0, int64_t n,
                      const float *bias, float *out, int64_t ldo) {
    (void)ng;
    for (int h = 0; h < 2; h++) {
        const int64_t row0 = g0 * QG + 8 * h;
        if (row0 >= n) break; /* the padded half of the last group */
        const __m256 bv = bias ? _mm256_loadu_ps(bias + row0) : _mm256_setzero_ps();
        for (int t = 0; t < nt; t++) {
            const __m256 v = bias ? _mm256_add_ps(acc[h * VT + t], bv) : acc[h * VT + t];
            _mm256_storeu_ps(out + (t0 + t) * ldo + row0, v);
        }
    }
}
#endif

#define VEC_CASE(KIND, G, NT) \
    vec_tile(KIND, G, NT, q, k, dx, sx, nb, wg, gbytes, acc); \
    break;
#define VEC_NT_SWITCH(KIND, G) \
    switch (nt) {              \
    case 1: VEC_CASE(KIND, G, 1) \
    case 2: VEC_CASE(KIND, G, 2) \
    case 3: VEC_CASE(KIND, G, (VT >= 3 ? 3 : 1)) \
    default: VEC_CASE(KIND, G, VT) \
    }

static void vec_tile_dispatch(int32_t kind, int ng, int nt, const int8_t *q, int64_t k, const float *dx,
                              const float *sx, int64_t nb, const uint8_t *wg, int64_t gbytes, vacc *acc) {
    if (kind == 0) {
        if (ng == VG) {
            VEC_NT_SWITCH(0, VG)
        } else {
            VEC_NT_SWITCH(0, 1)
        }
    } else {
        if (ng == VG) {
            VEC_NT_SWITCH(1, VG)
        } else {
            VEC_NT_SWITCH(1, 1)
        }
    }
}

static void vec_gemm(int32_t kind, const int8_t *q, const float *dx, const float *sx, int64_t t_count,
                     int64_t k, const uint8_t *w, int64_t n, const float *bias, float *out, int64_t ldo) {
    const int64_t nb = k / QK, groups = (n + QG - 1) / QG, gbytes = nb * block_bytes(kind);
    const int64_t tiles_g = (groups + VG - 1) / VG, tiles_t = (t_count + VT - 1) / VT;
    const int64_t items = tiles_g * tiles_t;
    int64_t chunk = items / ((int64_t)omp_get_max_threads() * 8);
    if (chunk < 1) chunk = 1;
    /* Dynamic chunks, as in hearth_cpu.c: API threads preempt engine threads on 2 cores. */
#pragma omp parallel for schedule(dynamic, chunk) collapse(2)
    for (int64_t pg = 0; pg < tiles_g; pg++) {
        for (int64_t tt = 0; tt < tiles_t; tt++) {
            const int64_t g0 = pg * VG, t0 = tt * VT;
            const int ng = (int)(groups - g0 < VG ? groups - g0 : VG);
            const int nt = (int)(t_count - t0 < VT ? t_count - t0 : VT);
            vacc acc[2 * VT];
            vec_tile_dispatch(kind, ng, nt, q + t0 * k, k, dx + t0 * nb, sx + t0 * nb, nb,
                              w + g0 * gbytes, gbytes, acc);
            vec_store(acc, ng, nt, g0, t0, n, bias, out, ldo);
        }
    }
}

/* -------------------------------------------------------------------- AMX tiles */
/*
 * A work item is (16 tokens, one group of 16 output rows): one 16 x 16 int32 C tile per
 * block, K = 32 (each block has its own scales, so every block's product is zeroed,
 * computed, stored and folded into float accumulators that stay in 16 zmm registers, with
 * exactly the vector kernels' formula). Two tile sets (C/A/B = tmm0-2 and tmm3-5)
 * alternate by block parity, and block b + 1's tiles are issued before block b is folded:
 * tile registers are not renamed, and the fold's vector loads then never wait on a tile
 * store just issued.
 * Q4_1: the signed activations are A, the unsigned nibbles B (tdpbsud); the item unpacks
 * its group's nibbles into B-tile bytes first. Q8_0: s8 x s8 directly (tdpbssd), B tiles
 * straight from the packed weight. Items run token tile by token tile, the groups inside:
 * a token tile's activations stay in L1 while the weights stream in order.
 */
static int amx_state; /* 0: not asked yet; 1: granted; < 0: -errno of the refusal */

#ifdef __AMX_INT8__
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux grants the tile data state only on request, once per process. */
static int amx_request(void) {
    int st = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (st != 0) return st;
    unsigned long bitmask = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0)
        st = -(errno ? errno : EPERM);
    else if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bitmask) != 0 || !(bitmask & (1UL << XFEATURE_XTILEDATA)))
        st = -EPERM;
    else
        st = 1;
    __atomic_store_n(&amx_state, st, __ATOMIC_RELEASE);
    return st;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

static void amx_config(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int set = 0; set < 6; set += 3) {
        c.rows[set] = 16, c.colsb[set] = 64;         /* C: 16 tokens x 16 int32 */
        c.rows[set + 1] = 16, c.colsb[set + 1] = QK; /* A: 16 tokens x 32 int8 */
        c.rows[set + 2] = 8, c.colsb[set + 2] = 64;  /* B: 8 x (16 rows x 4 int8) */
    }
    _tile_loadconfig(&c);
}

/* Block b's product into tile set 0 or 1, stored to c (16 x 16 int32). */
#define AMX_BLOCK(KIND, TC, TA, TB, b, c)                          \
    do {                                                           \
        _tile_loadd(TA, q + (b) * QK, k);                          \
        if (KIND == 0)                                             \
            _tile_loadd(TB, ub + (b) * 512, 64);                   \
        else                                                       \
            _tile_loadd(TB, wg + (b) * Q8A_BLOCK + 32, 64);        \
        _tile_zero(TC);                                            \
        if (KIND == 0)                                             \
            _tile_dpbsud(TC, TA, TB);                              \
        else                                                       \
            _tile_dpbssd(TC, TA, TB);                              \
        _tile_stored(TC, c, 64);                                   \
    } while (0)

/* Folds block b's tile c into acc. */
INLINE void amx_fold(const int kind, __m512 *acc, const int32_t *c, const uint8_t *blk, const float *dx,
                     const float *sx, int64_t nb) {
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const __m512 mw = kind == 0 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                                : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nb]));
        acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r)), acc[r]);
        if (kind == 0) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * nb]), acc[r]);
    }
}

/* One item: tokens of q/dx/sx (16 rows, zero padded), group wg; acc[r] = token r's 16 rows. */
INLINE void amx_item(const int kind, const int8_t *q, const float *dx, const float *sx, int64_t k, int64_t nb,
                     const uint8_t *wg, uint8_t *ub, int32_t *cbuf, __m512 *acc) {
    const int64_t bb = block_bytes(kind);
    int32_t *c0 = cbuf, *c1 = cbuf + 256;
    if (kind == 0) { /* nibbles -> B-tile bytes: low = tile rows 0-3, high = rows 4-7 */
        const __m512i m4 = _mm512_set1_epi8(0x0F);
        for (int64_t b = 0; b < nb; b++)
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512(wg + b * Q4A_BLOCK + 64 + 64 * j);
                _mm512_store_si512(ub + b * 512 + 64 * j, _mm512_and_si512(v, m4));
                _mm512_store_si512(ub + b * 512 + 64 * (4 + j), _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
            }
    }
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    AMX_BLOCK(kind, 0, 1, 2, 0, c0);
    for (int64_t b = 0; b < nb; b += 2) {
        if (b + 1 < nb) AMX_BLOCK(kind, 3, 4, 5, b + 1, c1);
        amx_fold(kind, acc, c0, wg + b * bb, dx + b, sx + b, nb);
        if (b + 1 < nb) {
            if (b + 2 < nb) AMX_BLOCK(kind, 0, 1, 2, b + 2, c0);
            amx_fold(kind, acc, c1, wg + (b + 1) * bb, dx + b + 1, sx + b + 1, nb);
        }
    }
}

/* Returns 0 (nothing computed) if its per-thread buffers cannot be allocated. */
static int amx_gemm(int32_t kind, const int8_t *q, const float *dx, const float *sx, int64_t t_count,
                    int64_t k, const uint8_t *w, int64_t n, const float *bias, float *out, int64_t ldo) {
    const int64_t nb = k / QK, groups = (n + QG - 1) / QG, gbytes = nb * block_bytes(kind);
    const int64_t tiles_t = (t_count + 15) / 16, items = groups * tiles_t;
    const int threads = omp_get_max_threads();
    int64_t chunk = items / ((int64_t)threads * 8);
    if (chunk < 1) chunk = 1;
    /* per thread: 2 tile-store buffers (2 KB) | the unpacked Q4_1 nibbles of a group */
    const int64_t per_thread = 2048 + (kind == 0 ? nb * 512 : 0);
    uint8_t *buffers = (uint8_t *)aligned_alloc(64, (size_t)(per_thread * threads));
    if (!buffers) return 0;
#pragma omp parallel num_threads(threads)
    {
        amx_config(); /* tile configuration is per thread */
        int32_t *cbuf = (int32_t *)(buffers + per_thread * omp_get_thread_num());
        uint8_t *ub = (uint8_t *)cbuf + 2048;
#pragma omp for schedule(dynamic, chunk) collapse(2)
        for (int64_t tt = 0; tt < tiles_t; tt++) {
            for (int64_t g = 0; g < groups; g++) {
                const int64_t t0 = 16 * tt, row0 = g * QG;
                __m512 acc[16];
                if (kind == 0)
                    amx_item(0, q + t0 * k, dx + t0 * nb, sx + t0 * nb, k, nb, w + g * gbytes, ub, cbuf, acc);
                else
                    amx_item(1, q + t0 * k, dx + t0 * nb, sx + t0 * nb, k, nb, w + g * gbytes, ub, cbuf, acc);
                const __mmask16 mask = (n - row0) >= QG ? 0xFFFF : 0x00FF;
                const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + row0) : _mm512_setzero_ps();
                for (int r = 0; r < 16 && t0 + r < t_count; r++)
                    _mm512_mask_storeu_ps(out + (t0 + r) * ldo + row0, mask,
                                          bias ? _mm512_add_ps(acc[r], bv) : acc[r]);
            }
        }
        _tile_release();
    }
    free(buffers);
    return 1;
}
#endif

/* ------------------------------------------------------------------------- entry */

/* Which integer path this build has: 0 = AVX2 maddubs, 1 = AVX512-VNNI, 2 = VNNI + AMX. */
int hearth_q8a_isa(void) {
#if defined(__AMX_INT8__)
    return 2;
#elif defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

/* AMX availability, requesting the tile state if not done yet: 1 = usable, 0 = not in
 * this build, < 0 = -errno of the kernel's refusal (the VNNI kernels run instead). */
int hearth_q8a_amx_status(void) {
#ifdef __AMX_INT8__
    return amx_request();
#else
    return 0;
#endif
}

/*
 * out[t, n] = x[t, :] . W[n, :] (+ bias[n]) with x quantized per token and block (see the
 * top of the file); kind 0 = Q4_1, 1 = Q8_0; w packed by hearth_q8a_pack; out rows `ldo`
 * floats apart; scratch of hearth_q8a_scratch_bytes(t, k) bytes, 64-byte aligned.
 * amx_min_t: calls of at least this many tokens use AMX tiles where the build and the
 * host allow (<= 0: the built-in default). Every choice gives the same bits.
 */
void hearth_q8a_gemm(int32_t kind, const float *x, int64_t t, int64_t ldx, int64_t k, const uint8_t *w,
                     int64_t n, const float *bias, float *out, int64_t ldo, uint8_t *scratch,
                     int64_t amx_min_t) {
    if (t <= 0) return;
    const int64_t nb = k / QK, tp = round16(t);
    int8_t *q = (int8_t *)scratch;
    float *dx = (float *)(scratch + align64(tp * k));
    float *sx = dx + tp * nb;
    hearth_quantize_q8(x, t, ldx, k, q, dx, sx);
    if (tp > t) {
        memset(q + t * k, 0, (size_t)((tp - t) * k));
        memset(dx + t * nb, 0, (size_t)((tp - t) * nb) * sizeof(float));
        memset(sx + t * nb, 0, (size_t)((tp - t) * nb) * sizeof(float));
    }
#ifdef __AMX_INT8__
    if (t >= (amx_min_t > 0 ? amx_min_t : Q8A_AMX_MIN_T) && amx_request() == 1 &&
        amx_gemm(kind, q, dx, sx, t, k, w, n, bias, out, ldo))
        return;
#else
    (void)amx_min_t;
    (void)amx_state;
#endif
    vec_gemm(kind, q, dx, sx, t, k, w, n, bias, out, ldo);
}
