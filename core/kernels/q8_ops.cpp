// specfw CPU kernels for linears with int8 activations (model.activation_quantization = int8):
// llama.cpp's arithmetic -- activations quantized to int8 per block of 32, integer dot products
// against 4- or 8-bit weight codes, one fp32 scale step per block -- batch invariant by
// construction.
//
// Activations (quantize_rows): each row, each block b of 32 inputs on its own:
//   dx = max|x| / 127, q = nearbyint(x * (1 / dx)) in -127..127, sx = dx * sum(q)
// (one scalar routine for every build: a row's codes never depend on other rows).
//
// Weights, w = d * q + m per block of 32 inputs of one output (m optional), for a group g of 8
// outputs and a block b of 32 inputs as 8 steps s of 4 inputs: step s is the 32 bytes
// V_s[4 o + t] = q[output 8 g + o][input 32 b + 4 s + t], so one vpmaddubsw + vpmaddwd against the
// row's 4 codes broadcast gives each output's partial sum in its own lane (no horizontal adds):
//   bits 4: codes uint8 [NG, KB, 4, 32]: byte j of (g, b, p) = V_2p[j] | V_2p+1[j] << 4, q in 0..15
//   bits 8: codes int8  [NG, KB, 8, 32]: V_s, q in -128..127
//   d, m:   fp32 or fp16 [NG, KB, 8] (fp16 where no value changes: converted exactly on load)
// (NG = ceil(N / 8), KB = K / 32.) Q4_0 is (d, m = -8 d); int8 per channel is d = the channel's
// scale in every block.
//
// Per (row, output), blocks in order b = 0..KB-1, from acc = 0:
//   P   = sum_j q_w[j] * q_x[j]                 (int32, exact: the order does not matter)
//   acc = fma(d[b] * dx[b], float(P), acc)       (d * dx rounded first)
//   acc = fma(m[b], sx[b], acc)                  (only with m)
// then y = acc + bias. Every build performs exactly these roundings (AVX2 with lanes = outputs,
// the portable build with scalar loops), so the builds agree bit for bit, and no result depends
// on how many rows a call has, how they are tiled or which thread ran them.
//
// Rows run in tiles of up to 4 over each group's codes (AVX2: over two groups' 4-bit codes at
// once in calls of 8+ rows; expanded in registers once per tile):
// a tree of 16 rows reads the weights from memory once. 4-bit products are summed in int16 over a
// block (8 x 15 x 127 x 2 < 32768: exact), 8-bit ones via |w| and sign(x, w) in int32.
//
// The amx build (SPECFW_Q8_AMX: AVX512-VNNI plus AMX-INT8) takes calls of kAmxRows rows or more
// on tiles: per block of 32 inputs, one TDPBSUD (4-bit codes, unsigned) or TDPBSSD (8-bit) gives
// the int32 sums P of 16 rows x 16 outputs at once (A tile: 16 rows x 32 codes, B tile: the
// block's codes of 16 outputs as 8 quads x 16 x 4), and the fp32 steps per row and block are the
// ones above, in the same order: the same bits as every other build, whatever path a call takes.
// The B tiles are staged once per 16 outputs (4-bit codes unpacked: the VNNI path's w0/w1 as they
// lie in registers) and serve every group of 16 rows. Fewer rows stay on vpdpbusd, which reads
// the codes once at the memory's pace.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#define SPECFW_Q8_SIMD 1
#endif
#if defined(__AVX512BW__) && defined(__AVX512DQ__)
#define SPECFW_Q8_ZMM 1  // zmm tiles: two groups' 8 outputs in one register
#if defined(__AVX512VNNI__)
#define SPECFW_Q8_VNNI 1  // ... summed on vpdpbusd; without it on vpmaddubsw + vpmaddwd (AVX-512BW)
#endif
#endif
#if defined(SPECFW_Q8_AMX)
#if !defined(SPECFW_Q8_VNNI) || !defined(__AMX_INT8__)
#error "the amx build of q8_ops needs AVX512-VNNI and AMX-INT8"
#endif
#include "amx_tiles.h"
#endif

namespace {

constexpr int64_t kQ = 32;  // inputs per block
constexpr int64_t kG = 8;   // outputs per group
#if defined(SPECFW_Q8_ZMM)
constexpr int64_t kSpan = 2;  // groups per work item: one zmm holds two groups' 8 outputs
constexpr int kTile = 8;      // rows per register tile (32 zmm registers)
#elif defined(SPECFW_Q8_SIMD)
constexpr int64_t kSpan = 2;  // groups per work item: 4-bit codes run both groups in one tile (tile2)
constexpr int kTile = 4;      // rows per register tile (16 ymm registers)
constexpr int64_t kPairRows = 8;
#else
constexpr int64_t kSpan = 1;
constexpr int kTile = 4;
#endif
constexpr int64_t kAhead = 8;  // blocks of codes prefetched ahead (a prefetch past the end is harmless)
// the VNNI tile's: 96 blocks ahead into L2, 12 KB of 4-bit codes per group (several DRAM latencies
// ahead of a one-row tile, which streams two groups' codes and scales at once). With 8 blocks into
// L1 one row of the demo's linears read its weights at 14 GB/s and the 8-bit lm_head at 20, where a
// plain read reached ~24-30; now 21 and 35-40: one row 1.36x, 8 rows 1.22x faster (AMD EPYC Zen 4,
// session 29). The AVX2 tile (one group at a time) streams at 20 and 33 with kAhead, and gained
// nothing from this.
constexpr int64_t kAheadL2 = 96;
// the AVX2 one-group tiles' (tile_codes): 32 blocks ahead into L2 (4 KB of 4-bit codes a group). 8 blocks
// into L1 read the demo's 120 layer linears for one row at 22 GB/s, 32 into L2 at 25 (2 threads;
// 1 thread 15 and 16: AMD EPYC Zen 3, session 46).
constexpr int64_t kAheadAvx2 = 32;

// one row: codes q [K], scales dx/sx [K/32]. The SIMD blocks give the scalar loop's bits: max is
// exact in any order, vcvtps2dq rounds half to even as nearbyint does (the default MXCSR mode),
// |codes| <= 127 pack without saturating, and integer sums are exact.
void quantize_row(const float* x, int64_t K, int8_t* q, float* dx, float* sx, int32_t* qs) {
  for (int64_t b = 0; b < K / kQ; ++b) {
    const float* v = x + b * kQ;
    int8_t* out = q + b * kQ;
    float amax = 0.f;
    int32_t sum = 0;
#if defined(__AVX512F__)
    const __m512 a = _mm512_loadu_ps(v), c = _mm512_loadu_ps(v + 16);
    amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id))), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(i1));
    sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#elif defined(SPECFW_Q8_SIMD)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 p[4];
    for (int j = 0; j < 4; ++j) p[j] = _mm256_loadu_ps(v + 8 * j);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, p[0]), _mm256_andnot_ps(sign, p[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, p[2]), _mm256_andnot_ps(sign, p[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    __m256i c[4];
    for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(p[j], _mm256_set1_ps(id)));
    // packs per 128-bit lane: bytes of c0[0..3] c1[0..3] c2[0..3] c3[0..3] | c0[4..7] ...; dwords back in order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
#else
    for (int j = 0; j < kQ; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    for (int j = 0; j < kQ; ++j) {
      const int32_t c = int32_t(std::nearbyint(v[j] * id));
      out[j] = int8_t(c);
      sum += c;
    }
#endif
    dx[b] = d;
    sx[b] = d * float(sum);
    qs[b] = sum;
  }
}

#if defined(SPECFW_Q8_SIMD)
// the 8 scales from element i (H: fp16, converted exactly)
template <bool H>
inline __m256 scales8(const uint8_t* p, int64_t i) {
  return H ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i * 2))) : _mm256_loadu_ps(reinterpret_cast<const float*>(p) + i);
}
#endif

