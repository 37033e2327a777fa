// specfw: a bfloat16 linear layer on Intel AMX tiles (TDPBF16PS), written for decoding and tree
// verification, where one to a few dozen rows meet the whole weight.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), fp32 accumulation, rounded once to bf16.
//
// Batch invariant by construction: an output row is accumulated tile by tile along k, k-tiles
// in sequence, each by one TDPBF16PS whose result for row m depends only on row m of the A tile
// and on the B tile. The other rows of the call (their number, their values, the row group a
// row lands in) and the thread that computes a block never change a row's bits.
//
// Layout: the weight is packed exactly as bf16_dot.cpp packs it -- for each block of 16 outputs
// and each k pair, the 16 (w[n, 2p], w[n, 2p+1]) pairs side by side (64 bytes) -- which is the
// B-tile layout of TDPBF16PS: a B tile is 16 consecutive k pairs of one block (1 KB, stride 64).
// K pairs are padded to a multiple of 16 (zero weights), x's columns likewise (zero inputs).
// A work item is four blocks (64 outputs, four C tiles); rows run in groups of 16 (an A tile,
// zero padded; a call of fewer rows configures tiles of its own row count) inside it, so up to 16
// rows cost one pass over the weight, and more rows re-read only the item's weights, from L2.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "amx_tiles.h"
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;      // outputs per block (C tile columns)
constexpr int64_t kTilePairs = 16;  // k pairs per tile (32 bf16)
constexpr int kBlocksPerItem = 4;   // C tiles tmm0..tmm3; A in tmm4, B in tmm5..tmm6

using specfw_amx::TileConfig;
using specfw_amx::request_amx;

void configure(int rows) {   // A and C tiles of `rows` rows (1-16), B tiles of 16 k pairs
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 4; ++t) { cfg.rows[t] = rows; cfg.colsb[t] = 64; }   // C: rows x 16 fp32
  cfg.rows[4] = rows; cfg.colsb[4] = 64;                                   // A: rows x 32 bf16
  for (int t = 5; t < 7; ++t) { cfg.rows[t] = kTilePairs; cfg.colsb[t] = 64; }   // B: 16 pairs x 16 x 2
  specfw_amx::load_config(cfg);
}

// NB blocks (1..4) of 16 outputs against rows [m0, m0 + rows); x rows have xs bf16 elements
template <int NB>
void group(const uint16_t* w, int64_t KP, const uint16_t* x, int64_t xs, float* out /* [16][64] */) {
  _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (NB > 2) _tile_zero(2);
  if (NB > 3) _tile_zero(3);
  const int64_t bstride = KP * 2 * kLanes;   // elements between blocks
  for (int64_t p = 0; p < KP; p += kTilePairs) {
    _tile_loadd(4, x + 2 * p, xs * 2);
    const uint16_t* wb = w + p * 2 * kLanes;
    _tile_loadd(5, wb, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (NB > 1) { _tile_loadd(6, wb + bstride, 64); _tile_dpbf16ps(1, 4, 6); }
    if (NB > 2) { _tile_loadd(5, wb + 2 * bstride, 64); _tile_dpbf16ps(2, 4, 5); }
    if (NB > 3) { _tile_loadd(6, wb + 3 * bstride, 64); _tile_dpbf16ps(3, 4, 6); }
  }
  _tile_stored(0, out, 64 * 4);
  if (NB > 1) _tile_stored(1, out + 16, 64 * 4);
  if (NB > 2) _tile_stored(2, out + 32, 64 * 4);
  if (NB > 3) _tile_stored(3, out + 48, 64 * 4);
}

inline void write_rows(const float* acc, int rows, int64_t n_valid, const float* bias, uint16_t* y, int64_t N) {
  for (int r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < n_valid; c += kLanes) {
      const int64_t left = std::min<int64_t>(kLanes, n_valid - c);
      const __mmask16 mask = left == kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      __m512 v = _mm512_loadu_ps(acc + r * 64 + c);
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + c));
      _mm256_mask_storeu_epi16(reinterpret_cast<void*>(y + r * N + c), mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// w [N, K] bf16 -> [ceil(N/16), KP, 32] bf16 with KP = K/2 rounded up to a multiple of 16
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "pack: a 2-d bfloat16 weight");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t NB = (N + kLanes - 1) / kLanes;
  const int64_t KP = ((K + 1) / 2 + kTilePairs - 1) / kTilePairs * kTilePairs;
  auto padded = torch::constant_pad_nd(w.contiguous(), {0, 2 * KP - K, 0, NB * kLanes - N});
  return padded.view({NB, kLanes, KP, 2}).permute({0, 2, 1, 3}).contiguous().view({NB, KP, 2 * kLanes});
}

