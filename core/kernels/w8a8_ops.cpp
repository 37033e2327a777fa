// specfw CPU kernels for linears with int8 weights, one scale per output channel, and int8
// activations, one scale per row: SGLang's w8a8_int8 form (model.activation_quantization =
// int8_token over model.quantization = int8). Unlike q8_ops.cpp's blocks of 32, whose scales
// need an fp32 step per block, a row's integer sum here runs over the whole input width, so AMX
// tiles (TDPBSSD: 16 rows x 16 outputs x 64 inputs an instruction) take it whole: a tree of 16
// rows costs about what one row does.
//
// Activations (quantize): each row on its own, dx = max|x| / 127, q = nearbyint(x * (1 / dx)) in
// -127..127 (one scalar routine for every build).
// Weights: int8 codes c[n, k] and fp32 d[n] (w ~ d * c), as the weight-only int8 scheme has them.
// Per (row m, output n):
//   P = sum_k q[m, k] * c[n, k]                 (int32, exact: the order does not matter)
//   y = fma(float(P), dx[m] * d[n], bias[n])    (dx * d rounded first; bias 0 without one)
// Every build (AMX tiles, AVX512-VNNI, AVX2, portable) performs exactly these roundings, so the
// builds agree bit for bit and no row's result depends on the rows beside it, the tiling or the
// thread: batch invariant by construction.
//
// Layout: codes int8 [NB, KC, 16, 64] with NB = ceil(N / 16) blocks of 16 outputs and KC =
// ceil(K / 64) chunks of 64 inputs (zero codes pad both): unit (block, chunk) is 1 KB, row i of
// it the 16 outputs' inputs 4i..4i+3 of the chunk ([o][t] = c[16 block + o, 64 chunk + 4 i + t]).
// That unit is a B tile of TDPBSSD as it lies, and each of its rows the weight operand of one
// vpdpbusd over 16 outputs (two AVX2 ymm of 8). A block's chunks lie one after another.
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
#endif
#if defined(SPECFW_W8A8_AMX)
#include "amx_tiles.h"
#endif

namespace {

constexpr int64_t kOut = 16;    // outputs per block
constexpr int64_t kChunk = 64;  // inputs per chunk
constexpr int64_t kUnit = kOut * kChunk;
constexpr int64_t kAhead = 8 * kUnit;  // bytes of codes fetched ahead by a tile that streams them (past the end: harmless)

struct Rows {
  const int8_t* q;    // [ceil(M / 16) * 16, KP], zero padded to KP = KC * 64 and to whole row groups of 16
  const float* dx;    // [M]
  const int32_t* qs;  // [M]: sum of the row's codes
  int64_t KP;
};

struct Out {
  float* y;           // [M, N]
  const float* d;     // [NB * 16], zero padded
  const float* bias;  // [N] or null
  int64_t N;
};

// the epilogue of one row and one block of 16 outputs from its int32 sums
inline void finish(const int32_t* P, int64_t m, int64_t n0, const Rows& x, const Out& o) {
  const int64_t left = std::min<int64_t>(kOut, o.N - n0);
#if defined(__AVX512F__)
  const __mmask16 mask = left == kOut ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
  const __m512 s = _mm512_mul_ps(_mm512_set1_ps(x.dx[m]), _mm512_loadu_ps(o.d + n0));
  const __m512 b = o.bias ? _mm512_maskz_loadu_ps(mask, o.bias + n0) : _mm512_setzero_ps();
  const __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(P)), s, b);
  _mm512_mask_storeu_ps(o.y + m * o.N + n0, mask, y);
#else
  for (int64_t j = 0; j < left; ++j) {
    const float s = x.dx[m] * o.d[n0 + j];
    o.y[m * o.N + n0 + j] = std::fma(float(P[j]), s, o.bias ? o.bias[n0 + j] : 0.f);
  }
#endif
}

#if defined(SPECFW_W8A8_AMX)
constexpr int kBlocksPerItem = 4;  // C tiles tmm0..tmm3; A in tmm4, B in tmm5..tmm6

using specfw_amx::TileConfig;
using specfw_amx::request_amx;

void configure(int rows) {  // 64-byte tiles: C rows x 16 int32, A rows x 64 codes (rows 1-16), B 16 quads x 16 x 4
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 7; ++t) { cfg.rows[t] = t < 5 ? rows : 16; cfg.colsb[t] = 64; }
  specfw_amx::load_config(cfg);
}

