/*
 * hearth_bf16.c: linear layers on the AMX-BF16 matrix units (Sapphire Rapids and newer), or
 * with AVX512-BF16 dot products (VDPBF16PS) on hosts that have those but no AMX.
 *
 * Why: on an AMX host the float32 block kernels (hearth_cpu.c) are compute-bound from a
 * few tokens up: a step of 16-64 decode tokens, and every prefill, spends its time in
 * FMAs a tile unit does 16x faster. Here each weight is stored once as bfloat16 in the
 * B-tile layout and every product is a TDPBF16PS (16 tokens x 16 outputs x 32 inputs per
 * instruction) accumulated in float32 tiles across the whole row, with no per-block fold.
 *
 * Precision contract (docs/performance.md, "Precision"): each weight is the dequantized
 * float32 weight (d*q + m of the GGUF block, as gguf-py computes it) rounded once to
 * bfloat16 (nearest-even), each activation is rounded once to bfloat16 (nearest-even,
 * VCVTNE2PS2BF16), products are exact and sums are float32 in the unit's own order (the
 * AMX and the AVX512-BF16 orders differ, so the two paths agree to rounding, not bitwise).
 * A token's result depends only on its own row (tile rows never mix), so it does not
 * change with batch size or thread count *within this kernel*; the engine's gguf-bf16 mode
 * runs it only from `min_t` tokens up (the float32 kernels below that), so batch
 * invariance across that threshold is not claimed (docs/performance.md says so).
 *
 * Packed layout of an [N, K] weight: N padded to 16 (groups of 16 outputs), K to 32
 * (chunks); group g, chunk c is one 1 KB B tile: row p (0..15) holds, for each of the 16
 * outputs j, the pair (W[16g + j][32c + 2p], W[16g + j][32c + 2p + 1]). Groups one after
 * the other, chunks in K order inside a group; padding is zero.
 */
#include <errno.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#define BK 32 /* K per tile: 16 bfloat16 pairs */
#define BN 16 /* outputs per B / C tile */
#define BM 16 /* tokens per A / C tile */
#define BLOCK_PAIRS 8 /* token-tile pairs and output-group pairs per cache block (256 x 256) */

static inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

/* A per-thread scratch buffer that only grows: the activation tiles of every call. A fresh
 * aligned_alloc per call of a few MB is an mmap whose pages the kernel zeroes on first touch
 * and unmaps after: that cost about as much as the conversion itself (prefill, 2026-12-02). */
static _Thread_local uint8_t *scratch_buf;
static _Thread_local size_t scratch_cap;

static uint8_t *scratch_of(size_t bytes) {
    if (bytes > scratch_cap) {
        const size_t step = (size_t)2 << 20, cap = (bytes + step - 1) / step * step;
        free(scratch_buf);
        scratch_buf = (uint8_t *)aligned_alloc(step, cap);
        scratch_cap = scratch_buf ? cap : 0;
    }
    return scratch_buf;
}

int64_t hearth_bf16_packed_bytes(int64_t n, int64_t k) { return round_up(n, BN) * round_up(k, BK) * 2; }

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* w: [n, k] float32, row-major (the dequantized weight). */
void hearth_pack_bf16(const float *w, int64_t n, int64_t k, uint16_t *dst) {
    const int64_t groups = round_up(n, BN) / BN, chunks = round_up(k, BK) / BK;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t c = 0; c < chunks; c++) {
            uint16_t *tile = dst + (g * chunks + c) * (BK * BN);
            for (int p = 0; p < BK / 2; p++)
                for (int j = 0; j < BN; j++)
                    for (int e = 0; e < 2; e++) {
                        const int64_t row = g * BN + j, col = c * BK + 2 * p + e;
                        tile[p * 2 * BN + 2 * j + e] = (row < n && col < k) ? bf16_round(w[row * k + col]) : 0;
                    }
        }
    }
}

