// specfw: a bfloat16 linear layer for CPUs with AVX512-BF16 (vdpbf16ps), written for decoding.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), fp32 accumulation, rounded once to bf16.
//
// Every output is reduced in one fixed order -- k pairs in sequence, each pair summed by one
// vdpbf16ps lane -- whatever the number of rows, the tile a row lands in or the thread that
// computes it, so a row's result never depends on the other rows of the call (batch invariant
// by construction). The weight is packed once: for each block of 16 outputs and each k pair,
// the 16 (w[n, 2p], w[n, 2p+1]) pairs side by side (64 bytes, one zmm load); a row's k pair is
// broadcast as one 32-bit value. At one to a few rows the kernel streams the weight once at
// memory speed; more rows reuse each loaded weight vector for up to 8 rows.
// Built with -fopenmp: at::parallel_for runs on torch's intra-op threads only then.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <type_traits>

namespace {

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
template <int MR, int NT, typename OUT>
inline void tile(const uint16_t* w, int64_t KP, const uint32_t* x, int64_t x_stride, const float* bias,
                 OUT* y, int64_t y_stride, int64_t n_valid) {
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < KP; ++p) {
    __m512bh wv[NT];
    for (int t = 0; t < NT; ++t)
      wv[t] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + (t * KP + p) * 2 * kLanes));
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

template <int NT, typename OUT>
void rows(int64_t M, const uint16_t* w, int64_t KP, const uint32_t* x, const float* bias, OUT* y,
          int64_t N, int64_t n_valid) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) tile<8, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid);
  switch (M - m) {
    case 7: tile<7, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid); break;
    case 6: tile<6, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid); break;
    case 5: tile<5, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid); break;
    case 4: tile<4, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid); break;
    case 3: tile<3, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid); break;
    case 2: tile<2, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid); break;
    case 1: tile<1, NT, OUT>(w, KP, x + m * KP, KP, bias, y + m * N, N, n_valid); break;
    default: break;
  }
}

// x [M, K] bf16; packed from pack(); bias fp32 [N] or empty -> y [M, N] bf16 (fp32 with f32_out:
// the sums before rounding; the greedy head's proxy logits)
torch::Tensor linear_out(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias, bool f32_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "linear: a 2-d bfloat16 input");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KP = packed.size(1);
  TORCH_CHECK((K + 1) / 2 == KP && NB * kLanes >= N, "linear: input width does not match the packed weight");
  if (K % 2) x = torch::constant_pad_nd(x, {0, 1});
  x = x.contiguous();
  auto y = torch::empty({M, N}, f32_out ? x.options().dtype(torch::kFloat32) : x.options());
  if (M == 0) return y;
  const uint16_t* W = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const uint32_t* X = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  auto run = [&](auto* Y) {
    const int64_t pairs = (NB + 1) / 2;   // work items: two blocks of 16 outputs (the last may be one)
    at::parallel_for(0, pairs, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = 2 * i, n0 = b * kLanes, n_valid = std::min<int64_t>(N - n0, 2 * kLanes);
        const float* bb = B ? B + n0 : nullptr;
        if (b + 1 < NB)
          rows<2>(M, W + b * KP * 2 * kLanes, KP, X, bb, Y + n0, N, n_valid);
        else
          rows<1>(M, W + b * KP * 2 * kLanes, KP, X, bb, Y + n0, N, n_valid);
      }
    });
  };
  if (f32_out) run(y.data_ptr<float>());
  else run(reinterpret_cast<uint16_t*>(y.data_ptr()));
  return y;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias) {
  return linear_out(x, packed, N, bias, false);
}

torch::Tensor linear_f32(torch::Tensor x, torch::Tensor packed, int64_t N) {
  return linear_out(x, packed, N, torch::empty({0}, x.options().dtype(torch::kFloat32)), true);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs: another Python thread (the overlap scheduler's
  // engine thread, the server's event loop) may run meanwhile; arguments and results are
  // converted with the GIL held
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("pack", &pack, "pack a [N, K] bf16 weight for linear()");
  m.def("linear", &linear, "batch-invariant bf16 linear (AVX512-BF16)", nogil);
  m.def("linear_f32", &linear_f32, "the same sums, returned in fp32 (no bias)", nogil);
}
