// specfw CPU kernels for weight-only quantized linears (model.quantization = int8 | int4 | gguf).
//
// A weight is stored as integer codes plus per-(group, output) fp32 scales d (and mins m), in
// the output-blocked layout of cpu_ops' linear (16 outputs side by side per k):
//   bits 8: codes int8  [NB, K, 16]                  w = d * q            (q = code)
//   bits 4: codes uint8 [NB, K/2, 16], low nibble = even k, high nibble = odd k
//                                                    w = d * q (+ m)      (q = nibble - offset)
//   scale / minv fp32 [NB, K/G, 16]: group g covers k in [g*G, (g+1)*G)
// Each weight is dequantized to fp32 exactly as gguf-py (and so the fp32 checkpoint specfw
// converts a GGUF file to) computes it: d * q rounded to fp32, then + m rounded to fp32 -- a
// separate multiply and add, never an FMA (built with -ffp-contract=off). Each output is then
// accumulated over k = 0..K-1 in sequence with one FMA per k (AVX2/AVX-512 builds) or a multiply
// then an add (portable build), starting from zero, bias added last: the very operations of
// cpu_ops' linear on the dequantized fp32 weight. So a GGUF model run on its blocks gives the
// bits of the same model dequantized to fp32 and run on cpu_ops, while streaming ~5x fewer bytes;
// and the kernel is batch invariant by construction (no sum depends on row count, tile or thread).
//
// Where every d * q is exact in fp32 (fma_dq: the scales' significands and the codes fit in 24
// bits, as GGUF's fp16 scales do; quant_linear.exact_products) the SIMD builds dequantize with one
// FMA, fma(q, d, m): the same exact sum rounded once, the same weight.
//
// Rows (SIMD builds): up to kRegisterRows rows, weights dequantized in registers and used at once by
// register tiles of up to kMaxTile rows (one row four blocks of 16 outputs at once, two rows two);
// each tile dequantizes its block again from L1/L2. More rows (prompt prefills) and the portable
// build: per block of 16 outputs, k runs in chunks of 64, each chunk dequantized once into an L1
// buffer that every tile of up to kTile rows accumulates from.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#define SPECFW_QISA_SIMD 1
#endif

