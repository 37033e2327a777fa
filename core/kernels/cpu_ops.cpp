// specfw CPU kernels for decoding: a linear layer (fp32 or bf16 weights) and attention of
// one-row queries over the slot-based KV pool. Batch invariant by construction: every output
// is reduced in one fixed order that depends only on its own inputs, never on how many rows
// the call has, which tile a row lands in or which thread computes it.
//
// One source, compiled once per instruction set (kernels/__init__.py picks by the CPU's flags):
//   -mavx512f -mavx512bw -mavx512vl -mfma  -> SPECFW_ISA "avx512" (16-lane vectors)
//   -mavx2 -mfma                           -> SPECFW_ISA "avx2"   (8-lane vectors)
//   (no flags)                             -> SPECFW_ISA "portable" (8-lane arrays; the compiler
//                                             vectorises with baseline SSE2)
// The AVX2 and AVX-512 linears give identical bits (both accumulate with FMA in k order); the
// portable one multiplies and adds separately.
//
// Linear: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]); the weight packed once as
// [ceil(N/16), K, 16] (16 outputs side by side per k: one or two vector loads), each output
// accumulated in fp32 over k = 0..K-1 in sequence. bf16 weights are widened in registers.
// One or two rows: the weight streams once at memory speed; more rows reuse each loaded weight
// vector for a tile of rows (tiles of near-equal size, k in chunks of 64 so that a chunk of weight
// stays in L1 for every row tile; the running sums carry from chunk to chunk, so each output
// still sees one FMA per k in k order).
//
// Attention: rows are grouped by request; a group has a shared prefix of KV slots and, per row,
// its own extra slots (its visible tree nodes, or its own new token). Per (group, kv head) the
// prefix K/V entries are read once for all the group's rows of every query head sharing that kv
// head (GQA), whatever way the work is split over the threads. A row's keys are its prefix then
// its extras, in that order: score_j = (q . k_j) * scale, p_j = exp(score_j - max), the sum of
// p_j in lanes j mod W, out = (sum_j p_j v_j) / sum in j order -- the same values, in the same
// order, whether the row is a lone decode step or one node of a 16-row tree.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#ifdef SPECFW_AMX_ATTENTION
#include "amx_tiles.h"
#endif
#endif

