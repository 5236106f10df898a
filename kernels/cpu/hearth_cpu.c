/*
 * hearth's CPU kernels: the fast path of the engine on x86 (AVX2 + FMA + F16C; the same
 * source is also built for AVX-512 hosts, where the compiler gets 32 vector registers).
 *
 * Why plain C behind ctypes and not a torch extension: it builds in a second with the
 * system compiler (no torch headers, no ninja), and it links the same `libgomp.so.1`
 * that torch already loaded, so its OpenMP threads are torch's threads (no second pool
 * spinning against the first on a two-core host).
 *
 * Precision contract (docs/performance.md):
 *  - Linear layers read the GGUF file's own Q4_1 / Q8_0 blocks. Each weight is rebuilt
 *    exactly as gguf-py's dequantizer does (Q4_1: d*q + m, Q8_0: d*q, float32, two
 *    roundings), and products are accumulated in float32: the same function as the
 *    dequantized float32 model, up to the order of the sums.
 *  - Attention reads a float32, float16 or int8 KV cache, or float16 keys with int8 values
 *    (`hearth_paged_attention[_f16|_i8|_f16_i8]`): a float16 cache holds each value rounded
 *    once to nearest-even (saturating at +-65504), widened exactly on load; an int8 cache
 *    holds each (slot, kv head) row as int8 with its float32 scale; scores, softmax and
 *    value sums are float32 in every case.
 *  - Every result of a token depends only on that token (and, for attention, on its own
 *    sequence's cache): no kernel splits a sum differently by batch size, chunking or
 *    thread count. A request's output therefore never changes with load.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "hearth_kv.h"

#define Q4_BLOCK 32
#define GROUP 8 /* output rows per packed group: one AVX2 lane each */
#define MOE_MAX_EXPERTS 1024 /* experts a router op takes (ops.moe_block checks) */

/* malloc for the buffers a kernel cannot do without: a kernel that returned without its
 * output would leave the caller's buffer as it was (a step of garbage logits, silently), so
 * the process stops here, loudly, and the server restarts its engine. Buffers with a slower
 * path to fall back on (the bfloat16 and long-run attention paths) check and fall back
 * instead. */
static void *alloc_or_die(size_t bytes, const char *what) {
    void *p = malloc(bytes);
    if (!p) {
        fprintf(stderr, "hearth kernels: out of memory: %zu bytes for %s\n", bytes, what);
        abort();
    }
    return p;
}

/* -------------------------------------------------------------------------- packing */
/*
 * Packed layout of an [N, K] weight (N % 8 == 0, K % 32 == 0), group g = rows 8g..8g+7,
 * block b = columns 32b..32b+31:
 *   Q4_1: d[8] f16 | m[8] f16 | q[16][8] bytes      (byte (j, r) = row r's GGUF qs[j]:
 *         low nibble = column j, high nibble = column j + 16)            160 B / block
 *   Q8_0: d[8] f16 | q[32][8] int8                                       272 B / block
 * Groups are stored one after the other, blocks in column order inside a group.
 */
int64_t hearth_q4_1_packed_bytes(int64_t n, int64_t k) { return (n / GROUP) * (k / Q4_BLOCK) * 160; }
int64_t hearth_q8_0_packed_bytes(int64_t n, int64_t k) { return (n / GROUP) * (k / Q4_BLOCK) * 272; }

/* 16 bytes at `at` of each of 8 rows -> 16 columns of 8 (out[8 j + r] = rows[r][at + j]):
 * the byte transposition of packing, in three rounds of unpacks (a scalar scatter was
 * a tenth of a big model's start). */
static inline void transpose_8x16(const uint8_t *const rows[GROUP], int at, uint8_t *out) {
    __m128i r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm_loadu_si128((const __m128i *)(rows[i] + at));
    for (int i = 0; i < 4; i++) { /* rows 2i, 2i+1 interleaved: columns 0-7, 8-15 */
        t[2 * i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) { /* rows 4i..4i+3: columns 0-3, 4-7, 8-11, 12-15 */
        u[4 * i] = _mm_unpacklo_epi16(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm_unpackhi_epi16(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm_unpacklo_epi16(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm_unpackhi_epi16(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) { /* all 8 rows: columns 4i, 4i+1 | 4i+2, 4i+3 */
        _mm_storeu_si128((__m128i *)(out + 32 * i), _mm_unpacklo_epi32(u[i], u[4 + i]));
        _mm_storeu_si128((__m128i *)(out + 32 * i + 16), _mm_unpackhi_epi32(u[i], u[4 + i]));
    }
}

/* One packed block from the 8 rows' blocks of the same columns (`blk[r]`: row r's GGUF
 * block as stored). */
static inline void pack_q4_1_block(const uint8_t *const blk[GROUP], uint8_t *out) {
    for (int r = 0; r < GROUP; r++) {
        memcpy(out + 2 * r, blk[r], 2);          /* d */
        memcpy(out + 16 + 2 * r, blk[r] + 2, 2); /* m */
    }
    transpose_8x16(blk, 4, out + 32);
}

static inline void pack_q8_0_block(const uint8_t *const blk[GROUP], uint8_t *out) {
    for (int r = 0; r < GROUP; r++) memcpy(out + 2 * r, blk[r], 2);
    transpose_8x16(blk, 2, out + 16);
    transpose_8x16(blk, 18, out + 16 + 128);
}

/* src: GGUF Q4_1 rows, 20 bytes per block (f16 d, f16 m, 16 bytes qs), row-major. */
void hearth_pack_q4_1(const uint8_t *src, int64_t n, int64_t k, uint8_t *dst) {
    const int64_t nb = k / Q4_BLOCK;
    const int64_t row_bytes = nb * 20;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n / GROUP; g++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk[GROUP];
            for (int r = 0; r < GROUP; r++) blk[r] = src + (g * GROUP + r) * row_bytes + b * 20;
            pack_q4_1_block(blk, dst + (g * nb + b) * 160);
        }
    }
}

/* src: GGUF Q8_0 rows, 34 bytes per block (f16 d, 32 int8), row-major. */
void hearth_pack_q8_0(const uint8_t *src, int64_t n, int64_t k, uint8_t *dst) {
    const int64_t nb = k / Q4_BLOCK;
    const int64_t row_bytes = nb * 34;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n / GROUP; g++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk[GROUP];
            for (int r = 0; r < GROUP; r++) blk[r] = src + (g * GROUP + r) * row_bytes + b * 34;
            pack_q8_0_block(blk, dst + (g * nb + b) * 272);
        }
    }
}

/*
 * 16-bit weights (F16 / BF16: a checkpoint's own weights, or a GGUF's F16 / BF16 tensors):
 *   W16: w[32][8] uint16, column j of the block = the 8 rows' values     512 B / block
 * src: row-major uint16 [n, k].
 */
int64_t hearth_w16_packed_bytes(int64_t n, int64_t k) { return (n / GROUP) * (k / Q4_BLOCK) * 512; }

void hearth_pack_w16(const uint16_t *src, int64_t n, int64_t k, uint16_t *dst) {
    const int64_t nb = k / Q4_BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n / GROUP; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint16_t *out = dst + (g * nb + b) * 256;
            for (int r = 0; r < GROUP; r++) {
                const uint16_t *row = src + (g * GROUP + r) * k + b * Q4_BLOCK;
                for (int j = 0; j < Q4_BLOCK; j++) out[j * GROUP + r] = row[j];
            }
        }
    }
}

/* ------------------------------------------------------------------ GGUF re-layout */
/*
 * GGUF formats without a GEMM of their own, as the blocks above read them
 * (engine/layers/gguf_relayout.py says why each is what it is). Each function is
 * bitwise the numpy it replaces (tests/kernels/test_relayout.py): a 7.5 B Q4_K_M file
 * took a minute of numpy at start-up. Layouts are ggml's (ggml-common.h).
 */
static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

static inline void put_f16(uint8_t *p, float v) {
    const uint16_t h = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    memcpy(p, &h, sizeof h);
}

/* Sub-block j's 6-bit scale and min in a Q4_K / Q5_K block's 12 bytes (get_scale_min_k4). */
static inline void k4_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K (144 B per 256) -> 8 Q4_1 blocks (20 B): scale d*sc and offset -(dmin*m), each
 * rounded once to float16 (returns how many exceed float16's range: those became inf);
 * the nibbles as stored (sub-block 2c: the low nibbles of 32-byte
 * chunk c, 2c + 1: the high ones; Q4_1 holds element j low and j + 16 high). */
static inline void q4_k_sub_scales(const uint8_t *s, int j, float *scale, float *offset) {
    int sc, m;
    k4_scale_min(j, s + 4, &sc, &m);
    *scale = f16_at(s) * (float)sc;
    *offset = -(f16_at(s + 2) * (float)m);
}

static inline int q4_k_overflows(float scale, float offset) { /* either rounds to float16 inf */
    return fabsf(scale) >= 65520.0f || fabsf(offset) >= 65520.0f;
}

static int relay_q4_k_block(const uint8_t *s, uint8_t *dst) {
    int overflowed = 0;
    for (int j = 0; j < 8; j++) {
        uint8_t *o = dst + j * 20;
        float scale, offset;
        q4_k_sub_scales(s, j, &scale, &offset);
        put_f16(o, scale);
        put_f16(o + 2, offset);
        overflowed += q4_k_overflows(scale, offset);
        const uint8_t *q = s + 16 + (j / 2) * 32;
        const __m128i low4 = _mm_set1_epi8(0x0F), shift = _mm_cvtsi32_si128((j & 1) * 4);
        const __m128i lo = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)q), shift), low4);
        const __m128i hi = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(q + 16)), shift), low4);
        _mm_storeu_si128((__m128i *)(o + 4), _mm_or_si128(lo, _mm_slli_epi16(hi, 4)));
    }
    return overflowed;
}

/* Q4_0 (18 B: f16 d, 16 B nibbles) -> the Q4_1 block of the same values: d, m = -8*d
 * (exact in float16 unless past its range, or NaN: counted, as `relay_q4_k_block` counts), the
 * nibbles as stored (both formats hold element j low and j + 16 high). */
static inline int q4_0_overflows(float m) { return !(fabsf(m) < 65520.0f); /* inf, or NaN from a NaN d */ }

static int relay_q4_0_block(const uint8_t *s, uint8_t *o) {
    const float m = -8.0f * f16_at(s);
    memcpy(o, s, 2);
    put_f16(o + 2, m);
    memcpy(o + 4, s + 2, 16);
    return q4_0_overflows(m);
}

/* Q6_K (210 B per 256: ql[128], qh[64], int8 scales[16], d) -> float32, d*sc*(q - 32):
 * every product exact in float32 (11 + 7 + 6 bits), so any order gives gguf-py's values. */