// NB blocks (1..4) from w, 16 staged rows from x -> int32 sums out [16][64]
template <int NB>
void group(const int8_t* w, int64_t KC, const int8_t* x, int64_t xs, int32_t* out) {
  _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (NB > 2) _tile_zero(2);
  if (NB > 3) _tile_zero(3);
  const int64_t bstride = KC * kUnit;
  for (int64_t c = 0; c < KC; ++c) {
    _tile_loadd(4, x + c * kChunk, xs);
    const int8_t* wc = w + c * kUnit;
    _tile_loadd(5, wc, 64);
    _tile_dpbssd(0, 4, 5);
    if (NB > 1) { _tile_loadd(6, wc + bstride, 64); _tile_dpbssd(1, 4, 6); }
    if (NB > 2) { _tile_loadd(5, wc + 2 * bstride, 64); _tile_dpbssd(2, 4, 5); }
    if (NB > 3) { _tile_loadd(6, wc + 3 * bstride, 64); _tile_dpbssd(3, 4, 6); }
  }
  _tile_stored(0, out, 64 * 4);
  if (NB > 1) _tile_stored(1, out + 16, 64 * 4);
  if (NB > 2) _tile_stored(2, out + 32, 64 * 4);
  if (NB > 3) _tile_stored(3, out + 48, 64 * 4);
}

void run(const int8_t* W, int64_t NB, int64_t KC, const Rows& x, int64_t M, const Out& o) {
  static const bool permitted = request_amx();
  TORCH_CHECK(permitted, "w8a8 linear: the kernel did not get the AMX tile state (arch_prctl)");
  const int8_t* X = x.q;  // whole A tiles: linear() zero-pads the rows to a multiple of 16
  // each thread a contiguous, near-equal range of blocks in items of up to four, on tiles of the
  // call's own row count up to 16, as bf16_amx.cpp: the demo's 120 layer shapes through W8A8Linear,
  // alternated with the old build (AMX Xeon, session 64; same bits): 0.93-0.99x the time at 1-32 rows
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) int32_t acc[16 * 64];
    configure(int(std::min<int64_t>(16, M)));
    for (int64_t b = b0; b < b1; b += kBlocksPerItem) {
      const int64_t nb = std::min<int64_t>(kBlocksPerItem, b1 - b);
      const int8_t* wb = W + b * KC * kUnit;
      // row groups inside the item: its 64 outputs' codes (K x 64 bytes) stay in L2 between groups
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int8_t* xr = X + m0 * x.KP;
        switch (nb) {
          case 4: group<4>(wb, KC, xr, x.KP, acc); break;
          case 3: group<3>(wb, KC, xr, x.KP, acc); break;
          case 2: group<2>(wb, KC, xr, x.KP, acc); break;
          default: group<1>(wb, KC, xr, x.KP, acc); break;
        }
        const int64_t rows = std::min<int64_t>(16, M - m0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < nb; ++j) {
            const int64_t n0 = (b + j) * kOut;
            if (n0 < o.N) finish(acc + r * 64 + j * kOut, m0 + r, n0, x, o);
          }
      }
    }
    _tile_release();
  });
}
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
// vpdpbusd multiplies unsigned by signed bytes: codes c go in as c + 128 (c ^ 0x80), and the
// 128 x (sum of the row's codes) that adds is where each sum starts from
constexpr int kTile = 8;  // rows per register tile
#define SPECFW_W8A8_TILE8 1

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int R>
void tile(const int8_t* w, int64_t KC, const Rows& x, int64_t r0, int32_t* out /* [R][16] */) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512i P[R];
  for (int r = 0; r < R; ++r) P[r] = _mm512_set1_epi32(-128 * x.qs[r0 + r]);
  for (int64_t c = 0; c < KC; ++c) {
    const int8_t* u = w + c * kUnit;
#pragma GCC unroll 2
    for (int i = 0; i < 16; ++i) {
      if (r0 == 0) _mm_prefetch(reinterpret_cast<const char*>(u + kAhead + i * 64), _MM_HINT_T0);  // the first tile streams the codes
      const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(u + i * 64), flip);
      for (int r = 0; r < R; ++r) P[r] = _mm512_dpbusd_epi32(P[r], wv, bcast4(x.q + (r0 + r) * x.KP + c * kChunk + 4 * i));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_si512(out + r * kOut, P[r]);
}
#elif defined(__AVX2__)
// vpmaddubsw multiplies unsigned by signed bytes: |c| by sign(q, c) (pairs <= 2 x 128 x 127: no
// int16 saturation), then vpmaddwd against ones sums pairs in int32
constexpr int kTile = 4;

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