namespace {

constexpr int64_t kBlock = 16;   // outputs per packed weight block

// ---------------------------------------------------------------- vectors of W fp32 lanes
#if defined(__AVX512F__)
#define SPECFW_ISA "avx512"
constexpr int W = 16;
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float a) { return _mm512_set1_ps(a); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vload(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline float vhsum(V a) {   // fixed order: halves, then halves again
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline float vhmax(V a) { return _mm512_reduce_max_ps(a); }
inline bool vany_gt(V a, float t) { return _mm512_cmp_ps_mask(a, _mm512_set1_ps(t), _CMP_GT_OQ) != 0; }
// vhsum of W vectors at once (lane j of the result: vhsum(a[j]), the same additions in the same
// order, bit for bit): four levels of pairwise adds across the vectors instead of a horizontal
// sum each (scores over 16 keys: ~45 shuffles and adds instead of ~130). a is overwritten.
inline V vhsum_many(V* a) {
  for (int m = 0; m < 8; ++m)   // lanes i + (i + 8): keys 2m, 2m+1 -> [A.h0-3 A.h4-7 B.h0-3 B.h4-7]
    a[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int n = 0; n < 4; ++n)   // + (i + 4): keys 4n..4n+3, one per 128-bit chunk
    a[n] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * n], a[2 * n + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * n], a[2 * n + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int o = 0; o < 2; ++o)   // + (i + 2): chunk k holds keys 8o+k and 8o+4+k, two lanes each
    a[o] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * o], a[2 * o + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * o], a[2 * o + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + (i + 1): lane 4k + m holds key k + 4m
  const V f = _mm512_add_ps(_mm512_shuffle_ps(a[0], a[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a[0], a[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}
#elif defined(__AVX2__)
#define SPECFW_ISA "avx2"
constexpr int W = 8;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float a) { return _mm256_set1_ps(a); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vload(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline float vhsum(V a) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline float vhmax(V a) {
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline bool vany_gt(V a, float t) { return _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(t), _CMP_GT_OQ)) != 0; }
inline V vhsum_many(V* a) {   // as the AVX-512 one, three levels
  for (int m = 0; m < 4; ++m)   // lanes i + (i + 4): keys 2m, 2m+1 -> [A.q0-3 B.q0-3]
    a[m] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * m], a[2 * m + 1], 0x20), _mm256_permute2f128_ps(a[2 * m], a[2 * m + 1], 0x31));
  for (int o = 0; o < 2; ++o)   // + (i + 2): chunk k holds keys 4o+k and 4o+2+k, two lanes each
    a[o] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * o], a[2 * o + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(a[2 * o], a[2 * o + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + (i + 1): lane 4k + m holds key k + 2m
  const V f = _mm256_add_ps(_mm256_shuffle_ps(a[0], a[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(a[0], a[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#else
#define SPECFW_ISA "portable"
constexpr int W = 8;
struct V { float l[W]; };
inline V vzero() { V r; for (int i = 0; i < W; ++i) r.l[i] = 0.f; return r; }
inline V vset1(float a) { V r; for (int i = 0; i < W; ++i) r.l[i] = a; return r; }
inline V vload(const float* p) { V r; std::memcpy(r.l, p, sizeof r.l); return r; }
inline V vload(const uint16_t* p) {
  V r;
  for (int i = 0; i < W; ++i) { uint32_t b = uint32_t(p[i]) << 16; std::memcpy(&r.l[i], &b, 4); }
  return r;
}
inline void vstore(float* p, V a) { std::memcpy(p, a.l, sizeof a.l); }
inline V vfma(V a, V b, V c) { V r; for (int i = 0; i < W; ++i) r.l[i] = a.l[i] * b.l[i] + c.l[i]; return r; }
inline V vadd(V a, V b) { V r; for (int i = 0; i < W; ++i) r.l[i] = a.l[i] + b.l[i]; return r; }
inline V vmax(V a, V b) { V r; for (int i = 0; i < W; ++i) r.l[i] = std::max(a.l[i], b.l[i]); return r; }
inline V vdiv(V a, V b) { V r; for (int i = 0; i < W; ++i) r.l[i] = a.l[i] / b.l[i]; return r; }
inline V vmul(V a, V b) { V r; for (int i = 0; i < W; ++i) r.l[i] = a.l[i] * b.l[i]; return r; }
inline float vhsum(V a) { return ((a.l[0] + a.l[4]) + (a.l[2] + a.l[6])) + ((a.l[1] + a.l[5]) + (a.l[3] + a.l[7])); }
inline float vhmax(V a) { float m = a.l[0]; for (int i = 1; i < W; ++i) m = std::max(m, a.l[i]); return m; }
inline bool vany_gt(V a, float t) { bool r = false; for (int i = 0; i < W; ++i) r |= a.l[i] > t; return r; }
inline V vhsum_many(V* a) { V r; for (int j = 0; j < W; ++j) r.l[j] = vhsum(a[j]); return r; }
#endif

constexpr int VB = kBlock / W;   // vectors per weight block (1 or 2)

// exp of every lane (Cephes' expf polynomial; |rel. error| < 2e-7 over the clamped range)
inline V vexp(V x) {
#if defined(__AVX2__)
#if defined(__AVX512F__)
  auto mul = [](V a, V b) { return _mm512_mul_ps(a, b); };
  auto sub = [](V a, V b) { return _mm512_sub_ps(a, b); };
  x = _mm512_min_ps(_mm512_max_ps(x, vset1(-87.3f)), vset1(88.3f));
  V fx = _mm512_roundscale_ps(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#else
  auto mul = [](V a, V b) { return _mm256_mul_ps(a, b); };
  auto sub = [](V a, V b) { return _mm256_sub_ps(a, b); };
  x = _mm256_min_ps(_mm256_max_ps(x, vset1(-87.3f)), vset1(88.3f));
  V fx = _mm256_floor_ps(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
#endif
  x = sub(x, mul(fx, vset1(0.693359375f)));
  x = sub(x, mul(fx, vset1(-2.12194440e-4f)));
  V y = vset1(1.9875691500e-4f);
  y = vfma(y, x, vset1(1.3981999507e-3f));
  y = vfma(y, x, vset1(8.3334519073e-3f));
  y = vfma(y, x, vset1(4.1665795894e-2f));
  y = vfma(y, x, vset1(1.6666665459e-1f));
  y = vfma(y, x, vset1(5.0000001201e-1f));
  y = vfma(y, mul(x, x), vadd(x, vset1(1.f)));
#if defined(__AVX512F__)
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return mul(y, _mm512_castsi512_ps(e));
#else
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return mul(y, _mm256_castsi256_ps(e));
#endif
#else
  V r;
  for (int i = 0; i < W; ++i) r.l[i] = std::exp(x.l[i]);
  return r;
#endif
}

inline uint16_t to_bf16(float f) {   // round to nearest even (NaN kept quiet)
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x40);
  b += 0x7fffu + ((b >> 16) & 1u);
  return uint16_t(b >> 16);
}

inline float from_bf16(uint16_t h) {
  uint32_t b = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Every lane rounded to bf16 as to_bf16 rounds it (nearest even, NaN kept quiet), as fp32 bits whose
// low half is zero (vround_bf16), or stored as W bf16 values (vstore_bf16). Not vcvtneps2bf16:
// it treats denormal inputs as zero, to_bf16 does not.
#if defined(__AVX512F__)
inline __m512i round_bits_bf16(V a) {
  const __m512i b = _mm512_castps_si512(a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_srli_epi32(_mm512_mask_mov_epi32(up, nan, _mm512_or_si512(b, _mm512_set1_epi32(0x400000))), 16);
}
inline V vround_bf16(V a) { return _mm512_castsi512_ps(_mm512_slli_epi32(round_bits_bf16(a), 16)); }
inline void vstore_bf16(uint16_t* p, V a) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(round_bits_bf16(a))); }
#elif defined(__AVX2__)
inline __m256i round_bits_bf16(V a) {
  const __m256i b = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  // |b| as a signed int is >= 0, so the signed compare is the unsigned one
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_srli_epi32(_mm256_blendv_epi8(up, _mm256_or_si256(b, _mm256_set1_epi32(0x400000)), nan), 16);
}
inline V vround_bf16(V a) { return _mm256_castsi256_ps(_mm256_slli_epi32(round_bits_bf16(a), 16)); }
inline void vstore_bf16(uint16_t* p, V a) {
  const __m256i packed = _mm256_packus_epi32(round_bits_bf16(a), _mm256_setzero_si256());   // per 128-bit lane: 4 values, 4 zeros
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}
#else
inline V vround_bf16(V a) { V r; for (int i = 0; i < W; ++i) r.l[i] = from_bf16(to_bf16(a.l[i])); return r; }
inline void vstore_bf16(uint16_t* p, V a) { for (int i = 0; i < W; ++i) p[i] = to_bf16(a.l[i]); }
#endif

// ---------------------------------------------------------------- linear

// MR rows x NT weight blocks over k in [k0, k1); w points at the first block ([K][16] each,
// blocks K*16 apart); part holds the MR x NT*16 running sums (k0 == 0: start from zero), so a
// sum spans k-chunks in k order exactly as in one pass
template <int MR, int NT, bool PF, typename WT>
inline void tile(const WT* w, int64_t K, int64_t k0, int64_t k1, const float* x, float* part, const WT* pf, int pf_every,
                 int pf_wait) {
  // pf: the blocks this thread streams next, prefetched one line per block at every pf_every-th k
  // (from pf_wait on) while this tile computes: the row tiles of a chunk take turns, so the next
  // blocks' lines are requested evenly over the whole chunk's arithmetic (memory and arithmetic
  // overlap; with the first tile alone prefetching, its requests came in bursts and 16 rows cost
  // 1.5-1.8x a row instead of 1.3-1.5x; without any, a multi-row tile waited for DRAM, then computed)
  // The hint is prefetcht1 (into L2), not prefetcht0: a burst of L1 prefetches holds the L1 miss
  // buffers that the tile's own loads need, and the next item's lines (2 blocks x K x 64 B, more than
  // L1) were evicted from L1 before use anyway. On the AMX Xeon (family 6 model 167, session 51) the
  // demo's 120 fp32 layer linears from DRAM on the AVX2 build took 17.7-17.8 ms at 3-4 rows against
  // 19.5-20.1 with prefetcht0, 8 rows 22.5 / 24.8, 16 rows 28.0 / 30.9; AVX-512 2-5% faster; bf16
  // weights 1.00-1.05x. Prefetching never changes a bit.
  constexpr int64_t PW = NT * kBlock;
  V acc[MR][NT * VB];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT * VB; ++t) acc[m][t] = k0 ? vload(part + m * PW + t * W) : vzero();
  for (int64_t k = k0; k < k1; ++k) {
    V wv[NT * VB];
    for (int b = 0; b < NT; ++b)
      for (int v = 0; v < VB; ++v) wv[b * VB + v] = vload(w + (b * K + k) * kBlock + v * W);
    if constexpr (PF) {
      if (pf_wait == 0)
        for (int b = 0; b < NT; ++b) __builtin_prefetch(pf + (b * K + k) * kBlock, 0, 2);   // to L2 (prefetcht1)
      if (--pf_wait < 0) pf_wait = pf_every - 1;
    }
    for (int m = 0; m < MR; ++m) {
      const V xb = vset1(x[m * K + k]);
      for (int t = 0; t < NT * VB; ++t) acc[m][t] = vfma(wv[t], xb, acc[m][t]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT * VB; ++t) vstore(part + m * PW + t * W, acc[m][t]);
}

#if defined(__AVX512F__)
constexpr int kTileRows = 8;   // 16 accumulators of two blocks
#else
constexpr int kTileRows = 6;   // 12 accumulators of one block
#endif
// Row tiles of a call of M rows: one up to 8 rows, else near-equal tiles of at most kTileRows. On
// AVX2 a tile of 7-8 rows has 14-16 accumulators, more than the registers left (the compiler keeps
// some in L1: 83 against 89 GFMA/s hot at 8 rows), yet from DRAM it beat 4 + 4 / 4 + 3 (the demo's
// fp32 layer linears, Xeon family 6 model 167, session 51: 7 rows 22.0-23.3 -> 20.1 ms, 8 rows
// 22.5-24.4 -> 22.0): each chunk's weights pass through the FMAs once. Past 8 rows the wide tiles
// lost (16 rows as 8 + 8: 31.3 against 29.4-30.8 as 6 + 5 + 5). Tiling never changes a bit.
inline int64_t row_tiles(int64_t M) { return M <= 8 ? 1 : (M + kTileRows - 1) / kTileRows; }
// Row tiles of a two-block (NT = 2) call: on AVX2 two rows a tile (8 accumulators and the four
// weight vectors of both blocks fit the 16 registers), elsewhere as row_tiles says.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool kPairRowTiles = true;
#else
constexpr bool kPairRowTiles = false;   // AVX-512: one tile of 8 rows fits; portable: the compiler's own vectors lost 2-4x
#endif
template <int NT>
inline int64_t tiles_of(int64_t M) { return NT == 2 && kPairRowTiles ? (M + 1) / 2 : row_tiles(M); }
// Which row tiles of a chunk prefetch the next blocks, for more than one tile (9+ rows on AVX-512).
// Spread: every tile takes its turn. On an AMD EPYC (family 26 model 2, session 22) that made 16 rows
// 1.33x a row instead of 1.46x with the first tile alone, 24 rows 1.41x instead of 1.71x; on an Intel
// Xeon with AMX (family 6 model 167, session 34) it is the other way round: the demo's fp32 linears
// from DRAM took 43.0 ms at 16 rows spread against 35.6 with the first tile alone (12 rows 38.0 / 33.6,
// 32 rows 55.5 / 51.3). So it is set at run time (set_spread_prefetch: engine.cpu_linear_prefetch, by
// default from the CPU's vendor). The AVX2 build, measured then, gained nothing from spreading and lost 8%
// at 24 rows. On an AVX2-only AMD EPYC (Zen 3, family 25 model 1, session 53) spreading made
// fp32 weights' multi-tile calls faster (the demo's 120 fp32 layer linears from DRAM, two runs: 12 rows
// 22.95 / 24.72 -> 22.37 / 21.77 ms, 16 rows 28.4 -> 25.6-25.9, 24 rows 38.1-39.2 -> 34.6-36.0; 10 rows
// even) but not bf16 weights (compute-bound on AVX2, 1.00-1.03x slower): 8-lane builds spread fp32 weights
// only. The vdpbf16ps tiles of bf16 models (bf16_dot_tiles.h) follow the same setting over their full
// 8-row tiles (the demo's 16-row bf16 forward 0.92-1.00x, 0.95x typical, on a Zen 4 EPYC, session 61). Prefetching never
// changes a bit.
bool g_spread_prefetch = W == 16;

void set_spread_prefetch(bool on) { g_spread_prefetch = on; }
bool spread_prefetch() { return g_spread_prefetch; }
// Multi-row calls prefetch the next work item from this many rows (set_linear_prefetch_rows: the default by
// CPU, kernels/__init__.py's default_prefetch_rows). 8-lane builds (AVX2, portable): from 3 (the
// demo's 120 layer linears from DRAM on AVX2, 3 rows 1.04-1.12x, 4 rows 1.05-1.11x faster than from
// 5, 1-2 and 6-16 rows unchanged; AMD EPYC Zen 3, session 41). AVX-512: from 5 as measured on an
// AMD EPYC before; from 2 on Intel (the demo's fp32 linears from DRAM, Xeon family 6 model 207,
// session 49: 3 rows 22.8 -> 20.8 ms, 4 rows 23.4 -> 20.4, 2 rows 20.6 -> 19.6, one row unchanged).
// AVX2 on Intel: from 2 too (Xeon family 6 model 167, session 51: 2 rows of bf16 weights 11.4 -> 7.7 ms,
// of fp32 17.7 -> 15.7, with the L2 prefetch hint). The build's own default below; the loader sets the CPU's.
int64_t g_prefetch_rows = W == 16 ? 5 : 3;

void set_linear_prefetch_rows(int64_t rows) { g_prefetch_rows = std::max<int64_t>(rows, 1); }
int64_t linear_prefetch_rows() { return g_prefetch_rows; }
constexpr int64_t kChunk = 64;   // k per pass: 4-8 KB of weight stay in L1 for every row tile (-7% at 8-12 rows)

// the tile with its prefetch loop compiled in only where a call prefetches (below g_prefetch_rows rows none does)
template <int MR, int NT, typename WT>
inline void tile_pf(const WT* w, int64_t K, int64_t k0, int64_t k1, const float* x, float* part, const WT* pf, int pe, int pw) {
  if (pf) tile<MR, NT, true>(w, K, k0, k1, x, part, pf, pe, pw);
  else tile<MR, NT, false>(w, K, k0, k1, x, part, pf, pe, pw);
}

template <int NT, typename WT>
inline void tile_rows(int mr, const WT* w, int64_t K, int64_t k0, int64_t k1, const float* x, float* part, const WT* pf, int pe, int pw) {
  switch (mr) {
    case 8: tile_pf<8, NT>(w, K, k0, k1, x, part, pf, pe, pw); break;
    case 7: tile_pf<7, NT>(w, K, k0, k1, x, part, pf, pe, pw); break;
    case 6: tile_pf<6, NT>(w, K, k0, k1, x, part, pf, pe, pw); break;
    case 5: tile_pf<5, NT>(w, K, k0, k1, x, part, pf, pe, pw); break;
    case 4: tile_pf<4, NT>(w, K, k0, k1, x, part, pf, pe, pw); break;
    case 3: tile_pf<3, NT>(w, K, k0, k1, x, part, pf, pe, pw); break;
    case 2: tile_pf<2, NT>(w, K, k0, k1, x, part, pf, pe, pw); break;
    case 1: tile_pf<1, NT>(w, K, k0, k1, x, part, pf, pe, pw); break;
    default: break;
  }
}

// All M rows against G groups of NT blocks (group g at w + g * NT * K * kBlock): rows split into
// tiles as row_tiles says (past 8 rows near-equal tiles, 16 on AVX2 as 6 + 5 + 5, not 6 + 6 + 4:
// every tile keeps enough independent accumulators), k in chunks, each chunk through every group
// in turn. Two groups of one block (AVX2 with more than two rows: 16 registers hold no wider tile)
// so stream both blocks' weights at once: run one block after the other, a thread read one stream,
// and a stream's hardware prefetch alone did not keep up with DRAM (3-4 rows of the demo's fp32
// linears from DRAM took 1.2-1.3x a 2-row call on AVX2, where 2 rows, both blocks in one tile, cost
// what one row costs; session 51). Each output still takes one FMA per k in k order: the same bits.
template <int NT, int G, typename WT>
void block_rows(int64_t M, const WT* w, int64_t K, const float* x, const float* bias, float* y, int64_t N,
                int64_t n_valid, const WT* pf, float* part) {
  constexpr int64_t PW = NT * kBlock;
  const int64_t tiles = tiles_of<NT>(M), base = M / tiles, extra = M % tiles;
  const bool spread = g_spread_prefetch && (W == 16 || sizeof(WT) == 4);
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min(K, k0 + kChunk);
    for (int g = 0; g < G; ++g) {
      const WT* wg = w + g * NT * K * kBlock;
      const WT* pg = pf ? pf + g * NT * K * kBlock : nullptr;
      float* sums = part + g * M * PW;
      int64_t m = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int mr = int(base + (t < extra));
        if (spread)
          tile_rows<NT>(mr, wg, K, k0, k1, x + m * K, sums + m * PW, pg, int(tiles), int(t));
        else
          tile_rows<NT>(mr, wg, K, k0, k1, x + m * K, sums + m * PW, t == 0 ? pg : nullptr, 1, 0);
        m += mr;
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const float* sums = part + g * M * PW;
    const int64_t n0 = g * PW, nv = std::min<int64_t>(n_valid - n0, PW);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < nv; ++n) y[m * N + n0 + n] = bias ? sums[m * PW + n] + bias[n0 + n] : sums[m * PW + n];
  }
}

// One row of bf16 weights: four blocks per tile in one pass over k. Each output's sum is one FMA
// chain in k order (the same bits as in any multi-row tile); four independent chains instead of
// two keep the FMA latency under the weight's streaming time (half the bytes a k of fp32's: the
// two-block tile was latency-bound; one row from DRAM, old / new: a 49k x 576 lm_head 1.29x on
// AVX2 and 1.08x on AVX-512, the demo's layers 1.02-1.13x; AMD EPYC family 26 model 2, session 23). The threads split the
// blocks, not the tiles (a 36-block layer: 18 blocks each, not 5 and 4 tiles of four).
template <typename WT>
void linear_one_row(const WT* W_, int64_t K, int64_t NB, const float* X, const float* B, float* Y, int64_t N) {
  constexpr int every = 64 / int(kBlock * sizeof(WT));   // k rows per cache line of a block
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    float part[4 * kBlock];
    for (int64_t b = b0; b < b1; b += 4) {
      const int64_t nb = std::min<int64_t>(4, b1 - b), n0 = b * kBlock;
      const WT* wb = W_ + b * K * kBlock;
      if (nb == 4 && b + 8 <= b1)   // the next four blocks, a line per block as this tile passes it
        tile<1, 4, true>(wb, K, 0, K, X, part, wb + 4 * K * kBlock, every, 0);
      else if (nb == 4)
        tile<1, 4, false>(wb, K, 0, K, X, part, wb, 1, 0);
      else if (nb == 3)
        tile<1, 3, false>(wb, K, 0, K, X, part, wb, 1, 0);
      else if (nb == 2)
        tile<1, 2, false>(wb, K, 0, K, X, part, wb, 1, 0);
      else
        tile<1, 1, false>(wb, K, 0, K, X, part, wb, 1, 0);
      const int64_t n_valid = std::min<int64_t>(N - n0, nb * kBlock);
      for (int64_t n = 0; n < n_valid; ++n) Y[n0 + n] = B ? part[n] + B[n0 + n] : part[n];
    }
  });
}

template <typename WT>
void linear_impl(int64_t M, const WT* W_, int64_t K, int64_t NB, const float* X, const float* B, float* Y, int64_t N) {
  if (M == 1 && sizeof(WT) == 2) return linear_one_row(W_, K, NB, X, B, Y, N);   // fp32: no gain measured (AVX2: 0.8-0.9x)
  // work item: two blocks (32 outputs); with few rows both blocks run in one tile (more
  // independent accumulators), with more rows each block runs its own row tiles (AVX2 has 16
  // registers; AVX-512 keeps two blocks throughout). AVX2, fp32 weights, 7-8 rows: both blocks
  // again, in tiles of two rows (tiles_of), not one 7-8-row tile per block, whose 14-16
  // accumulators spill. The demo's 120 fp32 layer linears from DRAM on the AVX2 build of an AMD
  // EPYC (family 25 model 17, session 57; three interleaved runs, median per-round ratio): 8 rows
  // 0.77-0.84x the one-tile time, 7 rows 0.82-0.89x; at 3-6 and 9-16 rows no steady gain either
  // way, and bf16 weights (widened per tile) none. (Session 51's Xeon figure for one 8-row tile,
  // above, predates this tiling.)
  const bool pair_tiles = W == 16 || M <= 2 || (kPairRowTiles && sizeof(WT) == 4 && (M == 7 || M == 8));
  const int64_t items = (NB + 1) / 2;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> part(M * 2 * kBlock);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = 2 * i, n0 = b * kBlock;
      const int64_t n_valid = std::min<int64_t>(N - n0, 2 * kBlock);
      const WT* wb = W_ + b * K * kBlock;
      const float* bb = B ? B + n0 : nullptr;
      // the next work item's two blocks, from g_prefetch_rows rows (fewer: the hardware prefetcher keeps up alone)
      const WT* next = M >= g_prefetch_rows && b + 3 < NB ? wb + 2 * K * kBlock : nullptr;
      if (b + 1 == NB)   // a last lone block
        block_rows<1, 1>(M, wb, K, X, bb, Y + n0, N, n_valid, next, part.data());
      else if (pair_tiles)
        block_rows<2, 1>(M, wb, K, X, bb, Y + n0, N, n_valid, next, part.data());
      else
        block_rows<1, 2>(M, wb, K, X, bb, Y + n0, N, n_valid, next, part.data());
    }
  });
}

#if defined(__AVX512BF16__)
#include "bf16_dot_tiles.h"
constexpr bool kHasDot = true;
#else
constexpr bool kHasDot = false;
#endif

bool has_bf16_dot() { return kHasDot; }

// w [N, K] bf16 -> bf16_dot's pair layout [ceil(N/16), ceil(K/2), 32], for bf16 models' linears
// on vdpbf16ps (linear() tells the layouts apart by the last dimension: 32 vs 16)
torch::Tensor pack_dot(torch::Tensor w) {
#if defined(__AVX512BF16__)
  return dot::pack(w);
#else
  TORCH_CHECK(false, "pack_dot: this build has no AVX512-BF16 path");
  return w;
#endif
}

// w [N, K] fp32 or bf16 -> [ceil(N/16), K, 16], zero padded
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack: a 2-d weight");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16, "pack: float32 or bfloat16");
  const int64_t N = w.size(0), K = w.size(1), NB = (N + kBlock - 1) / kBlock;
  auto padded = torch::constant_pad_nd(w.contiguous(), {0, 0, 0, NB * kBlock - N});
  return padded.view({NB, kBlock, K}).transpose(1, 2).contiguous();
}

// x [M, K] bf16, packed from pack_dot() -> y [M, N] bf16: bf16_dot's sums (k pairs on vdpbf16ps,
// one fixed order per output), bias added, rounded once
torch::Tensor linear_dot(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "linear: a pack_dot weight takes bf16 rows");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KP = packed.size(1);
  TORCH_CHECK((K + 1) / 2 == KP && NB * dot::kLanes >= N, "linear: input width does not match the packed weight");
  if (K % 2) x = torch::constant_pad_nd(x, {0, 1});
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  dot::linear_rows(M, reinterpret_cast<const uint16_t*>(packed.data_ptr()), KP, NB, reinterpret_cast<const uint32_t*>(x.data_ptr()),
                   bias.numel() ? bias.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()), N, g_spread_prefetch);
  return y;
#else
  TORCH_CHECK(false, "linear: a pack_dot weight needs the AVX512-BF16 build");
  return x;
#endif
}

// x [M, K] fp32 or bf16; packed from pack(); bias fp32 [N] or empty -> y [M, N] in x's dtype
// (a pack_dot() weight, last dimension 32: linear_dot)
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias) {
  TORCH_CHECK(!bias.numel() || (bias.scalar_type() == torch::kFloat32 && bias.numel() == N), "linear: fp32 bias [N]");
  if (x.dim() == 2 && packed.dim() == 3 && packed.size(2) == 2 * kBlock && packed.scalar_type() == torch::kBFloat16)
    return linear_dot(x, packed, N, bias);
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kBlock, "linear: x [M, K], packed [NB, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && NB * kBlock >= N, "linear: input width does not match the packed weight");
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({M, N}, xf.options());
  if (M == 0) return y.to(x.scalar_type());
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  if (packed.scalar_type() == torch::kBFloat16)
    linear_impl(M, reinterpret_cast<const uint16_t*>(packed.data_ptr()), K, NB, xf.data_ptr<float>(), B, y.data_ptr<float>(), N);
  else
    linear_impl(M, packed.data_ptr<float>(), K, NB, xf.data_ptr<float>(), B, y.data_ptr<float>(), N);
  return x.scalar_type() == torch::kFloat32 ? y : y.to(x.scalar_type());
}

// ---------------------------------------------------------------- attention

inline float load_scalar(const float* p) { return *p; }
inline float load_scalar(const uint16_t* p) { return from_bf16(*p); }

// Scores of one query over n keys: s[j] = (q . k_j) * scale, q . k summed as W-lane partial sums
// over the D/W full vectors in order, then vhsum, then the tail dims in order. ND: D / W as a
// template constant (registers), 0 for any other count (same order, runtime loop).
template <int ND, int NR, typename T>
void rows_scores(const float* q, int64_t D, const T* cache, int64_t slot_stride, const int64_t* slots, int64_t n, float scale,
                 float* s, int64_t s_stride);

template <int ND, typename T>
void row_scores(const float* q, int64_t D, const T* cache, int64_t slot_stride, const int64_t* slots, int64_t n,
                float scale, float* s) {
  if constexpr (ND > 0) {   // whole vectors: rows_scores' blocks of keys (the same bits, fewer horizontal sums)
    if (D == ND * W) return rows_scores<ND, 1>(q, D, cache, slot_stride, slots, n, scale, s, 0);
  }
  const int64_t nd = ND ? ND : D / W;
  V qv[ND ? ND : 1];
  if (ND) for (int i = 0; i < ND; ++i) qv[i] = vload(q + i * W);
  for (int64_t j = 0; j < n; ++j) {
    const T* k = cache + slots[j] * slot_stride;
    V a = vzero();
    for (int64_t i = 0; i < nd; ++i) a = vfma(ND ? qv[ND ? i : 0] : vload(q + i * W), vload(k + i * W), a);
    float x = vhsum(a);
    for (int64_t d = nd * W; d < D; ++d) x += q[d] * load_scalar(k + d);
    s[j] = x * scale;
  }
}

// acc[0..D) += sum_j p[j] * v_j over n keys, each dim accumulated in j order
template <int ND, typename T>
void row_values(const float* p, int64_t D, const T* cache, int64_t slot_stride, const int64_t* slots, int64_t n,
                float* acc) {
  const int64_t nd = ND ? ND : D / W;
  if (ND) {
    V a[ND ? ND : 1];
    for (int i = 0; i < ND; ++i) a[i] = vload(acc + i * W);
    for (int64_t j = 0; j < n; ++j) {
      const T* v = cache + slots[j] * slot_stride;
      const V pj = vset1(p[j]);
      for (int i = 0; i < ND; ++i) a[i] = vfma(pj, vload(v + i * W), a[i]);
    }
    for (int i = 0; i < ND; ++i) vstore(acc + i * W, a[i]);
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const T* v = cache + slots[j] * slot_stride;
      const V pj = vset1(p[j]);
      for (int64_t i = 0; i < nd; ++i) vstore(acc + i * W, vfma(pj, vload(v + i * W), vload(acc + i * W)));
    }
  }
  for (int64_t d = nd * W; d < D; ++d)
    for (int64_t j = 0; j < n; ++j) acc[d] += p[j] * load_scalar(cache + slots[j] * slot_stride + d);
}

// Several rows of one head over the same keys: each key's vectors are loaded once for NR rows,
// and each row's score / value sums are formed with exactly the operations of row_scores /
// row_values (so a row's bits do not depend on how many rows share the pass). Head dims of exactly
// ND vectors only (D == ND * W: no scalar tail).
constexpr int kRowsPerPass = W == 16 ? 4 : 2;

#ifdef SPECFW_AMX_ATTENTION
// bf16 attention on AMX tiles (TDPBF16PS), head dim 64, in every row alike -- prefix keys, a tree
// row's extras, decode rows, a prompt's causal blocks: a tile's sums follow no order vector code
// could repeat, so a row's bits may not depend on which path took it.
//   - scores (amx_scores): S^T = K Q^T, 16 keys' rows as A tiles (loaded from the pool where their
//     slots are consecutive), the rows transposed once into B tiles; each score from its row and
//     key alone;
//   - weighted values (amx_values): blocks of 32 keys at fixed positions of every row's key list
//     (multiples of 32), p split into bf16 hi + lo, values interleaved by key pairs; the last
//     partial block of a row in key order on vector FMAs (row_values), as a lone decode row's.
// The same bits whatever else is in the call; not the vector path's bits. On only where
// set_amx_attention(true) said the process may use AMX (the default where the CPU has AMX-BF16):
// one setting per process.
bool g_amx_attention = false;

inline void tr16x16(__m512i r[16]) {   // rows of 16 dwords -> columns
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) { t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]); t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]); }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]); r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]); r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512i ab0 = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88), ab1 = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    const __m512i cd0 = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88), cd1 = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
    t[i] = _mm512_shuffle_i32x4(ab0, cd0, 0x88); t[i + 8] = _mm512_shuffle_i32x4(ab0, cd0, 0xDD);
    t[i + 4] = _mm512_shuffle_i32x4(ab1, cd1, 0x88); t[i + 12] = _mm512_shuffle_i32x4(ab1, cd1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// every thread of an attention call configures its tiles once, before its first tile op
inline void amx_configure() {
  specfw_amx::TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  specfw_amx::load_config(cfg);
}

// R rows' scores (q fp32 rows D apart holding bf16 values; D == 64) over n keys of a bf16 cache,
// into s: S^T = K Q^T, the keys' rows as A tiles as they lie (two 32-dim halves), the rows
// transposed once into B tiles (16 rows a group), C = 16 keys x 16 rows read back per row.
void amx_scores(int64_t R, const float* q, int64_t D, const uint16_t* cache, int64_t slot_stride, const int64_t* slots, int64_t n,
                float scale, float* s, int64_t s_stride) {
  const int64_t G = (R + 15) / 16;
  thread_local std::vector<uint32_t> qb_tl;   // [groups][2 halves][16 pairs][16 rows], 64-byte aligned
  thread_local std::vector<float> staged_tl;   // the rows qb_tl holds (a task's key blocks share them)
  auto& qb_v = qb_tl;
  auto& staged = staged_tl;
  if (int64_t(qb_v.size()) < G * 2 * 256 + 16) qb_v.resize(G * 2 * 256 + 16), staged.clear();
  uint32_t* QB = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(qb_v.data()) + 63) & ~uintptr_t(63));
  const bool restage = int64_t(staged.size()) != R * D || std::memcmp(staged.data(), q, sizeof(float) * R * D) != 0;
  if (restage) staged.assign(q, q + R * D);
  for (int64_t g = 0; g < G && restage; ++g)
    for (int h = 0; h < 2; ++h) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t row = g * 16 + i;
        if (row >= R) { r[i] = _mm512_setzero_si512(); continue; }
        const float* src = q + row * D + 32 * h;   // fp32 holding bf16: the high halves, 32 dims = 16 pairs
        const __m256i lo = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_loadu_si512(src), 16));
        const __m256i hi = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_loadu_si512(src + 16), 16));
        r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      }
      tr16x16(r);
      for (int p = 0; p < 16; ++p) _mm512_store_si512(QB + ((g * 2 + h) * 16 + p) * 16, r[p]);
    }
  alignas(64) uint16_t ka[2][16][32] = {};
  alignas(64) float c[16][16];
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int nn = int(std::min<int64_t>(16, n - j0));
    bool in_place = nn == 16;   // 16 keys in consecutive slots: the A tiles loaded from the pool as it lies
    for (int k = 1; k < nn && in_place; ++k) in_place = slots[j0 + k] == slots[j0] + k;
    if (in_place) {
      const uint16_t* key = cache + slots[j0] * slot_stride;
      _tile_loadd(1, key, slot_stride * 2);
      _tile_loadd(3, key + 32, slot_stride * 2);
    } else {
      for (int k = 0; k < nn; ++k) {
        const uint16_t* key = cache + slots[j0 + k] * slot_stride;
        _mm512_store_si512(ka[0][k], _mm512_loadu_si512(key));
        _mm512_store_si512(ka[1][k], _mm512_loadu_si512(key + 32));
      }
      _tile_loadd(1, ka[0], 64);
      _tile_loadd(3, ka[1], 64);
    }
    for (int64_t g = 0; g < G; ++g) {
      _tile_zero(0);
      _tile_loadd(2, QB + (g * 2 + 0) * 256, 64);
      _tile_dpbf16ps(0, 1, 2);
      _tile_loadd(2, QB + (g * 2 + 1) * 256, 64);
      _tile_dpbf16ps(0, 3, 2);
      _tile_stored(0, c, 64);
      __m512i cr[16];   // keys x rows -> rows x keys, each row's 16 scores scaled as one vector
      for (int k = 0; k < 16; ++k) cr[k] = _mm512_load_si512(c[k]);
      tr16x16(cr);
      const __mmask16 keys = nn == 16 ? __mmask16(0xFFFF) : __mmask16((1u << nn) - 1);
      for (int64_t row = g * 16; row < std::min<int64_t>(R, g * 16 + 16); ++row)
        _mm512_mask_storeu_ps(s + row * s_stride + j0, keys, _mm512_mul_ps(_mm512_castsi512_ps(cr[row - g * 16]), _mm512_set1_ps(scale)));
    }
  }
}