static void dequant_q6_k_block(const uint8_t *s, float *y) {
    const uint8_t *ql = s, *qh = s + 128;
    const int8_t *sc = (const int8_t *)(s + 192);
    const float d = f16_at(s + 208);
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
    for (int n = 0; n < 2; n++) { /* 128 values: ql[64], qh[32], 8 scales of 16 values */
        const __m256i a = _mm256_loadu_si256((const __m256i *)ql);
        const __m256i b = _mm256_loadu_si256((const __m256i *)(ql + 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
        __m256i q[4]; /* values l, l + 32, l + 64, l + 96 of l = 0..31, each 6 bits - 32 */
        for (int i = 0; i < 4; i++) {
            const __m256i lo = _mm256_and_si256(i & 2 ? _mm256_srli_epi16(i & 1 ? b : a, 4) : i & 1 ? b : a, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(h, 2 * i), low2);
            q[i] = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), bias);
        }
        for (int i = 0; i < 4; i++) {
            for (int e = 0; e < 4; e++) { /* 8 values at 32 i + 8 e: scale 2 i + e / 2 */
                const __m128i bytes = e < 2 ? _mm256_castsi256_si128(q[i]) : _mm256_extracti128_si256(q[i], 1);
                const __m128i eight = (e & 1) ? _mm_srli_si128(bytes, 8) : bytes;
                const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
                const float ds = d * (float)sc[2 * i + e / 2];
                _mm256_storeu_ps(y + 32 * i + 8 * e, _mm256_mul_ps(_mm256_set1_ps(ds), v));
            }
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

/* Q4_K (no qh) and Q5_K (176 B per 256: d, dmin, scales[12], qh[32], qs[128]) -> float32,
 * (d*sc)*q - dmin*m: d*sc*q is exact (11 + 6 + 5 bits), so the one rounding is the
 * subtraction's, as in gguf-py (with or without a fused multiply-add). */
static void dequant_q45_k_block(const uint8_t *s, const uint8_t *qh, const uint8_t *qs, float *y) {
    const float d = f16_at(s), dmin = f16_at(s + 2);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k4_scale_min(j, s + 4, &sc, &m);
        const float ds = d * (float)sc, dm = dmin * (float)m;
        const uint8_t *q = qs + (j / 2) * 32;
        const int shift = (j & 1) * 4;
        for (int l = 0; l < 32; l++) {
            const int v = ((q[l] >> shift) & 0xF) | (qh ? ((qh[l] >> j) & 1) << 4 : 0);
            y[j * 32 + l] = ds * (float)v - dm;
        }
    }
}

/* 32 floats -> one Q8_0 block (34 B) exactly as gguf-py (and ggml's reference) quantize:
 * d = amax / 127, q = round-half-away(x * (1 / d)), d stored as float16. Eight lanes at a
 * time with the scalar code's operations one for one (gcc left the scalar loops
 * unvectorized: a third of a K-quant model's start): |x| by masking the sign, a NaN value
 * skipped by the maximum as the scalar `a > amax` skipped it (`max_ps` returns its second
 * operand on NaN), gguf-py's np_roundf as floor(a) + floor(2 (a - floor(a))) with x's sign,
 * and each int8 the low byte of the truncated int32, as the scalar cast took it. */
static void quantize_q8_0_block(const float *v, uint8_t *o) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 x[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        top = _mm256_max_ps(_mm256_and_ps(x[i], abs_mask), top);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    const float id = d == 0.0f ? 0.0f : 1.0f / d;
    put_f16(o, d);
    const __m256 vid = _mm256_set1_ps(id), two = _mm256_set1_ps(2.0f);
    int32_t q[32];
    for (int i = 0; i < 4; i++) {
        const __m256 y = _mm256_mul_ps(x[i], vid), a = _mm256_and_ps(y, abs_mask);
        const __m256 f = _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        const __m256 half = _mm256_round_ps(_mm256_mul_ps(two, _mm256_sub_ps(a, f)),
                                            _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        const __m256 r = _mm256_or_ps(_mm256_and_ps(_mm256_add_ps(f, half), abs_mask),
                                      _mm256_andnot_ps(abs_mask, y));
        _mm256_storeu_si256((__m256i *)(q + 8 * i), _mm256_cvttps_epi32(r));
    }
    for (int j = 0; j < 32; j++) o[2 + j] = (uint8_t)q[j];
}

void hearth_quantize_q8_0(const float *x, int64_t nblocks, uint8_t *dst) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; b++) quantize_q8_0_block(x + b * 32, dst + b * 34);
}

/* One block of a legacy format (32 values: 0: Q4_0, 1: Q4_1, 2: Q5_0, 3: Q5_1, 8: Q8_0)
 * -> float32 as gguf-py writes it: d*q (+ m), every product d*q exact in float32 (11-bit
 * d, at most 8-bit q), so the one rounding is the offset's, as in numpy. */
static void dequant_legacy_block(int kind, const uint8_t *s, float *y) {
    const float d = f16_at(s);
    if (kind == 8) {
        const int8_t *q = (const int8_t *)(s + 2);
        for (int l = 0; l < 32; l++) y[l] = (float)q[l] * d;
        return;
    }
    const int with_min = kind & 1, five = kind >= 2;
    const float m = with_min ? f16_at(s + 2) : 0.0f;
    uint32_t qh = 0;
    if (five) memcpy(&qh, s + 2 + 2 * with_min, sizeof qh);
    const uint8_t *qs = s + 2 + 2 * with_min + 4 * five;
    const int bias = with_min ? 0 : five ? 16 : 8;
    for (int l = 0; l < 32; l++) {
        const int lo = l < 16 ? qs[l] & 0xF : qs[l - 16] >> 4;
        const int q = (lo | (int)(((qh >> l) & 1) << 4)) - bias;
        y[l] = with_min ? d * (float)q + m : d * (float)q;
    }
}

/* GGUF blocks -> float32, bitwise gguf-py's `dequantize` (tests/kernels/test_relayout.py):
 * kinds 0-3 and 8 as `dequant_legacy_block` (32 values a block), 4: Q4_K, 5: Q5_K, 6: Q6_K
 * (256 a block). gguf-py's numpy took ~1 s per 100 M weights on one thread, and an exact
 * (float32) start of a GGUF dequantizes every weight. */
static inline int64_t gguf_block_bytes(int64_t kind) {
    return kind == 4 ? 144 : kind == 5 ? 176 : kind == 6 ? 210
         : kind == 8 ? 34 : kind == 0 ? 18 : kind == 1 ? 20 : kind == 2 ? 22 : 24;
}

static inline int64_t gguf_block_values(int64_t kind) { return kind >= 4 && kind <= 6 ? 256 : 32; }

static inline void dequant_block(int64_t kind, const uint8_t *s, float *y) {
    if (kind == 6)
        dequant_q6_k_block(s, y);
    else if (kind == 5)
        dequant_q45_k_block(s, s + 16, s + 48, y);
    else if (kind == 4)
        dequant_q45_k_block(s, NULL, s + 16, y);
    else
        dequant_legacy_block((int)kind, s, y);
}

void hearth_dequantize_gguf(int64_t kind, const uint8_t *src, int64_t nblocks, float *dst) {
    const int64_t size = gguf_block_bytes(kind), values = gguf_block_values(kind);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; b++) dequant_block(kind, src + b * size, dst + b * values);
}

/* K-quant super-blocks (kind 4: Q4_K, 5: Q5_K, 6: Q6_K) -> 8 Q8_0 blocks each: the
 * file's values (bitwise gguf-py's dequantization) quantized as `hearth_quantize_q8_0`,
 * without a float32 copy of the tensor in between. */
static void requant_k_block(int64_t kind, const uint8_t *s, uint8_t *dst) {
    float y[256];
    dequant_block(kind, s, y);
    for (int j = 0; j < 8; j++) quantize_q8_0_block(y + j * 32, dst + j * 34);
}

void hearth_requant_k_q8_0(int64_t kind, const uint8_t *src, int64_t nsuper, uint8_t *dst) {
    const int64_t size = gguf_block_bytes(kind);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nsuper; b++) requant_k_block(kind, src + b * size, dst + b * 8 * 34);
}

/* One stored block of `kind` as the Q4_1 (`q8` 0: kind 0 Q4_0, 4 Q4_K) or Q8_0 (`q8` 1:
 * the K-quants, requantized) blocks of its values; returns how many Q4_1 scales passed
 * float16's range. */
static int relay_block(int64_t kind, int q8, const uint8_t *s, uint8_t *dst) {
    if (q8) {
        requant_k_block(kind, s, dst);
        return 0;
    }
    return kind == 4 ? relay_q4_k_block(s, dst) : relay_q4_0_block(s, dst);
}

/* Q4_0 (kind 0) or Q4_K (kind 4) blocks -> the Q4_1 blocks of the same values
 * (`relay_q4_0_block`, `relay_q4_k_block`); returns how many scales passed float16's range
 * (those became inf). */
int64_t hearth_relay_q4_1(int64_t kind, const uint8_t *src, int64_t nblocks, uint8_t *dst) {
    const int64_t size = gguf_block_bytes(kind), out = gguf_block_values(kind) / Q4_BLOCK * 20;
    int64_t overflowed = 0;
#pragma omp parallel for schedule(static) reduction(+ : overflowed)
    for (int64_t b = 0; b < nblocks; b++) overflowed += relay_block(kind, 0, src + b * size, dst + b * out);
    return overflowed;
}

/* How many scales of `nblocks` Q4_0 (kind 0) or Q4_K (kind 4) blocks would pass float16's
 * range re-laid as Q4_1 (what `relay_q4_0_block` / `relay_q4_k_block` count), without
 * re-laying them: decides a layer's kind before it is packed. */
int64_t hearth_q4_1_overflows(int64_t kind, const uint8_t *src, int64_t nblocks) {
    int64_t overflowed = 0;
#pragma omp parallel for schedule(static) reduction(+ : overflowed)
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *s = src + b * gguf_block_bytes(kind);
        if (kind == 0) {
            overflowed += q4_0_overflows(-8.0f * f16_at(s));
            continue;
        }
        for (int j = 0; j < 8; j++) {
            float scale, offset;
            q4_k_sub_scales(s, j, &scale, &offset);
            overflowed += q4_k_overflows(scale, offset);
        }
    }
    return overflowed;
}

/* Rows stored in a GGUF format packed straight into the kernels' layout, re-laid block by
 * block on the way (`engine/layers/gguf_relayout.py` says why each is what it is):
 *   Q4_1 layout <- 1: Q4_1 as stored, 0: Q4_0 and 4: Q4_K (`relay_q4_0_block`,
 *                  `relay_q4_k_block`; returns how many scales overflowed float16),
 *   Q8_0 layout <- 8: Q8_0 as stored, 4 / 5 / 6: Q4_K / Q5_K / Q6_K requantized as
 *                  `hearth_requant_k_q8_0`.
 * Bitwise the re-layout followed by `hearth_pack_*`, without the re-laid copy of the
 * tensor in between: a 7.4 B Q4_K_M model's start wrote every weight twice more
 * (re-laid, then joined with its layer's other parts) before packing it. */
static int64_t pack_from(int64_t kind, int q8, const uint8_t *src, int64_t n, int64_t k, uint8_t *dst) {
    const int64_t nb = k / Q4_BLOCK, span = gguf_block_values(kind) / Q4_BLOCK; /* blocks per stored one */
    const int64_t stored = gguf_block_bytes(kind), row_bytes = nb / span * stored;
    const int64_t laid_bytes = q8 ? 34 : 20, packed_bytes = q8 ? 272 : 160;
    const int as_stored = kind == (q8 ? 8 : 1);
    int64_t overflowed = 0;
#pragma omp parallel for schedule(static) reduction(+ : overflowed)
    for (int64_t g = 0; g < n / GROUP; g++) {
        uint8_t laid[GROUP][8 * 34];
        for (int64_t s = 0; s < nb / span; s++) {
            const uint8_t *blk[GROUP];
            for (int r = 0; r < GROUP; r++) {
                const uint8_t *in = src + (g * GROUP + r) * row_bytes + s * stored;
                if (as_stored) {
                    blk[r] = in;
                    continue;
                }
                overflowed += relay_block(kind, q8, in, laid[r]);
                blk[r] = laid[r];
            }
            for (int64_t j = 0; j < span; j++) {
                uint8_t *out = dst + (g * nb + s * span + j) * packed_bytes;
                if (q8)
                    pack_q8_0_block(blk, out);
                else
                    pack_q4_1_block(blk, out);
                for (int r = 0; r < GROUP; r++) blk[r] += laid_bytes;
            }
        }
    }
    return overflowed;
}

int64_t hearth_pack_q4_1_from(int64_t kind, const uint8_t *src, int64_t n, int64_t k, uint8_t *dst) {
    return pack_from(kind, 0, src, n, k, dst);
}

void hearth_pack_q8_0_from(int64_t kind, const uint8_t *src, int64_t n, int64_t k, uint8_t *dst) {
    pack_from(kind, 1, src, n, k, dst);
}

static inline float hsum(__m256 v);

/* ------------------------------------------------------------------ quantized GEMM */
/*
 * out[t, n] = sum_k x[t, k] * W[n, k] (+ bias[n]) for T tokens. Lanes are output rows, so
 * each (token, row) is one lane accumulating its products in column order: the result of
 * a token does not depend on how many tokens share the call. Token tiles of up to 8 reuse
 * each rebuilt weight vector from registers.
 */
#define TILE 5 /* tokens per register tile */
#ifndef Q4_SINGLE_GROUPS
#define Q4_SINGLE_GROUPS 4 /* groups per tile for a single token (2 to 4) */
#endif
#if Q4_SINGLE_GROUPS < 2 || Q4_SINGLE_GROUPS > 4
#error "Q4_SINGLE_GROUPS must be 2, 3 or 4 (Q4_TILES has single-token tiles up to four groups)"
#endif

static inline __m256 bcast(const float *p) { return _mm256_broadcast_ss(p); }

/*
 * A register tile is G groups (8 output rows each; G = 2, or 1 for an odd last group) by
 * NT tokens: every broadcast input feeds G FMAs. Per block, each lane sums q * x over the
 * block's 32 columns with the raw quants (column j, then j + 16, for j = 0..15), then
 * folds in the scale and min once: acc += d * sum(q x) + m * sum(x). The weights are
 * exactly the file's (d q + m); only the rounding of the sums differs from the dequantized
 * product, and the per-lane arithmetic is the same for every G, NT and token count.
 */
#define Q4_TILE_FN(G, NT)                                                                     \
    static void q4_tile_##G##_##NT(const float *x, int64_t ldx, int64_t nb, const uint8_t *wg, \
                                   int64_t group_bytes, const float *xsum, __m256 *out) {     \
        __m256 acc[G][NT];                                                                    \
        _Pragma("GCC unroll 4") for (int g = 0; g < G; g++)                                  \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) acc[g][t] = _mm256_setzero_ps(); \
        const __m256i low = _mm256_set1_epi32(0xF);                                          \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            const float *xb = x + b * Q4_BLOCK;                                               \
            __m256 s[G][NT];                                                                  \
            _Pragma("GCC unroll 4") for (int g = 0; g < G; g++)                              \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) s[g][t] = _mm256_setzero_ps(); \
            for (int j = 0; j < 16; j++) {                                                    \
                __m256 w0[G], w1[G];                                                          \
                _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) {                        \
                    const uint8_t *q = wg + g * group_bytes + b * 160 + 32 + j * GROUP;       \
                    const __m256i qi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q)); \
                    w0[g] = _mm256_cvtepi32_ps(_mm256_and_si256(qi, low));                    \
                    w1[g] = _mm256_cvtepi32_ps(_mm256_srli_epi32(qi, 4));                     \
                }                                                                             \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                        \
                    const __m256 x0 = bcast(xb + t * ldx + j);                                \
                    const __m256 x1 = bcast(xb + t * ldx + j + 16);                           \
                    _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) {                    \
                        s[g][t] = _mm256_fmadd_ps(x0, w0[g], s[g][t]);                        \
                        s[g][t] = _mm256_fmadd_ps(x1, w1[g], s[g][t]);                        \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
            _Pragma("GCC unroll 4") for (int g = 0; g < G; g++) {                            \
                const uint8_t *blk = wg + g * group_bytes + b * 160;                          \
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));     \
                const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))); \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                        \
                    acc[g][t] = _mm256_fmadd_ps(s[g][t], d, acc[g][t]);                       \
                    acc[g][t] = _mm256_fmadd_ps(m, bcast(xsum + t * nb + b), acc[g][t]);      \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 4") for (int g = 0; g < G; g++)                                  \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) out[g * TILE + t] = acc[g][t]; \
    }

/* Q8_0 (the tied LM head): one group per tile, two FMA chains per token (even and odd
 * columns), which measured faster than two groups for the small token counts it sees. */