/*
 * Q-tiles: a GGUF Q4_1 / Q8_0 weight re-laid so that a B tile (the layout above) is built from
 * it on the fly, in L1, with a few vector instructions per tile row: the bytes a step streams
 * are the 4- or 8-bit blocks, not bfloat16 (3.2x / 1.9x fewer), which is what bounds a step of
 * 16-128 tokens (the tiles are idle waiting for weights there). Group g (16 outputs), chunk c
 * (32 inputs: one GGUF block of each output) is one record of:
 *   16 fp16 scales d_j, then (Q4_1) 16 fp16 mins m_j, then the quants by tile row: row p
 *   (0..15) holds the row's 32 elements e = 2j + s (output 16g + j, input 32c + 2p + s):
 *   Q4_1: 16 bytes, element e in the low nibble of byte e (e < 16) or the high nibble of
 *   byte e - 16; Q8_0: 32 int8, element e in byte e.
 * The value is d*q + m (Q4_1) or d*q (Q8_0) in float32, as gguf-py dequantizes (the
 * product of an fp16 scale and a 4- or 8-bit quant is exact, so a fused multiply-add rounds
 * the same), then rounded once to bfloat16: bit for bit the tile hearth_pack_bf16 makes
 * from the dequantized weight. Rows past n are zero (d = m = 0).
 */
#define Q4_RECORD 320 /* 32 + 32 + 16 * 16 */
#define Q8_RECORD 544 /* 32 + 16 * 32 */

static inline int64_t q_record(int32_t kind) { return kind == 0 ? Q4_RECORD : Q8_RECORD; }

int64_t hearth_qtiles_bytes(int32_t kind, int64_t n, int64_t k) {
    return round_up(n, BN) / BN * (k / BK) * q_record(kind);
}

/* raw: GGUF rows, [n, k / 32 * (20 | 34)] bytes (Q4_1: fp16 d, fp16 m, 16 bytes of nibbles,
 * quant i in the low nibble of byte i for i < 16, else the high nibble of byte i - 16;
 * Q8_0: fp16 d, 32 int8). k must be a multiple of 32. */
void hearth_pack_qtiles(int32_t kind, const uint8_t *raw, int64_t n, int64_t k, uint8_t *dst) {
    const int64_t groups = round_up(n, BN) / BN, chunks = k / BK, rec = q_record(kind);
    const int64_t block = kind == 0 ? 20 : 34, row_bytes = chunks * block;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t c = 0; c < chunks; c++) {
            uint8_t *r = dst + (g * chunks + c) * rec;
            memset(r, 0, (size_t)rec);
            for (int j = 0; j < BN; j++) {
                const int64_t row = g * BN + j;
                if (row >= n) continue;
                const uint8_t *b = raw + row * row_bytes + c * block;
                memcpy(r + 2 * j, b, 2); /* d */
                if (kind == 0) {
                    memcpy(r + 32 + 2 * j, b + 2, 2); /* m */
                    for (int p = 0; p < BK / 2; p++)
                        for (int s = 0; s < 2; s++) {
                            const int i = 2 * p + s, e = 2 * j + s;
                            const uint8_t q = i < 16 ? (b[4 + i] & 15) : (b[4 + i - 16] >> 4);
                            uint8_t *byte = r + 64 + p * 16 + (e & 15);
                            *byte |= e < 16 ? q : (uint8_t)(q << 4);
                        }
                } else {
                    for (int p = 0; p < BK / 2; p++)
                        for (int s = 0; s < 2; s++) r[32 + p * 32 + 2 * j + s] = b[2 + 2 * p + s];
                }
            }
        }
    }
}

/* Which bfloat16 path this build has: 2 = AMX-BF16 tiles (AVX512-BF16 where the kernel refuses
 * the tile state), 1 = AVX512-BF16 (VDPBF16PS), 0 = none (callers use the float32 kernels). */