// x [M, K] bf16; packed from pack(); bias fp32 [N] or empty -> y [M, N] bf16
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor bias) {
  static const bool permitted = request_amx();
  TORCH_CHECK(permitted, "linear: the kernel did not get the AMX tile state (arch_prctl)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "linear: a 2-d bfloat16 input");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KP = packed.size(1);
  TORCH_CHECK(KP % kTilePairs == 0 && 2 * KP >= K && 2 * KP - K < 2 * kTilePairs && NB * kLanes >= N,
              "linear: input width does not match the packed weight");
  // x staged with zero padding to whole A tiles (16 rows past 16, 32-wide k; rows are independent: the
  // padding changes no row's bits) in a per-thread buffer: a torch pad op per call cost ~7 us on every linear
  const int64_t Mp = M <= 16 ? M : (M + 15) / 16 * 16, xs = 2 * KP;
  x = x.contiguous();
  thread_local std::vector<uint16_t> staged;
  staged.assign(Mp * xs, 0);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for (int64_t m = 0; m < M; ++m) std::memcpy(staged.data() + m * xs, src + m * K, K * sizeof(uint16_t));
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint16_t* W = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const uint16_t* X = staged.data();
  const float* B = bias.numel() ? bias.data_ptr<float>() : nullptr;
  uint16_t* Y = reinterpret_cast<uint16_t*>(y.data_ptr());
  // each thread a contiguous, near-equal range of blocks, run in items of up to four: whole items
  // dealt out left one thread an item more than the other on the 576-wide outputs (9 items), and
  // tiles of the call's own row count up to 16 (TDPBF16PS takes time by the rows configured).
  // bf16 demo's 120 layer linears + lm_head, alternated with the old build in one process (AMX
  // Xeon, family 6 model 167, session 64; same bits): 1-4 rows 0.94-0.95x the time, 8 rows 0.97x,
  // 16 rows 0.98x, 17-32 rows 0.98-0.99x (a last partial group on tiles of its own rows: no gain)
  const int tile_rows = int(std::min<int64_t>(16, M));
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float acc[16 * 64];
    configure(tile_rows);
    for (int64_t b = b0; b < b1; b += kBlocksPerItem) {
      const int64_t nb = std::min<int64_t>(kBlocksPerItem, b1 - b);
      const uint16_t* wb = W + b * KP * 2 * kLanes;
      const int64_t n0 = b * kLanes, n_valid = std::min<int64_t>(N - n0, nb * kLanes);
      // row groups inside the item: its 64 outputs' weights (K x 128 bytes) stay in L2 between groups
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const uint16_t* xr = X + m0 * xs;
        switch (nb) {
          case 4: group<4>(wb, KP, xr, xs, acc); break;
          case 3: group<3>(wb, KP, xr, xs, acc); break;
          case 2: group<2>(wb, KP, xr, xs, acc); break;
          default: group<1>(wb, KP, xr, xs, acc); break;
        }
        write_rows(acc, int(std::min<int64_t>(16, M - m0)), n_valid, B ? B + n0 : nullptr, Y + m0 * N + n0, N);
      }
    }
    _tile_release();
  });
  return y;
}

// linear()'s address, for cpu_ops' one-call decoder layers (another extension in this process, on
// the same libtorch): they call it for each of a layer's four linears
int64_t linear_address() {
  return reinterpret_cast<int64_t>(&linear);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs: another Python thread (the overlap scheduler's
  // engine thread, the server's event loop) may run meanwhile; arguments and results are
  // converted with the GIL held
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("pack", &pack, "pack a [N, K] bf16 weight for linear() (bf16_dot's layout, k padded to 32)");
  m.def("linear", &linear, "batch-invariant bf16 linear on AMX tiles", nogil);
  m.def("linear_address", &linear_address, "linear()'s address, for cpu_ops' one-call decoder layers");
}