#define Q8_TILE_FN(G, NT)                                                                     \
    static void q8_tile_##G##_##NT(const float *x, int64_t ldx, int64_t nb, const uint8_t *wg, \
                                   int64_t group_bytes, const float *xsum, __m256 *out) {     \
        (void)xsum;                                                                           \
        (void)group_bytes;                                                                    \
        __m256 acc[NT];                                                                       \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();   \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            const uint8_t *blk = wg + b * 272;                                                \
            const int8_t *q = (const int8_t *)(blk + 16);                                     \
            const float *xb = x + b * Q4_BLOCK;                                               \
            __m256 s[NT], u[NT];                                                              \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                            \
                s[t] = _mm256_setzero_ps();                                                   \
                u[t] = _mm256_setzero_ps();                                                   \
            }                                                                                 \
            for (int j = 0; j < 32; j += 2) {                                                 \
                const __m256 w = _mm256_cvtepi32_ps(                                          \
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + j * GROUP)))); \
                const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(                     \
                    _mm_loadl_epi64((const __m128i *)(q + (j + 1) * GROUP))));                \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                        \
                    s[t] = _mm256_fmadd_ps(bcast(xb + t * ldx + j), w, s[t]);                 \
                    u[t] = _mm256_fmadd_ps(bcast(xb + t * ldx + j + 1), v, u[t]);             \
                }                                                                             \
            }                                                                                 \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));         \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                              \
                acc[t] = _mm256_fmadd_ps(_mm256_add_ps(s[t], u[t]), d, acc[t]);               \
        }                                                                                     \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) out[t] = acc[t];                \
    }

#define TILE_SET(Q, G) \
    Q##_TILE_FN(G, 1) Q##_TILE_FN(G, 2) Q##_TILE_FN(G, 3) Q##_TILE_FN(G, 4) Q##_TILE_FN(G, 5)
TILE_SET(Q4, 1)
TILE_SET(Q4, 2)
Q4_TILE_FN(3, 1)
Q4_TILE_FN(4, 1)
TILE_SET(Q8, 1)

/*
 * 16-bit weights: each weight widens exactly to float32 (F16 by F16C's vcvtph2ps, BF16 by
 * a 16-bit shift), and each lane (token, output row) accumulates x * w in one float32 FMA
 * chain in column order, the same for every G, NT and token count. No block scale: the
 * result is the float32 product of the 16-bit weights up to the order of the sums.
 */
static inline __m256 load_f16(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256 load_bf16(const uint8_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

#define W16_TILE_FN(NAME, G, NT)                                                              \
    static void NAME##_tile_##G##_##NT(const float *x, int64_t ldx, int64_t nb, const uint8_t *wg, \
                                       int64_t group_bytes, const float *xsum, __m256 *out) { \
        (void)xsum;                                                                           \
        __m256 acc[G][NT];                                                                    \
        _Pragma("GCC unroll 4") for (int g = 0; g < G; g++)                                  \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) acc[g][t] = _mm256_setzero_ps(); \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            const float *xb = x + b * Q4_BLOCK;                                               \
            for (int j = 0; j < Q4_BLOCK; j++) {                                              \
                __m256 w[G];                                                                  \
                _Pragma("GCC unroll 4") for (int g = 0; g < G; g++)                          \
                    w[g] = load_##NAME(wg + g * group_bytes + b * 512 + j * 2 * GROUP);       \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                        \
                    const __m256 xv = bcast(xb + t * ldx + j);                                \
                    _Pragma("GCC unroll 4") for (int g = 0; g < G; g++)                      \
                        acc[g][t] = _mm256_fmadd_ps(xv, w[g], acc[g][t]);                     \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 4") for (int g = 0; g < G; g++)                                  \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) out[g * TILE + t] = acc[g][t]; \
    }
#define W16_TILE_SET(NAME, G)                                                                 \
    W16_TILE_FN(NAME, G, 1) W16_TILE_FN(NAME, G, 2) W16_TILE_FN(NAME, G, 3) W16_TILE_FN(NAME, G, 4) \
    W16_TILE_FN(NAME, G, 5)
W16_TILE_SET(f16, 1)
W16_TILE_SET(f16, 2)
W16_TILE_FN(f16, 3, 1)
W16_TILE_FN(f16, 4, 1)
W16_TILE_SET(bf16, 1)
W16_TILE_SET(bf16, 2)
W16_TILE_FN(bf16, 3, 1)
W16_TILE_FN(bf16, 4, 1)

typedef void (*tile_fn)(const float *, int64_t, int64_t, const uint8_t *, int64_t, const float *,
                        __m256 *);
/* [G - 1][NT]. Three and four groups exist for single tokens only: one token's tile of two
 * groups is two dependent FMA chains, latency-bound at a quarter of the FMA units; four
 * groups keep four chains in flight (~1.5x a single-token GEMV). Lanes are still output
 * rows with the same per-lane arithmetic, so no result changes with G. */
static const tile_fn Q4_TILES[4][TILE + 1] = {
    {0, q4_tile_1_1, q4_tile_1_2, q4_tile_1_3, q4_tile_1_4, q4_tile_1_5},
    {0, q4_tile_2_1, q4_tile_2_2, q4_tile_2_3, q4_tile_2_4, q4_tile_2_5},
    {0, q4_tile_3_1},
    {0, q4_tile_4_1}};
static const tile_fn Q8_TILES[1][TILE + 1] = {
    {0, q8_tile_1_1, q8_tile_1_2, q8_tile_1_3, q8_tile_1_4, q8_tile_1_5}};

static const tile_fn F16_TILES[4][TILE + 1] = {
    {0, f16_tile_1_1, f16_tile_1_2, f16_tile_1_3, f16_tile_1_4, f16_tile_1_5},
    {0, f16_tile_2_1, f16_tile_2_2, f16_tile_2_3, f16_tile_2_4, f16_tile_2_5},
    {0, f16_tile_3_1},
    {0, f16_tile_4_1}};
static const tile_fn BF16_TILES[4][TILE + 1] = {
    {0, bf16_tile_1_1, bf16_tile_1_2, bf16_tile_1_3, bf16_tile_1_4, bf16_tile_1_5},
    {0, bf16_tile_2_1, bf16_tile_2_2, bf16_tile_2_3, bf16_tile_2_4, bf16_tile_2_5},
    {0, bf16_tile_3_1},
    {0, bf16_tile_4_1}};
#ifndef W16_SINGLE_GROUPS
#define W16_SINGLE_GROUPS 4 /* groups per tile for a single token (1 to 4) */
#endif

/* The sum of a block's 32 inputs (Q4_1's min term), in one fixed order. */
static inline float block_sum(const float *xb) {
    return hsum(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                              _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24))));
}

static void quant_gemm(const float *x, int64_t t_count, int64_t ldx, int64_t k, const uint8_t *w,
                       int64_t n, int64_t block_bytes, const tile_fn (*tiles)[TILE + 1],
                       int64_t groups_per_tile, const float *bias, float *out, int64_t ldo) {
    const int64_t nb = k / Q4_BLOCK;
    const int64_t groups = n / GROUP;
    const int64_t pairs = (groups + groups_per_tile - 1) / groups_per_tile;
    const int64_t group_bytes = nb * block_bytes;
    if (t_count <= 0) return;
    /* Token tiles of near-equal size (16 tokens: 4 x 4, not 5 + 5 + 5 + 1): a tile's time
     * is set by its FMA chains, so a lone token's tile costs ~1.5 of a full tile's tokens. */
    const int64_t tiles_t = (t_count + TILE - 1) / TILE;
    const int64_t tile_base = t_count / tiles_t, tile_rem = t_count % tiles_t;
    /* Per token and block, the sum of its 32 inputs (Q4_1's min term), in a fixed order:
     * only the Q4_1 tiles read it (Q8_0 and 16-bit weights have no min). */
    float *xsum = NULL;
    if (tiles == Q4_TILES) {
        xsum = (float *)alloc_or_die((size_t)(t_count * nb + 1) * sizeof(float), "the GEMM's block sums");
#pragma omp parallel for schedule(static) if (t_count * nb > 4096)
        for (int64_t i = 0; i < t_count * nb; i++) xsum[i] = block_sum(x + (i / nb) * ldx + (i % nb) * Q4_BLOCK);
    }
    /* One work item = (pair of groups, token tile). Dynamic chunks of ~1/8 of a thread's
     * share: on a two-core host the API workers preempt engine threads all the time, and
     * a static split would leave the other thread waiting for the preempted half. */
    const int64_t items = pairs * tiles_t;
    int64_t chunk = items / ((int64_t)omp_get_max_threads() * 8);
    if (chunk < 1) chunk = 1;
#pragma omp parallel for schedule(dynamic, chunk) collapse(2)
    for (int64_t pg = 0; pg < pairs; pg++) {
        for (int64_t tt = 0; tt < tiles_t; tt++) {
            const int64_t g0 = groups_per_tile * pg;
            const int ng = (int)(groups - g0 < groups_per_tile ? groups - g0 : groups_per_tile);
            const int64_t t0 = tt * tile_base + (tt < tile_rem ? tt : tile_rem);
            const int nt = (int)(tile_base + (tt < tile_rem));
            __m256 acc[4 * TILE];
            tiles[ng - 1][nt](x + t0 * ldx, ldx, nb, w + g0 * group_bytes, group_bytes,
                              xsum ? xsum + t0 * nb : NULL, acc);
            for (int g = 0; g < ng; g++) {
                const int64_t col = (g0 + g) * GROUP;
                const __m256 bv = bias ? _mm256_loadu_ps(bias + col) : _mm256_setzero_ps();
                for (int t = 0; t < nt; t++)
                    _mm256_storeu_ps(out + (t0 + t) * ldo + col, _mm256_add_ps(acc[g * TILE + t], bv));
            }
        }
    }
    free(xsum);
}

#ifdef __AVX512F__
/*
 * A single token's GEMV on 16 lanes (the AVX-512 builds): one zmm holds two groups' rows
 * (group 2p in lanes 0-7, group 2p + 1 in lanes 8-15), so every nibble conversion and FMA
 * covers twice the rows of the 8-lane tiles above. Each lane still runs exactly the
 * 8-lane tile's arithmetic for its row (FMA per column in the same order, then d and m
 * folded in once per block), so every output is bitwise the one `q4_tile_*` gives: the
 * batch-invariant mode keeps its results. P pairs of groups per tile keep P independent FMA
 * chains in flight. (Q8_0 stays on the 8-lane tiles: see hearth_q8_0_gemm.)
 */
static inline __m512i bytes_of_two_groups(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtepu8_epi32(
        _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b)));
}

static inline __m512 halves_of_two_groups(const uint8_t *a, const uint8_t *b) {
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                              _mm_loadu_si128((const __m128i *)b), 1);
    return _mm512_cvtph_ps(v);
}

#define Q4_WIDE_FN(P)                                                                                   \
    static void q4_wide_##P(const float *x, int64_t nb, const uint8_t *wg, int64_t group_bytes,       \
                            const float *xsum, __m512 *out) {                                          \
        __m512 acc[P];                                                                                  \
        for (int p = 0; p < P; p++) acc[p] = _mm512_setzero_ps();                                       \
        const __m512i low = _mm512_set1_epi32(0xF);                                                     \
        for (int64_t b = 0; b < nb; b++) {                                                              \
            const float *xb = x + b * Q4_BLOCK;                                                         \
            __m512 s[P];                                                                                \
            for (int p = 0; p < P; p++) s[p] = _mm512_setzero_ps();                                     \
            for (int j = 0; j < 16; j++) {                                                              \
                const __m512 x0 = _mm512_set1_ps(xb[j]), x1 = _mm512_set1_ps(xb[j + 16]);               \
                _Pragma("GCC unroll 4") for (int p = 0; p < P; p++) {                                  \
                    const uint8_t *q = wg + 2 * p * group_bytes + b * 160 + 32 + j * GROUP;             \
                    const __m512i qi = bytes_of_two_groups(q, q + group_bytes);                         \
                    s[p] = _mm512_fmadd_ps(x0, _mm512_cvtepi32_ps(_mm512_and_si512(qi, low)), s[p]);    \
                    s[p] = _mm512_fmadd_ps(x1, _mm512_cvtepi32_ps(_mm512_srli_epi32(qi, 4)), s[p]);     \
                }                                                                                       \
            }                                                                                           \
            const __m512 xs = _mm512_set1_ps(xsum[b]);                                                  \
            _Pragma("GCC unroll 4") for (int p = 0; p < P; p++) {                                      \
                const uint8_t *blk = wg + 2 * p * group_bytes + b * 160;                                \
                acc[p] = _mm512_fmadd_ps(s[p], halves_of_two_groups(blk, blk + group_bytes), acc[p]);   \
                acc[p] = _mm512_fmadd_ps(halves_of_two_groups(blk + 16, blk + group_bytes + 16), xs, acc[p]); \
            }                                                                                           \
        }                                                                                               \
        for (int p = 0; p < P; p++) out[p] = acc[p];                                                    \
    }

Q4_WIDE_FN(1)
Q4_WIDE_FN(2)
Q4_WIDE_FN(4)

#ifndef Q4_WIDE_PAIRS
/* 4: 7.0 ms per batch-1 engine step vs 7.3-7.9 for 1 or 2 (Sapphire Rapids, 2 threads) */
#define Q4_WIDE_PAIRS 4 /* pairs of groups per single-token Q4 tile: 1, 2 or 4 */
#endif

/* One token: items of `pairs` group pairs on 16-lane tiles; a last odd group runs the
 * 8-lane tile (`tail`), which computes the same lane arithmetic. */