// R rows' (at most 16) weighted values over n keys of a bf16 cache whose first key sits at a
// multiple of 32 in every row's key list, for ndb blocks of 16 head dims (cache and acc at the first):
// acc[r][0..16 ndb) += sum_j p[r][j] v_j. Per block of 32 keys (zero-padded past n), one tile pass:
// p split into bf16 hi = bf16(p) and lo = bf16(p - hi) as two A tiles, the 32 keys' values
// interleaved by key pairs into one B tile per 16 dims, C += hi V then C += lo V. Every row's
// sums depend on its own p and the block's keys alone, and the blocks sit at fixed absolute key
// positions: a tree row summing a block with other rows and a decode row summing it alone (or as
// its last, partial block) get the same bits.
void amx_values(int64_t R, const float* p, int64_t p_stride, const uint16_t* cache, int64_t slot_stride, const int64_t* slots,
                int64_t n, int ndb, float* acc, int64_t acc_stride) {
  alignas(64) uint16_t vb[4][16][32];
  alignas(64) uint16_t ph[16][32], pl[16][32];
  alignas(64) float cb[4][16][16];
  alignas(64) static const uint16_t kPairIdx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kPairIdx);
  std::memset(ph, 0, sizeof(ph));
  std::memset(pl, 0, sizeof(pl));
  for (int d = 0; d < ndb; ++d)
    for (int r = 0; r < 16; ++r) _mm512_store_ps(cb[d][r], r < R ? _mm512_loadu_ps(acc + r * acc_stride + 16 * d) : _mm512_setzero_ps());
  _tile_loadd(0, cb[0], 64);
  if (ndb > 1) _tile_loadd(1, cb[1], 64);
  if (ndb > 2) _tile_loadd(2, cb[2], 64);
  if (ndb > 3) _tile_loadd(3, cb[3], 64);
  for (int64_t j0 = 0; j0 < n; j0 += 32) {
    const int nn = int(std::min<int64_t>(32, n - j0));
    for (int i = 0; i < 16; ++i) {   // key pair i: keys j0 + 2i, j0 + 2i + 1 (zero past n)
      const int a = 2 * i, b = 2 * i + 1;
      const uint16_t* ka = a < nn ? cache + slots[j0 + a] * slot_stride : nullptr;
      const uint16_t* kb = b < nn ? cache + slots[j0 + b] * slot_stride : nullptr;
      for (int d = 0; d < ndb; ++d) {
        const __m256i va = ka ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ka + 16 * d)) : _mm256_setzero_si256();
        const __m256i vv = kb ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + 16 * d)) : _mm256_setzero_si256();
        _mm512_store_si512(vb[d][i], _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(va), vv, 1)));
      }
    }
    const __mmask16 m0 = nn >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nn) - 1);
    const __mmask16 m1 = nn >= 32 ? __mmask16(0xFFFF) : nn <= 16 ? __mmask16(0) : __mmask16((1u << (nn - 16)) - 1);
    for (int64_t r = 0; r < R; ++r) {
      const float* pr = p + r * p_stride + j0;
      for (int h = 0; h < 2; ++h) {
        const V x = _mm512_maskz_loadu_ps(h ? m1 : m0, pr + 16 * h);
        const V hi = vround_bf16(x);
        const V lo = vround_bf16(_mm512_sub_ps(x, hi));
        _mm256_store_si256(reinterpret_cast<__m256i*>(ph[r] + 16 * h), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(hi), 16)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(pl[r] + 16 * h), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(lo), 16)));
      }
    }
    _tile_loadd(4, ph, 64);
    _tile_loadd(5, pl, 64);
    _tile_loadd(6, vb[0], 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(0, 5, 6);
    if (ndb > 1) { _tile_loadd(7, vb[1], 64); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(1, 5, 7); }
    if (ndb > 2) { _tile_loadd(6, vb[2], 64); _tile_dpbf16ps(2, 4, 6); _tile_dpbf16ps(2, 5, 6); }
    if (ndb > 3) { _tile_loadd(7, vb[3], 64); _tile_dpbf16ps(3, 4, 7); _tile_dpbf16ps(3, 5, 7); }
  }
  _tile_stored(0, cb[0], 64);
  if (ndb > 1) _tile_stored(1, cb[1], 64);
  if (ndb > 2) _tile_stored(2, cb[2], 64);
  if (ndb > 3) _tile_stored(3, cb[3], 64);
  for (int d = 0; d < ndb; ++d)
    for (int64_t r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * acc_stride + 16 * d, _mm512_load_ps(cb[d][r]));
}

// ... R rows in groups of 16
void amx_values_rows(int64_t R, const float* p, int64_t p_stride, const uint16_t* cache, int64_t slot_stride, const int64_t* slots,
                     int64_t n, int ndb, float* acc, int64_t acc_stride) {
  for (int64_t r0 = 0; r0 < R; r0 += 16)
    amx_values(std::min<int64_t>(16, R - r0), p + r0 * p_stride, p_stride, cache, slot_stride, slots, n, ndb, acc + r0 * acc_stride, acc_stride);
}

template <typename T>
inline bool amx_attends(int64_t D) {
  return std::is_same<T, uint16_t>::value && g_amx_attention && D == 64;
}
#endif

bool set_amx_attention(bool on) {   // whether bf16 attention (head dim 64) now runs on AMX tiles; returns it
#ifdef SPECFW_AMX_ATTENTION
  static const bool permitted = specfw_amx::request_amx();
  g_amx_attention = on && permitted;
  return g_amx_attention;
#else
  return false;
#endif
}

bool amx_attention_on() {
#ifdef SPECFW_AMX_ATTENTION
  return g_amx_attention;
#else
  return false;
#endif
}

template <int ND, int NR, typename T>
void rows_scores(const float* q, int64_t D, const T* cache, int64_t slot_stride, const int64_t* slots, int64_t n, float scale,
                 float* s, int64_t s_stride) {
  V qv[NR][ND];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < ND; ++i) qv[r][i] = vload(q + r * D + i * W);
  // whole blocks of W keys: each row's lane partials kept, then W horizontal sums at once (vhsum_many:
  // vhsum's bits), scaled as one vector (the same multiply per score)
  alignas(64) float part[NR][W][W];
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    for (int t = 0; t < W; ++t) {
      const T* k = cache + slots[j + t] * slot_stride;
      V kv[ND];
      for (int i = 0; i < ND; ++i) kv[i] = vload(k + i * W);
      for (int r = 0; r < NR; ++r) {
        V a = vzero();
        for (int i = 0; i < ND; ++i) a = vfma(qv[r][i], kv[i], a);
        vstore(part[r][t], a);
      }
    }
    for (int r = 0; r < NR; ++r) {
      V a[W];
      for (int t = 0; t < W; ++t) a[t] = vload(part[r][t]);
      vstore(s + r * s_stride + j, vmul(vhsum_many(a), vset1(scale)));
    }
  }
  for (; j < n; ++j) {
    const T* k = cache + slots[j] * slot_stride;
    V kv[ND];
    for (int i = 0; i < ND; ++i) kv[i] = vload(k + i * W);
    for (int r = 0; r < NR; ++r) {
      V a = vzero();
      for (int i = 0; i < ND; ++i) a = vfma(qv[r][i], kv[i], a);
      s[r * s_stride + j] = vhsum(a) * scale;
    }
  }
}