namespace {

constexpr int64_t kBlock = 16;
constexpr int64_t kChunk = 64;
constexpr int kTile = 6;                // rows per tile of the buffered path (12 accumulators on AVX2)
constexpr int64_t kMaxTile = 6;         // rows per register tile of the SIMD builds (12 accumulators)
constexpr int64_t kRegisterRows = 16;   // SIMD builds: calls of up to this many rows take the register tiles

// codes of one k (16 outputs) as integers (before scale)
inline void codes_at(const uint8_t* codes, int bits, int64_t K, int64_t b, int64_t k, int offset, int32_t* q) {
  if (bits == 8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(codes) + (b * K + k) * kBlock;
    for (int l = 0; l < kBlock; ++l) q[l] = c[l];
  } else {
    const uint8_t* c = codes + (b * (K / 2) + k / 2) * kBlock;
    const int sh = (k & 1) * 4;
    for (int l = 0; l < kBlock; ++l) q[l] = int32_t((c[l] >> sh) & 0xF) - offset;
  }
}

// f(k, w0, w1) for k = k0..k1-1 in order: the 16 dequantized weights of k (lanes 0-7, 8-15);
// scales loaded once per group, a 4-bit byte row loaded once per pair of k
#if defined(SPECFW_QISA_SIMD)
template <typename F>
inline void for_weights(const uint8_t* codes, int bits, int offset, bool fma_dq, const float* scale, const float* minv, int64_t K,
                        int64_t G, int64_t b, int64_t k0, int64_t k1, F&& f) {
  const int64_t groups = K / G;
  const __m256i off = _mm256_set1_epi32(offset);
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t k = k0; k < k1;) {
    const int64_t g = k / G, ke = std::min(k1, (g + 1) * G);
    const float* d = scale + (b * groups + g) * kBlock;
    const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
    const bool has_m = minv != nullptr;
    const __m256 m0 = has_m ? _mm256_loadu_ps(minv + (b * groups + g) * kBlock) : _mm256_setzero_ps();
    const __m256 m1 = has_m ? _mm256_loadu_ps(minv + (b * groups + g) * kBlock + 8) : _mm256_setzero_ps();
    auto weights = [&](__m256i q0, __m256i q1, __m256& w0, __m256& w1) {
      if (has_m && fma_dq) {   // d * q exact: one rounding of d * q + m, as below (weight_of)
        w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), d0, m0);
        w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), d1, m1);
        return;
      }
      w0 = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(q0));   // d * q, rounded; then + m, rounded (no FMA)
      w1 = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(q1));
      if (has_m) { w0 = _mm256_add_ps(w0, m0); w1 = _mm256_add_ps(w1, m1); }
    };
    for (; k < ke; k += 2) {
      __m256 a0, a1, b0, b1;
      if (bits == 8) {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (b * K + k) * kBlock));
        const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (b * K + k + 1) * kBlock));
        weights(_mm256_cvtepi8_epi32(c), _mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)), a0, a1);
        weights(_mm256_cvtepi8_epi32(e), _mm256_cvtepi8_epi32(_mm_srli_si128(e, 8)), b0, b1);
      } else {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (b * (K / 2) + k / 2) * kBlock));
        const __m128i lo = _mm_and_si128(c, mask), hi = _mm_and_si128(_mm_srli_epi16(c, 4), mask);
        weights(_mm256_sub_epi32(_mm256_cvtepu8_epi32(lo), off), _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), off), a0, a1);
        weights(_mm256_sub_epi32(_mm256_cvtepu8_epi32(hi), off), _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)), off), b0, b1);
      }
      f(k, a0, a1);
      f(k + 1, b0, b1);
    }
  }
}
#endif

// dequantize k in [k0, k1) of block b into buf [(k - k0) * 16 + lane]
void dequant_chunk(const uint8_t* codes, int bits, int offset, bool fma_dq, const float* scale, const float* minv, int64_t K,
                   int64_t G, int64_t b, int64_t k0, int64_t k1, float* buf) {
#if defined(SPECFW_QISA_SIMD)
  for_weights(codes, bits, offset, fma_dq, scale, minv, K, G, b, k0, k1, [&](int64_t k, __m256 w0, __m256 w1) {
    _mm256_storeu_ps(buf + (k - k0) * kBlock, w0);
    _mm256_storeu_ps(buf + (k - k0) * kBlock + 8, w1);
  });
#else
  const int64_t groups = K / G;
  for (int64_t k = k0; k < k1; ++k) {
    const float* d = scale + (b * groups + k / G) * kBlock;
    const float* m = minv ? minv + (b * groups + k / G) * kBlock : nullptr;
    int32_t q[kBlock];
    codes_at(codes, bits, K, b, k, offset, q);
    for (int l = 0; l < kBlock; ++l) {
      float w = d[l] * float(q[l]);
      if (m) w = w + m[l];
      buf[(k - k0) * kBlock + l] = w;
    }
  }
#endif
}

#if defined(SPECFW_QISA_SIMD)
// How a 16-output row of codes becomes fp32 weights in registers: 4-bit codes without an offset
// (Q4_1, K-quants), 4-bit codes minus an offset (Q4_0), 8-bit codes.
enum Codes { kNibbles, kNibblesOffset, kBytes };

// A block's codes at k (even) as loaded once for k and k + 1: a 4-bit byte row holds both (low
// nibble = k, high = k + 1), widened straight from memory into outputs 0-7 (a) and 8-15 (e); 8-bit
// codes are read per k (codes_at).
struct CodeRow {
  __m256i a, e;
};

template <Codes C>
inline CodeRow code_row(const uint8_t* codes, int64_t K, int64_t b, int64_t k) {
  if constexpr (C == kBytes) {
    return {_mm256_setzero_si256(), _mm256_setzero_si256()};
  } else {
    const uint8_t* c = codes + (b * (K / 2) + k / 2) * kBlock;
    return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))),
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8)))};
  }
}