int hearth_bf16_isa(void) {
#if defined(__AMX_BF16__)
    return 2;
#elif defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512BF16__
/* 32 floats (the first `left` of them; the rest read as zero) -> 32 bfloat16, nearest-even. */
static inline void bf16_chunk(const float *src, int64_t left, uint16_t *dst) {
    const __mmask16 m0 = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
    const __mmask16 m1 = left >= 32 ? 0xFFFF : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
    const __m512 lo = _mm512_maskz_loadu_ps(m0, src);
    const __m512 hi = _mm512_maskz_loadu_ps(m1, src + 16);
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/*
 * The AVX512-BF16 kernel (hosts with VDPBF16PS but no AMX, e.g. AMD Zen 4/5): the same
 * packed tiles, read a B-tile row (16 outputs x one bfloat16 pair) per instruction. A
 * register tile is VT tokens x VG groups of 16 outputs; each step broadcasts a token's
 * activation pair and does VT x VG VDPBF16PS. Rows never mix, so a token's result does not
 * depend on the batch or the thread count either. A column (VG groups, all token tiles)
 * reads its weights from memory in its first pass and from L2 in the others; those later
 * passes prefetch the thread's next column into L2 (`pf`), so the stream overlaps the
 * products. Columns are split evenly between the threads, each walking its own in order,
 * so the column a thread prefetches is the one it computes next (Zen 5, weights cold, 16
 * tokens: the LM head 1.90 -> 1.65 ms, qkv 56 -> 43 us, down 81 -> 68 us; docs/performance.md,
 * stop 30).
 */
#define VT 4
#define VG 4

static inline __attribute__((always_inline)) void vec_tile(const int nt, const int ng, const uint16_t *a,
                                                           int64_t kp, const uint16_t *w, int64_t chunks,
                                                           __m512 *acc, const char *pf, int64_t pf_lines) {
    for (int i = 0; i < VT * VG; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        for (int64_t line = 0; line < pf_lines; line++) _mm_prefetch(pf + (c * pf_lines + line) * 64, _MM_HINT_T1);
        for (int p = 0; p < BK / 2; p++) {
            __m512bh b[VG];
            for (int g = 0; g < ng; g++)
                b[g] = (__m512bh)_mm512_loadu_si512(w + (g * chunks + c) * (BK * BN) + p * 2 * BN);
            for (int r = 0; r < nt; r++) {
                uint32_t pair;
                memcpy(&pair, a + r * kp + c * BK + 2 * p, 4);
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int g = 0; g < ng; g++) acc[r * VG + g] = _mm512_dpbf16_ps(acc[r * VG + g], x, b[g]);
            }
        }
    }
}

#define VEC_CASE(NT, NG) \
    case (NT) * 8 + (NG): vec_tile(NT, NG, a, kp, w, chunks, acc, pf, pf_lines); break;
#define VEC_ROW(NT) VEC_CASE(NT, 1) VEC_CASE(NT, 2) VEC_CASE(NT, 3) VEC_CASE(NT, 4)

static void vec_dispatch(int nt, int ng, const uint16_t *a, int64_t kp, const uint16_t *w, int64_t chunks,
                         __m512 *acc, const char *pf, int64_t pf_lines) {
    switch (nt * 8 + ng) {
        VEC_ROW(1)
        VEC_ROW(2)
        VEC_ROW(3)
        VEC_ROW(4)
    default:
        break;
    }
}

/* Activations -> bfloat16 rows of kp columns (zero padded). */
static void rows_bf16(const float *x, int64_t t, int64_t ldx, int64_t k, int64_t kp, uint16_t *a) {
#pragma omp parallel for schedule(static) if (t * k > 65536)
    for (int64_t r = 0; r < t; r++) {
        for (int64_t c = 0; c < kp; c += 32) bf16_chunk(x + r * ldx + c, k - c, a + r * kp + c);
    }
}

static int vec_bf16_gemm(const float *x, int64_t t, int64_t ldx, int64_t k, const uint16_t *w, int64_t n,
                         const float *bias, float *out, int64_t ldo) {
    const int64_t kp = round_up(k, BK), chunks = kp / BK, groups = round_up(n, BN) / BN;
    uint16_t *a = (uint16_t *)scratch_of((size_t)(t * kp * 2 + 64));
    if (!a) return 0;
    rows_bf16(x, t, ldx, k, kp, a);
    /* passes: the chunk steps of a column after its first token tile, which share the prefetch */
    const int64_t tiles_t = (t + VT - 1) / VT, passes = (tiles_t - 1) * chunks;
    /* Each thread takes an equal run of output groups and walks it a column (VG groups, every
     * token tile) at a time: a column's first pass reads its weights from memory, the later
     * ones from L2, and those later passes prefetch the thread's own next column into L2, a
     * share per pass, so the stream overlaps the products. */
#pragma omp parallel
    {
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t g_end = groups * (me + 1) / nth;
        for (int64_t g0 = groups * me / nth; g0 < g_end; g0 += VG) {
            const int ng = (int)(g_end - g0 < VG ? g_end - g0 : VG);
            const uint16_t *wg = w + g0 * chunks * (BK * BN);
            const int64_t next_ng = g_end - g0 - ng < VG ? g_end - g0 - ng : VG;
            const int64_t next_lines = next_ng * chunks * (BK * BN * 2) / 64;
            const int64_t pf_step = passes > 0 ? (next_lines + passes - 1) / passes : 0;
            for (int64_t tt = 0; tt < tiles_t; tt++) {
                const int64_t t0 = tt * VT;
                const int nt = (int)(t - t0 < VT ? t - t0 : VT);
                const char *pf = NULL;
                int64_t pf_lines = 0;
                if (tt > 0 && next_ng > 0) {
                    pf_lines = pf_step;
                    pf = (const char *)(wg + ng * chunks * (BK * BN)) + (tt - 1) * chunks * pf_lines * 64;
                }
                __m512 acc[VT * VG];
                vec_dispatch(nt, ng, a + t0 * kp, kp, wg, chunks, acc, pf, pf_lines);
                for (int r = 0; r < nt; r++)
                    for (int g = 0; g < ng; g++) {
                        const int64_t col = (g0 + g) * BN, cols = n - col < BN ? n - col : BN;
                        const __mmask16 mask = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
                        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
                        _mm512_mask_storeu_ps(out + (t0 + r) * ldo + col, mask,
                                              _mm512_add_ps(acc[r * VG + g], bv));
                    }
            }
        }
    }
    return 1;
}
#endif

#ifdef __AMX_BF16__
/* The tile state is granted per process by the int8 file's request (hearth_q8.c): the
 * same XTILEDATA permission covers every AMX instruction. 1 = usable, < 0 = -errno. */
int hearth_q8a_amx_status(void);

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) bf16_tile_config;