template <int ND, int NR, typename T>
void rows_values(const float* p, int64_t p_stride, int64_t D, const T* cache, int64_t slot_stride, const int64_t* slots, int64_t n,
                 float* acc) {
  V a[NR][ND];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < ND; ++i) a[r][i] = vload(acc + r * D + i * W);
  for (int64_t j = 0; j < n; ++j) {
    const T* v = cache + slots[j] * slot_stride;
    V vv[ND];
    for (int i = 0; i < ND; ++i) vv[i] = vload(v + i * W);
    for (int r = 0; r < NR; ++r) {
      const V pj = vset1(p[r * p_stride + j]);
      for (int i = 0; i < ND; ++i) a[r][i] = vfma(pj, vv[i], a[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < ND; ++i) vstore(acc + r * D + i * W, a[r][i]);
}

// R rows' scores (q rows D apart, score rows s_stride apart) over the same n keys: passes of
// kRowsPerPass rows, then the remaining rows in one pass (each row's sums as row_scores forms them)
template <int ND, typename T>
void all_rows_scores(int64_t R, const float* q, int64_t D, const T* cache, int64_t slot_stride, const int64_t* slots, int64_t n,
                     float scale, float* s, int64_t s_stride, bool tiles = false) {
#ifdef SPECFW_AMX_ATTENTION
  if constexpr (std::is_same<T, uint16_t>::value) {
    if (tiles) return amx_scores(R, q, D, cache, slot_stride, slots, n, scale, s, s_stride);
  }
#endif
  int64_t r = 0;
  if constexpr (ND > 0) {
    if (D == ND * W) {
      for (; r + kRowsPerPass <= R; r += kRowsPerPass)
        rows_scores<ND, kRowsPerPass>(q + r * D, D, cache, slot_stride, slots, n, scale, s + r * s_stride, s_stride);
      switch (R - r) {
        case 3: rows_scores<ND, 3>(q + r * D, D, cache, slot_stride, slots, n, scale, s + r * s_stride, s_stride); return;
        case 2: rows_scores<ND, 2>(q + r * D, D, cache, slot_stride, slots, n, scale, s + r * s_stride, s_stride); return;
        case 1: rows_scores<ND, 1>(q + r * D, D, cache, slot_stride, slots, n, scale, s + r * s_stride, s_stride); return;
        default: return;
      }
    }
  }
  for (; r < R; ++r) row_scores<ND>(q + r * D, D, cache, slot_stride, slots, n, scale, s + r * s_stride);
}

// R rows' weighted values over the same n keys, for the NDP vectors of dims at acc / cache (acc
// rows D apart); each dim accumulated in key order, as row_values does
template <int NDP, typename T>
void all_rows_values_part(int64_t R, const float* p, int64_t p_stride, int64_t D, const T* cache, int64_t slot_stride,
                          const int64_t* slots, int64_t n, float* acc) {
  int64_t r = 0;
  for (; r + kRowsPerPass <= R; r += kRowsPerPass)
    rows_values<NDP, kRowsPerPass>(p + r * p_stride, p_stride, D, cache, slot_stride, slots, n, acc + r * D);
  switch (R - r) {
    case 3: rows_values<NDP, 3>(p + r * p_stride, p_stride, D, cache, slot_stride, slots, n, acc + r * D); break;
    case 2: rows_values<NDP, 2>(p + r * p_stride, p_stride, D, cache, slot_stride, slots, n, acc + r * D); break;
    case 1: rows_values<NDP, 1>(p + r * p_stride, p_stride, D, cache, slot_stride, slots, n, acc + r * D); break;
    default: break;
  }
}

// ... over all D dims: in passes of rows where D is ND vectors, else row by row (the same bits)
template <int ND, typename T>
void all_rows_values(int64_t R, const float* p, int64_t p_stride, int64_t D, const T* cache, int64_t slot_stride, const int64_t* slots,
                     int64_t n, float* acc) {
  if constexpr (ND > 0) {
    if (D == ND * W) return all_rows_values_part<ND>(R, p, p_stride, D, cache, slot_stride, slots, n, acc);
  }
  for (int64_t r = 0; r < R; ++r) row_values<ND>(p + r * p_stride, D, cache, slot_stride, slots, n, acc + r * D);
}

// p[0..L) <- exp(p - max), returns their sum (lanes j mod W, then vhsum)
inline float softmax_numerators(float* p, int64_t L) {
  V mv = vset1(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + W <= L; j += W) mv = vmax(mv, vload(p + j));
  float m = vhmax(mv);
  for (int64_t t = j; t < L; ++t) m = std::max(m, p[t]);
  const V neg = vset1(-m);
  V sv = vzero();
  for (j = 0; j + W <= L; j += W) {
    V e = vexp(vadd(vload(p + j), neg));
    vstore(p + j, e);
    sv = vadd(sv, e);
  }
  if (j < L) {   // the tail through the same vector exp, zero lanes added as exact zeros
    float tmp[W];
    for (int t = 0; t < W; ++t) tmp[t] = j + t < L ? p[j + t] : -std::numeric_limits<float>::infinity();
    V e = vexp(vadd(vload(tmp), neg));
    vstore(tmp, e);
    for (int t = 0; j + t < L; ++t) p[j + t] = tmp[t];
    for (int t = int(L - j); t < W; ++t) tmp[t] = 0.f;
    sv = vadd(sv, vload(tmp));
  }
  return vhsum(sv);
}

// fetch ahead: the cache rows (bytes from row) of n slots, into L2
template <typename T>
inline void prefetch_rows(const T* cache, int64_t slot_stride, const int64_t* slots, int64_t n, int64_t bytes) {
  for (int64_t j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(cache + slots[j] * slot_stride);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
  }
}

// The work of one call: items (request group g, kv head) and their query rows t = hh * R + r (the
// kv head's query heads hh, the group's rows r): an item's prefix K/V are read once for all of
// them (each key block stays in L1 while every row scores it). Tasks go to the threads in even
// shares:
//   - fewer than two items per thread over a long prefix (one request: one or two rows over 256+
//     keys (512+ in 8-lane builds), a larger tree over 2,048+; K/V from memory) in three phases in one parallel region, each task sweeping the request's
//     kv heads together (a slot's K or V row read in one go, the next key block fetched ahead):
//     1. prefix scores in chunks of keys, 2. per query row its extras' scores and the softmax
//     numerators, 3. weighted values over half the head dims each;
//   - else each task a whole pass (scores, softmax, values) in its own scratch: one per query
//     head (its kv head's K/V still in L2 for the next head) for one request, over a short
//     prefix, or where an item's scores would not fit L2 (a prompt's causal blocks), else one
//     per item (a batch over long prefixes); several requests' tasks handed out as threads come
//     free.
// A task computes whole values with the functions above (each score on its own, each softmax over
// a row, each value dim in key order), so no value depends on how the work was split, how many
// rows or requests the call has, or which thread ran it: every split gives the same bits.
struct AttnItem {
  int64_t g, kvh, P, R, L;  // L: the longest row's keys (score row stride)
  int64_t q0, s0;           // first query row in qf, first score in sc
};

// head dims [off, off + dims) of an item's query rows [t0, t1), except in phase 1 (score tasks),
// where the same two fields are prefix keys: key0() / key1() name that reading
struct AttnTask {
  int64_t item, off, dims, t0, t1;
  bool tiles = false;   // its rows on AMX tiles (amx_values, amx_scores), else on vector FMAs
  int64_t key0() const { return t0; }
  int64_t key1() const { return t1; }
};

template <int ND, typename T>
void attention_impl(const T* Q, const T* Kc, const T* Vc, T* O, int64_t H, int64_t Hkv, int64_t D, float scale,
                    const int64_t* prefix_ptr, const int64_t* prefix_slots, const int64_t* row_ptr,
                    const int64_t* row_q, const int64_t* extra_ptr, const int64_t* extra_slots, int64_t G) {
  const int64_t group = H / Hkv, stride = Hkv * D;
  constexpr int64_t kKeyBlock = 64;   // keys per pass over an item's rows
  constexpr int64_t kChunk = 256;     // prefix keys per score task (at most)
  constexpr int kParts = ND >= 2 && ND % 2 == 0 ? 2 : 1;  // value tasks over half the head dims
  constexpr int64_t kLongPrefix = 512;  // prefix keys from which K/V come from memory (shorter ones stay in L2)
  constexpr int64_t kLongTreePrefix = 2048;
  // one or two rows take the three phases from this many prefix keys: the demo's one-row forwards,
  // the phases from 256 against 512 alternated in one process (Zen 4 EPYC, session 62, same bits):
  // 400 keys 0.973x / 0.969x the time (fp32 / bf16), two rows 0.980x / 0.986x; below 256 keys the phases
  // (from 128) gave nothing steady (0.985-1.019x); trees of 8 rows lost up to 1% on them at 200-400 keys
  // (8-lane builds keep 512: on an AVX2-only Zen 3, session 46, the phases below 512 keys measured 0.89-1.02x)
  constexpr int64_t kPhasedPrefix = W == 16 ? 256 : 512;
  constexpr int64_t kTileKeys = 128;    // AMX: rows with this many keys or more on tiles
  constexpr int64_t kScores = 1 << 16;  // scores of a whole-item task at most (256 KB: a causal block's 3 x 32 rows
                                        // over a long prompt split per query head, their scores in L2)
  const bool halves = ND > 0 && D == ND * W && kParts > 1;
#ifdef SPECFW_AMX_ATTENTION
  const bool amx = amx_attends<T>(D);
#else
  constexpr bool amx = false;
#endif
  const int nt = at::in_parallel_region() ? 1 : at::get_num_threads();
  // the call's lists and scratch live on in each calling thread: no allocation per call
  // (thread_local objects are named through references here: inside the parallel region a
  // thread_local name would be each worker thread's own object)
  thread_local std::vector<AttnItem> items_tl;
  thread_local std::vector<AttnTask> score_tl, row_tl, value_tl;
  thread_local std::vector<float> shared_tl;
  auto &items = items_tl;
  auto &score_tasks = score_tl, &row_tasks = row_tl, &value_tasks = value_tl;
  auto &shared = shared_tl;
  items.clear();
  score_tasks.clear();
  row_tasks.clear();
  value_tasks.clear();
  int64_t nq = 0, ns = 0, longest = 0, most_rows = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t P = prefix_ptr[g + 1] - prefix_ptr[g], r0 = row_ptr[g], R = row_ptr[g + 1] - r0;
    int64_t L = P;
    for (int64_t r = 0; r < R; ++r) L = std::max(L, P + extra_ptr[r0 + r + 1] - extra_ptr[r0 + r]);
    longest = std::max(longest, P);
    most_rows = std::max(most_rows, R);
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      items.push_back({g, kvh, P, R, L, nq, ns});
      nq += group * R;
      ns += group * R * L;
    }
  }
  const int64_t n_items = items.size();
  const bool few = n_items < 2 * nt;  // too few items to share out evenly: split each
  // ... over a long prefix: in three phases (a tree of 3+ rows only over a very long one: below it
  // a pass per query head, re-reading its kv head's K/V from L2, beat sharing its scores across cores)
  // tiles for a row with kTileKeys keys or more: below, their fixed costs outweigh what they save.
  // A row's key count is the same as the lone decode row's at its position: the same path, the same bits.
  auto row_tiles = [&](const AttnItem& it, int64_t r) {
    const int64_t row = row_ptr[it.g] + r;
    return amx && it.P + extra_ptr[row + 1] - extra_ptr[row] >= kTileKeys;
  };
  auto uniform_path = [&](const AttnItem& it) {
    for (int64_t r = 1; r < it.R; ++r)
      if (row_tiles(it, r) != row_tiles(it, 0)) return false;
    return true;
  };
  const bool phased = few && !amx && longest >= (most_rows > 2 ? kLongTreePrefix : kPhasedPrefix);
  for (int64_t i = 0; i < n_items; ++i) {
    const AttnItem& it = items[i];
    const int64_t NQ = group * it.R;
    if (phased) {
      for (int64_t t = 0; t < NQ; ++t) row_tasks.push_back({i, 0, D, t, t + 1});
      if (it.kvh) continue;  // key chunks and value parts span the group's kv heads (a slot's K/V rows in one sweep)
      const int64_t chunks = std::max<int64_t>((it.P + kChunk - 1) / kChunk, std::min<int64_t>(2, it.P));  // near-equal
      for (int64_t c = 0; c < chunks; ++c) score_tasks.push_back({i, 0, D, it.P * c / chunks, it.P * (c + 1) / chunks});
      if (halves) {
        value_tasks.push_back({i, 0, D / 2, 0, NQ});
        value_tasks.push_back({i, D / 2, D / 2, 0, NQ});
      } else {
        value_tasks.push_back({i, 0, D, 0, NQ});
      }
    } else if (amx && uniform_path(it) && row_tiles(it, 0)) {
      // tiles: a kv head's query rows (its query heads' rows together) in tasks of 16, one A tile each
      for (int64_t t = 0; t < NQ; t += 16) value_tasks.push_back({i, 0, D, t, std::min<int64_t>(NQ, t + 16), true});
    } else if (amx && !uniform_path(it)) {  // rows on both sides of kTileKeys: one task a row, each on its own path
      for (int64_t t = 0; t < NQ; ++t) value_tasks.push_back({i, 0, D, t, t + 1, row_tiles(it, t % it.R)});
    } else if (few || it.P < kLongPrefix || NQ * it.L > kScores) {  // one task per query head: its K/V stay in L2 for the next head
      for (int64_t hh = 0; hh < group; ++hh) value_tasks.push_back({i, 0, D, hh * it.R, (hh + 1) * it.R});
    } else {
      value_tasks.push_back({i, 0, D, 0, NQ});
    }
  }
  const int64_t n1 = score_tasks.size(), n2 = row_tasks.size(), n3 = value_tasks.size();
  // query rows [t0, t1) of an item as fp32, D apart
  auto load_q = [&](const AttnItem& it, int64_t t0, int64_t t1, float* q) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* src = Q + (row_q[row_ptr[it.g] + t % it.R] * H + it.kvh * group + t / it.R) * D;
      for (int64_t d = 0; d < D; ++d) q[(t - t0) * D + d] = load_scalar(src + d);
    }
  };
  // query row t's extras (its own keys after the prefix): scores into s[P..), then the softmax
  // numerators in place; returns their sum
  auto extras_softmax = [&](const AttnItem& it, int64_t t, const float* q, float* s) {
    const int64_t row = row_ptr[it.g] + t % it.R, e0 = extra_ptr[row], ne = extra_ptr[row + 1] - e0;
    row_scores<ND>(q, D, Kc + it.kvh * D, stride, extra_slots + e0, ne, scale, s + it.P);
    return softmax_numerators(s, it.P + ne);
  };
  // (tiles) the task's rows' extras' scores into s[P..) of each score row (it.L apart): each row
  // against the union of the rows' extra keys in one tile pass, then each row's own picked out (a
  // score is its row's and key's alone, wherever the tile holds them)
  auto extras_scores_union = [&](const AttnItem& it, const AttnTask& vt, const float* q, float* s) {
#ifdef SPECFW_AMX_ATTENTION
    if constexpr (std::is_same<T, uint16_t>::value) {
      // the union in first-seen order; where[slot] = (stamp << 32) | its place, valid for this stamp only
      thread_local std::vector<int64_t> uni_tl, where_tl, pick_tl;
      thread_local std::vector<float> us_tl;
      thread_local int64_t stamp_tl = 0;
      auto &uni = uni_tl, &where = where_tl, &pick = pick_tl;
      auto &us = us_tl;
      if (stamp_tl == INT32_MAX) {   // stamps never wrap into an old entry's (a long-running server)
        std::fill(where.begin(), where.end(), 0);
        stamp_tl = 0;
      }
      const int64_t stamp = ++stamp_tl, NT = vt.t1 - vt.t0;
      uni.clear();
      pick.clear();
      for (int64_t t = 0; t < NT; ++t) {
        const int64_t row = row_ptr[it.g] + (vt.t0 + t) % it.R;
        for (int64_t e = extra_ptr[row]; e < extra_ptr[row + 1]; ++e) {
          const int64_t slot = extra_slots[e];
          if (slot >= int64_t(where.size())) where.resize(slot + 1024, 0);
          if ((where[slot] >> 32) != stamp) {
            where[slot] = (stamp << 32) | int64_t(uni.size());
            uni.push_back(slot);
          }
          pick.push_back(where[slot] & 0xffffffffLL);
        }
      }
      const int64_t U = uni.size();
      if (int64_t(us.size()) < NT * U) us.resize(NT * U);
      amx_scores(NT, q, D, Kc + it.kvh * D, stride, uni.data(), U, scale, us.data(), U);
      int64_t k = 0;
      for (int64_t t = 0; t < NT; ++t) {
        const int64_t row = row_ptr[it.g] + (vt.t0 + t) % it.R, ne = extra_ptr[row + 1] - extra_ptr[row];
        for (int64_t e = 0; e < ne; ++e) s[t * it.L + it.P + e] = us[t * U + pick[k++]];
      }
    }
#endif
  };
  // the task's query rows' weighted values over its dims: p their score rows (it.L apart), a their
  // accumulators (D apart, at the task's first dim); first the prefix keys [j0, j0 + n) ...
  auto values_block = [&](const AttnItem& it, const AttnTask& vt, const float* p, float* a, int64_t j0, int64_t n) {
    const int64_t NT = vt.t1 - vt.t0, *pre = prefix_slots + prefix_ptr[it.g];
    const T* Vh = Vc + it.kvh * D + vt.off;
#ifdef SPECFW_AMX_ATTENTION
    if constexpr (std::is_same<T, uint16_t>::value) {
      if (vt.tiles) {   // whole blocks of 32 prefix keys on tiles
        const int64_t Pf = it.P / 32 * 32, m = std::min(j0 + n, Pf) - j0;
        if (m > 0) amx_values_rows(NT, p + j0, it.L, Vh, stride, pre + j0, m, int(vt.dims / 16), a, D);
        // the prefix's last partial block [Pf, P) in key order on vector FMAs, together for the rows
        // whose own keys end inside that block (the rest reach a whole block of their own: values_finish)
        const int64_t f0 = std::max(j0, Pf), f1 = std::min(j0 + n, it.P);
        if (f1 > f0) {
          auto in_block = [&](int64_t t) {
            const int64_t row = row_ptr[it.g] + (vt.t0 + t) % it.R;
            return (it.P + extra_ptr[row + 1] - extra_ptr[row]) / 32 * 32 == Pf;
          };
          for (int64_t t = 0; t < NT;) {
            if (!in_block(t)) { ++t; continue; }
            int64_t u = t + 1;
            while (u < NT && in_block(u)) ++u;
            if constexpr (kParts > 1) {
              if (vt.dims < D) {
                all_rows_values_part<ND / kParts>(u - t, p + t * it.L + f0, it.L, D, Vh, stride, pre + f0, f1 - f0, a + t * D);
                t = u;
                continue;
              }
            }
            all_rows_values<ND>(u - t, p + t * it.L + f0, it.L, D, Vh, stride, pre + f0, f1 - f0, a + t * D);
            t = u;
          }
        }
        return;
      }
    }
#endif
    if constexpr (kParts > 1) {
      if (vt.dims < D) return all_rows_values_part<ND / kParts>(NT, p + j0, it.L, D, Vh, stride, pre + j0, n, a);
    }
    all_rows_values<ND>(NT, p + j0, it.L, D, Vh, stride, pre + j0, n, a);
  };
  // ... then each row's extras, and its output (sums: the rows' softmax sums)
  auto values_finish = [&](const AttnItem& it, const AttnTask& vt, const float* p, float* a, const float* sums) {
    const T* Vh = Vc + it.kvh * D + vt.off;
    for (int64_t t = 0; t < vt.t1 - vt.t0; ++t) {
      const int64_t tq = vt.t0 + t, row = row_ptr[it.g] + tq % it.R, h = it.kvh * group + tq / it.R;
      const int64_t e0 = extra_ptr[row], ne = extra_ptr[row + 1] - e0;
      const float* pe = p + t * it.L + it.P;
      bool done = false;
#ifdef SPECFW_AMX_ATTENTION
      if constexpr (std::is_same<T, uint16_t>::value) {
        if (vt.tiles) {   // the row's tail after the shared whole blocks
          // keys [Pf, Fr): whole blocks holding the row's own keys, on tiles; [Fr, Lr): the row's last
          // partial block, in key order on vector FMAs (a decode row's last block is partial there too)
          thread_local std::vector<int64_t> tail_tl;
          auto& tail = tail_tl;
          const int64_t Pf = it.P / 32 * 32, Lr = it.P + ne, Fr = Lr / 32 * 32, *pre = prefix_slots + prefix_ptr[it.g];
          tail.assign(pre + Pf, pre + it.P);
          tail.insert(tail.end(), extra_slots + e0, extra_slots + e0 + ne);
          const float* pr = p + t * it.L;
          if (Fr > Pf) amx_values(1, pr + Pf, 0, Vh, stride, tail.data(), Fr - Pf, int(vt.dims / 16), a + t * D, D);
          const int64_t from = Fr > Pf ? Fr : it.P;   // else values_block summed [Pf, P) already
          if (Lr > from) {
            if (vt.dims < D) rows_values<ND / kParts, 1>(pr + from, 0, D, Vh, stride, tail.data() + (from - Pf), Lr - from, a + t * D);
            else row_values<ND>(pr + from, D, Vh, stride, tail.data() + (from - Pf), Lr - from, a + t * D);
          }
          done = true;
        }
      }
#endif
      if constexpr (kParts > 1) {
        if (!done && vt.dims < D) {
          rows_values<ND / kParts, 1>(pe, 0, D, Vh, stride, extra_slots + e0, ne, a + t * D);
          done = true;
        }
      }
      if (!done) row_values<ND>(pe, D, Vh, stride, extra_slots + e0, ne, a + t * D);
      T* o = O + (row_q[row] * H + h) * D + vt.off;
      for (int64_t d = 0; d < vt.dims; ++d) {
        const float val = a[t * D + d] / sums[t];
        if constexpr (std::is_same<T, float>::value) o[d] = val; else o[d] = to_bf16(val);
      }
    }
  };
  auto zero = [&](const AttnTask& vt, float* a) {
    for (int64_t t = 0; t < vt.t1 - vt.t0; ++t) std::fill(a + t * D, a + t * D + vt.dims, 0.f);
  };
  // phased: every item's query rows, scores, accumulators and sums in shared scratch (every value
  // is written before it is read)
  if (phased && int64_t(shared.size()) < nq * D * 2 + ns + nq) shared.resize(nq * D * 2 + ns + nq);
  float *qf = shared.data(), *acc = qf + nq * D, *sc = acc + nq * D, *sums = sc + ns;
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
#ifdef SPECFW_AMX_ATTENTION
    if constexpr (std::is_same<T, uint16_t>::value) {
      if (amx_attends<T>(D)) amx_configure();
    }
#endif
    if (phased) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n_items; ++i) load_q(items[i], 0, group * items[i].R, qf + items[i].q0 * D);
#pragma omp for schedule(static)
      for (int64_t k = 0; k < n1; ++k) {
        const AttnTask& st = score_tasks[k];
        const int64_t* pre = prefix_slots + prefix_ptr[items[st.item].g];
        for (int64_t j0 = st.key0(); j0 < st.key1(); j0 += kKeyBlock) {
          if (j0 + kKeyBlock < st.key1())
            prefetch_rows(Kc, stride, pre + j0 + kKeyBlock, std::min(st.key1() - j0 - kKeyBlock, kKeyBlock), int64_t(sizeof(T)) * stride);
          for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
            const AttnItem& it = items[st.item + kvh];
            all_rows_scores<ND>(group * it.R, qf + it.q0 * D, D, Kc + kvh * D, stride, pre + j0, std::min(st.key1() - j0, kKeyBlock), scale,
                                sc + it.s0 + j0, it.L);
          }
        }
      }
#pragma omp for schedule(static)
      for (int64_t k = 0; k < n2; ++k) {
        const AttnItem& it = items[row_tasks[k].item];
        const int64_t t = row_tasks[k].t0;
        sums[it.q0 + t] = extras_softmax(it, t, qf + (it.q0 + t) * D, sc + it.s0 + t * it.L);
      }
#pragma omp for schedule(static)
      for (int64_t k = 0; k < n3; ++k) {
        const AttnTask& vt = value_tasks[k];
        const int64_t P = items[vt.item].P;
        auto p = [&](const AttnItem& it) { return sc + it.s0 + vt.t0 * it.L; };
        auto a = [&](const AttnItem& it) { return acc + (it.q0 + vt.t0) * D + vt.off; };
        for (int64_t kvh = 0; kvh < Hkv; ++kvh) zero(vt, a(items[vt.item + kvh]));
        const int64_t* pre = prefix_slots + prefix_ptr[items[vt.item].g];
        for (int64_t j0 = 0; j0 < P; j0 += kKeyBlock) {
          if (j0 + kKeyBlock < P) prefetch_rows(Vc, stride, pre + j0 + kKeyBlock, std::min(P - j0 - kKeyBlock, kKeyBlock), int64_t(sizeof(T)) * stride);
          for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
            const AttnItem& it = items[vt.item + kvh];
            values_block(it, AttnTask{vt.item + kvh, vt.off, vt.dims, vt.t0, vt.t1}, p(it), a(it), j0, std::min(P - j0, kKeyBlock));
          }
        }
        for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
          const AttnItem& it = items[vt.item + kvh];
          values_finish(it, AttnTask{vt.item + kvh, vt.off, vt.dims, vt.t0, vt.t1}, p(it), a(it), sums + it.q0 + vt.t0);
        }
      }
    } else {
      thread_local std::vector<float> q, s, a, sum;  // this thread's query rows, score rows, accumulators, sums
      // one request: even shares in order (a thread's next head reads its kv head's K/V from L2);
      // several: handed out as threads come free (a causal prompt's blocks, a mixed batch), a kv
      // head's query heads (or a request's kv heads) together
      auto whole_task = [&](int64_t k) {
        const AttnTask& vt = value_tasks[k];
        const AttnItem& it = items[vt.item];
        const int64_t NT = vt.t1 - vt.t0;
        const int64_t* pre = prefix_slots + prefix_ptr[it.g];
        if (int64_t(s.size()) < NT * it.L) s.resize(NT * it.L);
        if (int64_t(q.size()) < NT * D) q.resize(NT * D), a.resize(NT * D), sum.resize(NT);
        load_q(it, vt.t0, vt.t1, q.data());
        // several requests: each task's K/V come from memory (one request's stay in L2 from head to
        // head, and its redundant prefetches cost more than they hide), the next key block fetched ahead
        const bool ahead = G > 1;
        const int64_t head_bytes = int64_t(sizeof(T)) * D;   // this kv head's part of a slot's row
        for (int64_t j0 = 0; j0 < it.P; j0 += kKeyBlock) {
          if (ahead && j0 + kKeyBlock < it.P)
            prefetch_rows(Kc + it.kvh * D, stride, pre + j0 + kKeyBlock, std::min(it.P - j0 - kKeyBlock, kKeyBlock), head_bytes);
          else if (ahead)   // the last key block: the values' first block next
            prefetch_rows(Vc + it.kvh * D, stride, pre, std::min(it.P, kKeyBlock), head_bytes);
          all_rows_scores<ND>(NT, q.data(), D, Kc + it.kvh * D, stride, pre + j0, std::min(it.P - j0, kKeyBlock), scale, s.data() + j0, it.L, vt.tiles);
        }
        if (vt.tiles) {   // tiles: every row's extras scored in one pass over the union of the task's extra keys
          extras_scores_union(it, vt, q.data(), s.data());
          for (int64_t t = 0; t < NT; ++t) {
            const int64_t row = row_ptr[it.g] + (vt.t0 + t) % it.R;
            sum[t] = softmax_numerators(s.data() + t * it.L, it.P + extra_ptr[row + 1] - extra_ptr[row]);
          }
        } else {
          for (int64_t t = 0; t < NT; ++t) sum[t] = extras_softmax(it, vt.t0 + t, q.data() + t * D, s.data() + t * it.L);
        }
        zero(vt, a.data());
        if (vt.tiles) {   // tiles: the whole prefix in one pass (its accumulators stay in the tiles)
          if (it.P) values_block(it, vt, s.data(), a.data(), 0, it.P);
        } else for (int64_t j0 = 0; j0 < it.P; j0 += kKeyBlock) {
          if (ahead && j0 + kKeyBlock < it.P) prefetch_rows(Vc + it.kvh * D, stride, pre + j0 + kKeyBlock, std::min(it.P - j0 - kKeyBlock, kKeyBlock), head_bytes);
          values_block(it, vt, s.data(), a.data(), j0, std::min(it.P - j0, kKeyBlock));
        }
        values_finish(it, vt, s.data(), a.data(), sum.data());
      };
      if (G == 1) {
#pragma omp for schedule(static) nowait
        for (int64_t k = 0; k < n3; ++k) whole_task(k);
      } else {
        const int64_t chunk = group;
#pragma omp for schedule(dynamic, chunk) nowait
        for (int64_t k = 0; k < n3; ++k) whole_task(k);
      }
    }
  }
}

