/*
 * hearth_kv.h: what hearth_cpu.c's float32 attention loops and hearth_attention_f32.c's
 * prefill loops share: how a KV cache row is laid out and read, the float32 softmax, and
 * the prefill loops' entry points. One copy, because the two must agree bit for bit (a
 * token's output may not depend on which loops ran it). hearth_attention_bf16.c reads the
 * cache rows with it too.
 *
 * The cache holds float32 (KV_F32), float16 (KV_F16) or int8 (KV_I8) elements; every
 * helper takes the kind as a compile-time constant and only its loads differ: a float16
 * row is widened to float32 by F16C on load (exact), and the scores, softmax and value sums
 * are the same float32 arithmetic in the same order for both float kinds. So the float16
 * path on a cache of float16 values gives bitwise what the float32 path gives on the same
 * values in float32. An int8 row is widened exactly too; its scale multiplies the key's
 * score after the dot product and each softmax weight before the value sums. Positions into
 * a cache are element indices (`base` + index), whatever the kind.
 */
#ifndef HEARTH_KV_H
#define HEARTH_KV_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define KV_F32 0
#define KV_F16 1
#define KV_I8 2 /* int8 rows, each followed by its float32 scale (hearth_kv_write_i8) */
#define KV_I8_SCALE_BYTES 4

#define KV_INLINE static inline __attribute__((always_inline))

/* Query vectors per attention pass, both loops': a thread's scratch holds this many score
 * rows (hearth_attention_scratch_floats), 4 tokens x 3 heads for SmolLM2's group of 3. */
#define ATT_MAXV 12

/* Elements of one (slot, kv head) row of a cache of this kind, an int8 row's scale included. */
KV_INLINE int64_t kv_head_pitch(const int kind, int64_t hd) { return kind == KV_I8 ? hd + KV_I8_SCALE_BYTES : hd; }

/* The scale of the int8 row whose values start at element `row` (1 for the float kinds). */
KV_INLINE float kv_row_scale(const void *base, int64_t row, int64_t hd, const int kind) {
    float s = 1.0f;
    if (kind == KV_I8) memcpy(&s, (const int8_t *)base + row + hd, sizeof s);
    return s;
}

/* 8 cache elements from element `idx` widened to float32 (exact for every kind). */
KV_INLINE __m256 kv_load8(const void *base, int64_t idx, const int kind) {
    if (kind == KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + idx)));
    if (kind == KV_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + idx))));
    return _mm256_loadu_ps((const float *)base + idx);
}

/* hearth_cpu.c: p[lo .. n) = exp(s - max), zero on [from, lo) (keys before the row's
 * sliding window) and on [n, upto); returns 1 / sum. Fixed 8-wide order from lo. */
float hearth_softmax_row(float *p, int64_t from, int64_t lo, int64_t n, int64_t upto);

/* hearth_attention_f32.c. Runs of at least this many tokens take its loops where the build
 * has them (0: none); process-wide, benchmarks and tests set it (`ops.f32_prefill_min_run`). */
extern int64_t hearth_attention_f32_min_run;

/* Whether this build runs hearth_attention_f32.c's loops (1: the AVX2 build) or leaves every
 * run to hearth_cpu.c's (0). */
int hearth_attention_f32_path(void);

/*
 * Attention of the rows in `runs` (num_runs [start, end) row ranges, each a run of
 * consecutive positions of one sequence) over their sequences' paged caches, bitwise what
 * hearth_cpu.c's loops give; the other rows are not touched. Arguments as
 * hearth_paged_attention's; kk / kv: the key and value caches' kinds (KV_F32, KV_F16,
 * KV_I8). `scratch`: each thread's ATT_MAXV score rows of `scratch_per_thread / ATT_MAXV`
 * floats (>= the longest context + 16). Returns 1 when computed, 0 when this build cannot
 * (not the AVX2 build, head_dim not a multiple of 32 or over 256, no memory): the caller
 * then runs its own loops.
 */
int hearth_attention_f32(int kk, int kv, const float *q, int64_t ldq, int64_t nh, int64_t nkv, int64_t hd,
                         const void *k_cache, const void *v_cache, int64_t block_size, const int32_t *block_tables,
                         int64_t max_blocks, const int32_t *seq, const int32_t *ctx, float scale, float *out,
                         float *scratch, int64_t scratch_per_thread, int64_t window, const int64_t *runs,
                         int64_t num_runs);

#endif /* HEARTH_KV_H */