// per-(block, output) scales d or m: fp32, or fp16 where that changes no value (GGUF's own scales
// are fp16: a sixth of a Q4_1 weight's bytes saved); converted exactly to fp32 on load
struct Scales {
  const uint8_t* p = nullptr;  // null: no m
  bool half = false;
  explicit operator bool() const { return p != nullptr; }
  Scales at(int64_t i) const { return Scales{p ? p + i * (half ? 2 : 4) : nullptr, half}; }
  const char* addr(int64_t i) const { return reinterpret_cast<const char*>(p + i * (half ? 2 : 4)); }
  float get(int64_t i) const {
    return half ? static_cast<float>(reinterpret_cast<const c10::Half*>(p)[i]) : reinterpret_cast<const float*>(p)[i];
  }
#if defined(SPECFW_Q8_SIMD)
  __m256 load8(int64_t i) const { return half ? scales8<true>(p, i) : scales8<false>(p, i); }
#endif
};

struct Rows {
  const int8_t* q;   // [M, K]
  const float* dx;   // [M, KB]
  const float* sx;
  const int32_t* qs;  // [M, KB]: sum of each block's codes
  int64_t K, KB;
};

// the groups of one work item: kSpan (or fewer at the end) consecutive groups of 8 outputs
struct Span {
  const uint8_t* codes;  // the first group's codes; the next group's lie per_group bytes on
  int64_t per_group;
  int groups;            // 1..kSpan
  Scales d, m;           // the first group's scales; the next group's lie KB * 8 on
  int bits;
  bool pair = false;     // AVX2, 4-bit codes: both groups in one tile (tile_two; calls of kPairRows+ rows)
  bool narrow = false;   // avx512 without VNNI: a call of few rows, on the AVX2 tiles (ymm_rows)
};

#if defined(SPECFW_Q8_SIMD)
// AVX2 tiles (one ymm: one group's 8 outputs). The avx512 build without VNNI keeps them for calls
// of few rows (ymm_rows, tile_rows).
namespace ymm {
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// the fp32 steps of block b for R rows from their int32 sums P: acc = fma(d * dx, P, acc), then
// acc = fma(m, sx, acc) (M); dx and sx the first row's (a row's lie KB on)
template <int R, bool M, bool H>
inline void scale_block(const __m256i* P, const uint8_t* dp, const uint8_t* mp, int64_t b, const float* dx, const float* sx, int64_t KB, __m256* acc) {
  const __m256 db = scales8<H>(dp, b * kG);
  const __m256 mb = M ? scales8<H>(mp, b * kG) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(db, _mm256_set1_ps(dx[r * KB + b])), _mm256_cvtepi32_ps(P[r]), acc[r]);
    if (M) acc[r] = _mm256_fmadd_ps(mb, _mm256_set1_ps(sx[r * KB + b]), acc[r]);
  }
}