/* tmm0-3: C (two token tiles x two output groups), tmm4-5: A, tmm6-7: B; all 16 x 64 B. */
static void bf16_config(void) {
    bf16_tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.rows[i] = 16, c.colsb[i] = 64;
    _tile_loadconfig(&c);
}

/* Activations -> bfloat16 A tiles: token tile r / 16, chunk c at a + (r / 16 * chunks + c) * 512,
 * row r % 16 inside (zero padded to whole tiles). Each tile is 1 KB contiguous, so a tile load
 * reads one stream the prefetcher follows, as the weights' tiles do. */
static void activations_bf16(const float *x, int64_t t, int64_t ldx, int64_t k, int64_t chunks, int64_t tp,
                             uint16_t *a) {
#pragma omp parallel for schedule(static) if (t * k > 65536)
    for (int64_t r = 0; r < tp; r++) {
        uint16_t *row = a + (r / BM) * chunks * (BM * BK) + (r % BM) * BK;
        const float *xr = x + r * ldx;
        for (int64_t c = 0; c < chunks; c++) bf16_chunk(xr + c * BK, r < t ? k - c * BK : 0, row + c * (BM * BK));
    }
}

/* One C tile's 16 x 16 floats (in `buf`) to out rows [r0, r0 + rows), outputs [col, col + cols). */
static inline void store_tile(const float *buf, float *out, int64_t ldo, int64_t rows, int64_t col, int64_t cols,
                              const float *bias) {
    const __mmask16 mask = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++)
        _mm512_mask_storeu_ps(out + r * ldo + col, mask, _mm512_add_ps(_mm512_load_ps(buf + 16 * r), bv));
}

/* Chunks ahead whose B tiles are prefetched into L1: the weights are the operand that comes
 * from L3 or memory (each is read once per step); 4 measured best of 0/2/4/8/16 (T0 and T1). */
#define B_PREFETCH 4

/* Chunk c's B tiles of an item's one or two output groups into L1 (past the end of the
 * weight a prefetch is a no-op: it never faults). */
static inline __attribute__((always_inline)) void prefetch_b(const uint16_t *b0, int64_t chunks, int64_t c,
                                                              int two_g) {
    const char *p0 = (const char *)(b0 + c * (BK * BN)), *p1 = (const char *)(b0 + (chunks + c) * (BK * BN));
    for (int line = 0; line < BK * BN * 2; line += 64) {
        _mm_prefetch(p0 + line, _MM_HINT_T0);
        if (two_g) _mm_prefetch(p1 + line, _MM_HINT_T0);
    }
}

/* The four (or fewer) C tiles of one item (tmm0-3), accumulated over every K chunk in
 * order; the loads sit between the products so each waits only for the products before it.
 * HOOK runs once per chunk, among the products (a prefetch, or building the next B tiles). */