template <int R>
void tile(const int8_t* w, int64_t KC, const Rows& x, int64_t r0, int32_t* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
  for (int64_t c = 0; c < KC; ++c) {
    const int8_t* u = w + c * kUnit;
#pragma GCC unroll 1
    for (int i = 0; i < 16; ++i) {
      if (r0 == 0) _mm_prefetch(reinterpret_cast<const char*>(u + kAhead + i * 64), _MM_HINT_T0);
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + i * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + i * 64 + 32));
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
      for (int r = 0; r < R; ++r) {
        const __m256i q = bcast4(x.q + (r0 + r) * x.KP + c * kChunk + 4 * i);
        lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(q, w0)), ones));
        hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(q, w1)), ones));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * kOut), lo[r]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * kOut + 8), hi[r]);
  }
}
#else
constexpr int kTile = 4;

template <int R>
void tile(const int8_t* w, int64_t KC, const Rows& x, int64_t r0, int32_t* out) {
  for (int r = 0; r < R; ++r) {
    const int8_t* q = x.q + (r0 + r) * x.KP;
    int32_t P[kOut] = {0};
    for (int64_t c = 0; c < KC; ++c)
      for (int i = 0; i < 16; ++i)
        for (int o = 0; o < kOut; ++o)
          for (int t = 0; t < 4; ++t) P[o] += int32_t(w[c * kUnit + i * 64 + o * 4 + t]) * int32_t(q[c * kChunk + 4 * i + t]);
    std::memcpy(out + r * kOut, P, sizeof(P));
  }
}
#endif

#if !defined(SPECFW_W8A8_AMX)
inline void tile_rows(int R, const int8_t* w, int64_t KC, const Rows& x, int64_t r0, int32_t* out) {
  switch (R) {
#if defined(SPECFW_W8A8_TILE8)
    case 8: tile<8>(w, KC, x, r0, out); break;
    case 7: tile<7>(w, KC, x, r0, out); break;
    case 6: tile<6>(w, KC, x, r0, out); break;
    case 5: tile<5>(w, KC, x, r0, out); break;
#endif
    case 4: tile<4>(w, KC, x, r0, out); break;
    case 3: tile<3>(w, KC, x, r0, out); break;
    case 2: tile<2>(w, KC, x, r0, out); break;
    default: tile<1>(w, KC, x, r0, out); break;
  }
}

void run(const int8_t* W, int64_t NB, int64_t KC, const Rows& x, int64_t M, const Out& o) {
  // rows in register tiles of up to kTile, as even as can be: a tree of 16 rows reads each block's codes twice
  const int64_t tiles = (M + kTile - 1) / kTile, base = M / tiles, extra = M % tiles;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) int32_t P[kTile * kOut];
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* wb = W + b * KC * kUnit;
      int64_t r0 = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int R = int(base + (t < extra));
        tile_rows(R, wb, KC, x, r0, P);
        for (int r = 0; r < R; ++r) finish(P + r * kOut, r0 + r, b * kOut, x, o);
        r0 += R;
      }
    }
  });
}
#endif

// each row's codes [KP] (zero padded), its scale dx and the sum of its codes. The SIMD loops give
// the scalar loop's bits: max is exact in any order, vcvtps2dq rounds half to even as nearbyint
// does (the default MXCSR mode), and integer sums are exact.
void quantize_row(const float* x, int64_t K, int64_t KP, int8_t* q, float* dx, int32_t* qs) {
  int64_t k = 0;
  float amax = 0.f;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  amax = _mm512_reduce_max_ps(vmax);
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float v : lanes) amax = std::max(amax, v);
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  int32_t sum = 0;
  k = 0;
#if defined(__AVX512F__)
  __m512i vsum = _mm512_setzero_si512();
  for (; k + 16 <= K; k += 16) {
    const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(c));
    vsum = _mm512_add_epi32(vsum, c);
  }
  sum = _mm512_reduce_add_epi32(vsum);
#elif defined(__AVX2__)
  __m256i vsum = _mm256_setzero_si256();
  alignas(32) int32_t codes[8];
  for (; k + 8 <= K; k += 8) {
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), _mm256_set1_ps(id)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes), c);
    for (int j = 0; j < 8; ++j) q[k + j] = int8_t(codes[j]);
    vsum = _mm256_add_epi32(vsum, c);
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(codes), vsum);
  for (int32_t v : codes) sum += v;
#endif
  for (; k < K; ++k) {
    const int32_t c = int32_t(std::nearbyint(x[k] * id));
    q[k] = int8_t(c);
    sum += c;
  }
  std::memset(q + K, 0, KP - K);
  *dx = d;
  *qs = sum;
}

}  // namespace