// The codes of k + h (h = 0 or 1) as fp32 values, outputs 0-7 in q0 and 8-15 in q1. Splitting a
// 4-bit row per k, when used, keeps wide tiles' registers for their accumulators (and was no slower
// at one or two rows: 0.91-0.96x against widening both k at once, session 70).
template <Codes C>
inline void codes_at(const CodeRow& row, const uint8_t* codes, int64_t K, int64_t b, int64_t k, int h, __m256i off, __m256& q0, __m256& q1) {
  if constexpr (C == kBytes) {
    const int8_t* c = reinterpret_cast<const int8_t*>(codes) + (b * K + k + h) * kBlock;
    q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
    q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8))));
  } else {
    const __m256i lo = _mm256_set1_epi32(0x0F);
    __m256i a = h ? _mm256_srli_epi32(row.a, 4) : _mm256_and_si256(row.a, lo);
    __m256i e = h ? _mm256_srli_epi32(row.e, 4) : _mm256_and_si256(row.e, lo);
    if constexpr (C == kNibblesOffset) {
      a = _mm256_sub_epi32(a, off);
      e = _mm256_sub_epi32(e, off);
    }
    q0 = _mm256_cvtepi32_ps(a);
    q1 = _mm256_cvtepi32_ps(e);
  }
}

// gguf-py's weight: d * q rounded, then + m rounded. Where every d * q is exact in fp32 (FMA_DQ:
// the scale's significand and the code fit in 24 bits, as GGUF's fp16 scales do, see
// exact_products), that is fma(q, d, m): one rounding of the same exact sum, the same bits.
template <bool FMA_DQ, bool HAS_M>
inline __m256 weight_of(__m256 q, const float* d, const float* m) {
  if constexpr (!HAS_M) return _mm256_mul_ps(q, _mm256_loadu_ps(d));
  else if constexpr (FMA_DQ) return _mm256_fmadd_ps(q, _mm256_loadu_ps(d), _mm256_loadu_ps(m));
  else return _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(d), q), _mm256_loadu_ps(m));
}