#define ITEM_LOOP(TWO_T, TWO_G, HOOK)                                             \
    do {                                                                          \
        _tile_zero(0);                                                            \
        if (TWO_G) _tile_zero(1);                                                 \
        if (TWO_T) _tile_zero(2);                                                 \
        if (TWO_T && TWO_G) _tile_zero(3);                                        \
        for (int64_t c = 0; c < chunks; c++) {                                    \
            HOOK;                                                                 \
            _tile_loadd(4, a0 + c * (BM * BK), 64);                               \
            _tile_loadd(6, b0 + c * (BK * BN), 64);                               \
            _tile_dpbf16ps(0, 4, 6);                                              \
            if (TWO_G) _tile_loadd(7, b0 + chunks * (BK * BN) + c * (BK * BN), 64); \
            if (TWO_G) _tile_dpbf16ps(1, 4, 7);                                   \
            if (TWO_T) _tile_loadd(5, a0 + chunks * (BM * BK) + c * (BM * BK), 64); \
            if (TWO_T) _tile_dpbf16ps(2, 5, 6);                                   \
            if (TWO_T && TWO_G) _tile_dpbf16ps(3, 5, 7);                          \
        }                                                                         \
    } while (0)

#define ITEM_BODY_TILES(TWO_T, TWO_G) ITEM_LOOP(TWO_T, TWO_G, prefetch_b(b0, chunks, c + B_PREFETCH, TWO_G))

/* ITEM_BODY_TILES, then its C tiles to `cbuf` (16 x 16 floats each, in order). */
#define ITEM_BODY(TWO_T, TWO_G)                                                   \
    do {                                                                          \
        ITEM_BODY_TILES(TWO_T, TWO_G);                                            \
        _tile_stored(0, cbuf, 64);                                                \
        if (TWO_G) _tile_stored(1, cbuf + 256, 64);                               \
        if (TWO_T) _tile_stored(2, cbuf + 512, 64);                               \
        if (TWO_T && TWO_G) _tile_stored(3, cbuf + 768, 64);                      \
    } while (0)

static void amx_item(int two_t, int two_g, const uint16_t *a0, const uint16_t *b0, int64_t chunks, float *cbuf) {
    if (two_t && two_g)
        ITEM_BODY(1, 1);
    else if (two_t)
        ITEM_BODY(1, 0);
    else if (two_g)
        ITEM_BODY(0, 1);
    else
        ITEM_BODY(0, 0);
}

/* The four C tiles of a whole item (32 tokens x 32 outputs) straight into `out` (rows ldo
 * floats apart), bias added in place after: the same sums as amx_item + store_edge without
 * the copy through a buffer, which cost ~20 % of the kernel at 64-2048 tokens. */
static inline void store_direct(float *o, int64_t ldo, const float *bias) {
    const int64_t stride = ldo * (int64_t)sizeof(float);
    _tile_stored(0, o, stride);
    _tile_stored(1, o + BN, stride);
    _tile_stored(2, o + BM * ldo, stride);
    _tile_stored(3, o + BM * ldo + BN, stride);
    if (!bias) return;
    const __m512 b0v = _mm512_loadu_ps(bias), b1v = _mm512_loadu_ps(bias + BN);
    for (int r = 0; r < 2 * BM; r++) {
        float *row = o + r * ldo;
        _mm512_storeu_ps(row, _mm512_add_ps(_mm512_loadu_ps(row), b0v));
        _mm512_storeu_ps(row + BN, _mm512_add_ps(_mm512_loadu_ps(row + BN), b1v));
    }
}

static void amx_item_direct(const uint16_t *a0, const uint16_t *b0, int64_t chunks, float *o, int64_t ldo,
                            const float *bias) {
    ITEM_BODY_TILES(1, 1);
    store_direct(o, ldo, bias);
}

/* An item at the edge of the output (a last token tile or output group of its own, or rows or
 * outputs past t or n): its C tiles through `cbuf`, then only the rows and outputs that exist. */
static void amx_item_edge(const uint16_t *a0, const uint16_t *b0, int64_t chunks, float *cbuf, int64_t t,
                          int64_t t0, int64_t n, int64_t g0, int64_t groups, const float *bias, float *out,
                          int64_t ldo) {
    const int two_t = t0 + BM < t, two_g = g0 + 1 < groups;
    amx_item(two_t, two_g, a0, b0, chunks, cbuf);
    for (int ti = 0; ti <= two_t; ti++) {
        const int64_t r0 = t0 + ti * BM, rows = t - r0 < BM ? t - r0 : BM;
        for (int gi = 0; gi <= two_g; gi++) {
            const int64_t col = (g0 + gi) * BN, cols = n - col < BN ? n - col : BN;
            store_tile(cbuf + 256 * (2 * ti + gi), out + r0 * ldo, ldo, rows, col, cols, bias);
        }
    }
}

