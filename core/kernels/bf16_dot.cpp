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

#include "bf16_dot_tiles.h"

using dot::kLanes;
using dot::pack;

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
  auto run = [&](auto* Y) { dot::linear_rows(M, W, KP, NB, X, B, Y, N); };
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