template <typename T, typename... A>
void attention_dispatch(int64_t D, A... args) {
  switch (D / W) {   // head dims of 32..256 keep q and the value accumulators in registers
    case 2: attention_impl<2, T>(args...); break;
    case 4: attention_impl<4, T>(args...); break;
    case 8: attention_impl<8, T>(args...); break;
    case 16: attention_impl<16, T>(args...); break;
    default: attention_impl<0, T>(args...); break;
  }
}

// q [T, H, D]; k_cache, v_cache [S, Hkv, D] (q's dtype); out [T, H, D] (rows not listed are left
// as they are). Groups: prefix_ptr [G+1] into prefix_slots; row_ptr [G+1] into row_q (query
// rows) and extra_ptr [R+1] into extra_slots.
void attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out, double scale,
               torch::Tensor prefix_ptr, torch::Tensor prefix_slots, torch::Tensor row_ptr, torch::Tensor row_q,
               torch::Tensor extra_ptr, torch::Tensor extra_slots) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "attention: q [T, H, D], caches [S, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "attention: q, caches and out of one dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes(),
              "attention: contiguous tensors, out shaped like q");
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && H % Hkv == 0, "attention: head_dim / kv heads mismatch");
  for (auto* t : {&prefix_ptr, &prefix_slots, &row_ptr, &row_q, &extra_ptr, &extra_slots})
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous(), "attention: int64 index tensors");
  const int64_t G = row_ptr.numel() - 1;
  if (G <= 0) return;
  const auto args = std::make_tuple(prefix_ptr.data_ptr<int64_t>(), prefix_slots.data_ptr<int64_t>(), row_ptr.data_ptr<int64_t>(),
                                    row_q.data_ptr<int64_t>(), extra_ptr.data_ptr<int64_t>(), extra_slots.data_ptr<int64_t>());
  if (q.scalar_type() == torch::kFloat32) {
    attention_dispatch<float>(D, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), out.data_ptr<float>(), H, Hkv, D,
                   float(scale), std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args), std::get<4>(args),
                   std::get<5>(args), G);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "attention: float32 or bfloat16");
    auto p = [](torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    attention_dispatch<uint16_t>(D, p(q), p(k_cache), p(v_cache), p(out), H, Hkv, D, float(scale), std::get<0>(args), std::get<1>(args),
                   std::get<2>(args), std::get<3>(args), std::get<4>(args), std::get<5>(args), G);
  }
}

// ---------------------------------------------------------------- per-row elementwise ops
// The decoder layer's glue in one call each instead of 5-10 torch ops (at batch 1 their dispatch
// cost more than the attention). Every row is computed on its own: batch invariant.

template <typename T> inline float ld(const T* p, int64_t i) { return load_scalar(p + i); }
template <typename T> inline void st(T* p, int64_t i, float v) {
  if constexpr (std::is_same<T, float>::value) p[i] = v; else p[i] = to_bf16(v);
}
template <typename T> inline float rnd(float v) {   // round to T and back (bf16: as torch rounds each op)
  if constexpr (std::is_same<T, float>::value) return v; else return from_bf16(to_bf16(v));
}

// whole vectors of T: rounded to T after each op as rnd<T> rounds a lane, stored as st stores it
template <typename T> inline V vrnd(V a) {
  if constexpr (std::is_same<T, float>::value) return a; else return vround_bf16(a);
}
inline void vst(float* p, V a) { vstore(p, a); }
inline void vst(uint16_t* p, V a) { vstore_bf16(p, a); }

// Rows of x (row r at x + r * D, or with ids at x + ids[r] * x_stride: rows of a table read in
// place) normed into y (row r at y + r * y_stride: e.g. one half of a wider row); res / sum as
// add_rms_norm's, D apart (without ids).
template <typename T>
void add_rms_norm_impl(const T* x, const T* res, T* sum, const T* w, T* y, int64_t rows, int64_t D, float eps, const int64_t* ids = nullptr,
                       int64_t x_stride = -1, int64_t y_stride = -1) {
  if (x_stride < 0) x_stride = D;
  if (y_stride < 0) y_stride = D;
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> f(D);
    // whole vectors, the scalar tail's operations lane by lane (bf16: rounded where it rounds)
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + (ids ? ids[r] : r) * x_stride;
      T* yr = y + r * y_stride;
      int64_t d = 0;
      for (; d + W <= D; d += W) {
        V v = vload(xr + d);
        if (res) { v = vrnd<T>(vadd(v, vload(res + r * D + d))); vst(sum + r * D + d, v); }
        vstore(f.data() + d, v);
      }
      for (; d < D; ++d) {
        float v = ld(xr, d);
        if (res) { v = rnd<T>(v + ld(res + r * D, d)); st(sum + r * D, d, v); }
        f[d] = v;
      }
      V acc = vzero();
      for (d = 0; d + W <= D; d += W) { V v = vload(f.data() + d); acc = vfma(v, v, acc); }
      float ss = vhsum(acc);
      for (; d < D; ++d) ss += f[d] * f[d];
      const float inv = 1.f / std::sqrt(ss / float(D) + eps);
      d = 0;
      for (; d + W <= D; d += W) vst(yr + d, vmul(vrnd<T>(vmul(vload(f.data() + d), vset1(inv))), vload(w + d)));
      for (; d < D; ++d) st(yr, d, rnd<T>(rnd<T>(f[d] * inv) * ld(w, d)));
    }
  });
}

// x [rows, D]; residual [rows, D] or empty; weight [D] -> (sum, normed): sum = x + residual (x
// itself without a residual), normed = RMSNorm(sum) * weight -- the pre-norm residual add.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.numel() == x.size(1), "add_rms_norm: x [rows, D] contiguous, weight [D]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && (!residual.numel() || (residual.sizes() == x.sizes() &&
              residual.scalar_type() == x.scalar_type())), "add_rms_norm: one dtype, residual shaped like x");
  auto w = weight.contiguous();
  auto res = residual.numel() ? residual.contiguous() : residual;
  auto y = torch::empty_like(x);
  auto sum = res.numel() ? torch::empty_like(x) : x;
  const int64_t rows = x.size(0), D = x.size(1);
  if (x.scalar_type() == torch::kFloat32)
    add_rms_norm_impl<float>(x.data_ptr<float>(), res.numel() ? res.data_ptr<float>() : nullptr, sum.data_ptr<float>(),
                             w.data_ptr<float>(), y.data_ptr<float>(), rows, D, float(eps));
  else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "add_rms_norm: float32 or bfloat16");
    auto p = [](torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    add_rms_norm_impl<uint16_t>(p(x), res.numel() ? p(res) : nullptr, p(sum), p(w), p(y), rows, D, float(eps));
  }
  return {sum, y};
}

// pos (not null): cos / sin are whole tables, row r's at pos[r]; else a row per qkv row
template <typename T>
void rope_write_impl(const T* qkv, const T* cos, const T* sin, T* kc, T* vc, const int64_t* slots, T* q,
                     int64_t rows, int64_t H, int64_t Hkv, int64_t D, const int64_t* pos = nullptr) {
  const int64_t width = (H + 2 * Hkv) * D, half = D / 2;
  at::parallel_for(0, rows, 32, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = qkv + r * width;
      const T* c = cos + (pos ? pos[r] : r) * D;
      const T* s = sin + (pos ? pos[r] : r) * D;
      for (int64_t h = 0; h < H + Hkv; ++h) {   // rope on q heads, then k heads (HF: x*cos + rotate_half(x)*sin)
        const T* x = row + h * D;
        T* out = h < H ? q + (r * H + h) * D : kc + (slots[r] * Hkv + (h - H)) * D;
        if constexpr (!std::is_same<T, float>::value) {
          if (half % W == 0) {   // bf16: whole vectors, each op rounded as rnd<T> rounds a lane (the same bits)
            const V neg = vset1(-1.f);
            for (int64_t i = 0; i < half; i += W) {
              const V lo = vload(x + i), hi = vload(x + half + i);
              vst(out + i, vrnd<T>(vadd(vrnd<T>(vmul(lo, vload(c + i))), vrnd<T>(vmul(vmul(hi, neg), vload(s + i))))));
              vst(out + half + i, vrnd<T>(vadd(vrnd<T>(vmul(hi, vload(c + half + i))), vrnd<T>(vmul(lo, vload(s + half + i))))));
            }
            continue;
          }
        }
        for (int64_t d = 0; d < D; ++d) {
          const float rot = d < half ? -ld(x, d + half) : ld(x, d - half);
          st(out, d, rnd<T>(rnd<T>(ld(x, d) * ld(c, d)) + rnd<T>(rnd<T>(rot) * ld(s, d))));
        }
      }
      std::memcpy(vc + slots[r] * Hkv * D, row + (H + Hkv) * D, sizeof(T) * Hkv * D);
    }
  });
}

// rope_write with cos / sin given as whole tables [P, D] (contiguous) and each row's position
// (pos [rows] int64, checked): the rows read in place, no gathered copy of them
torch::Tensor rope_write_at(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, const int64_t* pos,
                            const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots, int64_t H, int64_t Hkv) {
  const int64_t rows = qkv.size(0), D = k_cache.size(2);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (H + 2 * Hkv) * D && D % 2 == 0, "rope_write: qkv [rows, (H + 2 Hkv) D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(1) == Hkv, "rope_write: contiguous caches [S, Hkv, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == rows && slots.is_contiguous(), "rope_write: int64 slots [rows]");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == cos.scalar_type(),
              "rope_write: one dtype");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == sin.numel() && cos.numel() % D == 0, "rope_write: contiguous tables of D-wide rows");
  const int64_t S = k_cache.size(0), P = pos ? cos.numel() / D : rows;
  TORCH_CHECK(pos || cos.numel() == rows * D, "rope_write: cos / sin [rows, D]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(sp[r] >= 0 && sp[r] < S && (!pos || (pos[r] >= 0 && pos[r] < P)), "rope_write: slot or position out of range");
  auto q = torch::empty({rows, H, D}, qkv.options());
  if (qkv.scalar_type() == torch::kFloat32)
    rope_write_impl<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), k_cache.data_ptr<float>(),
                           v_cache.data_ptr<float>(), sp, q.data_ptr<float>(), rows, H, Hkv, D, pos);
  else {
    auto p = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    rope_write_impl<uint16_t>(p(qkv), p(cos), p(sin), p(k_cache), p(v_cache), sp, p(q), rows, H, Hkv, D, pos);
  }
  return q;
}

// qkv [rows, (H + 2 Hkv) D]; cos, sin [rows, D]; caches [S, Hkv, D]; slots [rows] -> q [rows, H, D]
// with rope applied; k (roped) and v written to the caches at ``slots``.
torch::Tensor rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                         torch::Tensor v_cache, torch::Tensor slots, int64_t H, int64_t Hkv) {
  const int64_t rows = qkv.size(0), D = k_cache.size(2);
  return rope_write_at(qkv, cos.reshape({rows, D}).contiguous(), sin.reshape({rows, D}).contiguous(), nullptr, k_cache, v_cache, slots.contiguous(), H, Hkv);
}

template <typename T>
void silu_mul_impl(const T* gu, T* y, int64_t rows, int64_t I) {
  at::parallel_for(0, rows * I / W, 512, [&]   // from ~8k outputs (6 rows of the demo) on two threads (16 rows: 0.70 -> 0.49 ms a forward)
      (int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {   // y = rnd(rnd(g / (1 + exp(-g))) * u) lane by lane (fp32: no rounding)
      const int64_t r = c * W / I, i = c * W % I;
      const V gv = vload(gu + r * 2 * I + i), uv = vload(gu + r * 2 * I + I + i);
      vst(y + r * I + i, vmul(vrnd<T>(vdiv(gv, vadd(vset1(1.f), vexp(vmul(gv, vset1(-1.f)))))), uv));
    }
  });
}

// gate_up [rows, 2I] (gate | up) -> silu(gate) * up [rows, I]; I a multiple of the vector width
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % (2 * W) == 0, "silu_mul: gate_up [rows, 2I], I % W == 0");
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2;
  auto y = torch::empty({rows, I}, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32)
    silu_mul_impl<float>(gate_up.data_ptr<float>(), y.data_ptr<float>(), rows, I);
  else {
    TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16, "silu_mul: float32 or bfloat16");
    silu_mul_impl<uint16_t>(reinterpret_cast<uint16_t*>(gate_up.data_ptr()), reinterpret_cast<uint16_t*>(y.data_ptr()), rows, I);
  }
  return y;
}

// b = a + b elementwise, in place (b: a tensor of the caller's own, shaped and typed like a; both
// contiguous): torch's `a + b` bits (fp32: the sum; bf16: the fp32 sum rounded once) without its
// dispatch and a new tensor. Returns b.
template <typename T>
void add_into_impl(const T* a, T* b, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) vst(b + i, vrnd<T>(vadd(vload(a + i), vload(b + i))));
  for (; i < n; ++i) st(b, i, rnd<T>(ld(a, i) + ld(b, i)));
}

torch::Tensor add_into(const torch::Tensor& a, torch::Tensor b) {
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && a.is_contiguous() && b.is_contiguous(),
              "add_into: contiguous tensors of one shape and dtype");
  if (a.scalar_type() == torch::kFloat32)
    add_into_impl<float>(a.data_ptr<float>(), b.data_ptr<float>(), a.numel());
  else {
    TORCH_CHECK(a.scalar_type() == torch::kBFloat16, "add_into: float32 or bfloat16");
    add_into_impl<uint16_t>(reinterpret_cast<const uint16_t*>(a.data_ptr()), reinterpret_cast<uint16_t*>(b.data_ptr()), a.numel());
  }
  return b;
}

// rows idx[0..n) of src [R, C] (contiguous; checked) -> [n, C]: index_select's result by row copies
torch::Tensor gather_rows(const torch::Tensor& src, const int64_t* idx, int64_t n) {
  TORCH_CHECK(src.dim() == 2 && src.is_contiguous(), "gather_rows: contiguous [rows, C]");
  const int64_t R = src.size(0), bytes = src.size(1) * src.element_size();
  auto out = torch::empty({n, src.size(1)}, src.options());
  const char* s = static_cast<const char*>(src.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(idx[i] >= 0 && idx[i] < R, "gather_rows: row index out of range");
    std::memcpy(o + i * bytes, s + idx[i] * bytes, bytes);
  }
  return out;
}

// Each row's k best log-probabilities (log-softmax over the row) and their indices, best first,
// ties to the lower index: out [2, rows, k] fp32, ids stored as floats (exact below 2^24). One
// call replaces log_softmax + topk + a stack for the draft loop's per-depth read-back.
torch::Tensor top_logprobs(torch::Tensor logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32, "top_logprobs: float32 [rows, V]");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), V_ = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V_, "top_logprobs: 1 <= k <= V");
  auto out = torch::empty({2, rows, k}, x.options());
  const float* X = x.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = X + r * V_;
    std::vector<float> best(k, ninf);
    std::vector<int64_t> idx(k, -1);
    int64_t filled = 0;
    V m = vset1(ninf);
    int64_t v = 0;
    for (; v + W <= V_; v += W) m = vmax(m, vload(row + v));
    float mx = vhmax(m);
    for (; v < V_; ++v) mx = std::max(mx, row[v]);
    V acc = vzero();
    for (v = 0; v + W <= V_; v += W) acc = vadd(acc, vexp(vadd(vload(row + v), vset1(-mx))));
    float sum = vhsum(acc);
    for (; v < V_; ++v) sum += std::exp(row[v] - mx);
    auto insert = [&](int64_t i) {   // into the k best: strictly greater moves up (ties keep the lower index first)
      const float a = row[i];
      if (filled == k && !(a > best[k - 1])) return;
      int64_t j = filled < k ? filled++ : k - 1;
      while (j > 0 && a > best[j - 1]) { best[j] = best[j - 1]; idx[j] = idx[j - 1]; --j; }
      best[j] = a; idx[j] = i;
    };
    for (v = 0; v + W <= V_; v += W)   // a vector with nothing above the k-th best is skipped whole
      if (filled < k || vany_gt(vload(row + v), best[k - 1]))
        for (int64_t i = v; i < v + W; ++i) insert(i);
    for (; v < V_; ++v) insert(v);
    const float lse = mx + std::log(sum);
    for (int64_t j = 0; j < k; ++j) {
      O[r * k + j] = best[j] - lse;
      O[rows * k + r * k + j] = static_cast<float>(idx[j]);
    }
  }
  return out;
}