// tile_one with the code width and scale kinds fixed at compile time (BITS: 4 or 8; M: an m;
// H: fp16 scales) and a block's steps unrolled: a 4-bit block of one row is ~50 instructions
// instead of ~80 (no per-block tests of bits, half or m, no loop counter per step). A 4-bit step's
// two products go into one vpaddw before the block's sum (the same exact int16 sums: at most
// 8 x 2 x 15 x 127); 8-bit codes have no m in any scheme that makes them, but an m is honoured.
template <int BITS, int R, bool M, bool H>
void tile_codes(const Span& sp, const Rows& x, int64_t r0, float* out) {
  constexpr int64_t step = BITS == 4 ? 128 : 256;  // bytes of one block's codes of a group
  constexpr int64_t sb = H ? 16 : 32;               // bytes of one block's 8 scales
  const uint8_t *dp = sp.d.p, *mp = sp.m.p;
  const int64_t K = x.K, KB = x.KB;
  const int8_t* q0 = x.q + r0 * K;
  const float *dx = x.dx + r0 * KB, *sx = x.sx + r0 * KB;
  const bool lead = r0 == 0;  // the first tile streams the codes: fetch ahead
  const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* c = sp.codes + b * step;
    if (lead) {
      for (int64_t o = 0; o < step; o += 64) _mm_prefetch(reinterpret_cast<const char*>(c + kAheadAvx2 * step + o), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(dp + (b + kAheadAvx2) * sb), _MM_HINT_T1);
      if (M) _mm_prefetch(reinterpret_cast<const char*>(mp + (b + kAheadAvx2) * sb), _MM_HINT_T1);
    }
    __m256i P[R];
    if constexpr (BITS == 4) {
      __m256i s16[R];
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + p * 32));
        const __m256i w0 = _mm256_and_si256(v, mask), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        for (int r = 0; r < R; ++r) {
          const int8_t* q = q0 + r * K + b * kQ + p * 8;
          const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(w0, bcast4(q)), _mm256_maddubs_epi16(w1, bcast4(q + 4)));
          s16[r] = p == 0 ? t : _mm256_add_epi16(s16[r], t);
        }
      }
      for (int r = 0; r < R; ++r) P[r] = _mm256_madd_epi16(s16[r], ones);
    } else {
#pragma GCC unroll 8
      for (int st = 0; st < 8; ++st) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + st * 32)), aw = _mm256_abs_epi8(w);
        for (int r = 0; r < R; ++r) {
          const __m256i xs = _mm256_sign_epi8(bcast4(q0 + r * K + b * kQ + st * 4), w);
          const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones);
          P[r] = st == 0 ? t : _mm256_add_epi32(P[r], t);
        }
      }
    }
    scale_block<R, M, H>(P, dp, mp, b, dx, sx, KB, acc);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * kSpan * kG, acc[r]);
}

// R rows (r0..r0+R-1) x the span's first group of 8 outputs -> out [R, 8] (rows kSpan * 8 apart)
template <int R>
void tile_one(const Span& sp, const Rows& x, int64_t r0, float* out) {
  if (sp.bits == 4) {
    if (sp.m) return sp.d.half ? tile_codes<4, R, true, true>(sp, x, r0, out) : tile_codes<4, R, true, false>(sp, x, r0, out);
    return sp.d.half ? tile_codes<4, R, false, true>(sp, x, r0, out) : tile_codes<4, R, false, false>(sp, x, r0, out);
  }
  if (sp.m) return sp.d.half ? tile_codes<8, R, true, true>(sp, x, r0, out) : tile_codes<8, R, true, false>(sp, x, r0, out);
  return sp.d.half ? tile_codes<8, R, false, true>(sp, x, r0, out) : tile_codes<8, R, false, false>(sp, x, r0, out);
}


// R rows x two groups of 4-bit codes -> out [R, 16]: each row's codes broadcast once serve both
// groups' outputs. One group per tile runs ~40 instructions per 256 multiply-adds of a row (unpack,
// broadcast, vpmaddubsw, vpaddw, the block's scale step), ~4 a cycle: instruction-bound at
// ~65 GMAC/s a core where vpmaddubsw alone would allow ~190. Two groups: 1.15-1.18x faster with
// the codes in cache at 1-16 rows, 1.08x from DRAM at 8-16 rows, but 0.84-0.96x from DRAM at 1-4
// rows (two streams of codes a thread instead of one), so only calls of kPairRows rows or more
// take it (the demo's 120 layer linears, AMD EPYC Zen 3, session 41). The same integer sums and fp32
// steps per output as tile_one: the same bits.
template <int R>
void tile_two(const Span& sp, const Rows& x, int64_t r0, float* out) {
  const uint8_t *c0 = sp.codes, *c1 = sp.codes + sp.per_group;
  const Scales &d = sp.d, &m = sp.m;
  const int64_t snext = x.KB * kG;
  const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0F);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.KB; ++b) {
    if (r0 == 0) {  // the first tile streams both groups' codes: fetch ahead
      for (const uint8_t* c : {c0, c1}) {
        _mm_prefetch(reinterpret_cast<const char*>(c + (b + kAhead) * 128), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(c + (b + kAhead) * 128 + 64), _MM_HINT_T0);
      }
      for (int g = 0; g < 2; ++g) {
        _mm_prefetch(d.addr(g * snext + (b + kAhead) * kG), _MM_HINT_T0);
        if (m) _mm_prefetch(m.addr(g * snext + (b + kAhead) * kG), _MM_HINT_T0);
      }
    }
    __m256i s0[R], s1[R];
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int p = 0; p < 4; ++p) {  // low nibbles of both groups, then high ones: 13 registers live at R = 4
      const __m256i* v0 = reinterpret_cast<const __m256i*>(c0 + b * 128 + p * 32);
      const __m256i* v1 = reinterpret_cast<const __m256i*>(c1 + b * 128 + p * 32);
      for (int half = 0; half < 2; ++half) {
        const __m256i w0 = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(v0), 4 * half), mask);
        const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(v1), 4 * half), mask);
        for (int r = 0; r < R; ++r) {
          const __m256i xq = bcast4(x.q + (r0 + r) * x.K + b * kQ + p * 8 + 4 * half);
          s0[r] = _mm256_add_epi16(s0[r], _mm256_maddubs_epi16(w0, xq));
          s1[r] = _mm256_add_epi16(s1[r], _mm256_maddubs_epi16(w1, xq));
        }
      }
    }
    const __m256 d0 = d.load8(b * kG), d1 = d.load8(snext + b * kG);
    for (int r = 0; r < R; ++r) {
      const __m256 dxr = _mm256_set1_ps(x.dx[(r0 + r) * x.KB + b]);
      acc[r][0] = _mm256_fmadd_ps(_mm256_mul_ps(d0, dxr), _mm256_cvtepi32_ps(_mm256_madd_epi16(s0[r], ones)), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_mul_ps(d1, dxr), _mm256_cvtepi32_ps(_mm256_madd_epi16(s1[r], ones)), acc[r][1]);
      if (m) {
        const __m256 sxr = _mm256_set1_ps(x.sx[(r0 + r) * x.KB + b]);
        acc[r][0] = _mm256_fmadd_ps(m.load8(b * kG), sxr, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(m.load8(snext + b * kG), sxr, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kSpan * kG, acc[r][0]);
    _mm256_storeu_ps(out + r * kSpan * kG + kG, acc[r][1]);
  }
}

// R rows x the span's groups -> out [R, 16] (columns of a missing second group: untouched)
template <int R>
void tile(const Span& sp, const Rows& x, int64_t r0, float* out) {
  if (sp.pair && sp.bits == 4 && sp.groups == 2) return tile_two<R>(sp, x, r0, out);
  tile_one<R>(sp, x, r0, out);
  if (sp.groups == 2) {
    const int64_t snext = x.KB * kG;
    tile_one<R>(Span{sp.codes + sp.per_group, sp.per_group, 1, sp.d.at(snext), sp.m.at(snext), sp.bits}, x, r0, out + kG);
  }
}
}  // namespace ymm
#endif