// one or two rows against NBK blocks at once: weights dequantized in registers and used at once
// (no buffer); NBK blocks give 2 * NBK * MR independent FMA chains (one block alone would wait on
// the FMA latency). Per output the sum still runs k = 0..K-1 in sequence.
template <int MR, int NBK, Codes C, bool FMA_DQ, bool HAS_M>
void fused_tile(const uint8_t* codes, int offset, const float* scale, const float* minv, int64_t K, int64_t G, int64_t b,
                const float* x, float* part) {
  __m256 acc[MR][NBK][2];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NBK; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  const int64_t groups = K / G;
  const __m256i off = _mm256_set1_epi32(offset);
  for (int64_t g = 0; g < groups; ++g) {
    const float* d[NBK];
    const float* m[NBK];
    for (int j = 0; j < NBK; ++j) {
      d[j] = scale + ((b + j) * groups + g) * kBlock;
      m[j] = HAS_M ? minv + ((b + j) * groups + g) * kBlock : nullptr;
    }
    for (int64_t k = g * G; k < (g + 1) * G; k += 2) {
      for (int j = 0; j < NBK; ++j) {
        const CodeRow row = code_row<C>(codes, K, b + j, k);
        for (int h = 0; h < 2; ++h) {   // h = 0: k, h = 1: k + 1
          __m256 q0, q1;
          codes_at<C>(row, codes, K, b + j, k, h, off, q0, q1);
          const __m256 w0 = weight_of<FMA_DQ, HAS_M>(q0, d[j], m[j]);
          const __m256 w1 = weight_of<FMA_DQ, HAS_M>(q1, d[j] + 8, HAS_M ? m[j] + 8 : nullptr);
          for (int r = 0; r < MR; ++r) {
            const __m256 xb = _mm256_set1_ps(x[r * K + k + h]);
            acc[r][j][0] = _mm256_fmadd_ps(w0, xb, acc[r][j][0]);
            acc[r][j][1] = _mm256_fmadd_ps(w1, xb, acc[r][j][1]);
          }
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NBK; ++j) {
      _mm256_storeu_ps(part + (r * NBK + j) * kBlock, acc[r][j][0]);
      _mm256_storeu_ps(part + (r * NBK + j) * kBlock + 8, acc[r][j][1]);
    }
}

template <int MR, int NBK>
void fused(const uint8_t* codes, int bits, int offset, bool fma_dq, const float* scale, const float* minv, int64_t K, int64_t G,
           int64_t b, const float* x, float* part) {
  const bool has_m = minv != nullptr;
  if (bits == 8) {
    if (has_m && fma_dq) return fused_tile<MR, NBK, kBytes, true, true>(codes, offset, scale, minv, K, G, b, x, part);
    if (has_m) return fused_tile<MR, NBK, kBytes, false, true>(codes, offset, scale, minv, K, G, b, x, part);
    return fused_tile<MR, NBK, kBytes, false, false>(codes, offset, scale, minv, K, G, b, x, part);
  }
  if (offset) {
    if (has_m) return fused_tile<MR, NBK, kNibblesOffset, false, true>(codes, offset, scale, minv, K, G, b, x, part);
    return fused_tile<MR, NBK, kNibblesOffset, false, false>(codes, offset, scale, minv, K, G, b, x, part);
  }
  if (has_m && fma_dq) return fused_tile<MR, NBK, kNibbles, true, true>(codes, offset, scale, minv, K, G, b, x, part);
  if (has_m) return fused_tile<MR, NBK, kNibbles, false, true>(codes, offset, scale, minv, K, G, b, x, part);
  return fused_tile<MR, NBK, kNibbles, false, false>(codes, offset, scale, minv, K, G, b, x, part);
}

// a tile of M = 1-6 rows (X: its first row; Y: that row's outputs): blocks [b, b + nbk) into Y
// (nbk: up to 4 for one row, 2 for two, 1 for three to six)
void fused_rows(int64_t M, int nbk, const uint8_t* C, int bits, int offset, bool fma_dq, const float* S, const float* Mn, int64_t K,
                int64_t G, int64_t b, const float* X, const float* B, float* Y, int64_t N, float* part) {
  if (M == 1) {
    switch (nbk) {
      case 4: fused<1, 4>(C, bits, offset, fma_dq, S, Mn, K, G, b, X, part); break;
      case 3: fused<1, 3>(C, bits, offset, fma_dq, S, Mn, K, G, b, X, part); break;
      case 2: fused<1, 2>(C, bits, offset, fma_dq, S, Mn, K, G, b, X, part); break;
      default: fused<1, 1>(C, bits, offset, fma_dq, S, Mn, K, G, b, X, part); break;
    }
  } else if (M == 2) {
    switch (nbk) {
      case 2: fused<2, 2>(C, bits, offset, fma_dq, S, Mn, K, G, b, X, part); break;
      default: fused<2, 1>(C, bits, offset, fma_dq, S, Mn, K, G, b, X, part); break;
    }
  } else if (M == 3) {
    fused<3, 1>(C, bits, offset, fma_dq, S, Mn, K, G, b, X, part);
  } else if (M == 4) {
    fused<4, 1>(C, bits, offset, fma_dq, S, Mn, K, G, b, X, part);
  } else if (M == 5) {
    fused<5, 1>(C, bits, offset, fma_dq, S, Mn, K, G, b, X, part);
  } else {
    fused<6, 1>(C, bits, offset, fma_dq, S, Mn, K, G, b, X, part);
  }
  // part [M][nbk][16] -> rows of Y
  for (int64_t r = 0; r < M; ++r)
    for (int j = 0; j < nbk; ++j) {
      const int64_t n0 = (b + j) * kBlock, nv = std::min<int64_t>(kBlock, N - n0);
      for (int64_t l = 0; l < nv; ++l) {
        const float v = part[(r * nbk + j) * kBlock + l];
        Y[r * N + n0 + l] = B ? v + B[n0 + l] : v;
      }
    }
}
#endif

// MR rows over the chunk in buf (n = k1 - k0 values of k), running sums in part [MR][16]
template <int MR>
inline void tile(const float* buf, int64_t n, const float* x, int64_t K, float* part, bool fresh) {
#if defined(SPECFW_QISA_SIMD)
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 2; ++v) acc[r][v] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(part + r * kBlock + v * 8);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 w0 = _mm256_loadu_ps(buf + j * kBlock), w1 = _mm256_loadu_ps(buf + j * kBlock + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_set1_ps(x[r * K + j]);
      acc[r][0] = _mm256_fmadd_ps(w0, xb, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xb, acc[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(part + r * kBlock + v * 8, acc[r][v]);
#else
  float acc[MR][kBlock];
  for (int r = 0; r < MR; ++r)
    for (int l = 0; l < kBlock; ++l) acc[r][l] = fresh ? 0.f : part[r * kBlock + l];
  for (int64_t j = 0; j < n; ++j)
    for (int r = 0; r < MR; ++r) {
      const float xv = x[r * K + j];
      for (int l = 0; l < kBlock; ++l) acc[r][l] = acc[r][l] + buf[j * kBlock + l] * xv;
    }
  for (int r = 0; r < MR; ++r)
    for (int l = 0; l < kBlock; ++l) part[r * kBlock + l] = acc[r][l];
#endif
}

inline void tile_rows(int mr, const float* buf, int64_t n, const float* x, int64_t K, float* part, bool fresh) {
  switch (mr) {
    case 6: tile<6>(buf, n, x, K, part, fresh); break;
    case 5: tile<5>(buf, n, x, K, part, fresh); break;
    case 4: tile<4>(buf, n, x, K, part, fresh); break;
    case 3: tile<3>(buf, n, x, K, part, fresh); break;
    case 2: tile<2>(buf, n, x, K, part, fresh); break;
    case 1: tile<1>(buf, n, x, K, part, fresh); break;
    default: break;
  }
}

}  // namespace

// x [M, K]; codes/scale/minv as above (minv may be empty); bias fp32 [N] or empty -> y [M, N] fp32
torch::Tensor qlinear(torch::Tensor x, torch::Tensor codes, torch::Tensor scale, torch::Tensor minv, int64_t bits,
                      int64_t offset, int64_t G, int64_t N, torch::Tensor bias, bool fma_dq) {
  TORCH_CHECK(x.dim() == 2 && (bits == 8 || bits == 4), "qlinear: x [M, K], bits 8 or 4");
  const int64_t M = x.size(0), K = x.size(1), NB = codes.size(0);
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kBlock && codes.size(1) == (bits == 8 ? K : K / 2),
              "qlinear: codes [NB, K (or K/2), 16] for this input width");
  TORCH_CHECK(G > 0 && K % G == 0 && G % 2 == 0, "qlinear: group size (divides K, even)");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == NB * (K / G) * kBlock, "qlinear: scale [NB, K/G, 16]");
  TORCH_CHECK(!minv.numel() || minv.sizes() == scale.sizes(), "qlinear: minv like scale");
  TORCH_CHECK(NB * kBlock >= N && (!bias.numel() || bias.numel() == N), "qlinear: N / bias");
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({M, N}, xf.options());
  if (M == 0) return y;
  const uint8_t* C = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* S = scale.data_ptr<float>();
  const float* Mn = minv.numel() ? minv.data_ptr<float>() : nullptr;
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const float* X = xf.data_ptr<float>();
  float* Y = y.data_ptr<float>();
#if defined(SPECFW_QISA_SIMD)
  // Weights dequantized in registers and used at once, by tiles of up to kMaxTile rows (near-equal:
  // 8 rows as 4 + 4); one row runs four blocks at once, two rows two. A block's codes stay in L1/L2
  // from one tile to the next, and each tile dequantizes them again. Against dequantizing a chunk
  // once into an L1 buffer that every 1-4-row tile read (before session 70), the demo's 120 Q4_1
  // linears (2 threads, AMD EPYC Zen 3, one process, interleaved) took 0.48x / 0.49x the time at
  // 3 / 4 rows, ~0.55-0.65x at 5-8 rows, 0.85-1.0x at 12-16; tiles of up to 6 rows against 4:
  // 5 rows 0.79-0.83x, 6 rows 0.81x, 16 rows 0.85-1.04x.
  // Above kRegisterRows rows (prompt prefills) every tile dequantizing again costs more than one
  // dequantization per chunk into L1 that every tile reads: the buffered path below took 0.69-0.79x
  // the register tiles' time at 32-128 rows, 1.0x at 16, 1.35x at 8 (same host and runs).
  if (M <= kRegisterRows) {
    const int64_t tiles = (M + kMaxTile - 1) / kMaxTile, base = M / tiles, extra = M % tiles;
    const int64_t nbk = M == 1 ? 4 : M == 2 ? 2 : 1, items = (NB + nbk - 1) / nbk;
    at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
      float part[6 * 4 * kBlock];
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i * nbk;
        int64_t m = 0;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t mr = base + (t < extra);
          fused_rows(mr, int(std::min<int64_t>(nbk, NB - b)), C, int(bits), int(offset), fma_dq, S, Mn, K, G, b, X + m * K, B, Y + m * N, N, part);
          m += mr;
        }
      }
    });
    return y;
  }