/* Returns 0 (nothing computed) if its buffers cannot be allocated. */
static int amx_bf16_gemm(const float *x, int64_t t, int64_t ldx, int64_t k, const uint16_t *w, int64_t n,
                         const float *bias, float *out, int64_t ldo) {
    const int64_t kp = round_up(k, BK), chunks = kp / BK;
    const int64_t tiles_t = round_up(t, BM) / BM, pairs_t = (tiles_t + 1) / 2;
    const int64_t groups = round_up(n, BN) / BN, pairs_g = (groups + 1) / 2;
    const int threads = omp_get_max_threads();
    const size_t a_bytes = (size_t)(tiles_t * BM * kp * 2);
    uint8_t *scratch = scratch_of(a_bytes + (size_t)threads * 1024 * sizeof(float));
    if (!scratch) return 0;
    uint16_t *a = (uint16_t *)scratch;
    float *cbufs = (float *)(scratch + a_bytes);
    activations_bf16(x, t, ldx, k, chunks, tiles_t * BM, a);
    /* Bands of 256 tokens (their activation tiles, <= 300 KB at K = 576, stay in L2); inside a
     * band, output pair by output pair (its weight tiles, the operand that comes from memory,
     * are read once and stay in L1 while every token pair of the band runs over them). Items
     * are numbered densely and handed out a few output pairs at a time: at 64 tokens a slot
     * per (token pair, output pair) of a 256 x 256 block left 3/4 of the dispatches empty, and
     * each dispatch is an atomic both cores contend for (~40 us of a 230 us call). */
    const int64_t items = pairs_t * pairs_g, per_band = BLOCK_PAIRS * pairs_g;
#pragma omp parallel num_threads(threads)
    {
        bf16_config();
        float *cbuf = cbufs + 1024 * omp_get_thread_num();
        const int64_t in_band0 = pairs_t < BLOCK_PAIRS ? pairs_t : BLOCK_PAIRS;
#pragma omp for schedule(dynamic, 4 * in_band0)
        for (int64_t i = 0; i < items; i++) {
            const int64_t band = i / per_band, r = i % per_band;
            const int64_t first = band * BLOCK_PAIRS;
            const int64_t in_band = pairs_t - first < BLOCK_PAIRS ? pairs_t - first : BLOCK_PAIRS;
            const int64_t gp = r / in_band, tp = first + r % in_band;
            const int64_t t0 = tp * 2 * BM, g0 = gp * 2;
            if (t0 + 2 * BM <= t && (g0 + 2) * BN <= n) {
                amx_item_direct(a + (t0 / BM) * chunks * (BM * BK), w + g0 * chunks * (BK * BN), chunks,
                                out + t0 * ldo + g0 * BN, ldo, bias ? bias + g0 * BN : NULL);
                continue;
            }
            amx_item_edge(a + (t0 / BM) * chunks * (BM * BK), w + g0 * chunks * (BK * BN), chunks, cbuf, t, t0, n,
                          g0, groups, bias, out, ldo);
        }
        _tile_release();
    }
    return 1;
}