#if defined(SPECFW_Q8_ZMM)
// AVX-512: one zmm holds two groups' 8 outputs (low half group g, high half g + 1).
// With VNNI, vpdpbusd does vpmaddubsw + vpmaddwd + vpaddd in one instruction: 4-bit codes (0..15)
// are its unsigned operand as they are; 8-bit codes w go in as w + 128 (w ^ 0x80), and the 128 x
// sum of the row's codes that adds is where the sum starts from.
// Without VNNI (AVX-512BW only: Skylake-SP Xeons), the AVX2 build's arithmetic on
// twice the lanes: 4-bit products via vpmaddubsw summed in int16 over a block (8 x 2 x 15 x 127 <
// 32768: exact), then one vpmaddwd into int32; 8-bit ones as |w| x (x negated where w < 0; a
// masked subtract, AVX-512 has no vpsignb), vpmaddwd, int32 adds. On the Xeon family 6 model 85
// (no VNNI, session 52) it runs calls of 8-16 rows 1.2-1.6x faster than the AVX2 tiles did.
// Integer sums are exact, the fp32 steps per output are the ones above: the same bits as every
// other build.
inline __m512i pair_codes(const uint8_t* c, int64_t next, bool two) {
  const __m512i lo = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
  return two ? _mm512_inserti64x4(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + next)), 1) : lo;
}