#endif
  const int64_t tiles = (M + kTile - 1) / kTile, base = M / tiles, extra = M % tiles;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(kChunk * kBlock), part(M * kBlock);
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t k1 = std::min(K, k0 + kChunk);
        dequant_chunk(C, int(bits), int(offset), fma_dq, S, Mn, K, G, b, k0, k1, buf.data());
        int64_t m = 0;
        for (int64_t t = 0; t < tiles; ++t) {
          const int mr = int(base + (t < extra));
          tile_rows(mr, buf.data(), k1 - k0, X + m * K + k0, K, part.data() + m * kBlock, k0 == 0);
          m += mr;
        }
      }
      const int64_t n0 = b * kBlock, nv = std::min<int64_t>(kBlock, N - n0);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t l = 0; l < nv; ++l) Y[m * N + n0 + l] = B ? part[m * kBlock + l] + B[n0 + l] : part[m * kBlock + l];
    }
  });
  return y;
}

// the fp32 weight [N, K] these codes stand for (tests, the module's .weight)
torch::Tensor dequantize(torch::Tensor codes, torch::Tensor scale, torch::Tensor minv, int64_t bits, int64_t offset,
                         int64_t G, int64_t K, int64_t N) {
  const int64_t NB = codes.size(0);
  auto out = torch::empty({NB, K, kBlock}, torch::kFloat32);
  const uint8_t* C = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  for (int64_t b = 0; b < NB; ++b)
    dequant_chunk(C, int(bits), int(offset), false, scale.data_ptr<float>(), minv.numel() ? minv.data_ptr<float>() : nullptr,
                  K, G, b, 0, K, out.data_ptr<float>() + b * K * kBlock);
  return out.transpose(1, 2).reshape({NB * kBlock, K}).slice(0, 0, N).contiguous();
}

// qlinear()'s address, for cpu_ops' one-call decoder layers (another extension in this process,
// on the same libtorch): they call it for each of a layer's four linears
int64_t linear_address() {
  return reinterpret_cast<int64_t>(&qlinear);
}

std::string isa() {
#if defined(__AVX512F__)
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
  m.def("qlinear", &qlinear, "batch-invariant weight-only quantized linear", nogil);
  m.def("dequantize", &dequantize, "the fp32 weight of packed codes");
  m.def("linear_address", &linear_address, "qlinear()'s address, for cpu_ops' one-call decoder layers");
  m.def("isa", &isa, "the instruction set this build targets");
}