/* One Q-tile record -> the B tile it stands for (512 bfloat16, 64-byte aligned). */
static inline void unpack_qtile(int32_t kind, const uint8_t *rec, uint16_t *tile) {
    const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rec));
    const __m512 d_lo = _mm512_permutexvar_ps(lo_idx, d), d_hi = _mm512_permutexvar_ps(hi_idx, d);
    if (kind == 0) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 32)));
        const __m512 m_lo = _mm512_permutexvar_ps(lo_idx, m), m_hi = _mm512_permutexvar_ps(hi_idx, m);
        /* A quant's float value by a permute of 0..15 (its index bits 3:0 are the low nibble;
         * shifted, the high one): the permute port, where the conversion would share the
         * multiply-add's. Exact, as the conversion is. */
        const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const uint8_t *q = rec + 64;
        for (int p = 0; p < BK / 2; p++) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * p)));
            const __m512 lo = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, values), d_lo, m_lo);
            const __m512 hi = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), values), d_hi, m_hi);
            _mm512_store_si512(tile + 32 * p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    } else {
        const int8_t *q = (const int8_t *)(rec + 32);
        for (int p = 0; p < BK / 2; p++) {
            const __m512 lo = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * p)))), d_lo);
            const __m512 hi = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * p + 16)))), d_hi);
            _mm512_store_si512(tile + 32 * p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* Building the next output pair's B tiles (`total` records from `src` into `dst`), a few
 * per chunk of the current item so the vector units build while the tile unit multiplies. */
typedef struct {
    int32_t kind;
    int64_t rec, done, total, per_chunk;
    const uint8_t *src;
    uint16_t *dst;
} unpack_job;

static inline __attribute__((always_inline)) void unpack_some(unpack_job *job, int64_t count) {
    for (int64_t s = 0; s < count && job->done < job->total; s++, job->done++)
        unpack_qtile(job->kind, job->src + job->done * job->rec, job->dst + job->done * (BK * BN));
}

static void amx_item_direct_building(const uint16_t *a0, const uint16_t *b0, int64_t chunks, float *o,
                                     int64_t ldo, const float *bias, unpack_job *job) {
    const int64_t per_chunk = job->per_chunk;
    ITEM_LOOP(1, 1, unpack_some(job, per_chunk));
    store_direct(o, ldo, bias);
}

/* The AMX GEMM over Q-tiles. Per band of ~256 tokens, each output pair's B tiles are built into
 * one of two per-thread panels (2 groups x chunks KB, in L1/L2) and every token pair of the
 * band runs over it while the next output pair's tiles are built into the other, so a record
 * is unpacked once per 256 tokens and the building overlaps the products. Each thread takes
 * a contiguous run of (band, output pair) items, so its next panel is known. Same items and
 * sums as amx_bf16_gemm on the tiles hearth_pack_bf16 makes of the dequantized weight. */
static int amx_q_gemm(int32_t kind, const float *x, int64_t t, int64_t ldx, int64_t k, const uint8_t *w,
                      int64_t n, const float *bias, float *out, int64_t ldo) {
    const int64_t chunks = k / BK, rec = q_record(kind);
    const int64_t tiles_t = round_up(t, BM) / BM, pairs_t = (tiles_t + 1) / 2;
    const int64_t groups = round_up(n, BN) / BN, pairs_g = (groups + 1) / 2;
    /* Bands of about BLOCK_PAIRS token pairs, as many as the nearest whole number: a band costs
     * a build of every B tile, so 1032 tokens as 256 x 4 + 8 cost as much as 1280 (a step's
     * prompt chunk plus its decodes). Bands of 4-12 pairs keep their activations in L2. */
    const int64_t bands = pairs_t < BLOCK_PAIRS ? 1 : (pairs_t + BLOCK_PAIRS / 2) / BLOCK_PAIRS;
    const int64_t items = bands * pairs_g;
    const int threads = omp_get_max_threads();
    const size_t a_bytes = (size_t)(tiles_t * BM * k * 2), panel = (size_t)(2 * chunks * BK * BN);
    uint8_t *scratch = scratch_of(a_bytes + (size_t)threads * (1024 * sizeof(float) + 2 * panel * 2));
    if (!scratch) return 0;
    uint16_t *a = (uint16_t *)scratch;
    float *cbufs = (float *)(scratch + a_bytes);
    uint16_t *panels = (uint16_t *)(scratch + a_bytes + (size_t)threads * 1024 * sizeof(float));
    activations_bf16(x, t, ldx, k, chunks, tiles_t * BM, a);
#pragma omp parallel num_threads(threads)
    {
        bf16_config();
        const int me = omp_get_thread_num(), nth = omp_get_num_threads();
        float *cbuf = cbufs + 1024 * me;
        uint16_t *pan[2] = {panels + (size_t)me * 2 * panel, panels + (size_t)me * 2 * panel + panel};
        const int64_t per = (items + nth - 1) / nth, lo = me * per, hi = lo + per < items ? lo + per : items;
        int cur = 0;
        if (lo < hi) {
            const int64_t g0 = (lo % pairs_g) * 2;
            unpack_job first = {kind, rec, 0, (g0 + 1 < groups ? 2 : 1) * chunks, 0, w + g0 * chunks * rec, pan[0]};
            unpack_some(&first, first.total);
        }
        for (int64_t i = lo; i < hi; i++) {
            const int64_t band = i / pairs_g, gp = i % pairs_g, g0 = gp * 2;
            const int64_t tp_begin = band * pairs_t / bands, tp_end = (band + 1) * pairs_t / bands;
            unpack_job job = {kind, rec, 0, 0, 0, w, pan[cur ^ 1]};
            if (i + 1 < hi) {
                const int64_t gn = ((i + 1) % pairs_g) * 2;
                job.total = (gn + 1 < groups ? 2 : 1) * chunks;
                job.src = w + gn * chunks * rec;
                const int64_t steps = (tp_end - tp_begin) * chunks;
                job.per_chunk = (job.total + steps - 1) / steps;
            }
            const uint16_t *b0 = pan[cur];
            for (int64_t tp = tp_begin; tp < tp_end; tp++) {
                const int64_t t0 = tp * 2 * BM;
                const uint16_t *a0 = a + (t0 / BM) * chunks * (BM * BK);
                if (t0 + 2 * BM <= t && (g0 + 2) * BN <= n) {
                    amx_item_direct_building(a0, b0, chunks, out + t0 * ldo + g0 * BN, ldo,
                                             bias ? bias + g0 * BN : NULL, &job);
                    continue;
                }
                amx_item_edge(a0, b0, chunks, cbuf, t, t0, n, g0, groups, bias, out, ldo);
            }
            unpack_some(&job, job.total);
            cur ^= 1;
        }
        _tile_release();
    }
    return 1;
}
#endif

/* The AMX tile state: 1 = granted, 0 = not in this build, < 0 = -errno of the refusal. */
int hearth_bf16_status(void) {
#ifdef __AMX_BF16__
    return hearth_q8a_amx_status();
#else
    return 0;
#endif
}

/*
 * out[t, n] = x[t, :] . W[n, :] (+ bias[n]); x float32 rows `ldx` apart, w packed by
 * hearth_pack_bf16, out rows `ldo` floats apart: AMX tiles where built and granted, else
 * AVX512-BF16. Returns 1 when computed, 0 when this build has neither (or memory ran out):
 * the caller then runs its float32 kernel.
 */
int hearth_bf16_gemm(const float *x, int64_t t, int64_t ldx, int64_t k, const uint16_t *w, int64_t n,
                     const float *bias, float *out, int64_t ldo) {
    if (t <= 0) return 1;
#ifdef __AMX_BF16__
    if (hearth_q8a_amx_status() == 1 && amx_bf16_gemm(x, t, ldx, k, w, n, bias, out, ldo)) return 1;
#endif
#ifdef __AVX512BF16__
    return vec_bf16_gemm(x, t, ldx, k, w, n, bias, out, ldo);
#else
    (void)x, (void)ldx, (void)k, (void)w, (void)n, (void)bias, (void)out, (void)ldo;
    return 0;
#endif
}

/*
 * hearth_bf16_gemm over Q-tiles (hearth_pack_qtiles; kind 0 = Q4_1, 1 = Q8_0): the same
 * result bit for bit as hearth_bf16_gemm on hearth_pack_bf16 of the dequantized weight,
 * reading the 4- or 8-bit records instead. AMX tiles only: returns 0 (nothing computed)
 * where this build or host has none, or memory ran out; k must be a multiple of 32.
 */
int hearth_qtiles_gemm(int32_t kind, const float *x, int64_t t, int64_t ldx, int64_t k, const uint8_t *w,
                       int64_t n, const float *bias, float *out, int64_t ldo) {
    if (t <= 0) return 1;
#ifdef __AMX_BF16__
    if (k % BK == 0 && hearth_q8a_amx_status() == 1 && amx_q_gemm(kind, x, t, ldx, k, w, n, bias, out, ldo))
        return 1;
#endif
    (void)kind, (void)x, (void)ldx, (void)k, (void)w, (void)n, (void)bias, (void)out, (void)ldo;
    return 0;
}

/*
 * The gguf-bf16 linear: `w` holds the bfloat16 tiles (hearth_pack_bf16) and, when q_min_t > 0,
 * right after them the same weight's Q-tiles (hearth_pack_qtiles of its `kind`). Calls of
 * q_min_t tokens or more read the Q-tiles, fewer the bfloat16 tiles; the two give the same
 * bits, so which one ran never shows in a result. Returns 0 when neither could run (the caller
 * runs its float32 kernel).
 */
int hearth_bf16_linear(int32_t kind, const float *x, int64_t t, int64_t ldx, int64_t k, const uint16_t *w,
                       int64_t n, const float *bias, float *out, int64_t ldo, int64_t q_min_t) {
    if (q_min_t > 0 && t >= q_min_t &&
        hearth_qtiles_gemm(kind, x, t, ldx, k, (const uint8_t *)w + hearth_bf16_packed_bytes(n, k), n, bias, out,
                           ldo))
        return 1;
    return hearth_bf16_gemm(x, t, ldx, k, w, n, bias, out, ldo);
}