inline __m512 pair_scales(const Scales& s, int64_t i, int64_t next, bool two) {
  const __m512 lo = _mm512_zextps256_ps512(s.load8(i));
  return two ? _mm512_insertf32x8(lo, s.load8(i + next), 1) : lo;
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// R rows (r0..r0+R-1) x the span's groups -> out [R, 16] (columns of a missing second group: 0)
template <int R>
void tile(const Span& sp, const Rows& x, int64_t r0, float* out) {
  const bool two = sp.groups == 2;
  const int64_t step = sp.bits == 4 ? 128 : 256, snext = x.KB * kG;
  const __m512i mask = _mm512_set1_epi8(0x0F);
#if defined(SPECFW_Q8_VNNI)
  const __m512i flip = _mm512_set1_epi8(char(0x80));
#else
  const __m512i ones = _mm512_set1_epi16(1);
#endif
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.KB; ++b) {
    if (r0 == 0) {  // the first tile streams the codes of both groups: fetch ahead
      for (int g = 0; g < sp.groups; ++g) {
        const char* c = reinterpret_cast<const char*>(sp.codes + g * sp.per_group + (b + kAheadL2) * step);
        for (int64_t o = 0; o < step; o += 64) _mm_prefetch(c + o, _MM_HINT_T1);
        _mm_prefetch(sp.d.addr(g * snext + (b + kAheadL2) * kG), _MM_HINT_T1);
        if (sp.m) _mm_prefetch(sp.m.addr(g * snext + (b + kAheadL2) * kG), _MM_HINT_T1);
      }
    }
    __m512i P[R];
    const int8_t* qb = x.q + r0 * x.K + b * kQ;
    const uint8_t* c = sp.codes + b * step;
    if (sp.bits == 4) {
      for (int r = 0; r < R; ++r) P[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
      for (int p = 0; p < 4; ++p) {
        const __m512i v = pair_codes(c + p * 32, sp.per_group, two);
        const __m512i w0 = _mm512_and_si512(v, mask), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        for (int r = 0; r < R; ++r) {
#if defined(SPECFW_Q8_VNNI)
          P[r] = _mm512_dpbusd_epi32(P[r], w0, bcast4(qb + r * x.K + p * 8));
          P[r] = _mm512_dpbusd_epi32(P[r], w1, bcast4(qb + r * x.K + p * 8 + 4));
#else  // int16 sums over the block (P holds them until the vpmaddwd below)
          const __m512i t = _mm512_add_epi16(_mm512_maddubs_epi16(w0, bcast4(qb + r * x.K + p * 8)),
                                             _mm512_maddubs_epi16(w1, bcast4(qb + r * x.K + p * 8 + 4)));
          P[r] = _mm512_add_epi16(P[r], t);
#endif
        }
      }
#if !defined(SPECFW_Q8_VNNI)
      for (int r = 0; r < R; ++r) P[r] = _mm512_madd_epi16(P[r], ones);
#endif
    } else {
#if defined(SPECFW_Q8_VNNI)
      for (int r = 0; r < R; ++r) P[r] = _mm512_set1_epi32(-128 * x.qs[(r0 + r) * x.KB + b]);
#pragma GCC unroll 1
      for (int st = 0; st < 8; ++st) {
        const __m512i w = _mm512_xor_si512(pair_codes(c + st * 32, sp.per_group, two), flip);
        for (int r = 0; r < R; ++r) P[r] = _mm512_dpbusd_epi32(P[r], w, bcast4(qb + r * x.K + st * 4));
      }
#else
      for (int r = 0; r < R; ++r) P[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
      for (int st = 0; st < 8; ++st) {
        const __m512i w = pair_codes(c + st * 32, sp.per_group, two), aw = _mm512_abs_epi8(w);
        const __mmask64 neg = _mm512_movepi8_mask(w);
        for (int r = 0; r < R; ++r) {
          const __m512i xb = bcast4(qb + r * x.K + st * 4);
          const __m512i xs = _mm512_mask_sub_epi8(xb, neg, _mm512_setzero_si512(), xb);  // |w| x sign(w) x
          P[r] = _mm512_add_epi32(P[r], _mm512_madd_epi16(_mm512_maddubs_epi16(aw, xs), ones));
        }
      }
#endif
    }
    const __m512 db = pair_scales(sp.d, b * kG, snext, two);
    const __m512 mb = sp.m ? pair_scales(sp.m, b * kG, snext, two) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 dd = _mm512_mul_ps(db, _mm512_set1_ps(x.dx[(r0 + r) * x.KB + b]));
      acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(P[r]), acc[r]);
      if (sp.m) acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(x.sx[(r0 + r) * x.KB + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kSpan * kG, acc[r]);
}
#elif defined(SPECFW_Q8_SIMD)
using ymm::tile;
#else
// the weight code of (output o, input j of block b)
inline int32_t code_at(const uint8_t* codes, int bits, int64_t b, int o, int j) {
  const int s = j / 4, t = j % 4;
  if (bits == 4) {
    const uint8_t v = codes[b * 128 + (s / 2) * 32 + 4 * o + t];
    return (s % 2) ? v >> 4 : v & 0x0F;
  }
  return reinterpret_cast<const int8_t*>(codes)[b * 256 + s * 32 + 4 * o + t];
}

template <int R>
void tile(const Span& sp, const Rows& x, int64_t r0, float* out) {
  const uint8_t* codes = sp.codes;
  const int bits = sp.bits;
  const Scales &d = sp.d, &m = sp.m;
  for (int r = 0; r < R; ++r) {
    const int8_t* q = x.q + (r0 + r) * x.K;
    float acc[kG] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t b = 0; b < x.KB; ++b) {
      const float dxv = x.dx[(r0 + r) * x.KB + b], sxv = x.sx[(r0 + r) * x.KB + b];
      for (int o = 0; o < kG; ++o) {
        int32_t P = 0;
        for (int j = 0; j < kQ; ++j) P += code_at(codes, bits, b, o, j) * int32_t(q[b * kQ + j]);
        const float dd = d.get(b * kG + o) * dxv;
        acc[o] = std::fma(dd, float(P), acc[o]);
        if (m) acc[o] = std::fma(m.get(b * kG + o), sxv, acc[o]);
      }
    }
    for (int o = 0; o < kG; ++o) out[r * kG + o] = acc[o];
  }
}
#endif

#if defined(SPECFW_Q8_ZMM) && !defined(SPECFW_Q8_VNNI)
// Without VNNI, calls of few rows stay on the AVX2 tiles, one group's codes streamed at a time: up
// to 4 rows of 4-bit codes, up to 2 of 8-bit ones. The demo's 120 Q4_1 layer linears from DRAM
// (random codes, Xeon family 6 model 85, 2 threads, session 52), AVX2 tiles / zmm tiles: 3 rows
// 9.5-10.6 / 10.8-12.4 ms, 4 rows 11.9-13.1 / 11.9-13.4, 8 rows 24.9-28.6 / 20.6-22.1, 16 rows
// 45.5-50.9 / 37.0-38.8; with 8-bit codes 4 rows 20.5 / 17.0, 8 rows 36.6 / 26.3. The same bits.
inline int64_t ymm_rows(int64_t bits) { return bits == 4 ? 4 : 2; }
#endif

inline void tile_rows(int R, const Span& sp, const Rows& x, int64_t r0, float* out) {
#if defined(SPECFW_Q8_ZMM) && !defined(SPECFW_Q8_VNNI)
  if (sp.narrow) {
    switch (R) {
      case 4: return ymm::tile<4>(sp, x, r0, out);
      case 3: return ymm::tile<3>(sp, x, r0, out);
      case 2: return ymm::tile<2>(sp, x, r0, out);
      default: return ymm::tile<1>(sp, x, r0, out);
    }
  }
#endif
  switch (R) {
#if defined(SPECFW_Q8_ZMM)
    case 8: tile<8>(sp, x, r0, out); break;
    case 7: tile<7>(sp, x, r0, out); break;
    case 6: tile<6>(sp, x, r0, out); break;
    case 5: tile<5>(sp, x, r0, out); break;
#endif
    case 4: tile<4>(sp, x, r0, out); break;
    case 3: tile<3>(sp, x, r0, out); break;
    case 2: tile<2>(sp, x, r0, out); break;
    default: tile<1>(sp, x, r0, out); break;
  }
}

#if defined(SPECFW_Q8_AMX)
// calls of this many rows or more run on tiles: a tree of SGLang's large shapes, a prompt. Staging
// the B tiles costs about 0.6 of a one-row pass over the codes, and the scale step stays per row
// and block (4 vector ops a row for 16 outputs, against vpdpbusd's 8 plus those). In isolation
// (weights in L2) tiles took 0.77-0.92x vpdpbusd's time from 10 rows; in a forward of the demo's
// 121 linears, 1.05x at 10 rows, 1.0x at 12, 0.93x at 16, 0.90x at 32 (Intel Xeon with AMX,
// 2 threads, session 38).
constexpr int64_t kAmxRows = 16;
constexpr int64_t kStaged = 8 * 64;  // bytes of one B tile: a block's codes of 16 outputs

using specfw_amx::TileConfig;

// tmm0, tmm1: C (rows x 16 int32); tmm4, tmm5: A (rows x 32 codes); tmm6, tmm7: B (8 quads x 16
// outputs x 4 codes); tmm2, tmm3 configured as C, unused (four C tiles in flight measured no
// faster than two). Block b + 1's product is issued before block b's sums are stored and scaled.
// rows: of A and C (16; a call of fewer rows would load, multiply and store only its own)
void configure_tiles(int rows) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 4; ++t) { cfg.rows[t] = rows; cfg.colsb[t] = 64; }
  for (int t = 4; t < 6; ++t) { cfg.rows[t] = rows; cfg.colsb[t] = kQ; }
  for (int t = 6; t < 8; ++t) { cfg.rows[t] = kQ / 4; cfg.colsb[t] = 64; }
  specfw_amx::load_config(cfg);
}