// w [N, K] int8 codes -> the layout above, int8 [ceil(N/16), ceil(K/64), 16, 64]
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8, "w8a8 pack: a 2-d int8 weight");
  const int64_t N = w.size(0), K = w.size(1), NB = (N + kOut - 1) / kOut, KC = (K + kChunk - 1) / kChunk;
  auto p = torch::constant_pad_nd(w.contiguous(), {0, KC * kChunk - K, 0, NB * kOut - N});
  // [NB, 16 o, KC, 16 i, 4 t] -> [NB, KC, 16 i, 16 o, 4 t]
  return p.view({NB, kOut, KC, 16, 4}).permute({0, 2, 3, 1, 4}).contiguous().view({NB, KC, 16, 64});
}

// x [M, K] fp32/bf16 -> (q int8 [M, K], dx fp32 [M]): the activation codes the kernel multiplies
std::tuple<torch::Tensor, torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2, "w8a8 quantize_rows: x [M, K]");
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  auto q = torch::empty({M, K}, torch::kInt8);
  auto dx = torch::empty({M}, torch::kFloat32);
  std::vector<int32_t> qs(M);
  for (int64_t m = 0; m < M; ++m) quantize_row(xf.data_ptr<float>() + m * K, K, K, q.data_ptr<int8_t>() + m * K, dx.data_ptr<float>() + m, &qs[m]);
  return {q, dx};
}

// x [M, K] fp32/bf16; codes from pack(); d fp32 [N] or more (per-channel scales); m must be empty
// and bits 8 (q8_ops.linear's signature, so that cpu_ops' one-call layers can call either);
// bias fp32 [N] or empty -> y [M, N] fp32
torch::Tensor linear(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t bits, int64_t N, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && bits == 8 && m.numel() == 0, "w8a8 linear: x [M, K], 8-bit codes, no m");
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == torch::kInt8 && codes.size(2) == 16 && codes.size(3) == 64 && codes.is_contiguous(),
              "w8a8 linear: codes [ceil(N/16), ceil(K/64), 16, 64] from pack()");
  const int64_t M = x.size(0), K = x.size(1), NB = codes.size(0), KC = codes.size(1);
  TORCH_CHECK(KC == (K + kChunk - 1) / kChunk && NB == (N + kOut - 1) / kOut, "w8a8 linear: input width or N does not match the codes");
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.numel() == NB * kOut, "w8a8 linear: d fp32 [ceil(N/16) * 16]");
  TORCH_CHECK(!bias.numel() || (bias.numel() == N && bias.scalar_type() == torch::kFloat32), "w8a8 linear: bias fp32 [N]");
  auto y = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return y;
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t KP = KC * kChunk;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> dx;
  thread_local std::vector<int32_t> qs;
  // whole A tiles of 16 rows for the amx build: the rows past M stay zero codes (rows are
  // independent, the padding changes no row), so its tiles load straight from this buffer
  const int64_t Mp = (M + 15) / 16 * 16;
  q.resize(Mp * KP);
  std::memset(q.data() + M * KP, 0, (Mp - M) * KP);
  dx.resize(M);
  qs.resize(M);
  // pointers, not the thread_local names: inside the parallel region those name each worker's own vectors
  const float* X = xf.data_ptr<float>();
  int8_t* Q = q.data();
  float* DX = dx.data();
  int32_t* QS = qs.data();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {  // a prompt's rows on every core; up to 16 rows on the caller
    for (int64_t r = r0; r < r1; ++r) quantize_row(X + r * K, K, KP, Q + r * KP, DX + r, QS + r);
  });
  const Rows rows{Q, DX, QS, KP};
  const Out out{y.data_ptr<float>(), d.data_ptr<float>(), bias.numel() ? bias.data_ptr<float>() : nullptr, N};
  run(codes.data_ptr<int8_t>(), NB, KC, rows, M, out);
  return y;
}

// linear()'s address, for cpu_ops' one-call decoder layers (q8_ops.linear's signature)
int64_t linear_address() {
  return reinterpret_cast<int64_t>(&linear);
}

std::string isa() {
#if defined(SPECFW_W8A8_AMX)
  return "amx";
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "avx512_vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs (the overlap scheduler's engine thread, the server's
  // event loop may run meanwhile); arguments and results are converted with the GIL held
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("pack", &pack, "int8 codes [N, K] in the kernel's layout");
  m.def("quantize_rows", &quantize_rows, "int8 codes and one scale of each row", nogil);
  m.def("linear", &linear, "batch-invariant linear: int8 activations per row x int8 weights per channel", nogil);
  m.def("linear_address", &linear_address, "linear()'s address, for cpu_ops' one-call decoder layers");
  m.def("isa", &isa, "the instruction set this build runs");
}