static void wide_gemv(const float *x, int64_t k, const uint8_t *w, int64_t n, int64_t block_bytes,
                      void (*wide[])(const float *, int64_t, const uint8_t *, int64_t, const float *, __m512 *),
                      int pairs, tile_fn tail, const float *bias, float *out) {
    const int64_t nb = k / Q4_BLOCK, groups = n / GROUP, group_bytes = nb * block_bytes;
    float xsum[nb > 0 ? nb : 1];
    for (int64_t b = 0; b < nb; b++) xsum[b] = block_sum(x + b * Q4_BLOCK);
    const int64_t per_item = 2 * pairs, items = (groups + per_item - 1) / per_item;
    int64_t chunk = items / ((int64_t)omp_get_max_threads() * 8);
    if (chunk < 1) chunk = 1;
#pragma omp parallel for schedule(dynamic, chunk)
    for (int64_t it = 0; it < items; it++) {
        const int64_t g0 = it * per_item, left = groups - g0 < per_item ? groups - g0 : per_item;
        __m512 acc[4];
        int64_t done = 0;
        if (left == per_item) {
            wide[pairs](x, nb, w + g0 * group_bytes, group_bytes, xsum, acc);
            done = left;
        } else { /* the short last item: one pair at a time */
            for (int64_t p = 0; p < left / 2; p++)
                wide[1](x, nb, w + (g0 + 2 * p) * group_bytes, group_bytes, xsum, acc + p);
            done = left / 2 * 2;
        }
        for (int64_t g = 0; g < done; g++) {
            const int64_t col = (g0 + g) * GROUP;
            const __m256 a = (g & 1) ? _mm512_extractf32x8_ps(acc[g / 2], 1) : _mm512_castps512_ps256(acc[g / 2]);
            const __m256 bv = bias ? _mm256_loadu_ps(bias + col) : _mm256_setzero_ps();
            _mm256_storeu_ps(out + col, _mm256_add_ps(a, bv));
        }
        if (done < left) { /* the odd last group */
            __m256 one[4 * TILE];
            const int64_t col = (g0 + done) * GROUP;
            tail(x, k, nb, w + (g0 + done) * group_bytes, group_bytes, xsum, one);
            const __m256 bv = bias ? _mm256_loadu_ps(bias + col) : _mm256_setzero_ps();
            _mm256_storeu_ps(out + col, _mm256_add_ps(one[0], bv));
        }
    }
}

static void (*Q4_WIDE[5])(const float *, int64_t, const uint8_t *, int64_t, const float *, __m512 *) = {
    0, q4_wide_1, q4_wide_2, 0, q4_wide_4};
#endif

void hearth_q4_1_gemm(const float *x, int64_t t, int64_t ldx, int64_t k, const uint8_t *w, int64_t n,
                      const float *bias, float *out, int64_t ldo) {
#ifdef __AVX512F__
    if (t == 1) {
        wide_gemv(x, k, w, n, 160, Q4_WIDE, Q4_WIDE_PAIRS, q4_tile_1_1, bias, out);
        return;
    }
#endif
    quant_gemm(x, t, ldx, k, w, n, 160, Q4_TILES, t == 1 ? Q4_SINGLE_GROUPS : 2, bias, out, ldo);
}

void hearth_q8_0_gemm(const float *x, int64_t t, int64_t ldx, int64_t k, const uint8_t *w, int64_t n,
                      const float *bias, float *out, int64_t ldo) {
    /* Every build, one token included, runs the 8-lane one-group tiles: the tied LM head
     * (576 -> 49152, 28 MB streamed per token) is bound by the weight stream, and one group's
     * sequential stream per thread reads it fastest. Zen 4, 2 threads, weights cold: 716-884
     * us per call, vs 1281-1310 for 8-lane tiles of four groups, 1674 for two, and 986-1217
     * for the 16-lane GEMV of four group pairs (`wide_gemv`, which the Q4_1 layers keep); the
     * batch-1 engine step 5.3-6.0 ms vs 5.8-6.6 with that GEMV. */
    quant_gemm(x, t, ldx, k, w, n, 272, Q8_TILES, 1, bias, out, ldo);
}

/* 16-bit weights (hearth_pack_w16): every build runs the 8-lane tiles. */
void hearth_f16_gemm(const float *x, int64_t t, int64_t ldx, int64_t k, const uint8_t *w, int64_t n,
                     const float *bias, float *out, int64_t ldo) {
    quant_gemm(x, t, ldx, k, w, n, 512, F16_TILES, t == 1 ? W16_SINGLE_GROUPS : 2, bias, out, ldo);
}

void hearth_bf16w_gemm(const float *x, int64_t t, int64_t ldx, int64_t k, const uint8_t *w, int64_t n,
                       const float *bias, float *out, int64_t ldo) {
    quant_gemm(x, t, ldx, k, w, n, 512, BF16_TILES, t == 1 ? W16_SINGLE_GROUPS : 2, bias, out, ldo);
}

/* ------------------------------------------------------------------ vector helpers */

static inline float hsum(__m256 v) {  /* fixed order: lanes 0+4, 1+5, ... */
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* exp(x) for x <= 0 in float32 (Cephes-style: 2^n * p(r), |rel err| < 2e-7). */
static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    x = _mm256_max_ps(x, lo);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(fx, c1));
    r = _mm256_sub_ps(r, _mm256_mul_ps(fx, c2));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float exp_scalar(float x) {
    float buf[8];
    _mm256_storeu_ps(buf, exp256(_mm256_set1_ps(x)));
    return buf[0];
}

/* ------------------------------------------------------------------ norms, activation */

static void rms_row(const float *x, const float *w, float *out, int64_t h, float eps) {
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= h; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        s = _mm256_fmadd_ps(v, v, s);
    }
    float ss = hsum(s);
    for (; i < h; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
    const __m256 vi = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= h; i += 8)
        _mm256_storeu_ps(out + i,
                         _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), vi)));
    for (; i < h; i++) out[i] = w[i] * (x[i] * inv);
}

/* out = rms_norm(x) * w, row by row. */
void hearth_rms_norm(const float *x, const float *w, float *out, int64_t t, int64_t h, float eps) {
#pragma omp parallel for schedule(static) if (t > 4)
    for (int64_t r = 0; r < t; r++) rms_row(x + r * h, w, out + r * h, h, eps);
}

/* RMSNorm over each head's `hd` values, `heads` heads a token (Qwen3's and Gemma 3's q / k
 * norms): x rows of stride ldx (q or k inside the fused qkv output), out [t, heads * hd].
 * Each (token, head) is `rms_row` over hd, bit for bit what `hearth_rms_norm` gives the same
 * values copied into rows of hd: one call where the eager path copied the strided heads out
 * in torch first, which kept a step of such a model from being a step program. */
void hearth_head_rms_norm(const float *x, int64_t ldx, const float *w, float *out, int64_t t, int64_t heads,
                          int64_t hd, float eps) {
#pragma omp parallel for schedule(static) if (t * heads > 4)
    for (int64_t r = 0; r < t * heads; r++) rms_row(x + (r / heads) * ldx + (r % heads) * hd, w, out + r * hd, hd, eps);
}

/* residual += x; x = rms_norm(residual) * w (both in place). */
void hearth_add_rms_norm(float *x, float *residual, const float *w, int64_t t, int64_t h, float eps) {
#pragma omp parallel for schedule(static) if (t > 4)
    for (int64_t r = 0; r < t; r++) {
        float *xr = x + r * h, *rr = residual + r * h;
        int64_t i = 0;
        for (; i + 8 <= h; i += 8)
            _mm256_storeu_ps(rr + i, _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(rr + i)));
        for (; i < h; i++) rr[i] += xr[i];
        rms_row(rr, w, xr, h, eps);
    }
}

/* out[t, :I] = silu(gu[t, :I]) * gu[t, I:] */
void hearth_silu_mul(const float *gu, float *out, int64_t t, int64_t inter) {
#pragma omp parallel for schedule(static) if (t > 1)
    for (int64_t r = 0; r < t; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= inter; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            /* silu(g) = g / (1 + exp(-g)); exp of -|g| keeps the argument <= 0. */
            __m256 neg_abs = _mm256_or_ps(gv, _mm256_set1_ps(-0.0f));
            __m256 e = exp256(neg_abs);
            __m256 pos = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_GE_OQ);
            __m256 sig = _mm256_blendv_ps(_mm256_div_ps(e, _mm256_add_ps(one, e)),
                                          _mm256_div_ps(one, _mm256_add_ps(one, e)), pos);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; i++) {
            float e = exp_scalar(-fabsf(g[i]));
            float sig = g[i] >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
            o[i] = g[i] * sig * u[i];
        }
    }
}

/* GeGLU (Gemma's gelu_pytorch_tanh): out = gelu_tanh(g) * u, gate columns first.
 * 0.5 (1 + tanh(y)) is sigmoid(2 y), so gelu_tanh(g) = g * sigmoid(2 sqrt(2/pi) (g + 0.044715
 * g^3)), computed as `hearth_silu_mul` computes its sigmoid (exp of -|z|): within float32
 * rounding of torch's tanh form, not bitwise it. */
void hearth_gelu_tanh_mul(const float *gu, float *out, int64_t t, int64_t inter) {
    const float c = 2.0f * 0.7978845608028654f, k = 0.044715f;
#pragma omp parallel for schedule(static) if (t > 1)
    for (int64_t r = 0; r < t; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f), vc = _mm256_set1_ps(c), vk = _mm256_set1_ps(k);
        for (; i + 8 <= inter; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 z = _mm256_mul_ps(vc, _mm256_fmadd_ps(_mm256_mul_ps(vk, gv), _mm256_mul_ps(gv, gv), gv));
            const __m256 e = exp256(_mm256_or_ps(z, _mm256_set1_ps(-0.0f)));
            const __m256 pos = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GE_OQ);
            const __m256 sig = _mm256_blendv_ps(_mm256_div_ps(e, _mm256_add_ps(one, e)),
                                                _mm256_div_ps(one, _mm256_add_ps(one, e)), pos);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; i++) {
            const float z = c * fmaf(k * g[i], g[i] * g[i], g[i]);
            const float e = exp_scalar(-fabsf(z));
            const float sig = z >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
            o[i] = g[i] * sig * u[i];
        }
    }
}

/* ------------------------------------------------------------------ rotary, KV write */
/*
 * x: [T, ld] rows whose first `heads` * hd floats are heads of width hd (a q or k view of
 * the fused qkv rows works as is). Rotates them in place, rotate_half style: cos_sin row
 * p = cos[hd/2] | sin[hd/2].
 */
void hearth_rope(float *x, int64_t t, int64_t ld, int64_t heads, int64_t hd, const int64_t *positions,
                 const float *cos_sin) {
    const int64_t half = hd / 2;
#pragma omp parallel for schedule(static) if (t > 4)
    for (int64_t r = 0; r < t; r++) {
        const float *cs = cos_sin + positions[r] * hd;
        for (int64_t h = 0; h < heads; h++) {
            float *y = x + r * ld + h * hd;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(cs + half + i);
                __m256 x1 = _mm256_loadu_ps(y + i), x2 = _mm256_loadu_ps(y + half + i);
                _mm256_storeu_ps(y + i, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
                _mm256_storeu_ps(y + half + i, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
            }
            for (; i < half; i++) {
                float c = cs[i], s = cs[half + i], x1 = y[i], x2 = y[half + i];
                y[i] = x1 * c - x2 * s;
                y[half + i] = x2 * c + x1 * s;
            }
        }
    }
}

/* Copies each token's k and v rows (`width` floats, row strides ldk / ldv) into the paged
 * caches [num_blocks * block_size, width] at slot[t]; slots < 0 (padding) are skipped. */
void hearth_kv_write(const float *k, int64_t ldk, const float *v, int64_t ldv, int64_t t, int64_t width,
                     float *k_cache, float *v_cache, const int64_t *slots) {
    for (int64_t r = 0; r < t; r++) {
        const int64_t slot = slots[r];
        if (slot < 0) continue;
        memcpy(k_cache + slot * width, k + r * ldk, (size_t)width * sizeof(float));
        memcpy(v_cache + slot * width, v + r * ldv, (size_t)width * sizeof(float));
    }
}

/*
 * The same into float16 caches (IEEE binary16, as torch.float16): each float is rounded to
 * nearest-even by F16C, as `tensor.half()` rounds. Values beyond float16's range saturate
 * to +-65504 (the largest finite float16) instead of becoming inf as `.half()` makes them,
 * so one outlier key cannot turn every score of its head into inf/NaN; +-inf saturates the
 * same way and NaN stays NaN. Everything inside the range is exactly `.half()`.
 */
#define F16_MAX 65504.0f

static inline void f16_row(const float *src, uint16_t *dst, int64_t width) {
    const __m256 hi = _mm256_set1_ps(F16_MAX), lo = _mm256_set1_ps(-F16_MAX);
    int64_t i = 0;
    for (; i + 8 <= width; i += 8) {
        /* min/max return their second operand when one is NaN: NaN goes through. */
        const __m256 x = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(src + i)));
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < width; i++) {
        const float x = src[i] > F16_MAX ? F16_MAX : src[i] < -F16_MAX ? -F16_MAX : src[i];
        dst[i] = (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
    }
}

void hearth_kv_write_f16(const float *k, int64_t ldk, const float *v, int64_t ldv, int64_t t, int64_t width,
                         uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots) {
    for (int64_t r = 0; r < t; r++) {
        const int64_t slot = slots[r];
        if (slot < 0) continue;
        f16_row(k + r * ldk, k_cache + slot * width, width);
        f16_row(v + r * ldv, v_cache + slot * width, width);
    }
}

/*
 * The same into int8 caches: each (slot, kv head) row of hd values is stored as hd int8
 * q = round(x * 127 / amax) (nearest-even; amax = the row's largest |x|, after the same
 * +-65504 clamp as the float16 path) followed by the float32 scale amax / 127 (4 bytes,
 * unaligned), so a row is x ~= q * scale and a slot is nkv * (hd + 4) bytes: 0.27x the
 * float32 cache's bytes, 0.53x the float16's, which is what decode attention is bound by.
 * A zero row has scale 0. Per-row scales keep every token's error its own (batch
 * invariance holds: a row's bytes depend only on the row). hd % 8 == 0.
 */