bool amx_permitted() {
  static const bool permitted = specfw_amx::request_amx();  // Linux: the tile state, once per process
  return permitted;
}

// the span's B tiles, one per block: row s of block b holds the 16 outputs' codes of inputs
// 32 b + 4 s .. + 3 (outputs 8..15 from the second group, zero where there is none)
using Staged = std::vector<uint8_t>;

void stage(const Span& sp, int64_t KB, Staged& out) {
  const bool two = sp.groups == 2;
  const int64_t step = sp.bits == 4 ? 128 : 256;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  out.resize(KB * kStaged);
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* c = sp.codes + b * step;
    for (int g = 0; g < sp.groups; ++g) {  // into L2 as far ahead as the vpdpbusd tiles fetch (spans lie one after another)
      const char* ahead = reinterpret_cast<const char*>(c + g * sp.per_group + kAheadL2 * step);
      for (int64_t o = 0; o < step; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T1);
      _mm_prefetch(sp.d.addr(g * KB * kG + (b + kAheadL2) * kG), _MM_HINT_T1);
      if (sp.m) _mm_prefetch(sp.m.addr(g * KB * kG + (b + kAheadL2) * kG), _MM_HINT_T1);
    }
    uint8_t* t = out.data() + b * kStaged;
    if (sp.bits == 4) {
      for (int p = 0; p < 4; ++p) {
        const __m512i v = pair_codes(c + p * 32, sp.per_group, two);
        _mm512_storeu_si512(t + (2 * p) * 64, _mm512_and_si512(v, mask));
        _mm512_storeu_si512(t + (2 * p + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
      }
    } else {
      for (int st = 0; st < 8; ++st) _mm512_storeu_si512(t + st * 64, pair_codes(c + st * 32, sp.per_group, two));
    }
  }
  // the tile loads below read these bytes, and GCC's tile loads name no memory: keep the stores before them
  __asm__ volatile("" ::: "memory");
}

// block b's sums into C tile T from A tile TA and B tile TB (GCC's tile intrinsics paste their
// register numbers into the instruction: literals, hence a macro)
#define SPECFW_Q8_PRODUCT(T, TA, TB, b)                 \
  do {                                                  \
    _tile_zero(T);                                      \
    _tile_loadd(TA, A + (b) * kQ, x.K);                 \
    _tile_loadd(TB, staged + (b) * kStaged, 64);        \
    if (four) _tile_dpbsud(T, TA, TB);                  \
    else _tile_dpbssd(T, TA, TB);                       \
  } while (0)

// the scale step of block b for R rows from their int32 sums P [16][16]: the span's scales of
// block b, dx and sx the first row's (a row's lie KB on)
template <int R, bool M>
inline void scale(const Span& sp, int64_t b, bool two, const float* dx, const float* sx, int64_t KB, const int32_t* P, __m512* acc) {
  const __m512 db = pair_scales(sp.d, b * kG, KB * kG, two);
  const __m512 mb = M ? pair_scales(sp.m, b * kG, KB * kG, two) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const __m512 dd = _mm512_mul_ps(db, _mm512_set1_ps(dx[r * KB]));
    acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(_mm512_load_si512(P + r * 16)), acc[r]);
    if (M) acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(sx[r * KB]), acc[r]);
  }
}

// R rows (r0..r0+R-1; the codes buffer holds min(M, 16) from r0, the tiles' rows) x the span's 16 outputs -> out [R, 16]
template <int R, bool M>
void amx_tile(const Span& sp, const Rows& x, int64_t r0, const Staged& st, float* out) {
  alignas(64) int32_t P[4][16 * 16];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  // locals: every tile store clobbers memory, and the compiler would reload what it read through x
  const int8_t* A = x.q + r0 * x.K;
  const int64_t KB = x.KB, K = x.K;
  const float *dx = x.dx + r0 * KB, *sx = x.sx + r0 * KB;
  const uint8_t* staged = st.data();
  const Span span = sp;
  const bool four = sp.bits == 4, two = sp.groups == 2;
#define SPECFW_Q8_SCALE(i, b) scale<R, M>(span, b, two, dx + (b), sx + (b), KB, P[i], acc)
  // block b's product in C tile b % 2 (literals: unrolled by two): block b + 1's runs while b's sums are scaled
  SPECFW_Q8_PRODUCT(0, 4, 6, 0);
  for (int64_t b = 0; b < KB; b += 2) {
    if (b + 1 < KB) SPECFW_Q8_PRODUCT(1, 5, 7, b + 1);
    _tile_stored(0, P[0], 64);
    SPECFW_Q8_SCALE(0, b);
    if (b + 1 < KB) {
      if (b + 2 < KB) SPECFW_Q8_PRODUCT(0, 4, 6, b + 2);
      _tile_stored(1, P[1], 64);
      SPECFW_Q8_SCALE(1, b + 1);
    }
  }
#undef SPECFW_Q8_SCALE
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * 16, acc[r]);
}

template <int R>
void amx_tile_m(const Span& sp, const Rows& x, int64_t r0, const Staged& st, float* out) {
  if (sp.m) amx_tile<R, true>(sp, x, r0, st, out);
  else amx_tile<R, false>(sp, x, r0, st, out);
}

void amx_rows(int R, const Span& sp, const Rows& x, int64_t r0, const Staged& st, float* out) {
  switch (R) {
    case 16: amx_tile_m<16>(sp, x, r0, st, out); break;
    case 15: amx_tile_m<15>(sp, x, r0, st, out); break;
    case 14: amx_tile_m<14>(sp, x, r0, st, out); break;
    case 13: amx_tile_m<13>(sp, x, r0, st, out); break;
    case 12: amx_tile_m<12>(sp, x, r0, st, out); break;
    case 11: amx_tile_m<11>(sp, x, r0, st, out); break;
    case 10: amx_tile_m<10>(sp, x, r0, st, out); break;
    case 9: amx_tile_m<9>(sp, x, r0, st, out); break;
    case 8: amx_tile_m<8>(sp, x, r0, st, out); break;
    case 7: amx_tile_m<7>(sp, x, r0, st, out); break;
    case 6: amx_tile_m<6>(sp, x, r0, st, out); break;
    case 5: amx_tile_m<5>(sp, x, r0, st, out); break;
    case 4: amx_tile_m<4>(sp, x, r0, st, out); break;
    case 3: amx_tile_m<3>(sp, x, r0, st, out); break;
    case 2: amx_tile_m<2>(sp, x, r0, st, out); break;
    default: amx_tile_m<1>(sp, x, r0, st, out); break;
  }
}
#endif