// ---------------------------------------------------------------- decoder layers in one call
// One decoder layer after its input norm: h (the attention input) through qkv, rope + KV write
// (cos / sin: contiguous [T, D], or with pos whole tables read at pos[r]; out_slots contiguous),
// attention, o; the residual x plus that, normed (ln2), through the MLP. lin(i, a): linear i of
// the layer (0 qkv, 1 o, 2 gate_up, 3 down) applied to a. Returns (x plus the attention's output,
// the MLP's output): the layer's output is their sum, left to the caller.
template <typename Lin>
std::pair<torch::Tensor, torch::Tensor> layer_body(const Lin& lin, const torch::Tensor& h, const torch::Tensor& x, const torch::Tensor& ln2, const torch::Tensor& k_cache,
                         const torch::Tensor& v_cache, const torch::Tensor& cos, const torch::Tensor& sin, const int64_t* pos, const torch::Tensor& out_slots,
                         double eps, double scale, int64_t H, int64_t Hkv, int64_t D, const torch::Tensor& prefix_ptr,
                         const torch::Tensor& prefix_slots, const torch::Tensor& row_ptr, const torch::Tensor& row_q,
                         const torch::Tensor& extra_ptr, const torch::Tensor& extra_slots) {
  const int64_t T = x.size(0);
  auto q = rope_write_at(lin(0, h), cos, sin, pos, k_cache, v_cache, out_slots, H, Hkv);
  auto o = torch::empty_like(q);
  attention(q, k_cache, v_cache, o, scale, prefix_ptr, prefix_slots, row_ptr, row_q, extra_ptr, extra_slots);
  auto sum_normed = add_rms_norm(x, lin(1, o.reshape({T, H * D})), ln2, eps);
  return {sum_normed[0], lin(3, silu_mul(lin(2, sum_normed[1])))};
}

// A packed linear of another extension with this build's signature (x, packed, N, fp32 bias or
// empty): bf16_amx.cpp's AMX tiles, called through the address its build hands out
// (bf16_amx.linear_address(); the extensions are separate libraries in one process, on one libtorch).
using PackedLinear = torch::Tensor (*)(torch::Tensor, torch::Tensor, int64_t, torch::Tensor);

// A layer's linears on packed weights: this build's fp32/bf16 ones, or ``fn``'s (not null). w: qkv
// packed, qkv bias (or empty), o packed, (the post-attention norm), gate_up packed, down packed,
// widths [4] (int64).
struct PackedLinears {
  const torch::Tensor* w;
  torch::Tensor no_bias;
  PackedLinear fn;
  PackedLinears(const torch::Tensor* w_, const torch::Tensor& like, PackedLinear fn_ = nullptr)
      : w(w_), no_bias(torch::empty({0}, like.options().dtype(torch::kFloat32))), fn(fn_) {}
  torch::Tensor operator()(int i, const torch::Tensor& a) const {
    static constexpr int packed[4] = {0, 2, 4, 5};
    const auto& b = i == 0 ? w[1] : no_bias;
    return fn ? fn(a, w[packed[i]], w[6].data_ptr<int64_t>()[i], b) : linear(a, w[packed[i]], w[6].data_ptr<int64_t>()[i], b);
  }
};

// .to(float32) of a bf16 tensor (exact; fp32 passes through) and .to(bfloat16) of an fp32 one
// (nearest even, as to_bf16), contiguous, in one loop each instead of a torch conversion
torch::Tensor as_fp32(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kFloat32) return t.contiguous();
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, "as_fp32: float32 or bfloat16");
  const auto c = t.contiguous();
  auto out = torch::empty(c.sizes(), c.options().dtype(torch::kFloat32));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(c.data_ptr());
  float* dst = out.data_ptr<float>();
  const int64_t n = c.numel();
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(dst + i, vload(src + i));
  for (; i < n; ++i) dst[i] = from_bf16(src[i]);
  return out;
}

torch::Tensor as_bf16(const torch::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, "as_bf16: float32");
  const auto c = t.contiguous();
  auto out = torch::empty(c.sizes(), c.options().dtype(torch::kBFloat16));
  const float* src = c.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t n = c.numel();
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore_bf16(dst + i, vload(src + i));
  for (; i < n; ++i) dst[i] = to_bf16(src[i]);
  return out;
}

// A layer's linears on int8 activations x 4/8-bit weight codes: q8_ops.cpp's linear, called
// through the address its build hands out (q8_ops.linear_address(): the two extensions are
// separate libraries in one process, on one libtorch). w: codes, d, m, bias for qkv, o, gate_up,
// down (16 tensors), then meta [8] int64: the four output widths, then the four code widths.
using Q8Linear = torch::Tensor (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, torch::Tensor);
struct CodeLinears {
  const torch::Tensor* w;
  const torch::Tensor& meta;
  Q8Linear fn;
  torch::Tensor operator()(int i, const torch::Tensor& a) const {
    const int64_t* n = meta.data_ptr<int64_t>();
    auto y = fn(as_fp32(a), w[4 * i], w[4 * i + 1], w[4 * i + 2], n[4 + i], n[i], w[4 * i + 3]);   // fp32 sums
    return a.scalar_type() == torch::kBFloat16 ? as_bf16(y) : y;   // a bf16 layer: rounded as Q8Linear rounds
  }
};

Q8Linear q8_linear_at(int64_t address) {
  TORCH_CHECK(address != 0, "q8 layers: no q8_ops linear address");
  return reinterpret_cast<Q8Linear>(address);
}

// A layer's linears on weight-only quantized codes (model.quantization = gguf | int8 | int4):
// quant_ops.cpp's qlinear, called through the address its build hands out
// (quant_ops.linear_address()). w: codes, scale, minv, bias for qkv, o, gate_up, down (16
// tensors), then meta [20] int64: the four output widths, code widths, code offsets, group sizes
// and fma_dq flags. fp32 layers only (QuantLinear rounds a bf16 layer's sums afterwards).
using QLinear = torch::Tensor (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, int64_t,
                                  torch::Tensor, bool);
struct QuantLinears {
  const torch::Tensor* w;
  const torch::Tensor& meta;
  QLinear fn;
  torch::Tensor operator()(int i, const torch::Tensor& a) const {
    const int64_t* n = meta.data_ptr<int64_t>();
    return fn(a, w[4 * i], w[4 * i + 1], w[4 * i + 2], n[4 + i], n[8 + i], n[12 + i], n[i], w[4 * i + 3], n[16 + i] != 0);
  }
};

PackedLinear packed_linear_at(int64_t address) {   // 0: this build's own linear
  return address ? reinterpret_cast<PackedLinear>(address) : nullptr;
}

// Every layer of a Llama-style decoder over decode / tree / extend rows (no prompt prefill), in
// one call instead of ~13 Python-side ops per layer (0.5-0.8 ms of a 9-17 ms fp32 forward of the
// 30-layer demo model at 1-16 rows): the same functions in the same order as the model's per-op path
// (models/llama.py, DecoderLayer._forward_fused), so the same bits. Per layer l, ``weights`` holds
// 8 tensors: input norm weight, qkv packed, qkv bias (or empty), o packed, post-attention norm
// weight, gate_up packed, down packed, a [4] int64 of the four linears' output widths; with
// ``q8_linear`` (an address, not 0) instead 19: input norm weight, post-attention norm weight,
// the CodeLinears' 16 tensors and meta; with ``quant_linear`` (quant_ops' qlinear) likewise 19, the
// QuantLinears' 16 tensors and meta. ``packed_linear`` (an address, not 0): the packed weights
// are another build's, run by the function at that address (bf16_amx's AMX tiles). Returns the
// hidden state after the last layer, then the hidden state entering each layer in ``capture``.
std::vector<torch::Tensor> decoder_layers(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> k_caches,
                                          std::vector<torch::Tensor> v_caches, torch::Tensor cos, torch::Tensor sin,
                                          torch::Tensor out_slots, double eps, double scale, int64_t H, int64_t Hkv,
                                          torch::Tensor prefix_ptr, torch::Tensor prefix_slots, torch::Tensor row_ptr,
                                          torch::Tensor row_q, torch::Tensor extra_ptr, torch::Tensor extra_slots,
                                          std::vector<int64_t> capture, int64_t q8_linear, int64_t packed_linear, int64_t quant_linear) {
  const int64_t L = int64_t(k_caches.size()), T = x.size(0), D = k_caches.empty() ? 0 : k_caches[0].size(2);
  const int64_t per = q8_linear || quant_linear ? 19 : 8;
  TORCH_CHECK(!(q8_linear && quant_linear), "decoder_layers: q8 or weight-only quantized linears, not both");
  TORCH_CHECK(int64_t(weights.size()) == per * L && int64_t(v_caches.size()) == L, "decoder_layers: 8 (19 with q8 or quantized linears) weights and 2 caches per layer");
  std::vector<torch::Tensor> captured(capture.size());
  const auto no_residual = x.new_empty({0});
  x = x.contiguous();
  // rope's rows and the KV slots made contiguous once for every layer
  cos = cos.reshape({T, D}).contiguous();
  sin = sin.reshape({T, D}).contiguous();
  out_slots = out_slots.contiguous();
  // the residual stream as x + delta, the last layer's MLP output not yet added: each layer's
  // input norm adds it (add_rms_norm's sum: the one rounding of the per-op path's `x + down`, so the
  // same bits) instead of a torch add between the layers (~5-14 us each on the caller's thread)
  torch::Tensor delta = no_residual;
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = weights.data() + per * l;
    const auto sum_normed = add_rms_norm(x, delta, w[0], eps);
    x = sum_normed[0];
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == l) captured[c] = x;
    const auto& h = sum_normed[1];
    if (q8_linear)
      std::tie(x, delta) = layer_body(CodeLinears{w + 2, w[18], q8_linear_at(q8_linear)}, h, x, w[1], k_caches[l], v_caches[l], cos, sin, nullptr,
                                      out_slots, eps, scale, H, Hkv, D, prefix_ptr, prefix_slots, row_ptr, row_q, extra_ptr, extra_slots);
    else if (quant_linear)
      std::tie(x, delta) = layer_body(QuantLinears{w + 2, w[18], reinterpret_cast<QLinear>(quant_linear)}, h, x, w[1], k_caches[l], v_caches[l], cos,
                                      sin, nullptr, out_slots, eps, scale, H, Hkv, D, prefix_ptr, prefix_slots, row_ptr, row_q, extra_ptr, extra_slots);
    else
      std::tie(x, delta) = layer_body(PackedLinears(w + 1, x, packed_linear_at(packed_linear)), h, x, w[4], k_caches[l], v_caches[l], cos, sin,
                                      nullptr, out_slots, eps, scale, H, Hkv, D, prefix_ptr, prefix_slots, row_ptr, row_q, extra_ptr, extra_slots);
  }
  if (L) x = add_into(x, delta);
  captured.insert(captured.begin(), x);
  return captured;
}

// An EAGLE-family draft head's decoder layer (DraftDecoderLayer: its attention input attn_in is
// not the residual stream, e.g. EAGLE-3's cat(norm(embed), norm(hidden)) of width 2H) in one call:
// the per-op path's kernel functions in its order, so the same bits. weights: qkv, qkv bias (or
// empty), o, post-attention norm, gate_up, down, widths [4]; with ``q8_linear`` (an address, not
// 0) instead the post-attention norm, the CodeLinears' 16 tensors and meta; ``packed_linear`` as in
// decoder_layers. cos / sin: the full tables, indexed by positions here.
torch::Tensor draft_layer(torch::Tensor attn_in, torch::Tensor residual, std::vector<torch::Tensor> weights, torch::Tensor k_cache,
                          torch::Tensor v_cache, torch::Tensor cos_table, torch::Tensor sin_table, torch::Tensor positions,
                          torch::Tensor out_slots, double eps, double scale, int64_t H, int64_t Hkv, torch::Tensor prefix_ptr,
                          torch::Tensor prefix_slots, torch::Tensor row_ptr, torch::Tensor row_q, torch::Tensor extra_ptr,
                          torch::Tensor extra_slots, int64_t q8_linear, int64_t packed_linear) {
  TORCH_CHECK(weights.size() == (q8_linear ? 18 : 7), "draft_layer: qkv, qkv bias, o, norm, gate_up, down, widths (q8: norm, 16 code tensors, meta)");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.numel() == residual.size(0), "draft_layer: int64 positions, one a row");
  const auto h = attn_in.contiguous(), x = residual.contiguous(), pos = positions.contiguous(), slots = out_slots.contiguous();
  const auto cos = cos_table.contiguous(), sin = sin_table.contiguous();   // read at each row's position in place
  const int64_t D = k_cache.size(2);
  const int64_t* p = pos.data_ptr<int64_t>();
  const auto out = q8_linear ? layer_body(CodeLinears{weights.data() + 1, weights[17], q8_linear_at(q8_linear)}, h, x, weights[0], k_cache, v_cache,
                                          cos, sin, p, slots, eps, scale, H, Hkv, D, prefix_ptr, prefix_slots, row_ptr, row_q, extra_ptr, extra_slots)
                            : layer_body(PackedLinears(weights.data(), x, packed_linear_at(packed_linear)), h, x, weights[3], k_cache, v_cache, cos, sin,
                                         p, slots, eps, scale, H, Hkv, D, prefix_ptr, prefix_slots, row_ptr, row_q, extra_ptr, extra_slots);
  return add_into(out.first, out.second);
}

// ---------------------------------------------------------------- an EAGLE-3 head's draft step in one call
// An EAGLE-3-layout draft head: attention input cat(in_norm(embed(t)), h_norm(h)), residual h (the
// target's projected feature in an extend pass, the parent's output hidden in a beam step); the
// final norm and an lm_head over the draft vocabulary. forward() is the Python head_forward's kernel
// functions in its order (embedding rows, add_rms_norm for both input norms, cat, draft_layer,
// add_rms_norm, linear, widened to fp32), so the same bits.
struct Eagle3Head {
  torch::Tensor embed, in_norm, h_norm, final_norm;
  std::vector<double> norm_eps;   // in_norm's, h_norm's, final_norm's
  std::vector<torch::Tensor> layer_weights;   // as draft_layer's
  torch::Tensor k_cache, v_cache, cos_table, sin_table;
  double eps, scale;
  int64_t H, Hkv, q8_linear, packed_linear;
  std::vector<torch::Tensor> lm_weights;   // packed, bias (linear()); with lm_q8: codes, d, m, bias
  int64_t lm_N, lm_bits, lm_q8;   // lm_q8: a q8_ops linear's address (an int8-activation lm_head: fp32 rows in, fp32 sums out), or 0
  // q8_ops' AMX-INT8 tile build for calls of tile_rows rows or more (the same bits as q8_linear's /
  // lm_q8's build): the layer's and the lm_head's addresses, or 0
  int64_t q8_tile = 0, lm_q8_tile = 0, tile_rows = 0;
  torch::Tensor none = torch::empty({0});   // add_rms_norm's "no residual"
  int64_t layer_q8(int64_t rows) const { return q8_tile && rows >= tile_rows ? q8_tile : q8_linear; }
  int64_t head_q8(int64_t rows) const { return lm_q8_tile && rows >= tile_rows ? lm_q8_tile : lm_q8; }

  // the layer's output hidden of rows (ids, x) at positions, K/V written at out_slots; plan: the
  // attention kernel's six slot arrays
  // the attention input cat(in_norm(embed[ids]), h_norm(x)) [T, 2 D]: add_rms_norm's arithmetic
  // (no residual) on the embedding rows in place and on x, written into the two halves (the bits
  // of the norms, index_select and cat of head_forward)
  torch::Tensor attention_input(const torch::Tensor& ids, const torch::Tensor& x) const {
    const int64_t T = ids.numel(), D = x.size(1), V = embed.size(0);
    TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.is_contiguous() && x.dim() == 2 && x.size(0) == T && x.is_contiguous(),
                "eagle3 head: int64 ids and contiguous rows, one each");
    TORCH_CHECK(embed.is_contiguous() && embed.size(1) == D && embed.scalar_type() == x.scalar_type() && in_norm.scalar_type() == x.scalar_type() &&
                h_norm.scalar_type() == x.scalar_type(), "eagle3 head: embedding, norms and rows of one dtype and width");
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t r = 0; r < T; ++r) TORCH_CHECK(id[r] >= 0 && id[r] < V, "eagle3 head: token id out of range");
    auto out = torch::empty({T, 2 * D}, x.options());
    const auto wa = in_norm.contiguous(), wb = h_norm.contiguous();
    if (x.scalar_type() == torch::kFloat32) {
      float* o = out.data_ptr<float>();
      add_rms_norm_impl<float>(embed.data_ptr<float>(), nullptr, nullptr, wa.data_ptr<float>(), o, T, D, float(norm_eps[0]), id, D, 2 * D);
      add_rms_norm_impl<float>(x.data_ptr<float>(), nullptr, nullptr, wb.data_ptr<float>(), o + D, T, D, float(norm_eps[1]), nullptr, D, 2 * D);
    } else {
      TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "eagle3 head: float32 or bfloat16");
      auto p = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
      add_rms_norm_impl<uint16_t>(p(embed), nullptr, nullptr, p(wa), p(out), T, D, float(norm_eps[0]), id, D, 2 * D);
      add_rms_norm_impl<uint16_t>(p(x), nullptr, nullptr, p(wb), p(out) + D, T, D, float(norm_eps[1]), nullptr, D, 2 * D);
    }
    return out;
  }
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& x, const torch::Tensor& pos, const torch::Tensor& out_slots,
                        const std::vector<torch::Tensor>& plan) const {
    const auto xc = x.contiguous();
    return draft_layer(attention_input(ids, xc), xc, layer_weights, k_cache, v_cache, cos_table, sin_table, pos, out_slots, eps, scale, H, Hkv,
                       plan[0], plan[1], plan[2], plan[3], plan[4], plan[5], layer_q8(ids.size(0)), packed_linear);
  }
  torch::Tensor logits(const torch::Tensor& out) const {   // fp32 [rows, V_draft], as sdk.draft_logits
    const auto normed = add_rms_norm(out, none, final_norm, norm_eps[2])[1];
    const auto& w = lm_weights;
    if (lm_q8) return q8_linear_at(head_q8(out.size(0)))(as_fp32(normed), w[0], w[1], w[2], lm_bits, lm_N, w[3]);
    return as_fp32(linear(normed, w[0], lm_N, w[1]));
  }
};