static inline void i8_row(const float *src, int8_t *dst, int64_t hd) {
    const __m256 hi = _mm256_set1_ps(F16_MAX), lo = _mm256_set1_ps(-F16_MAX);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < hd; i += 8) {
        const __m256 x = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(src + i)));
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float a = _mm_cvtss_f32(m4);
    const float scale = a / 127.0f;
    const __m256 inv = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
    const __m256i qmax = _mm256_set1_epi32(127), qmin = _mm256_set1_epi32(-127);
    for (int64_t i = 0; i < hd; i += 8) {
        const __m256 x = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(src + i)));
        __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(x, inv)); /* MXCSR: nearest-even */
        q = _mm256_max_epi32(qmin, _mm256_min_epi32(qmax, q));
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(dst + i), _mm_packs_epi16(w, w));
    }
    memcpy(dst + hd, &scale, sizeof scale);
}

/* The nkv rows of one slot (src: nkv * hd floats) into their int8 rows. */
static inline void i8_slot(const float *src, int8_t *dst, int64_t nkv, int64_t hd) {
    for (int64_t h = 0; h < nkv; h++) i8_row(src + h * hd, dst + h * (hd + KV_I8_SCALE_BYTES), hd);
}

void hearth_kv_write_i8(const float *k, int64_t ldk, const float *v, int64_t ldv, int64_t t, int64_t nkv,
                        int64_t hd, int8_t *k_cache, int8_t *v_cache, const int64_t *slots) {
    const int64_t pitch = nkv * (hd + KV_I8_SCALE_BYTES); /* bytes per slot */
    for (int64_t r = 0; r < t; r++)
        if (slots[r] >= 0) {
            i8_slot(k + r * ldk, k_cache + slots[r] * pitch, nkv, hd);
            i8_slot(v + r * ldv, v_cache + slots[r] * pitch, nkv, hd);
        }
}

/* float16 keys and int8 values (the quality bar passes with int8 values, not int8 keys). */
void hearth_kv_write_f16_i8(const float *k, int64_t ldk, const float *v, int64_t ldv, int64_t t, int64_t nkv,
                            int64_t hd, uint16_t *k_cache, int8_t *v_cache, const int64_t *slots) {
    for (int64_t r = 0; r < t; r++)
        if (slots[r] >= 0) {
            f16_row(k + r * ldk, k_cache + slots[r] * nkv * hd, nkv * hd);
            i8_slot(v + r * ldv, v_cache + slots[r] * nkv * (hd + KV_I8_SCALE_BYTES), nkv, hd);
        }
}

/* ------------------------------------------------------------------ paged attention */
/*
 * Token r belongs to sequence seq[r] (a row of block_tables) and attends to that
 * sequence's keys 0 .. ctx[r]-1 (causal: ctx = position + 1), read in place from the paged
 * cache. Decodes and prefill chunks are the same code, so a token's output never depends
 * on how its prompt was chunked or what it was batched with.
 * q: [T, ldq] (heads at q + h*hd); out: [T, nh*hd]; caches [blocks*bs, nkv, hd].
 *
 * Work is split into items of (tile, kv head). A tile is a run of at most ATT_MAXV / group
 * consecutive tokens of one sequence at consecutive positions (a piece of a prefill chunk;
 * a decode token is a tile of one), and an item holds the tile's query vectors of every
 * head that shares the kv head. The item reads each key and value row once for all of
 * its vectors instead of once per vector, which is what long prompts are bound by.
 *
 * Batch invariance: every score is one accumulator per (vector, key) over the dimensions
 * in order, reduced in one fixed tree (`reduce4`); every output dimension is one
 * accumulator over the keys in position order. A vector only ever gets zero weight for
 * keys past its own context (the tile's later tokens), and adding 0 * v leaves a sum as
 * it is, so a token's output is bitwise the same whatever tile or batch it lands in.
 */
#define ATT_PAD 16  /* score rows overrun n by up to 3 here, 15 in hearth_attention_f32.c: pad them */
#define ATT_INLINE static inline __attribute__((always_inline))

int64_t hearth_attention_scratch_floats(int64_t max_ctx) {
    return (int64_t)ATT_MAXV * (max_ctx + ATT_PAD);
}

/* The cache kinds and how a row is read (kv_head_pitch, kv_row_scale, kv_load8): hearth_kv.h. */
#define KV_F16_I8 3 /* the step program's code of float16 keys with int8 values */

/* Tunables (-D for A/B builds; none changes a result): query vectors scored per pass over
 * 4 keys (1..3; 3 = a SmolLM2 kv head's whole group, each key loaded once); how many
 * blocks ahead the loops prefetch into L1 (0: none) and into L2; how many bytes of a
 * kv head's values the score pass asks into L2 for the value pass after it. */
#ifndef ATT_SCORE_U
#define ATT_SCORE_U 3
#endif
#if ATT_SCORE_U < 1 || ATT_SCORE_U > 3
#error "ATT_SCORE_U must be 1, 2 or 3"
#endif
#ifndef ATT_PF_BLOCKS
#define ATT_PF_BLOCKS 2
#endif
#ifndef ATT_L2_BLOCKS
#define ATT_L2_BLOCKS 8
#endif
#ifndef ATT_EARLY_BYTES
#define ATT_EARLY_BYTES (128 << 10)
#endif

ATT_INLINE int64_t kv_elem_size(const int kind) { return kind == KV_F16 ? 2 : kind == KV_I8 ? 1 : 4; }

/*
 * Prefetch of block b of a sequence's n keys (none past them): in each of its slots,
 * `elems` elements from element `off`, every cache line they touch (an int8 row, hd + 4
 * bytes, mostly straddles two), into L1 (l2 = 0) or L2.
 *
 * Why: a cache's blocks lie anywhere in memory, so the hardware prefetchers cannot see the
 * next one coming, and a decode's attention reads its whole context once per layer from
 * DRAM. Two streams run ahead of each pass: L1 a couple of blocks ahead, L2 further (DRAM
 * latency is several blocks' work); and the score pass asks for the first
 * ATT_EARLY_BYTES of the values too, so the value pass that follows starts from L2
 * rather than from DRAM (bench_cpu_attention.py, cold cache, Zen 5: 16 decodes over
 * 1024 keys 600 -> 390 us per layer, 64 over 1024 2.6 -> 1.5 ms, 16 over 4096 2.8 ->
 * 1.7 ms; the same loads in the same order, so the same results).
 */
ATT_INLINE void prefetch_block(const int l2, const void *base, const int kind, const int32_t *table, int64_t b,
                               int64_t n, int64_t block_size, int64_t kv_stride, int64_t off, int64_t elems) {
    const int64_t left = n - b * block_size, esz = kv_elem_size(kind);
    if (left <= 0) return;
    const char *p = (const char *)base + ((int64_t)table[b] * block_size * kv_stride + off) * esz;
    const int64_t rows = left < block_size ? left : block_size;
    for (int64_t r = 0; r < rows; r++) {
        const uintptr_t first = (uintptr_t)(p + r * kv_stride * esz), last = first + (uintptr_t)(elems * esz) - 1;
        for (uintptr_t x = first & ~(uintptr_t)63; x <= last; x += 64) {
            if (l2)
                _mm_prefetch((const char *)x, _MM_HINT_T1);
            else
                _mm_prefetch((const char *)x, _MM_HINT_T0);
        }
    }
}

/* A pass's prologue: the blocks after b0 that its loop's streams (block b asks for
 * b + ATT_PF_BLOCKS into L1 and, with l2_stream, b + ATT_L2_BLOCKS into L2) never ask for. */
ATT_INLINE void prefetch_first(const int l2_stream, const void *base, const int kind, const int32_t *table,
                               int64_t b0, int64_t n, int64_t block_size, int64_t kv_stride, int64_t off,
                               int64_t elems) {
    for (int64_t d = 1; d < ATT_PF_BLOCKS; d++)
        prefetch_block(0, base, kind, table, b0 + d, n, block_size, kv_stride, off, elems);
    if (l2_stream && ATT_PF_BLOCKS)
        for (int64_t d = ATT_PF_BLOCKS; d < ATT_L2_BLOCKS; d++)
            prefetch_block(1, base, kind, table, b0 + d, n, block_size, kv_stride, off, elems);
}

/* The blocks from a pass's first whose values the score pass asks into L2: rows of `pitch`
 * elements (kv_head_pitch) of this kind, ATT_EARLY_BYTES of them. */
ATT_INLINE int64_t early_value_blocks(const int kind, int64_t pitch, int64_t block_size) {
    return ATT_EARLY_BYTES / (block_size * pitch * kv_elem_size(kind));
}

/* The 4 keys' row scales (int8 caches): a score is scale * (q . the int8 row). */
ATT_INLINE __m128 key_scales(const void *kc, const int64_t *kp, int64_t hd, const int kind) {
    return _mm_set_ps(kv_row_scale(kc, kp[3], hd, kind), kv_row_scale(kc, kp[2], hd, kind),
                      kv_row_scale(kc, kp[1], hd, kind), kv_row_scale(kc, kp[0], hd, kind));
}

/* The 8 lanes of each of a0..a3 summed in one fixed tree ((0+1)+(2+3)) + ((4+5)+(6+7)). */
ATT_INLINE __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* dst[u][0..3] = scale * <q_u, k_x> for U (1 to 3) vectors and 4 keys (rows kc + kp[x]).
 * Each (vector, key) is its own accumulator: how vectors are grouped into calls changes
 * how often a key is loaded, never a result. The AVX-512 builds run 16 lanes (half the
 * loads, conversions and FMAs of 8, which is what a decode's attention is bound by when
 * its keys are in cache) and fold them to 8 (lane i + lane i + 8) before the same tree:
 * a fixed order in every AVX-512 build, another than the AVX2 build's. */
#ifdef __AVX512F__
ATT_INLINE __m512 kv_load16(const void *base, int64_t idx, const int kind) {
    if (kind == KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx)));
    if (kind == KV_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + idx))));
    return _mm512_loadu_ps((const float *)base + idx);
}

ATT_INLINE __m256 fold16(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

ATT_INLINE void scores_4keys(const int U, const int kind, const float *const *qv, const void *kc,
                             const int64_t *kp, int64_t hd, __m128 vscale, float *const *dst, int64_t at) {
    __m512 acc[3][4];
    for (int u = 0; u < U; u++)
        for (int x = 0; x < 4; x++) acc[u][x] = _mm512_setzero_ps();
    for (int64_t c = 0; c < hd; c += 16) {
        __m512 qc[3];
        for (int u = 0; u < U; u++) qc[u] = _mm512_loadu_ps(qv[u] + c);
        for (int x = 0; x < 4; x++) {
            const __m512 kx = kv_load16(kc, kp[x] + c, kind);
            for (int u = 0; u < U; u++) acc[u][x] = _mm512_fmadd_ps(qc[u], kx, acc[u][x]);
        }
    }
    if (kind == KV_I8) vscale = _mm_mul_ps(vscale, key_scales(kc, kp, hd, kind));
    for (int u = 0; u < U; u++)
        _mm_storeu_ps(dst[u] + at, _mm_mul_ps(reduce4(fold16(acc[u][0]), fold16(acc[u][1]), fold16(acc[u][2]),
                                                      fold16(acc[u][3])),
                                              vscale));
}
#else
ATT_INLINE void scores_4keys(const int U, const int kind, const float *const *qv, const void *kc,
                             const int64_t *kp, int64_t hd, __m128 vscale, float *const *dst, int64_t at) {
    __m256 acc[3][4];
    for (int u = 0; u < U; u++)
        for (int x = 0; x < 4; x++) acc[u][x] = _mm256_setzero_ps();
    for (int64_t c = 0; c < hd; c += 8) {
        __m256 qc[3];
        for (int u = 0; u < U; u++) qc[u] = _mm256_loadu_ps(qv[u] + c);
        for (int x = 0; x < 4; x++) {
            const __m256 kx = kv_load8(kc, kp[x] + c, kind);
            for (int u = 0; u < U; u++) acc[u][x] = _mm256_fmadd_ps(qc[u], kx, acc[u][x]);
        }
    }
    if (kind == KV_I8) vscale = _mm_mul_ps(vscale, key_scales(kc, kp, hd, kind));
    for (int u = 0; u < U; u++)
        _mm_storeu_ps(dst[u] + at, _mm_mul_ps(reduce4(acc[u][0], acc[u][1], acc[u][2], acc[u][3]), vscale));
}
#endif

/* Scores of nv vectors over keys b0 * block_size .. n-1, stored at their positions (rows may
 * get up to 3 more, overwritten or unused). k_cache + koff is the kv head's first element of
 * slot 0. Blocks before b0 (wholly before every vector's sliding window) are never read. */
ATT_INLINE void attention_scores(const int kind, const float *const *qv, int64_t nv, const void *k_cache,
                                 int64_t koff, const int32_t *table, int64_t b0, int64_t n, int64_t block_size,
                                 int64_t kv_stride, int64_t hd, float scale, float *const *dst, const int vkind,
                                 const void *v_cache, int64_t voff, int64_t v_stride) {
    const __m128 vscale = _mm_set1_ps(scale);
    const int64_t nblk = (n + block_size - 1) / block_size;
    const int64_t pitch = kv_head_pitch(kind, hd), vpitch = kv_head_pitch(vkind, hd);
    const int64_t early_end = b0 + early_value_blocks(vkind, vpitch, block_size);
    int64_t i0 = b0 * block_size;
    prefetch_first(1, k_cache, kind, table, b0, n, block_size, kv_stride, koff, pitch);
    for (int64_t b = b0; b < nblk; b++, i0 += block_size) {
        const int64_t kb = koff + (int64_t)table[b] * block_size * kv_stride;
        const int64_t m = (n - i0) < block_size ? (n - i0) : block_size;
        if (ATT_PF_BLOCKS) {
            prefetch_block(0, k_cache, kind, table, b + ATT_PF_BLOCKS, n, block_size, kv_stride, koff, pitch);
            prefetch_block(1, k_cache, kind, table, b + ATT_L2_BLOCKS, n, block_size, kv_stride, koff, pitch);
            if (b < early_end) prefetch_block(1, v_cache, vkind, table, b, n, block_size, v_stride, voff, vpitch);
        }
        for (int64_t j = 0; j < m; j += 4) {
            int64_t kp[4];
            for (int x = 0; x < 4; x++) kp[x] = kb + ((j + x) < m ? (j + x) : (m - 1)) * kv_stride;
            int64_t u = 0;
            for (; u + ATT_SCORE_U <= nv; u += ATT_SCORE_U)
                scores_4keys(ATT_SCORE_U, kind, qv + u, k_cache, kp, hd, vscale, dst + u, i0 + j);
            for (; u + 2 <= nv; u += 2) scores_4keys(2, kind, qv + u, k_cache, kp, hd, vscale, dst + u, i0 + j);
            if (u < nv) scores_4keys(1, kind, qv + u, k_cache, kp, hd, vscale, dst + u, i0 + j);
        }
    }
}

/* hearth_kv.h's softmax (hearth_attention_f32.c runs it too: one function, so both loops'
 * weights are the same bits). */
float hearth_softmax_row(float *p, int64_t from, int64_t lo, int64_t n, int64_t upto) {
    for (int64_t i = from; i < lo; i++) p[i] = 0.0f;
    p += lo;
    n -= lo;
    upto -= lo;
    /* The max 8 lanes at a time: the same value as a scalar scan (NaN scores are skipped by
     * both: vmaxps keeps its second operand; a tie of -0 and +0 may pick either, and
     * s - (-0) = s - (+0) for every s). */
    __m256 vm = _mm256_set1_ps(-INFINITY);
    int64_t m8 = 0;
    for (; m8 + 8 <= n; m8 += 8) vm = _mm256_max_ps(_mm256_loadu_ps(p + m8), vm);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float mx = _mm_cvtss_f32(m4);
    for (; m8 < n; m8++) mx = p[m8] > mx ? p[m8] : mx;
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + i), vmx));
        _mm256_storeu_ps(p + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (; i < n; i++) {
        p[i] = exp_scalar(p[i] - mx);
        sum += p[i];
    }
    for (i = n; i < upto; i++) p[i] = 0.0f;
    return 1.0f / sum;
}