// the activation codes and scales of a call's rows, in buffers the caller keeps (thread_local in
// linear(): four tensor allocations per call cost ~2-4 us, on every one of a forward's linears)
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> dx, sx;
  std::vector<int32_t> qs;

  // pad_to: rows of codes the buffer holds (zero codes past M: whole A tiles for the amx path)
  Rows of(const float* X, int64_t M, int64_t K, int64_t pad_to = 0) {
    const int64_t KB = K / kQ;
    q.resize(std::max(M, pad_to) * K);
    if (pad_to > M) std::memset(q.data() + M * K, 0, (pad_to - M) * K);
    dx.resize(M * KB);
    sx.resize(M * KB);
    qs.resize(M * KB);
    int8_t* Q = q.data();
    float *DX = dx.data(), *SX = sx.data();
    int32_t* QS = qs.data();
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {  // a prompt's rows on every core; up to 16 on the caller
      for (int64_t i = r0; i < r1; ++i) quantize_row(X + i * K, K, Q + i * K, DX + i * KB, SX + i * KB, QS + i * KB);
    });
    return Rows{Q, DX, SX, QS, K, KB};
  }
};

}  // namespace

// x [M, K] -> (q int8 [M, K], dx fp32 [M, K/32], sx fp32 [M, K/32])
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kQ == 0, "quantize_rows: x [M, K] with K a multiple of 32");
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), KB = K / kQ;
  Quantized buf;
  const Rows r = buf.of(xf.data_ptr<float>(), M, K);
  auto q = torch::empty({M, K}, torch::kInt8);
  auto dx = torch::empty({M, KB}, torch::kFloat32), sx = torch::empty({M, KB}, torch::kFloat32);
  std::memcpy(q.data_ptr<int8_t>(), r.q, M * K);
  std::memcpy(dx.data_ptr<float>(), r.dx, M * KB * sizeof(float));
  std::memcpy(sx.data_ptr<float>(), r.sx, M * KB * sizeof(float));
  return {q, dx, sx};
}

// x [M, K] fp32/bf16; codes/d/m as above (m may be empty); bias fp32 [N] or empty -> y [M, N] fp32
torch::Tensor linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t bits, int64_t N, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && (bits == 4 || bits == 8), "q8 linear: x [M, K], bits 4 or 8");
  const int64_t M = x.size(0), K = x.size(1), KB = K / kQ, NG = (N + kG - 1) / kG;
  TORCH_CHECK(K % kQ == 0, "q8 linear: K must be a multiple of 32");
  TORCH_CHECK(codes.dim() == 4 && codes.size(0) == NG && codes.size(1) == KB && codes.size(2) == (bits == 4 ? 4 : 8) && codes.size(3) == 32,
              "q8 linear: codes [ceil(N/8), K/32, 4 (bits 4) or 8 (bits 8), 32]");
  TORCH_CHECK((d.scalar_type() == torch::kFloat32 || d.scalar_type() == torch::kHalf) && d.is_contiguous() && d.numel() == NG * KB * kG,
              "q8 linear: d fp32 or fp16 [ceil(N/8), K/32, 8]");
  TORCH_CHECK(!m.numel() || (m.scalar_type() == d.scalar_type() && m.is_contiguous() && m.numel() == d.numel()), "q8 linear: m like d");
  TORCH_CHECK(!bias.numel() || bias.numel() == N, "q8 linear: bias [N]");
  auto y = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return y;
  const auto xf = x.to(torch::kFloat32).contiguous();
#if defined(SPECFW_Q8_AMX)
  const bool amx = M >= kAmxRows && amx_permitted();
  const int64_t pad_to = amx && M > 16 ? (M + 15) / 16 * 16 : 0;  // past 16 rows: whole groups of 16
#else
  const int64_t pad_to = 0;
#endif
  thread_local Quantized buf;  // the caller's buffers: taken here, before any parallel region
  const Rows rows = buf.of(xf.data_ptr<float>(), M, K, pad_to);
  const uint8_t* C = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const bool half = d.scalar_type() == torch::kHalf;
  const Scales D{reinterpret_cast<const uint8_t*>(d.data_ptr()), half};
  const Scales Mn{m.numel() ? reinterpret_cast<const uint8_t*>(m.data_ptr()) : nullptr, half};
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  const int64_t per_group = KB * (bits == 4 ? 128 : 256), NS = (NG + kSpan - 1) / kSpan;
#if defined(SPECFW_Q8_AMX)
  if (amx) {
    at::parallel_for(0, NS, 1, [&](int64_t s0, int64_t s1) {
      thread_local Staged staged;  // each worker's own
      alignas(64) float out[16 * 16];
      configure_tiles(int(std::min<int64_t>(M, 16)));
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t g = s * kSpan, n0 = g * kG;
        const Span sp{C + g * per_group, per_group, int(std::min<int64_t>(kSpan, NG - g)), D.at(g * KB * kG), Mn.at(g * KB * kG), int(bits)};
        const int64_t nv = std::min<int64_t>(sp.groups * kG, N - n0);
        const __mmask16 keep = nv == 16 ? __mmask16(0xFFFF) : __mmask16((1u << nv) - 1);
        const __m512 bias = B ? _mm512_maskz_loadu_ps(keep, B + n0) : _mm512_setzero_ps();
        stage(sp, KB, staged);
        for (int64_t r0 = 0; r0 < M; r0 += 16) {
          const int R = int(std::min<int64_t>(16, M - r0));
          amx_rows(R, sp, rows, r0, staged, out);
          for (int r = 0; r < R; ++r) {
            const __m512 v = _mm512_load_ps(out + r * 16);
            _mm512_mask_storeu_ps(Y + (r0 + r) * N + n0, keep, B ? _mm512_add_ps(v, bias) : v);
          }
        }
      }
      _tile_release();
    });
    return y;
  }