// The attention kernel's slot arrays (attention_plan's layout) from per group: its shared prefix
// (a pointer and a length) and each of its rows' own slots.
struct PlanBuilder {
  std::vector<int64_t> pp{0}, ps, rp{0}, rq, ep{0}, es;
  void group(const int64_t* prefix, int64_t n) {
    ps.insert(ps.end(), prefix, prefix + n);
    pp.push_back(int64_t(ps.size()));
  }
  void row(int64_t q, const int64_t* own, int64_t n) {
    rq.push_back(q);
    es.insert(es.end(), own, own + n);
    ep.push_back(int64_t(es.size()));
  }
  void end_group() { rp.push_back(int64_t(rq.size())); }
  std::vector<torch::Tensor> tensors() const {
    auto t = [](const std::vector<int64_t>& v) {   // torch::tensor(v)'s result, without its dispatch chain
      auto out = torch::empty({int64_t(v.size())}, torch::TensorOptions().dtype(torch::kLong));
      if (!v.empty()) std::memcpy(out.data_ptr<int64_t>(), v.data(), v.size() * sizeof(int64_t));
      return out;
    };
    return {t(pp), t(ps), t(rp), t(rq), t(ep), t(es)};
  }
};

// speculative/feature_drafter.py's greedy draft step over an Eagle3Head in one call instead of
// ~25 Python-side ops a head forward (0.2-0.3 ms each on the Zen 4 EPYC, next to ~0.4 ms of head
// kernels; the auto shape makes 3-5 forwards a step): the extend pass over each request's pending
// pairs (optional), then speculative/beam.py's beam_search. The search is the Python one: a beam's
// children scored by its score plus their log-prob (double sums, as Python floats), all of a
// request's children of a depth stably sorted best first (ties: in order of expansion) and kept as
// candidates, the best topk the next beams, a beam below max(score_floor, the keep-th best
// candidate score so far) not expanded. So the same candidates in the same order.
//
// Extend pass (ext_tokens not empty): request i's ext_rows[i] pending pairs (tokens, projected
// features, positions, KV slots; requests one after another) attend causally after its earlier
// pairs, committed[i] minus its last ext_rows[i] slots, in blocks of 32 rows as
// kernel_attention.py's _causal_blocks cuts them; the first logits and hidden are each request's
// last pair's. Else first_logits [R, V_draft] fp32 and first_hidden [R, H] give them.
// Beam steps: a node attends to its request's committed slots (the shared prefix), its forwarded
// ancestors and itself (its own slots, in depth order: the Python tree mask's order); it takes
// its KV slot from beam_slots [R, >= topk * (num_steps - 1)]. keep <= 0: no keep cut. to_target
// [V_draft] int64 (empty: one vocabulary). q8_tile_linear / lm_q8_tile: q8_ops' AMX-INT8 tile
// build's linear for the layer's / the lm_head's calls of tile_rows rows or more (0: q8_linear /
// lm_q8 at every row count; the same bits either way): a batch's beam steps and extend passes.
// Returns (tokens int64, parents int64, scores fp32, counts [R] int64): every request's
// candidates, one request after another.
std::vector<torch::Tensor> eagle3_draft(torch::Tensor ext_tokens, torch::Tensor ext_features, torch::Tensor ext_positions,
                                        torch::Tensor ext_slots, std::vector<int64_t> ext_rows, torch::Tensor first_logits,
                                        torch::Tensor first_hidden, std::vector<torch::Tensor> committed, std::vector<int64_t> root_pos,
                                        torch::Tensor beam_slots, torch::Tensor embed, torch::Tensor in_norm, torch::Tensor h_norm,
                                        torch::Tensor final_norm, std::vector<double> norm_eps, std::vector<torch::Tensor> layer_weights,
                                        torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor cos_table, torch::Tensor sin_table,
                                        double eps, double scale, int64_t H, int64_t Hkv, int64_t q8_linear, int64_t packed_linear,
                                        std::vector<torch::Tensor> lm_weights, int64_t lm_N, int64_t lm_bits, int64_t lm_q8, torch::Tensor to_target, int64_t topk,
                                        int64_t num_steps, double score_floor, int64_t keep, int64_t q8_tile_linear, int64_t lm_q8_tile,
                                        int64_t tile_rows) {
  const int64_t R = int64_t(committed.size());
  const bool extend = ext_tokens.numel() > 0;
  TORCH_CHECK(int64_t(root_pos.size()) == R && norm_eps.size() == 3, "eagle3_draft: a committed slot list and a root per request, three norm eps");
  TORCH_CHECK(topk >= 1 && num_steps >= 1, "eagle3_draft: topk >= 1, num_steps >= 1");
  TORCH_CHECK(beam_slots.dim() == 2 && beam_slots.size(0) == R && beam_slots.size(1) >= topk * (num_steps - 1) && beam_slots.scalar_type() == torch::kLong,
              "eagle3_draft: beam_slots [R, topk * (num_steps - 1)] int64");
  TORCH_CHECK(!to_target.numel() || to_target.scalar_type() == torch::kLong, "eagle3_draft: to_target int64");
  for (auto& c : committed) {
    c = c.contiguous();
    TORCH_CHECK(c.dim() == 1 && c.scalar_type() == torch::kLong, "eagle3_draft: committed slots 1-d int64");
  }
  const Eagle3Head head{embed, in_norm, h_norm, final_norm, norm_eps, layer_weights, k_cache, v_cache, cos_table, sin_table,
                        eps, scale, H, Hkv, q8_linear, packed_linear, lm_weights, lm_N, lm_bits, lm_q8,
                        q8_linear ? q8_tile_linear : 0, lm_q8 ? lm_q8_tile : 0, tile_rows};
  TORCH_CHECK(lm_weights.size() == (lm_q8 ? 4u : 2u), "eagle3_draft: the lm_head's packed weight and bias (q8: codes, d, m, bias)");
  const auto lopt = torch::TensorOptions().dtype(torch::kLong);

  if (extend) {
    TORCH_CHECK(int64_t(ext_rows.size()) == R, "eagle3_draft: pending pairs per request");
    int64_t total = 0;
    std::vector<int64_t> last(R);
    PlanBuilder plan;
    for (int64_t i = 0; i < R; ++i) {
      const int64_t m = ext_rows[i], n = committed[i].numel();
      TORCH_CHECK(m >= 1 && m <= n, "eagle3_draft: a request's pending pairs are its last committed slots");
      const int64_t* cs = committed[i].data_ptr<int64_t>();
      for (int64_t a0 = 0; a0 < m; a0 += 32) {   // kernel_attention.CAUSAL_BLOCK
        const int64_t q = std::min<int64_t>(32, m - a0), base = n - m + a0;
        plan.group(cs, base);
        for (int64_t r = 0; r < q; ++r) plan.row(total + a0 + r, cs + base, r + 1);
        plan.end_group();
      }
      total += m;
      last[i] = total - 1;
    }
    TORCH_CHECK(ext_tokens.numel() == total && ext_features.size(0) == total, "eagle3_draft: one token and feature per pending pair");
    const auto out = head.forward(ext_tokens.contiguous(), ext_features, ext_positions.contiguous(), ext_slots.contiguous(), plan.tensors());
    first_hidden = gather_rows(out, last.data(), R);
    first_logits = head.logits(first_hidden);
  }
  TORCH_CHECK(first_logits.dim() == 2 && first_logits.size(0) == R && first_hidden.dim() == 2 && first_hidden.size(0) == R,
              "eagle3_draft: first logits and hidden, a row per request");

  const auto slots_c = beam_slots.contiguous();
  const int64_t* bslot = slots_c.data_ptr<int64_t>();
  const int64_t bstride = slots_c.size(1);
  const auto map_c = to_target.contiguous();
  const int64_t* map = map_c.numel() ? map_c.data_ptr<int64_t>() : nullptr;

  struct Beam { int64_t cand; double score; int64_t row; };   // row: its output hidden's row in `hidden`
  struct Cands { std::vector<int64_t> tok, par; std::vector<double> score; std::vector<std::vector<int64_t>> chain; };
  std::vector<Cands> cands(R);
  std::vector<std::vector<Beam>> beams(R);
  std::vector<int64_t> used(R, 0);   // beam slots taken per request

  // the children of beams bs (their top-k in rows row0.. of a depth's top_logprobs), best first, all
  // kept as candidates; returns the best topk as the next beams (their parent's output row: out_row0 + b)
  auto expand = [&](int64_t i, const float* vals, const float* ids, int64_t row0, const std::vector<Beam>& bs, int64_t out_row0) {
    struct Child { double score; int64_t parent; int64_t tok; int64_t row; };
    std::vector<Child> ch;
    ch.reserve(bs.size() * topk);
    for (size_t b = 0; b < bs.size(); ++b)
      for (int64_t j = 0; j < topk; ++j) {
        const int64_t at = (row0 + int64_t(b)) * topk + j;
        ch.push_back({bs[b].score + double(vals[at]), bs[b].cand, int64_t(ids[at]), out_row0 + int64_t(b)});
      }
    std::stable_sort(ch.begin(), ch.end(), [](const Child& a, const Child& b) { return a.score > b.score; });
    auto& c = cands[i];
    std::vector<Beam> next;
    for (size_t j = 0; j < ch.size(); ++j) {
      c.tok.push_back(map ? map[ch[j].tok] : ch[j].tok);
      c.par.push_back(ch[j].parent);
      c.score.push_back(ch[j].score);
      c.chain.emplace_back();
      if (int64_t(j) < topk) next.push_back({int64_t(c.tok.size()) - 1, ch[j].score, ch[j].row});
    }
    return next;
  };
  auto kth_best = [&](const std::vector<double>& s) {   // beam.py's _kth_best
    if (keep <= 0 || int64_t(s.size()) < keep) return -std::numeric_limits<double>::infinity();
    std::vector<double> t(s);
    std::nth_element(t.begin(), t.begin() + (keep - 1), t.end(), std::greater<double>());
    return t[keep - 1];
  };

  {
    const auto top = top_logprobs(first_logits.to(torch::kFloat32), topk);
    const float* tv = top.data_ptr<float>();
    for (int64_t i = 0; i < R; ++i) beams[i] = expand(i, tv, tv + R * topk, i, {Beam{-1, 0.0, i}}, i);
  }
  torch::Tensor hidden = first_hidden;
  for (int64_t depth = 1; depth < num_steps; ++depth) {
    std::vector<int64_t> live;
    int64_t T = 0;
    for (int64_t i = 0; i < R; ++i) {
      const double floor = std::max(score_floor, kth_best(cands[i].score));
      std::vector<Beam> kept;
      for (const auto& b : beams[i])
        if (b.score >= floor) kept.push_back(b);
      beams[i] = std::move(kept);
      if (beams[i].empty()) continue;
      live.push_back(i);
      T += int64_t(beams[i].size());
    }
    if (live.empty()) break;
    auto ids_t = torch::empty({T}, lopt), pos_t = torch::empty({T}, lopt), out_t = torch::empty({T}, lopt);
    std::vector<int64_t> parent_rows(T);
    int64_t *ids = ids_t.data_ptr<int64_t>(), *pos = pos_t.data_ptr<int64_t>(), *outs = out_t.data_ptr<int64_t>(), *prow = parent_rows.data();
    PlanBuilder plan;
    int64_t t = 0;
    for (int64_t i : live) {
      auto& c = cands[i];
      plan.group(committed[i].data_ptr<int64_t>(), committed[i].numel());
      for (const auto& b : beams[i]) {
        const int64_t p = c.par[b.cand];
        std::vector<int64_t> chain = p >= 0 ? c.chain[p] : std::vector<int64_t>();
        chain.push_back(bslot[i * bstride + used[i]++]);
        ids[t] = c.tok[b.cand];
        pos[t] = root_pos[i] + depth;
        outs[t] = chain.back();
        prow[t] = b.row;
        plan.row(t, chain.data(), int64_t(chain.size()));
        c.chain[b.cand] = std::move(chain);
        ++t;
      }
      plan.end_group();
    }
    hidden = head.forward(ids_t, gather_rows(hidden.contiguous(), prow, T), pos_t, out_t, plan.tensors());
    const auto top = top_logprobs(head.logits(hidden), topk);
    const float* tv = top.data_ptr<float>();
    int64_t off = 0;
    for (int64_t i : live) {
      const int64_t n = int64_t(beams[i].size());
      beams[i] = expand(i, tv, tv + T * topk, off, beams[i], off);
      off += n;
    }
  }

  int64_t total = 0;
  for (const auto& c : cands) total += int64_t(c.tok.size());
  auto tokens = torch::empty({total}, lopt), parents = torch::empty({total}, lopt), counts = torch::empty({R}, lopt);
  auto scores = torch::empty({total}, torch::TensorOptions().dtype(torch::kFloat32));
  int64_t *to = tokens.data_ptr<int64_t>(), *pa = parents.data_ptr<int64_t>(), *cn = counts.data_ptr<int64_t>();
  float* so = scores.data_ptr<float>();
  int64_t o = 0;
  for (int64_t i = 0; i < R; ++i) {
    const auto& c = cands[i];
    cn[i] = int64_t(c.tok.size());
    for (size_t j = 0; j < c.tok.size(); ++j, ++o) {
      to[o] = c.tok[j];
      pa[o] = c.par[j];
      so[o] = static_cast<float>(c.score[j]);
    }
  }
  return {tokens, parents, scores, counts};
}

// Logits of greedy rows from a cheaper copy of an fp32 weight (the lm_head), exact where it
// matters: y_v = x . w_v is bracketed by the proxy p_v = x . w'_v (w' the weight rounded to bf16:
// half the bytes) as |y_v - p_v| <= |x| * bound_v, bound_v >= |w_v - w'_v| + gamma * (|w_v| + |w'_v|)
// (Cauchy-Schwarz, plus both fp32 sums' rounding: gamma = (K + 2) u / (1 - (K + 2) u), any order,
// with or without FMA; computed by the caller). Every v whose upper end reaches the largest lower
// end may be the argmax; those are recomputed from the fp32 weight with the same tile as linear()
// (one FMA chain per output in k order: the full product's bits); every other entry is -inf. So a
// row's argmax (first index on ties: every maximal v is a candidate) and the value there are the
// full product's. A row with a non-finite proxy gets every output computed exactly.
//
// pick_exact: that selection for M rows given their proxies P [M, N]; row m's radius at v is
// nx_m * C[v] + bx_m * C2[v] + slack (C2 null: the first term alone), nx_m = |x_m|. The screen
// runs in fp32 vectors: each computed radius, hi = p + r and lo = p - r is within 4 u (|p| + r) of
// its exact value, so radii widened by 1e-5 and a cut lowered by 1e-5 * max(|p| + r) keep every
// v whose exact upper end reaches the exact largest lower end (a superset: never a lost argmax).
//
// rel > 0 (a head whose outputs are rounded to bf16 after the fp32 sum): the cut is lowered by rel *
// max(|largest lower end|, |largest upper end|) too, so every v whose rounded value can equal the
// rounded maximum (within one bf16 ulp of it: rel >= 2^-7) stays a candidate. block(m, blk, part)
// writes the full product's outputs of block blk (16 outputs) for row m into part. AM (not null):
// each row's argmax as numpy's argmax reads Y (the first NaN, else the first index of the maximum;
// 0 for a row of -inf), from the candidates alone: the caller need not read Y back for it.
template <class Block>
void pick_exact(const float* X, int64_t M, int64_t K, const float* P, const float* C, const float* C2, const double* bx,
                double slack, double rel, float* Y, int64_t N, const Block& block, int64_t* AM = nullptr) {
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    float part[kBlock];
    thread_local std::vector<float> hi_tl;   // every entry is written before it is read
    auto& hi = hi_tl;
    hi.resize(N);
    for (int64_t m = m0; m < m1; ++m) {
      const float *xr = X + m * K, *pr = P + m * N;
      float* yr = Y + m * N;
      std::fill(yr, yr + N, -std::numeric_limits<float>::infinity());
      double nx = 0;
      for (int64_t k = 0; k < K; ++k) nx += double(xr[k]) * xr[k];
      const float widen = 1 + 1e-5f;
      const float a = float(std::sqrt(nx)) * widen, b = C2 ? float(bx[m]) * widen : 0.f, c = float(slack) * widen;
      bool finite = std::isfinite(a) && std::isfinite(b);
      const V av = vset1(a), bv = vset1(b), cv = vset1(c), neg = vset1(-1.f), zero = vzero();
      V lo = vset1(-std::numeric_limits<float>::infinity()), mag = vzero(), bad = vzero();
      int64_t v = 0;
      for (; v + W <= N; v += W) {
        const V r = C2 ? vfma(av, vload(C + v), vfma(bv, vload(C2 + v), cv)) : vfma(av, vload(C + v), cv);
        const V p = vload(pr + v), h = vadd(p, r), l = vadd(p, vmul(r, neg));
        vstore(hi.data() + v, h);
        lo = vmax(lo, l);
        mag = vmax(mag, vmax(h, vmul(l, neg)));
        bad = vadd(bad, vmul(p, zero));   // NaN once any proxy is not finite
      }
      V top = vset1(-std::numeric_limits<float>::infinity());
      for (int64_t u = 0; rel > 0 && u + W <= N; u += W) top = vmax(top, vload(hi.data() + u));
      float lo_s = vhmax(lo), mag_s = vhmax(mag), hi_s = vhmax(top);
      finite = finite && std::isfinite(vhsum(bad));
      for (; v < N; ++v) {
        const float r = a * C[v] + (C2 ? b * C2[v] : 0.f) + c, h = pr[v] + r, l = pr[v] - r;
        hi[v] = h;
        hi_s = std::max(hi_s, h);
        lo_s = std::max(lo_s, l);
        mag_s = std::max(mag_s, std::max(h, -l));
        finite = finite && std::isfinite(pr[v]);
      }
      finite = finite && std::isfinite(lo_s) && std::isfinite(mag_s);
      float cut = lo_s - 1e-5f * mag_s;
      if (rel > 0)
        cut -= float(rel * std::max(std::abs(double(lo_s)), std::abs(double(hi_s))) * 1.01 + std::ldexp(1.0, -126));
      const float below = std::nextafter(cut, -std::numeric_limits<float>::infinity());   // h > below <=> h >= cut
      int64_t done = -1;   // the last block recomputed for this row
      int64_t best = 0;    // the argmax so far: candidates come in index order, the -inf others never win
      float best_v = -std::numeric_limits<float>::infinity();
      bool nan = false;
      for (v = 0; v < N; ++v) {
        if (finite && v % W == 0 && v + W <= N && !vany_gt(vload(hi.data() + v), below)) {
          v += W - 1;   // no candidate among these W
          continue;
        }
        if (finite && hi[v] < cut) continue;
        const int64_t blk = v / kBlock;
        if (blk != done) {
          block(m, blk, part);
          done = blk;
        }
        const float y = part[v - blk * kBlock];
        yr[v] = y;
        if (!nan && (std::isnan(y) || y > best_v)) {
          best = v;
          best_v = y;
          nan = std::isnan(y);
        }
      }
      if (AM) AM[m] = best;
    }
  });
}