#ifdef __AVX512F__
/* o_u[d0 .. d0 + 16 * NC) = inv_u * sum_i p_u[i] v_i[off ..] for U (1..3) vectors and NC (2 or 4)
 * chunks of 16 dimensions, keys in position order from block b0. Every output dimension is
 * one accumulator over the keys, so the lane width changes nothing: bitwise the AVX2 sums. */
ATT_INLINE void values_w(const int U, const int NC, const int kind, const float *const *p, const void *v_cache,
                         const int32_t *table, int64_t b0, int64_t n, int64_t block_size, int64_t kv_stride,
                         int64_t off, int64_t soff, const float *inv, float *const *o, int64_t d0) {
    __m512 a[3][4];
    for (int u = 0; u < U; u++)
        for (int c = 0; c < NC; c++) a[u][c] = _mm512_setzero_ps();
    const int64_t nblk = (n + block_size - 1) / block_size;
    /* the rows' elements this pass reads, an int8 row's scale included; the first blocks
     * the score pass has asked into L2 already */
    const int64_t elems = kind == KV_I8 ? soff + KV_I8_SCALE_BYTES : 16 * NC;
    const int64_t early_end = b0 + early_value_blocks(kind, kv_head_pitch(kind, soff + d0), block_size);
    int64_t i = b0 * block_size;
    prefetch_first(0, v_cache, kind, table, b0, n, block_size, kv_stride, off, elems);
    for (int64_t b = b0; b < nblk; b++) {
        const int64_t vb = (int64_t)table[b] * block_size * kv_stride + off;
        const int64_t m = (n - i) < block_size ? (n - i) : block_size;
        if (ATT_PF_BLOCKS) {
            prefetch_block(0, v_cache, kind, table, b + ATT_PF_BLOCKS, n, block_size, kv_stride, off, elems);
            if (b + ATT_L2_BLOCKS >= early_end)
                prefetch_block(1, v_cache, kind, table, b + ATT_L2_BLOCKS, n, block_size, kv_stride, off, elems);
        }
        for (int64_t j = 0; j < m; j++, i++) {
            const int64_t v = vb + j * kv_stride;
            __m512 x[4];
            for (int c = 0; c < NC; c++) x[c] = kv_load16(v_cache, v + 16 * c, kind);
            const float sv = kv_row_scale(v_cache, v + soff, 0, kind); /* int8: the row's scale */
            for (int u = 0; u < U; u++) {
                const __m512 w = _mm512_set1_ps(kind == KV_I8 ? p[u][i] * sv : p[u][i]);
                for (int c = 0; c < NC; c++) a[u][c] = _mm512_fmadd_ps(w, x[c], a[u][c]);
            }
        }
    }
    for (int u = 0; u < U; u++) {
        const __m512 vi = _mm512_set1_ps(inv[u]);
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(o[u] + d0 + 16 * c, _mm512_mul_ps(a[u][c], vi));
    }
}

/* 64 dimensions at a time (each value row read once for a SmolLM2 head), 32 for the rest. */
ATT_INLINE void attention_values(const int kind, const float *const *p, int64_t nv, const void *v_cache,
                                 const int32_t *table, int64_t b0, int64_t n, int64_t block_size,
                                 int64_t kv_stride, int64_t off, int64_t hd, const float *inv, float *const *o) {
    for (int64_t d0 = 0; d0 < hd;) {
        const int nc = hd - d0 >= 64 ? 4 : 2;
        int64_t u = 0;
#define VALUES_W(U)                                                                                         \
    do {                                                                                                    \
        if (nc == 4)                                                                                        \
            values_w(U, 4, kind, p + u, v_cache, table, b0, n, block_size, kv_stride, off + d0, hd - d0,   \
                     inv + u, o + u, d0);                                                                   \
        else                                                                                                \
            values_w(U, 2, kind, p + u, v_cache, table, b0, n, block_size, kv_stride, off + d0, hd - d0,   \
                     inv + u, o + u, d0);                                                                   \
    } while (0)
        for (; u + 3 <= nv; u += 3) VALUES_W(3);
        if (nv - u == 2)
            VALUES_W(2);
        else if (nv - u == 1)
            VALUES_W(1);
#undef VALUES_W
        d0 += 16 * nc;
    }
}
#else
/* o_u[0 .. 32) = inv_u * sum_i p_u[i] v_i[off ..] for U (1..3) vectors, keys in position order
 * from block b0. */
ATT_INLINE void values_32(const int U, const int kind, const float *const *p, const void *v_cache,
                          const int32_t *table, int64_t b0, int64_t n, int64_t block_size, int64_t kv_stride,
                          int64_t off, int64_t soff, const float *inv, float *const *o, int64_t d0) {
    __m256 a[3][4];
    for (int u = 0; u < U; u++)
        for (int c = 0; c < 4; c++) a[u][c] = _mm256_setzero_ps();
    const int64_t nblk = (n + block_size - 1) / block_size;
    /* the rows' elements this pass reads, an int8 row's scale included; the first blocks
     * the score pass has asked into L2 already */
    const int64_t elems = kind == KV_I8 ? soff + KV_I8_SCALE_BYTES : 32;
    const int64_t early_end = b0 + early_value_blocks(kind, kv_head_pitch(kind, soff + d0), block_size);
    int64_t i = b0 * block_size;
    prefetch_first(0, v_cache, kind, table, b0, n, block_size, kv_stride, off, elems);
    for (int64_t b = b0; b < nblk; b++) {
        const int64_t vb = (int64_t)table[b] * block_size * kv_stride + off;
        const int64_t m = (n - i) < block_size ? (n - i) : block_size;
        if (ATT_PF_BLOCKS) {
            prefetch_block(0, v_cache, kind, table, b + ATT_PF_BLOCKS, n, block_size, kv_stride, off, elems);
            if (b + ATT_L2_BLOCKS >= early_end)
                prefetch_block(1, v_cache, kind, table, b + ATT_L2_BLOCKS, n, block_size, kv_stride, off, elems);
        }
        for (int64_t j = 0; j < m; j++, i++) {
            const int64_t v = vb + j * kv_stride;
            const __m256 x0 = kv_load8(v_cache, v, kind), x1 = kv_load8(v_cache, v + 8, kind);
            const __m256 x2 = kv_load8(v_cache, v + 16, kind), x3 = kv_load8(v_cache, v + 24, kind);
            const float sv = kv_row_scale(v_cache, v + soff, 0, kind); /* int8: the row's scale */
            for (int u = 0; u < U; u++) {
                const __m256 w = _mm256_set1_ps(kind == KV_I8 ? p[u][i] * sv : p[u][i]);
                a[u][0] = _mm256_fmadd_ps(w, x0, a[u][0]);
                a[u][1] = _mm256_fmadd_ps(w, x1, a[u][1]);
                a[u][2] = _mm256_fmadd_ps(w, x2, a[u][2]);
                a[u][3] = _mm256_fmadd_ps(w, x3, a[u][3]);
            }
        }
    }
    for (int u = 0; u < U; u++) {
        const __m256 vi = _mm256_set1_ps(inv[u]);
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(o[u] + d0 + 8 * c, _mm256_mul_ps(a[u][c], vi));
    }
}

ATT_INLINE void attention_values(const int kind, const float *const *p, int64_t nv, const void *v_cache,
                                 const int32_t *table, int64_t b0, int64_t n, int64_t block_size,
                                 int64_t kv_stride, int64_t off, int64_t hd, const float *inv, float *const *o) {
    for (int64_t d0 = 0; d0 < hd; d0 += 32) {
        int64_t u = 0;
        const int64_t so = hd - d0;
        for (; u + 3 <= nv; u += 3)
            values_32(3, kind, p + u, v_cache, table, b0, n, block_size, kv_stride, off + d0, so, inv + u, o + u, d0);
        if (nv - u == 2)
            values_32(2, kind, p + u, v_cache, table, b0, n, block_size, kv_stride, off + d0, so, inv + u, o + u, d0);
        else if (nv - u == 1)
            values_32(1, kind, p + u, v_cache, table, b0, n, block_size, kv_stride, off + d0, so, inv + u, o + u, d0);
    }
}
#endif

/* The tiles of a call: tiles[2i] .. tiles[2i+1]-1 are tile i's tokens; returns their count
 * (tiles has 2t entries). The rows of the `num_skip` [start, end) ranges in `skip` (sorted;
 * computed elsewhere) get no tile. */
static int64_t attention_tiles(const int32_t *seq, const int32_t *ctx, int64_t t, int64_t tile_tokens,
                               const int64_t *skip, int64_t num_skip, int64_t **tiles_out) {
    int64_t *tiles = (int64_t *)alloc_or_die((size_t)(2 * t + 1) * sizeof(int64_t), "the attention's tiles");
    int64_t num_tiles = 0, next = 0;
    *tiles_out = tiles;
    for (int64_t r = 0; r < t;) {
        if (next < num_skip && r == skip[2 * next]) {
            r = skip[2 * next + 1];
            next++;
            continue;
        }
        const int64_t stop = next < num_skip ? skip[2 * next] : t;
        int64_t e = r + 1;
        while (e < stop && e - r < tile_tokens && seq[e] == seq[r] && ctx[e] == ctx[e - 1] + 1) e++;
        tiles[2 * num_tiles] = r;
        tiles[2 * num_tiles + 1] = e;
        num_tiles++;
        r = e;
    }
    return num_tiles;
}

/* The maximal runs of consecutive positions of one sequence of at least min_run tokens, as
 * [start, end) pairs in *runs_out (NULL, 0 runs, if it could not be allocated). */
static int64_t long_runs(const int32_t *seq, const int32_t *ctx, int64_t t, int64_t min_run, int64_t **runs_out) {
    int64_t *runs = (int64_t *)malloc((size_t)(2 * (t / min_run + 1)) * sizeof(int64_t));
    int64_t num = 0;
    *runs_out = runs;
    if (!runs) return 0;
    for (int64_t r = 0; r < t;) {
        int64_t e = r + 1;
        while (e < t && seq[e] == seq[r] && ctx[e] == ctx[e - 1] + 1) e++;
        if (e - r >= min_run) runs[2 * num] = r, runs[2 * num + 1] = e, num++;
        r = e;
    }
    return num;
}

int hearth_attention_bf16(int kind, const float *q, int64_t ldq, int64_t nh, int64_t nkv, int64_t hd,
                          const void *k_cache, const void *v_cache, int64_t block_size, const int32_t *block_tables,
                          int64_t max_blocks, const int32_t *seq, const int32_t *ctx, float scale, float *out,
                          int64_t window, const int64_t *runs, int64_t num_runs);