#endif
  const int64_t tiles = (M + kTile - 1) / kTile, base = M / tiles, extra = M % tiles;
#if defined(SPECFW_Q8_SIMD) && !defined(SPECFW_Q8_ZMM)
  const bool pair = M >= kPairRows, narrow = false;
#elif defined(SPECFW_Q8_ZMM) && !defined(SPECFW_Q8_VNNI)
  const bool pair = false, narrow = M <= ymm_rows(bits);
#else
  const bool pair = false, narrow = false;
#endif
  at::parallel_for(0, NS, 1, [&](int64_t s0, int64_t s1) {
    float out[kTile * kSpan * kG];
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t g = s * kSpan, n0 = g * kG;
      const Span sp{C + g * per_group, per_group, int(std::min<int64_t>(kSpan, NG - g)), D.at(g * KB * kG), Mn.at(g * KB * kG), int(bits), pair, narrow};
      const int64_t nv = std::min<int64_t>(sp.groups * kG, N - n0);
      int64_t r0 = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int R = int(base + (t < extra));
        tile_rows(R, sp, rows, r0, out);
        for (int r = 0; r < R; ++r)
          for (int64_t o = 0; o < nv; ++o) Y[(r0 + r) * N + n0 + o] = B ? out[r * kSpan * kG + o] + B[n0 + o] : out[r * kSpan * kG + o];
        r0 += R;
      }
    }
  });
  return y;
}

// rescore_best(logits [R, V] fp32, x [R, K] fp32, codes [V, K] int8, d [V, K / 32] fp32, C):
// per row, the C largest logits (the first index on ties) are overwritten with the fp32 product
// of the row and those outputs' 8-bit weights w = d q, summed over k in order. A draft's lm_head
// (core/backends/proxy_head.py) takes a 4-bit proxy's logits and puts the 8-bit head's
// values at its best candidates: one pass over the row, no torch ops between. Rows in parallel,
// each row's result from its own data only.
void rescore_best(torch::Tensor logits, torch::Tensor x, torch::Tensor codes, torch::Tensor d, int64_t C) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.is_contiguous(), "logits: [R, V] fp32 contiguous");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.size(0) == logits.size(0), "x: [R, K] fp32 contiguous");
  const int64_t R = logits.size(0), V = logits.size(1), K = x.size(1), KB = K / 32;
  TORCH_CHECK(K % 32 == 0 && codes.scalar_type() == torch::kChar && codes.is_contiguous() && codes.numel() == V * K, "codes: [V, K] int8, K a multiple of 32");
  TORCH_CHECK(d.scalar_type() == torch::kFloat && d.is_contiguous() && d.numel() == V * KB, "d: [V, K / 32] fp32");
  C = std::max<int64_t>(0, std::min<int64_t>(C, V));
  if (C == 0 || R == 0) return;
  float* L = logits.data_ptr<float>();
  const float* X = x.data_ptr<float>();
  const int8_t* Q = codes.data_ptr<int8_t>();
  const float* D = d.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> best(C);
    std::vector<float> val(C);
    for (int64_t r = r0; r < r1; ++r) {
      float* row = L + r * V;
      // the C best so far, sorted by value descending (ties: the earlier index stays ahead)
      int64_t n = 0;
      for (int64_t v0 = 0; v0 < V; v0 += 64) {
        const int64_t v1 = std::min<int64_t>(V, v0 + 64);
        if (n == C) {  // a chunk with nothing above the C-th best is skipped whole (a vectorised max)
          float top = row[v0];
          for (int64_t v = v0 + 1; v < v1; ++v) top = std::max(top, row[v]);
          if (!(top > val[C - 1])) continue;
        }
        for (int64_t v = v0; v < v1; ++v) {
          const float y = row[v];
          if (n == C && !(y > val[C - 1])) continue;
          int64_t i = n < C ? n++ : C - 1;
          while (i > 0 && y > val[i - 1]) {
            val[i] = val[i - 1];
            best[i] = best[i - 1];
            --i;
          }
          val[i] = y;
          best[i] = v;
        }
      }
      const float* xr = X + r * K;
      for (int64_t c = 0; c < n; ++c) {
        const int8_t* q = Q + best[c] * K;
        const float* dv = D + best[c] * KB;
        float acc = 0.f;
        for (int64_t b = 0; b < KB; ++b)
          for (int j = 0; j < 32; ++j) acc = std::fma(dv[b] * float(q[b * 32 + j]), xr[b * 32 + j], acc);
        row[best[c]] = acc;
      }
    }
  });
}

// linear()'s address, for cpu_ops' one-call decoder layers (another extension in this process,
// on the same libtorch): they call it for each of a layer's four linears
int64_t linear_address() {
  return reinterpret_cast<int64_t>(&linear);
}

std::string isa() {
#if defined(SPECFW_Q8_AMX)
  return "amx";
#elif defined(SPECFW_Q8_VNNI)
  return "avx512_vnni";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs: another Python thread (the overlap scheduler's
  // engine thread, the server's event loop) may run meanwhile; arguments and results are
  // converted with the GIL held
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("linear", &linear, "batch-invariant linear with int8 activations and 4/8-bit weight codes", nogil);
  m.def("quantize_rows", &quantize_rows, "int8 codes and per-32 scales of each row", nogil);
  m.def("rescore_best", &rescore_best, "a proxy head's best logits per row recomputed from 8-bit codes", nogil);
  m.def("linear_address", &linear_address, "linear()'s address, for cpu_ops' one-call decoder layers");
  m.def("isa", &isa, "the instruction set this build targets");
}