// the optional argmax output of the greedy_* functions: an int64 [M] tensor to fill, or empty
inline int64_t* argmax_out(const torch::Tensor& am, int64_t M, const char* fn) {
  if (!am.numel()) return nullptr;
  TORCH_CHECK(am.scalar_type() == torch::kInt64 && am.is_contiguous() && am.numel() == M, fn, ": argmax out int64 [M]");
  return am.data_ptr<int64_t>();
}

// pick_exact's block for an fp32 head: linear()'s one-row tile over the packed fp32 weight
auto fp32_block(const float* X, const float* F, int64_t K) {
  return [=](int64_t m, int64_t blk, float* part) { tile<1, 1, false>(F + blk * K * kBlock, K, 0, K, X + m * K, part, F, 1, 0); };
}

torch::Tensor greedy_logits(torch::Tensor x, torch::Tensor proxy, torch::Tensor full, torch::Tensor bound, int64_t N, torch::Tensor am) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "greedy_logits: fp32 x [M, K]");
  TORCH_CHECK(full.scalar_type() == torch::kFloat32 && proxy.sizes() == full.sizes() && bound.numel() >= N, "greedy_logits: weights");
  const int64_t M = x.size(0), K = x.size(1);
  auto xc = x.contiguous();
  auto p = linear(xc, proxy, N, torch::empty({0}, xc.options()));
  auto y = torch::empty({M, N}, xc.options());
  pick_exact(xc.data_ptr<float>(), M, K, p.data_ptr<float>(), bound.data_ptr<float>(), nullptr, nullptr, 0.0, 0.0, y.data_ptr<float>(), N,
             fp32_block(xc.data_ptr<float>(), full.data_ptr<float>(), K), argmax_out(am, M, "greedy_logits"));
  return y;
}

// The same from a proxy computed elsewhere on bf16 inputs too: p_v = x' . w'_v (x' = xb, x rounded
// to bf16 with subnormals flushed to zero; bf16_dot's vdpbf16ps sums, fp32). Beside |x| * bound_v,
// |x . w'_v - x' . w'_v| <= |x - x'| |w'_v| and p_v's own rounding gamma |x'| |w'_v|, so the radius
// gains (|x - x'| + gamma |x'|) * wbound_v, wbound_v >= |w'_v| (the caller's), and an absolute
// 2 (K + 2) 2^-126 for intermediate sums flushed to zero (vdpbf16ps flushes subnormals).
torch::Tensor greedy_pick(torch::Tensor x, torch::Tensor xb, torch::Tensor p, torch::Tensor full, torch::Tensor bound,
                          torch::Tensor wbound, int64_t N, torch::Tensor am) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "greedy_pick: fp32 x [M, K]");
  TORCH_CHECK(xb.scalar_type() == torch::kBFloat16 && xb.sizes() == x.sizes(), "greedy_pick: bf16 xb shaped like x");
  TORCH_CHECK(p.scalar_type() == torch::kFloat32 && p.dim() == 2 && p.size(0) == x.size(0) && p.size(1) == N, "greedy_pick: fp32 p [M, N]");
  TORCH_CHECK(full.scalar_type() == torch::kFloat32 && full.size(1) == x.size(1) && full.size(0) * kBlock >= N, "greedy_pick: the packed fp32 weight");
  TORCH_CHECK(bound.numel() >= N && wbound.numel() >= N, "greedy_pick: bounds");
  const int64_t M = x.size(0), K = x.size(1);
  auto xc = x.contiguous(), xbc = xb.contiguous(), pc = p.contiguous();
  const double u = std::ldexp(1.0, -24), gamma = (K + 2) * u / (1 - (K + 2) * u);
  std::vector<double> bx(M);
  const float* X = xc.data_ptr<float>();
  const uint16_t* XB = reinterpret_cast<const uint16_t*>(xbc.data_ptr());
  for (int64_t m = 0; m < M; ++m) {
    double d = 0, n = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double xv = X[m * K + k], bv = from_bf16(XB[m * K + k]);
      d += (xv - bv) * (xv - bv);   // exact differences (both are fp32 values); the sums' rounding is in the margin
      n += bv * bv;
    }
    bx[m] = (std::sqrt(d) + gamma * std::sqrt(n)) * (1 + 1e-12);
  }
  auto y = torch::empty({M, N}, xc.options());
  pick_exact(X, M, K, pc.data_ptr<float>(), bound.data_ptr<float>(), wbound.data_ptr<float>(), bx.data(),
             2.0 * (K + 2) * std::ldexp(1.0, -126), 0.0, y.data_ptr<float>(), N, fp32_block(X, full.data_ptr<float>(), K),
             argmax_out(am, M, "greedy_pick"));
  return y;
}

// The same selection from a proxy computed elsewhere with the caller's per-row input term:
// row m's radius at v is |x_m| * bound_v + bx[m] * wbound_v + slack. GreedyHead's int8 proxy
// (q8_ops' linear over 8-bit codes of the head, the row quantized to int8 per block of 32) passes
// bx = |x - x'| + gamma |x'| from the row's own codes (x' = q * dx) and wbound_v >= |w'_v|.
torch::Tensor greedy_select(torch::Tensor x, torch::Tensor p, torch::Tensor full, torch::Tensor bound, torch::Tensor wbound,
                            torch::Tensor bx, double slack, int64_t N, torch::Tensor am) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "greedy_select: fp32 x [M, K]");
  TORCH_CHECK(p.scalar_type() == torch::kFloat32 && p.dim() == 2 && p.size(0) == x.size(0) && p.size(1) == N, "greedy_select: fp32 p [M, N]");
  TORCH_CHECK(full.scalar_type() == torch::kFloat32 && full.size(1) == x.size(1) && full.size(0) * kBlock >= N, "greedy_select: the packed fp32 weight");
  TORCH_CHECK(bound.numel() >= N && wbound.numel() >= N, "greedy_select: bounds");
  TORCH_CHECK(bx.scalar_type() == torch::kFloat64 && bx.numel() == x.size(0), "greedy_select: bx float64 [M]");
  const int64_t M = x.size(0), K = x.size(1);
  auto xc = x.contiguous(), pc = p.contiguous(), bxc = bx.contiguous();
  auto y = torch::empty({M, N}, xc.options());
  pick_exact(xc.data_ptr<float>(), M, K, pc.data_ptr<float>(), bound.data_ptr<float>(), wbound.data_ptr<float>(), bxc.data_ptr<double>(),
             slack, 0.0, y.data_ptr<float>(), N, fp32_block(xc.data_ptr<float>(), full.data_ptr<float>(), K), argmax_out(am, M, "greedy_select"));
  return y;
}

// greedy_select for a head on bf16 weights (the packed weight in either layout; x [M, K] bf16 for a
// bf16 model, fp32 for an fp32 model whose head holds bf16 values): the full product is
// linear()'s. With bf16 rows its outputs are fp32 sums rounded to bf16, so the cut also keeps every
// v within one bf16 ulp of the maximum (rel 2^-7). A candidate's block is recomputed by linear()
// itself on that block of the packed weight and the row alone (a row's outputs depend neither on
// the other rows nor on the other blocks: the same bits). The caller's radius covers the fp32
// sums (the kernel's rounding, subnormals read as zero); the -inf entries are the others.
torch::Tensor greedy_select_packed(torch::Tensor x, torch::Tensor xf, torch::Tensor p, torch::Tensor packed, torch::Tensor bound,
                                   torch::Tensor wbound, torch::Tensor bx, double slack, int64_t N, torch::Tensor am) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32), "greedy_select_packed: bf16 or fp32 x [M, K]");
  TORCH_CHECK(xf.scalar_type() == torch::kFloat32 && xf.sizes() == x.sizes(), "greedy_select_packed: xf = x in fp32");
  TORCH_CHECK(p.scalar_type() == torch::kFloat32 && p.dim() == 2 && p.size(0) == x.size(0) && p.size(1) == N, "greedy_select_packed: fp32 p [M, N]");
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.dim() == 3 && packed.size(0) * kBlock >= N, "greedy_select_packed: a packed bf16 weight");
  TORCH_CHECK(bound.numel() >= N && wbound.numel() >= N, "greedy_select_packed: bounds");
  TORCH_CHECK(bx.scalar_type() == torch::kFloat64 && bx.numel() == x.size(0), "greedy_select_packed: bx float64 [M]");
  const int64_t M = x.size(0), K = x.size(1);
  auto xc = x.contiguous(), xfc = xf.contiguous(), pc = p.contiguous(), bxc = bx.contiguous();
  const auto no_bias = torch::empty({0}, xfc.options());
  auto y = torch::empty({M, N}, xfc.options());
  auto block = [&](int64_t m, int64_t blk, float* part) {
    const int64_t n = std::min<int64_t>(kBlock, N - blk * kBlock);
    const auto out = linear(xc.narrow(0, m, 1), packed.narrow(0, blk, 1), n, no_bias).to(torch::kFloat32).contiguous();
    std::copy(out.data_ptr<float>(), out.data_ptr<float>() + n, part);
  };
  pick_exact(xfc.data_ptr<float>(), M, K, pc.data_ptr<float>(), bound.data_ptr<float>(), wbound.data_ptr<float>(), bxc.data_ptr<double>(),
             slack, x.scalar_type() == torch::kBFloat16 ? std::ldexp(1.0, -7) : 0.0, y.data_ptr<float>(), N, block,
             argmax_out(am, M, "greedy_select_packed"));
  return y;
}

std::string isa() { return SPECFW_ISA; }

// The slot lists of KernelAttentionPlan (kernel_attention.py) for the sequences that are not
// prompt prefills, in one call: per sequence its kv_slots (int64, prefix first, then the last m
// entries that tree_mask [q_len, m] covers; an empty mask = a decode row (q_len 1, m 1) or causal
// among the q_len new tokens). Returns (prefix_ptr, prefix_slots, row_ptr, row_q, extra_ptr,
// extra_slots): sequence g's prefix is prefix_slots[prefix_ptr[g]:prefix_ptr[g+1]], its rows are
// row_q[row_ptr[g]:row_ptr[g+1]], row r's own slots extra_slots[extra_ptr[r]:extra_ptr[r+1]] in
// cache order. (The numpy version cost ~100 us a forward; the draft loop makes several a step.)
std::vector<torch::Tensor> attention_plan(std::vector<torch::Tensor> slots, std::vector<torch::Tensor> masks,
                                          const std::vector<int64_t>& q_start, const std::vector<int64_t>& q_len) {
  const int64_t G = int64_t(slots.size());
  TORCH_CHECK(int64_t(masks.size()) == G && int64_t(q_start.size()) == G && int64_t(q_len.size()) == G, "attention_plan: one entry per sequence");
  for (int64_t g = 0; g < G; ++g) {
    slots[g] = slots[g].contiguous();
    masks[g] = masks[g].contiguous();
  }
  int64_t n_prefix = 0, n_rows = 0, n_extra = 0;
  std::vector<int64_t> m_of(G);
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(slots[g].dim() == 1 && slots[g].scalar_type() == torch::kLong, "attention_plan: 1-d int64 slots");
    const int64_t n = slots[g].numel(), q = q_len[g];
    const bool has_mask = masks[g].numel() > 0;
    if (has_mask)
      TORCH_CHECK(masks[g].dim() == 2 && masks[g].size(0) == q && masks[g].scalar_type() == torch::kBool, "attention_plan: a [q_len, m] bool mask");
    const int64_t m = has_mask ? masks[g].size(1) : q;
    TORCH_CHECK(q >= 1 && m >= q && m <= n, "attention_plan: the mask covers more entries than the sequence has");
    m_of[g] = m;
    n_prefix += n - m;
    n_rows += q;
    if (has_mask) {
      const bool* tm = masks[g].data_ptr<bool>();
      for (int64_t i = 0; i < q * m; ++i) n_extra += tm[i];
    } else {
      n_extra += q * (q + 1) / 2;
    }
  }
  auto opt = torch::TensorOptions().dtype(torch::kLong);
  auto prefix_ptr = torch::empty({G + 1}, opt), prefix_slots = torch::empty({n_prefix}, opt);
  auto row_ptr = torch::empty({G + 1}, opt), row_q = torch::empty({n_rows}, opt);
  auto extra_ptr = torch::empty({n_rows + 1}, opt), extra_slots = torch::empty({n_extra}, opt);
  int64_t *pp = prefix_ptr.data_ptr<int64_t>(), *ps = prefix_slots.data_ptr<int64_t>(), *rp = row_ptr.data_ptr<int64_t>();
  int64_t *rq = row_q.data_ptr<int64_t>(), *ep = extra_ptr.data_ptr<int64_t>(), *es = extra_slots.data_ptr<int64_t>();
  int64_t P = 0, R = 0, E = 0;
  pp[0] = rp[0] = ep[0] = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t* sl = slots[g].data_ptr<int64_t>();
    const int64_t n = slots[g].numel(), q = q_len[g], m = m_of[g], base = n - m;
    for (int64_t i = 0; i < base; ++i) ps[P++] = sl[i];
    pp[g + 1] = P;
    const bool* tm = masks[g].numel() > 0 ? masks[g].data_ptr<bool>() : nullptr;
    for (int64_t r = 0; r < q; ++r) {
      rq[R] = q_start[g] + r;
      for (int64_t j = 0; j < m; ++j)
        if (tm ? tm[r * m + j] : j <= r + (m - q)) es[E++] = sl[base + j];
      ep[++R] = E;
    }
    rp[g + 1] = R;
  }
  return {prefix_ptr, prefix_slots, row_ptr, row_q, extra_ptr, extra_slots};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs: another Python thread (the overlap scheduler's
  // engine thread, the server's event loop) may run meanwhile; arguments and results are
  // converted with the GIL held
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("isa", &isa, "the instruction set this build was compiled for");
  m.def("pack", &pack, "pack a [N, K] fp32/bf16 weight for linear()");
  m.def("set_spread_prefetch", &set_spread_prefetch, "multi-tile linears: every row tile prefetches in turn (true) or the first alone (false); 8-lane builds (AVX2, portable) spread fp32 weights only");
  m.def("set_linear_prefetch_rows", &set_linear_prefetch_rows, "multi-row fp32/bf16 linears (pack layout) prefetch the next work item from this many rows");
  m.def("linear_prefetch_rows", &linear_prefetch_rows, "the row count from which multi-row linears prefetch the next work item");
  m.def("spread_prefetch", &spread_prefetch, "whether multi-tile linears spread their prefetches over the row tiles");
  m.def("linear", &linear, "batch-invariant linear over a packed weight (pack or pack_dot)", nogil);
  m.def("pack_dot", &pack_dot, "pack a [N, K] bf16 weight in bf16_dot's pair layout (AVX512-BF16 builds)");
  m.def("set_amx_attention", &set_amx_attention, "bf16 attention (head dim 64) on AMX tiles (builds with AMX-BF16); returns whether on");
  m.def("amx_attention_on", &amx_attention_on, "whether bf16 attention runs on AMX tiles");
  m.def("has_bf16_dot", &has_bf16_dot, "whether this build has the vdpbf16ps path (pack_dot)");
  m.def("attention", &attention, "batch-invariant attention of one-row queries over the KV pool", nogil);
  m.def("add_rms_norm", &add_rms_norm, "(x + residual, RMSNorm(x + residual) * weight); residual optional", nogil);
  m.def("rope_write", &rope_write, "rope on q and k heads; k and v written to the KV pool; returns q", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up", nogil);
  m.def("decoder_layers", &decoder_layers, "every decoder layer over decode/tree rows in one call (the per-op path's bits)", nogil);
  m.def("greedy_select_packed", &greedy_select_packed, "greedy rows' logits of a head on bf16 weights from a proxy computed elsewhere", nogil);
  m.def("greedy_select", &greedy_select, "greedy rows' logits from a proxy computed elsewhere and per-row input terms", nogil);
  m.def("greedy_logits", &greedy_logits, "greedy rows' logits: exact at every possible argmax, -inf elsewhere (am: int64 [M] for the rows' argmax, or empty)", nogil);
  m.def("greedy_pick", &greedy_pick, "greedy_logits from a proxy computed on bf16 inputs (bf16_dot)", nogil);
  m.def("draft_layer", &draft_layer, "an EAGLE-family draft head's decoder layer in one call (the per-op path's bits)", nogil);
  m.def("eagle3_draft", &eagle3_draft, "an EAGLE-3-layout head's greedy draft step (extend pass, EAGLE-2 beam search) in one call: beam_search's candidates", nogil);
  m.def("attention_plan", &attention_plan, "the attention kernel's slot lists from each sequence's slots and tree mask");
  m.def("top_logprobs", &top_logprobs, "each row's k best log-softmax values and ids, [2, rows, k]", nogil);
}