/* One work item: tile `it`'s query vectors of the heads that share kv head kvh. */
ATT_INLINE void attention_item(const int kk, const int kv, int64_t it, int64_t kvh, const int64_t *tiles,
                               const float *q, int64_t ldq, int64_t nh, int64_t hd, int64_t group, int64_t nkv,
                               const void *k_cache, const void *v_cache, int64_t block_size,
                               const int32_t *block_tables, int64_t max_blocks, const int32_t *seq,
                               const int32_t *ctx, float scale, int64_t window, float *out, float *rows,
                               int64_t row) {
    const int64_t r0 = tiles[2 * it], num_vecs = (tiles[2 * it + 1] - r0) * group;
    const int32_t *table = block_tables + (int64_t)seq[r0] * max_blocks;
    for (int64_t v0 = 0; v0 < num_vecs; v0 += ATT_MAXV) {
        const int64_t nv = (num_vecs - v0) < ATT_MAXV ? (num_vecs - v0) : ATT_MAXV;
        const float *qv[ATT_MAXV];
        float *ov[ATT_MAXV], *pv[ATT_MAXV], inv[ATT_MAXV];
        int64_t len[ATT_MAXV], lo[ATT_MAXV], n = 0, first = INT64_MAX;
        for (int64_t u = 0; u < nv; u++) {
            const int64_t r = r0 + (v0 + u) / group, h = kvh * group + (v0 + u) % group;
            qv[u] = q + r * ldq + h * hd;
            ov[u] = out + r * nh * hd + h * hd;
            pv[u] = rows + u * row;
            len[u] = ctx[r];
            n = len[u] > n ? len[u] : n;
            /* sliding window: the query at position len - 1 sees keys len - window .. len - 1 */
            lo[u] = window > 0 && len[u] > window ? len[u] - window : 0;
            first = lo[u] < first ? lo[u] : first;
        }
        const int64_t b0 = first / block_size; /* blocks before it are outside every window */
        /* the kv head's row in a slot, and the elements between consecutive slots, per cache */
        const int64_t pk = kv_head_pitch(kk, hd), pv_ = kv_head_pitch(kv, hd);
        attention_scores(kk, qv, nv, k_cache, kvh * pk, table, b0, n, block_size, nkv * pk, hd, scale, pv, kv,
                         v_cache, kvh * pv_, nkv * pv_);
        for (int64_t u = 0; u < nv; u++) inv[u] = hearth_softmax_row(pv[u], b0 * block_size, lo[u], len[u], n);
        attention_values(kv, (const float *const *)pv, nv, v_cache, table, b0, n, block_size, nkv * pv_,
                         kvh * pv_, hd, inv, ov);
    }
}

/* The entry points differ only in the caches' element types (the kinds are constants in
 * each, so each gets its own inlined loops). k_cache / v_cache: float32, float16 (as
 * uint16 bits) [blocks*bs, nkv, hd], or int8 rows with their scales [blocks*bs, nkv, hd + 4];
 * `_f16_i8`: float16 keys, int8 values. q, out and the arithmetic are float32 in all.
 * min_run > 0 (gguf-bf16): runs of at least min_run consecutive positions of one sequence
 * (prefill chunks) go to the bfloat16 kernel (hearth_attention_bf16.c) where this build has
 * one. Where none took them, runs of at least hearth_attention_f32_min_run tokens go to the
 * AVX2 build's prefill loops (hearth_attention_f32.c: the same bits as the loops below, in
 * GEMM-shaped loops). Everything else takes the float32 loops below. */
#define PAGED_ATTENTION_FN(NAME, KK, KV, ELEM_K, ELEM_V)                                                      \
    void NAME(const float *q, int64_t t, int64_t ldq, int64_t nh, int64_t nkv, int64_t hd,                \
              const ELEM_K *k_cache, const ELEM_V *v_cache, int64_t block_size, const int32_t *block_tables, \
              int64_t max_blocks, const int32_t *seq, const int32_t *ctx, float scale, float *out,        \
              float *scratch, int64_t scratch_per_thread, int64_t window, int64_t min_run) {              \
        const int64_t group = nh / nkv;                                                                   \
        const int64_t tile_tokens = group >= ATT_MAXV ? 1 : ATT_MAXV / group;                             \
        const int64_t row = scratch_per_thread / ATT_MAXV; /* floats per score row */                    \
        int64_t *runs = NULL, num_runs = 0;                                                               \
        if (min_run > 0) num_runs = long_runs(seq, ctx, t, min_run, &runs);                               \
        if (num_runs > 0 &&                                                                               \
            !hearth_attention_bf16(KK | KV << 2, q, ldq, nh, nkv, hd, k_cache, v_cache, block_size, block_tables, \
                                   max_blocks, seq, ctx, scale, out, window, runs, num_runs))             \
            num_runs = 0;                                                                                 \
        if (num_runs == 0 && hearth_attention_f32_min_run > 0 && hearth_attention_f32_path()) {          \
            free(runs);                                                                                   \
            num_runs = long_runs(seq, ctx, t, hearth_attention_f32_min_run, &runs);                       \
            if (num_runs > 0 &&                                                                           \
                !hearth_attention_f32(KK, KV, q, ldq, nh, nkv, hd, k_cache, v_cache, block_size,          \
                                      block_tables, max_blocks, seq, ctx, scale, out, scratch,            \
                                      scratch_per_thread, window, runs, num_runs))                        \
                num_runs = 0;                                                                             \
        }                                                                                                 \
        int64_t *tiles;                                                                                   \
        const int64_t num_tiles = attention_tiles(seq, ctx, t, tile_tokens, runs, num_runs, &tiles);      \
        free(runs);                                                                                       \
        /* A tile's kv heads in a row on one thread (once there are tiles enough for every          \
         * thread): their rows share each slot's memory, so the later ones find it in cache      \
         * (~1.2x at 16-64 decodes on a cold cache). Which thread runs an item changes nothing. */ \
        const int64_t chunk = num_tiles >= 4 * omp_get_max_threads() ? nkv : 1;                          \
        _Pragma("omp parallel for schedule(dynamic, chunk) collapse(2)")                                  \
        for (int64_t it = 0; it < num_tiles; it++)                                                        \
            for (int64_t kvh = 0; kvh < nkv; kvh++)                                                       \
                attention_item(KK, KV, it, kvh, tiles, q, ldq, nh, hd, group, nkv, k_cache, v_cache,     \
                               block_size, block_tables, max_blocks, seq, ctx, scale, window, out,        \
                               scratch + (int64_t)omp_get_thread_num() * scratch_per_thread, row);        \
        free(tiles);                                                                                      \
    }

PAGED_ATTENTION_FN(hearth_paged_attention, KV_F32, KV_F32, float, float)
PAGED_ATTENTION_FN(hearth_paged_attention_f16, KV_F16, KV_F16, uint16_t, uint16_t)
PAGED_ATTENTION_FN(hearth_paged_attention_i8, KV_I8, KV_I8, int8_t, int8_t)
PAGED_ATTENTION_FN(hearth_paged_attention_f16_i8, KV_F16, KV_I8, uint16_t, int8_t)

int hearth_num_threads(void) { return omp_get_max_threads(); }

/* ------------------------------------------------------------------ LoRA */
/*
 * y[t] += scale[slot, s] * B[slot, rows of s] (A[slot, s] x[t]) for every token t whose slot
 * is >= 0 (-1: the base model), every shard s of the (possibly fused) output: the batched
 * LoRA term of one linear (kernels/reference_lora.py's contract) in two passes, shrink then
 * expand. A[slot, s] is [max_rank, in] and B[slot] [out, max_rank], zero past an adapter's
 * rank (a zero product adds nothing). Each token's sums run in a fixed order, alone or in
 * a batch. `h` is scratch of t * shards * max_rank floats.
 */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    float s = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

void hearth_lora(const float *x, int64_t t, int64_t ldx, int64_t in, const int32_t *slots, const float *lora_a,
                 const float *lora_b, const float *scales, const int32_t *row_shard, int64_t shards,
                 int64_t max_rank, int64_t out, float *y, int64_t ldy, float *h) {
    const int64_t sr = shards * max_rank;
#pragma omp parallel for schedule(static) collapse(2) if (t * sr * in > 65536)
    for (int64_t i = 0; i < t; i++) {
        for (int64_t j = 0; j < sr; j++) {
            const int32_t slot = slots[i];
            h[i * sr + j] = slot < 0 ? 0.0f : dot_f32(lora_a + (slot * sr + j) * in, x + i * ldx, in);
        }
    }
    const int64_t chunk = 64;
    const int64_t chunks = (out + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) collapse(2) if (t * out * max_rank > 65536)
    for (int64_t i = 0; i < t; i++) {
        for (int64_t c = 0; c < chunks; c++) {
            const int32_t slot = slots[i];
            if (slot < 0) continue;
            const int64_t end = (c + 1) * chunk < out ? (c + 1) * chunk : out;
            for (int64_t o = c * chunk; o < end; o++) {
                const int32_t s = row_shard[o];
                const float scale = scales[slot * shards + s];
                if (scale == 0.0f) continue;
                y[i * ldy + o] += scale * dot_f32(lora_b + (slot * out + o) * max_rank, h + i * sr + s * max_rank,
                                                  max_rank);
            }
        }
    }
}

/* ------------------------------------------------------------------ embedding */

/* out[r] = table[ids[r]] widened exactly to float32, for T rows of width h. kind: the
 * table's element type, EMBED_F32, or the packed kinds' codes for float16 (2) and
 * bfloat16 (3): a table held in the checkpoint's 16 bits (engine/layers/weight_storage.py);
 * or EMBED_BLOCKS + a `hearth_dequantize_gguf` kind: a GGUF's rows in that format (Q8_0,
 * a Q4_K_M file's Q4_K, ...), each dequantized as gguf-py does, not quantized again. */
enum { EMBED_F32 = 0, EMBED_F16 = 2, EMBED_BF16 = 3, EMBED_BLOCKS = 16 };
void hearth_embedding(const int64_t *ids, int64_t t, const void *table, int64_t h, int64_t kind,
                      float *out) {
    for (int64_t r = 0; r < t; r++) {
        float *o = out + r * h;
        if (kind >= EMBED_BLOCKS) {
            const int64_t code = kind - EMBED_BLOCKS, values = gguf_block_values(code);
            const int64_t size = gguf_block_bytes(code), nb = h / values;
            const uint8_t *row = (const uint8_t *)table + ids[r] * nb * size;
            for (int64_t b = 0; b < nb; b++) dequant_block(code, row + b * size, o + b * values);
            continue;
        }
        if (kind == EMBED_F32) {
            memcpy(o, (const float *)table + ids[r] * h, (size_t)h * sizeof(float));
            continue;
        }
        /* 16-bit rows: the weight kernels' own exact widening (load_f16 / load_bf16), 8 at
         * a time, then the tail one by one. */
        const uint16_t *row = (const uint16_t *)table + ids[r] * h;
        const int f16 = kind == EMBED_F16;
        int64_t j = 0;
        for (; j + 8 <= h; j += 8) {
            const uint8_t *p = (const uint8_t *)(row + j);
            _mm256_storeu_ps(o + j, f16 ? load_f16(p) : load_bf16(p));
        }
        for (; j < h; j++) {
            const uint32_t bits = (uint32_t)row[j] << 16;
            if (f16)
                o[j] = _cvtsh_ss(row[j]);
            else
                memcpy(o + j, &bits, sizeof bits);
        }
    }
}

/* ------------------------------------------------------------------ step programs */
/*
 * A step program is the model's own forward, recorded once from the same kernel calls the
 * eager path makes (kernels/cpu/program.py), replayed here with one call per step: the
 * per-op trip through Python (module call, wrapper checks, tensor allocation, ctypes)
 * costs more than the kernels themselves at one or a few tokens. Nothing here knows the
 * architecture: it runs a list of kernel calls whose row count is the step's token
 * count. An operand is a persistent pointer (weights, caches, tables) or a column offset
 * into one of the step's row buffers (`bufs[slot] + row * width + off`).
 */
enum {
    OP_EMBED = 1,
    OP_RMS_NORM,
    OP_ADD_RMS_NORM,
    OP_LINEAR_F32,
    OP_LINEAR_Q8A,
    OP_ROPE,
    OP_KV_WRITE,
    OP_ATTENTION,
    OP_SILU_MUL,
    OP_LINEAR_BF16,
    OP_LORA,
    OP_HEAD_NORM,
    OP_MOE,
    OP_GELU_MUL,
};

typedef struct {
    int32_t code;
    int32_t kind;       /* linear: 0 = Q4_1, 1 = Q8_0, 2 = F16, 3 = BF16 */
    int64_t slot[4];    /* operand buffer slots; -1: the operand is ptr[j] */
    int64_t off[4];     /* float offset of the operand inside its buffer's row */
    int64_t ld[4];      /* row stride of the operand (floats) */
    const void *ptr[4]; /* persistent operands */
    int64_t i[4];       /* sizes: see each op */
    float f[2];         /* eps, scale */
    const void *aux;    /* a second persistent operand (OP_LINEAR_BF16: the float32 kernel's blocks) */
    const void *aux2;   /* a third (OP_LORA: each output row's shard) */
} hearth_op;

typedef struct {
    int64_t t;
    float *const *bufs;
    const int64_t *ids, *positions, *slots;
    const int32_t *tables, *seq, *ctx;
    int64_t max_blocks, block_size;
    float *att_scratch;
    int64_t att_per_thread;
    uint8_t *q8_scratch;
    int64_t amx_min_t;
    const int32_t *lora_slots; /* each token's adapter slot (-1: the base); NULL: no LoRA op runs */
    float *lora_scratch;       /* t * (shards * max_rank) floats of the widest LoRA op */
    float *moe_scratch;        /* the widest MoE op's scratch for t tokens (`hearth_moe_block`) */
    int64_t *moe_order;
} hearth_step;

void hearth_moe_block(const float *x, int64_t ldx, const float *logits, int64_t ldl, int64_t t, int64_t top_k,
                      int64_t renorm, const int64_t *table, float *out, int64_t ldo, float *scratch,
                      int64_t *order);

void hearth_q8a_gemm(int32_t kind, const float *x, int64_t t, int64_t ldx, int64_t k, const uint8_t *w,
                     int64_t n, const float *bias, float *out, int64_t ldo, uint8_t *scratch,
                     int64_t amx_min_t);

int hearth_bf16_linear(int32_t kind, const float *x, int64_t t, int64_t ldx, int64_t k, const uint16_t *w,
                       int64_t n, const float *bias, float *out, int64_t ldo, int64_t q_min_t);

