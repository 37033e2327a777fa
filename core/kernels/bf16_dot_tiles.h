// specfw: the vdpbf16ps tiles of bf16_dot.cpp, shared with cpu_ops.cpp's avx512 build where the
// CPU has AVX512-BF16 (its bf16 models' linears, KernelLinear and the one-call decoder layers).
// Included inside an anonymous namespace; needs <torch/extension.h>, <ATen/Parallel.h>,
// <immintrin.h>, <type_traits> and -mavx512bf16.
#pragma once

namespace dot {

constexpr int64_t kLanes = 16;

// w [N, K] bf16 -> [ceil(N/16), ceil(K/2), 32] bf16 (zero padded)
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "pack: a 2-d bfloat16 weight");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t NB = (N + kLanes - 1) / kLanes, KP = (K + 1) / 2;
  auto out = torch::zeros({NB, KP, 2 * kLanes}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t n = 0; n < N; ++n) {
    const int64_t b = n / kLanes, lane = n % kLanes;
    for (int64_t k = 0; k < K; ++k)
      dst[(b * KP + k / 2) * 2 * kLanes + 2 * lane + (k % 2)] = src[n * K + k];
  }
  return out;
}

// MR rows x NT blocks of 16 outputs; x rows are k-pair arrays (uint32 = two bf16)
// OUT: uint16_t (bf16, rounded once) or float (the fp32 sums as they are)
// pf (not null): the next work item's NT blocks, requested one line per block at every pf_every-th
// pair from pair pf_first on while this tile computes, so that they stream in under its arithmetic
// (without it a multi-row call waited for each item's weights, then computed: memory and arithmetic
// added up). One tile: every pair's lines; several (9+ rows, spread): tile j of J the pairs j, j + J,
// ..., so the requests come evenly over all the item's arithmetic, not in the first tile's time alone
template <int MR, int NT, typename OUT>
inline void tile(const uint16_t* w, int64_t KP, const uint32_t* x, int64_t x_stride, const float* bias,
                 OUT* y, int64_t y_stride, int64_t n_valid, const uint16_t* pf, int pf_every = 1, int pf_first = 0) {
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  int pf_wait = pf_first;
  for (int64_t p = 0; p < KP; ++p) {
    __m512bh wv[NT];
    for (int t = 0; t < NT; ++t)
      wv[t] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + (t * KP + p) * 2 * kLanes));
    if (pf) {
      if (pf_wait == 0)
        for (int t = 0; t < NT; ++t) _mm_prefetch(reinterpret_cast<const char*>(pf + (t * KP + p) * 2 * kLanes), _MM_HINT_T1);
      if (--pf_wait < 0) pf_wait = pf_every - 1;
    }
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * x_stride + p]));
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], wv[t], xv);
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t left = n_valid - t * kLanes;
    if (left <= 0) break;
    const __mmask16 mask = left >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + t * kLanes) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      const __m512 sum = _mm512_add_ps(acc[m][t], b);
      if constexpr (std::is_same<OUT, float>::value) {
        _mm512_mask_storeu_ps(y + m * y_stride + t * kLanes, mask, sum);
      } else {
        const __m256bh out = _mm512_cvtneps_pbh(sum);
        _mm256_mask_storeu_epi16(reinterpret_cast<void*>(y + m * y_stride + t * kLanes), mask, (__m256i)out);
      }
    }
  }
}

// spread: every full 8-row tile requests its share of the next item's lines (tile j of J: pairs j,
// j + J, ...), else the first tile all of them; a last partial tile none (its arithmetic is short: its
// share came in a burst). Whole bf16 forwards of the demo after a 400-token prefix (Zen 4 EPYC, family 25
// model 17, session 61, interleaved in one process): 16 rows 0.921-0.955x the first tile's time in four
// runs of six (0.992x and 0.996x in the others); 9 rows (8 + 1) 1.05-1.07x slower while the one-row tile took half
// (even since), 12 and 24 rows even. Prefetching never changes a bit.
template <int NT, typename OUT>
void rows(int64_t M, const uint16_t* w, int64_t KP, const uint32_t* x, const float* bias, OUT* y,
          int64_t N, int64_t n_valid, const uint16_t* pf, bool spread) {
  const int J = spread ? int(std::max<int64_t>(1, M / 8)) : 1;
  int64_t m = 0;
  int j = 0;
  for (; m + 8 <= M; m += 8, ++j) tile<8, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid, j < J ? pf : nullptr, J, j);
  const uint16_t* p = j < J ? pf : nullptr;
  switch (M - m) {
    case 7: tile<7, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid, p, J, j); break;
    case 6: tile<6, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid, p, J, j); break;
    case 5: tile<5, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid, p, J, j); break;
    case 4: tile<4, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid, p, J, j); break;
    case 3: tile<3, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid, p, J, j); break;
    case 2: tile<2, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid, p, J, j); break;
    case 1: tile<1, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid, p, J, j); break;
    default: break;
  }
}

// y [M, N] (OUT: bf16 rounded once, or fp32 sums) = x [M, 2 KP] (k pairs) . packed + bias; spread:
// as rows() says (cpu_ops passes its set_spread_prefetch setting)
template <typename OUT>
void linear_rows(int64_t M, const uint16_t* W, int64_t KP, int64_t NB, const uint32_t* X, const float* B, OUT* Y, int64_t N,
                 bool spread = false) {
  const int64_t pairs = (NB + 1) / 2;   // work items: two blocks of 16 outputs (the last may be one)
  at::parallel_for(0, pairs, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = 2 * i, n0 = b * kLanes, n_valid = std::min<int64_t>(N - n0, 2 * kLanes);
      const float* bb = B ? B + n0 : nullptr;
      const uint16_t* wb = W + b * KP * 2 * kLanes;
      const uint16_t* next = i + 1 < i1 && b + 3 < NB ? wb + 2 * KP * 2 * kLanes : nullptr;   // this thread's next item
      if (b + 1 < NB)
        rows<2>(M, wb, KP, X, bb, Y + n0, N, n_valid, next, spread);
      else
        rows<1>(M, wb, KP, X, bb, Y + n0, N, n_valid, next, spread);
    }
  });
}

}  // namespace dot