static inline void linear_f32(int32_t kind, const float *x, int64_t t, int64_t ldx, int64_t k, const uint8_t *w,
                              int64_t n, const float *bias, float *out, int64_t ldo) {
    if (kind == 0)
        hearth_q4_1_gemm(x, t, ldx, k, w, n, bias, out, ldo);
    else if (kind == 1)
        hearth_q8_0_gemm(x, t, ldx, k, w, n, bias, out, ldo);
    else if (kind == 2)
        hearth_f16_gemm(x, t, ldx, k, w, n, bias, out, ldo);
    else
        hearth_bf16w_gemm(x, t, ldx, k, w, n, bias, out, ldo);
}

static inline float *operand(const hearth_op *op, const hearth_step *st, int j) {
    if (op->slot[j] < 0) return (float *)op->ptr[j];
    return st->bufs[op->slot[j]] + op->off[j];
}

void hearth_run_program(const hearth_op *ops, int64_t n_ops, const hearth_step *st) {
    const int64_t t = st->t;
    for (int64_t n = 0; n < n_ops; n++) {
        const hearth_op *op = ops + n;
        float *a = operand(op, st, 0), *b = operand(op, st, 1), *c = operand(op, st, 2);
        float *d = operand(op, st, 3);
        switch (op->code) {
        case OP_EMBED: /* table = a (persistent, element type `kind`), out = c; i0 = width; f0: a
                        * scale of the rows (Gemma's sqrt(hidden)), 0: none */
            hearth_embedding(st->ids, t, a, op->i[0], op->kind, c);
            if (op->f[0] != 0.0f)
                for (int64_t j = 0; j < t * op->i[0]; j++) c[j] *= op->f[0];
            break;
        case OP_GELU_MUL: /* gate_up = a, out = c; i0 = inter */
            hearth_gelu_tanh_mul(a, c, t, op->i[0]);
            break;
        case OP_RMS_NORM: /* x = a, w = b, out = c; i0 = width */
            hearth_rms_norm(a, b, c, t, op->i[0], op->f[0]);
            break;
        case OP_MOE: /* x = a, router logits = b, out = c; aux = the experts' table; i0 = top_k, i1 = renorm */
            hearth_moe_block(a, op->ld[0], b, op->ld[1], t, op->i[0], op->i[1], (const int64_t *)op->aux, c,
                             op->ld[2], st->moe_scratch, st->moe_order);
            break;
        case OP_HEAD_NORM: /* x = a (stride ld0), w = b, out = c; i0 = heads, i1 = head width */
            hearth_head_rms_norm(a, op->ld[0], b, c, t, op->i[0], op->i[1], op->f[0]);
            break;
        case OP_ADD_RMS_NORM: /* x = a, residual = b, w = c */
            hearth_add_rms_norm(a, b, c, t, op->i[0], op->f[0]);
            break;
        case OP_LINEAR_F32: /* x = a, w = b, bias = d, out = c; i0 = k, i1 = n */
            linear_f32(op->kind, a, t, op->ld[0], op->i[0], (const uint8_t *)b, op->i[1], d, c, op->ld[2]);
            break;
        case OP_LINEAR_BF16: /* tiles = b, blocks = aux; i2 = min_t (fewer tokens: the blocks),
                              * i3 = the Q-tiles' min_t (0: b holds none) */
            if (t < op->i[2] || !hearth_bf16_linear(op->kind, a, t, op->ld[0], op->i[0], (const uint16_t *)b,
                                                    op->i[1], d, c, op->ld[2], op->i[3]))
                linear_f32(op->kind, a, t, op->ld[0], op->i[0], (const uint8_t *)op->aux, op->i[1], d, c,
                           op->ld[2]);
            break;
        case OP_LINEAR_Q8A:
            hearth_q8a_gemm(op->kind, a, t, op->ld[0], op->i[0], (const uint8_t *)b, op->i[1], d, c,
                            op->ld[2], st->q8_scratch, st->amx_min_t);
            break;
        case OP_ROPE: /* x = a; i0 = heads, i1 = head_dim; cos_sin = b */
            hearth_rope(a, t, op->ld[0], op->i[0], op->i[1], st->positions, b);
            break;
        case OP_KV_WRITE: /* k = a, v = b, k_cache = c, v_cache = d; i0 = width, i1 = head_dim;
                           * kind 1: fp16, 2: int8, 3: fp16 keys and int8 values */
            if (op->kind == KV_F16_I8)
                hearth_kv_write_f16_i8(a, op->ld[0], b, op->ld[1], t, op->i[0] / op->i[1], op->i[1],
                                       (uint16_t *)c, (int8_t *)d, st->slots);
            else if (op->kind == KV_I8)
                hearth_kv_write_i8(a, op->ld[0], b, op->ld[1], t, op->i[0] / op->i[1], op->i[1], (int8_t *)c,
                                   (int8_t *)d, st->slots);
            else if (op->kind == 1)
                hearth_kv_write_f16(a, op->ld[0], b, op->ld[1], t, op->i[0], (uint16_t *)c,
                                    (uint16_t *)d, st->slots);
            else
                hearth_kv_write(a, op->ld[0], b, op->ld[1], t, op->i[0], c, d, st->slots);
            break;
        case OP_ATTENTION: /* q = a, k_cache = b, v_cache = c, out = d; i0..3 = nh, nkv, hd, window;
                            * kind & 3: the KV kind (KV_F32, KV_F16, KV_I8, KV_F16_I8), kind >> 2: the bfloat16
                            * kernel's min run (0: never) */
            if ((op->kind & 3) == KV_F16_I8)
                hearth_paged_attention_f16_i8(a, t, op->ld[0], op->i[0], op->i[1], op->i[2], (const uint16_t *)b,
                                              (const int8_t *)c, st->block_size, st->tables, st->max_blocks,
                                              st->seq, st->ctx, op->f[1], d, st->att_scratch,
                                              st->att_per_thread, op->i[3], op->kind >> 2);
            else if ((op->kind & 3) == KV_I8)
                hearth_paged_attention_i8(a, t, op->ld[0], op->i[0], op->i[1], op->i[2], (const int8_t *)b,
                                          (const int8_t *)c, st->block_size, st->tables, st->max_blocks, st->seq,
                                          st->ctx, op->f[1], d, st->att_scratch, st->att_per_thread, op->i[3],
                                          op->kind >> 2);
            else if ((op->kind & 3) == KV_F16)
                hearth_paged_attention_f16(a, t, op->ld[0], op->i[0], op->i[1], op->i[2],
                                           (const uint16_t *)b, (const uint16_t *)c, st->block_size,
                                           st->tables, st->max_blocks, st->seq, st->ctx, op->f[1], d,
                                           st->att_scratch, st->att_per_thread, op->i[3], op->kind >> 2);
            else
                hearth_paged_attention(a, t, op->ld[0], op->i[0], op->i[1], op->i[2], b, c,
                                       st->block_size, st->tables, st->max_blocks, st->seq, st->ctx,
                                       op->f[1], d, st->att_scratch, st->att_per_thread, op->i[3],
                                       op->kind >> 2);
            break;
        case OP_LORA: /* x = a, lora_a = b, y = c (in place), lora_b = d; aux = scales, aux2 = row_shard;
                       * i0 = in, i1 = out, i2 = max_rank, i3 = shards */
            if (st->lora_slots)
                hearth_lora(a, t, op->ld[0], op->i[0], st->lora_slots, b, d, (const float *)op->aux,
                            (const int32_t *)op->aux2, op->i[3], op->i[2], op->i[1], c, op->ld[2], st->lora_scratch);
            break;
        case OP_SILU_MUL: /* gate_up = a, out = c; i0 = inter */
            hearth_silu_mul(a, c, t, op->i[0]);
            break;
        default:
            break;
        }
    }
}

/* ------------------------------------------------------------------ MoE experts */
/*
 * A MoE layer's routed experts in one call, on packed expert weights (any `linear_f32`
 * kind, per expert): out[t] = sum_j weights[t, j] * down_e(silu_mul(gate_up_e(x[t]))),
 * e = ids[t, j]. The Python loop over experts (engine/layers/moe.py ExpertLinearsMoEMethod:
 * index_select, two linears, the activation, index_copy per expert) cost more than the
 * GEMMs at decode batches: a Qwen3-MoE layer routes 16 tokens to up to 64 experts.
 * Slots are grouped by expert as `moe_combine` groups them (a stable counting sort), each
 * expert's rows run through the batch-invariant GEMMs, and a token's k weighted outputs are
 * summed in slot order: a token's result does not depend on the batch.
 * scratch: t * top_k * (2 * h + 3 * inter) floats; order: t * top_k int64.
 */
static void moe_experts(const float *x, int64_t ldx, int64_t t, int64_t h, int64_t inter, int64_t top_k,
                        const int64_t *ids, const float *weights, int64_t n_experts, const int32_t *kind13,
                        const uint8_t *const *w13, const float *const *b13, const int32_t *kind2,
                        const uint8_t *const *w2, const float *const *b2, float *out, int64_t ldo, float *scratch,
                        int64_t *order) {
    const int64_t slots = t * top_k;
    float *xe = scratch, *gu = xe + slots * h, *act = gu + slots * 2 * inter, *per_slot = act + slots * inter;
    int64_t start = 0;
    for (int64_t e = 0; e < n_experts; e++) { /* slots of expert e, in slot order */
        int64_t n = 0;
        for (int64_t s = 0; s < slots; s++)
            if (ids[s] == e) order[start + n++] = s;
        if (n == 0) continue;
        const int64_t *mine = order + start;
        start += n;
        for (int64_t r = 0; r < n; r++) memcpy(xe + r * h, x + (mine[r] / top_k) * ldx, h * sizeof(float));
        linear_f32(kind13[e], xe, n, h, h, w13[e], 2 * inter, b13[e], gu, 2 * inter);
        hearth_silu_mul(gu, act, n, inter);
        linear_f32(kind2[e], act, n, inter, inter, w2[e], h, b2[e], xe, h);
        for (int64_t r = 0; r < n; r++) {
            const float w = weights[mine[r]];
            const float *y = xe + r * h;
            float *o = per_slot + mine[r] * h;
            for (int64_t c = 0; c < h; c++) o[c] = y[c] * w;
        }
    }
#pragma omp parallel for schedule(static) if (t > 1)
    for (int64_t r = 0; r < t; r++) {
        float *o = out + r * ldo;
        memcpy(o, per_slot + r * top_k * h, h * sizeof(float));
        for (int64_t j = 1; j < top_k; j++) {
            const float *p = per_slot + (r * top_k + j) * h;
            for (int64_t c = 0; c < h; c++) o[c] += p[c];
        }
    }
}

void hearth_moe_experts(const float *x, int64_t t, int64_t h, int64_t inter, int64_t top_k, const int64_t *ids,
                        const float *weights, int64_t n_experts, const int32_t *kind13,
                        const uint8_t *const *w13, const float *const *b13, const int32_t *kind2,
                        const uint8_t *const *w2, const float *const *b2, float *out, float *scratch,
                        int64_t *order) {
    moe_experts(x, h, t, h, inter, top_k, ids, weights, n_experts, kind13, w13, b13, kind2, w2, b2, out, h,
                scratch, order);
}

/* A token's router (engine/layers/moe.py TopKRouter, "softmax_topk"): softmax of its E
 * logits in float32 (the maximum subtracted, the sum in expert order), the k largest
 * (a tie to the lower expert), renormalised over the k when `renorm`. The ids are
 * transformers' (the softmax keeps the logits' order); a weight may differ from torch's
 * in its last bits (another exp), as the activation's already did. */
static void moe_route(const float *logits, int64_t n_experts, int64_t top_k, int renorm, int64_t *ids, float *w) {
    uint64_t taken[(MOE_MAX_EXPERTS + 63) / 64] = {0};
    for (int64_t j = 0; j < top_k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n_experts; e++)
            if (!(taken[e >> 6] >> (e & 63) & 1) && (best < 0 || logits[e] > logits[best])) best = e;
        taken[best >> 6] |= 1ull << (best & 63);
        ids[j] = best;
    }
    const float top = logits[ids[0]];
    float sum = 0.0f;
    for (int64_t e = 0; e < n_experts; e++) sum += expf(logits[e] - top);
    float kept = 0.0f;
    for (int64_t j = 0; j < top_k; j++) {
        w[j] = expf(logits[ids[j]] - top) / sum;
        kept += w[j];
    }
    if (renorm)
        for (int64_t j = 0; j < top_k; j++) w[j] /= kept;
}

/* A MoE block from its router's logits: each token routed (`moe_route`), then the experts
 * (`moe_experts`). `table`: n_experts, h, inter, then the addresses of the six per-expert
 * tables of `hearth_moe_experts` (ops.PackedExperts.table). scratch: t * top_k * (2 h +
 * 3 inter + 1) floats; order: 2 t * top_k int64. The step program's OP_MOE. */
void hearth_moe_block(const float *x, int64_t ldx, const float *logits, int64_t ldl, int64_t t, int64_t top_k,
                      int64_t renorm, const int64_t *table, float *out, int64_t ldo, float *scratch,
                      int64_t *order) {
    const int64_t n_experts = table[0], h = table[1], inter = table[2], slots = t * top_k;
    int64_t *ids = order + slots;
    float *weights = scratch + slots * (2 * h + 3 * inter);
    for (int64_t r = 0; r < t; r++)
        moe_route(logits + r * ldl, n_experts, top_k, (int)renorm, ids + r * top_k, weights + r * top_k);
    moe_experts(x, ldx, t, h, inter, top_k, ids, weights, n_experts, (const int32_t *)table[3],
                (const uint8_t *const *)table[4], (const float *const *)table[5], (const int32_t *)table[6],
                (const uint8_t *const *)table[7], (const float *const *)table[8], out, ldo, scratch, order);
}
