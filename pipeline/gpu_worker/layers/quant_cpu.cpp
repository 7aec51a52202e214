// Weight-only quantized matmul on the CPU, y [M, N] = x [M, K] @ W.T, computed in float32 (quant_cpu.py).
//
// W is held as integer codes in tiles of 16 output rows (quant_cpu.py's pack):
//   int4: codes [N/16, K, 8] uint8, byte j of (tile, k) = q[16t + j][k] | q[16t + j + 8][k] << 4, and
//         coefficients [N/16, G, 2, 16] float32 (a, b) per group so that w = q a + b;
//   int8: codes [N/16, K, 16] int8 and coefficients [N/16, G, 1, 16] float32, w = q a.
// A group is group_size consecutive input columns (G = K / group_size).
//
// Each task owns whole output tiles. For each block of KC input columns it dequantizes the tile's weights
// into a panel [KC, NB] floats that stays in L1, then runs every row of x against it with a register-blocked
// FMA micro-kernel (MR rows x NB columns of accumulators), so a weight is dequantized once per call, not
// once per row. Compiled with -march=native by quant_cpu.py: with AVX-512 the vectors are 16 floats and a
// tile pair makes the panel (NB = 32), with AVX2 + FMA they are 8 floats (NB = 16); without AVX2 + FMA
// nothing is compiled and `supported` says so.

// The narrow headers, not ATen/ATen.h: 40 % less compile time at first start.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PIPELINE_QUANT_SIMD 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PIPELINE_QUANT_VNNI 1
#endif
#endif

namespace {

#if defined(PIPELINE_QUANT_SIMD)

constexpr int64_t TILE = 16;  // output rows per code tile
constexpr int64_t KC = 256;   // input columns per dequantized panel: 16-32 KiB, within L1

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int W = 16;   // floats per vector
constexpr int MR = 12;  // rows per micro-kernel call: 24 accumulators + 2 weights + 1 broadcast of 32 registers
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
#else
using Vec = __m256;
constexpr int W = 8;
constexpr int MR = 6;  // 12 accumulators + 2 weights + 1 broadcast of 16 registers
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
#endif

constexpr int NV = 2;            // vectors per panel row
constexpr int64_t NB = NV * W;   // output columns per task tile (one or two code tiles)

// Dequantize code tile rows k0 .. k1 - 1 into panel rows 0 .. k1 - k0 - 1 (row stride NB floats). The group's
// coefficients are loaded once per group; a weight costs one FMA (int4) or one multiply (int8).
template <int BITS>
void dequantize_tile(const uint8_t* codes, const float* coef, int64_t group_size, int64_t k0, int64_t k1,
                     float* panel) {
  constexpr int64_t code_bytes = BITS == 4 ? 8 : 16, coef_floats = BITS == 4 ? 32 : 16;
  for (int64_t k = k0; k < k1;) {
    const int64_t g = k / group_size, end = std::min(k1, (g + 1) * group_size);
    const float* c = coef + g * coef_floats;
    const __m256 a0 = _mm256_loadu_ps(c), a1 = _mm256_loadu_ps(c + 8);
    const __m256 b0 = BITS == 4 ? _mm256_loadu_ps(c + 16) : a0, b1 = BITS == 4 ? _mm256_loadu_ps(c + 24) : a1;
    for (; k < end; ++k) {
      const uint8_t* q = codes + k * code_bytes;
      float* dst = panel + (k - k0) * NB;
      if constexpr (BITS == 4) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
        _mm256_storeu_ps(dst, _mm256_fmadd_ps(lo, a0, b0));
        _mm256_storeu_ps(dst + 8, _mm256_fmadd_ps(hi, a1, b1));
      } else {
        const __m256i q0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
        const __m256i q1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
        _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(q0), a0));
        _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(q1), a1));
      }
    }
  }
}

// Fully unrolled, so that the accumulator arrays live in registers (GCC keeps them on the stack otherwise).
#define PIPELINE_UNROLL _Pragma("GCC unroll 16")

// y[R, nv * W] (+)= x @ panel[kc, nv * W], x's R rows interleaved (x[k * R + i], see pack_rows). With few rows
// the FMA latency, not the throughput, would bound the loop, so U interleaved sets of accumulators cover
// consecutive input columns (summed at the end).
template <int R, int nv>
inline void micro(const float* x, const float* panel, int64_t kc, float* y, int64_t ldy, bool accumulate) {
  constexpr int U = R == 1 ? 4 : R <= 3 ? 2 : 1;
  Vec acc[U][R][nv];
  PIPELINE_UNROLL
  for (int u = 0; u < U; ++u)
    PIPELINE_UNROLL
    for (int i = 0; i < R; ++i)
      PIPELINE_UNROLL
      for (int j = 0; j < nv; ++j) acc[u][i][j] = u == 0 && accumulate ? vload(y + i * ldy + j * W) : vzero();
  int64_t k = 0;
  for (; k + U <= kc; k += U) {
    PIPELINE_UNROLL
    for (int u = 0; u < U; ++u) {
      Vec w[nv];
      PIPELINE_UNROLL
      for (int j = 0; j < nv; ++j) w[j] = vload(panel + (k + u) * NB + j * W);
      PIPELINE_UNROLL
      for (int i = 0; i < R; ++i) {
        const Vec xi = vbcast(x + (k + u) * R + i);
        PIPELINE_UNROLL
        for (int j = 0; j < nv; ++j) acc[u][i][j] = vfma(xi, w[j], acc[u][i][j]);
      }
    }
  }
  for (; k < kc; ++k)
    PIPELINE_UNROLL
    for (int i = 0; i < R; ++i) {
      const Vec xi = vbcast(x + k * R + i);
      PIPELINE_UNROLL
      for (int j = 0; j < nv; ++j) acc[0][i][j] = vfma(xi, vload(panel + k * NB + j * W), acc[0][i][j]);
    }
  PIPELINE_UNROLL
  for (int u = 1; u < U; ++u)
    PIPELINE_UNROLL
    for (int i = 0; i < R; ++i)
      PIPELINE_UNROLL
      for (int j = 0; j < nv; ++j) acc[0][i][j] = vadd(acc[0][i][j], acc[u][i][j]);
  PIPELINE_UNROLL
  for (int i = 0; i < R; ++i)
    PIPELINE_UNROLL
    for (int j = 0; j < nv; ++j) vstore(y + i * ldy + j * W, acc[0][i][j]);
}

// x [M, K] as blocks of MR rows (the last block holds the rest), each [K, rows] (row i of input column k at
// k * rows + i): a micro-kernel call then reads its rows' inputs as one contiguous stream, and the
// hardware prefetcher follows it, rather than MR streams K floats apart.
void pack_rows(const float* x, int64_t M, int64_t K, float* xp) {
  const int64_t full = M / MR;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t b = m / MR, i = m % MR, rows = b < full ? MR : M - full * MR;
    float* dst = xp + b * MR * K + i;
    for (int64_t k = 0; k < K; ++k) dst[k * rows] = x[m * K + k];
  }
}

// All M rows (packed by pack_rows) against the panel of input columns k0 .. k0 + kc - 1: full MR-row blocks,
// then the remaining rows in one call.
template <int nv>
void rows_times_panel(const float* xp, int64_t M, int64_t K, int64_t k0, const float* panel, int64_t kc, float* y,
                      int64_t N, bool accumulate) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) micro<MR, nv>(xp + m * K + k0 * MR, panel, kc, y + m * N, N, accumulate);
  const int64_t rows = M - m;
  const float* xr = xp + m * K + k0 * rows;
  float* yr = y + m * N;
  switch (rows) {
#define PIPELINE_TAIL(r) \
  case r:                \
    micro<r, nv>(xr, panel, kc, yr, N, accumulate); \
    break;
    PIPELINE_TAIL(1) PIPELINE_TAIL(2) PIPELINE_TAIL(3) PIPELINE_TAIL(4) PIPELINE_TAIL(5)
#if defined(__AVX512F__)
    PIPELINE_TAIL(6) PIPELINE_TAIL(7) PIPELINE_TAIL(8) PIPELINE_TAIL(9) PIPELINE_TAIL(10) PIPELINE_TAIL(11)
#endif
#undef PIPELINE_TAIL
    default:
      break;
  }
}

// y [M, N] = x @ W.T, x packed by pack_rows.
template <int BITS>
void matmul(const float* xp, int64_t M, int64_t K, const uint8_t* codes, const float* coef, int64_t N,
            int64_t group_size, float* y) {
  constexpr int64_t code_bytes = BITS == 4 ? 8 : 16, coef_floats = BITS == 4 ? 32 : 16;
  const int64_t groups = K / group_size, tiles = (N + NB - 1) / NB;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float panel[KC * NB];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NB, code_tiles = std::min(NB, N - n0) / TILE;
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = std::min(K, k0 + KC);
        for (int64_t c = 0; c < code_tiles; ++c) {
          const int64_t tile = n0 / TILE + c;
          dequantize_tile<BITS>(codes + tile * K * code_bytes, coef + tile * groups * coef_floats, group_size, k0,
                                k1, panel + c * TILE);
        }
        // With AVX-512 an odd last code tile fills half a panel row: one vector of it is used.
        if (code_tiles * TILE == NB)
          rows_times_panel<NV>(xp, M, K, k0, panel, k1 - k0, y + n0, N, k0 > 0);
        else
          rows_times_panel<1>(xp, M, K, k0, panel, k1 - k0, y + n0, N, k0 > 0);
      }
    }
  });
}

#endif  // PIPELINE_QUANT_SIMD

#if defined(PIPELINE_QUANT_VNNI)
// Integer dot products with int8 activations (quant_linear_vnni, AVX-512 VNNI): codes [N/16, K/4, 16, 4] uint8 for int8
// (c = q + 128: the instruction multiplies unsigned by signed bytes) and [N/16, K/8, 16, 4] for int4 (byte t of
// output j in block o: c[8o + t] | c[8o + 4 + t] << 4), with coefficients (a, b) [N/16, G, 2, 16] float32 so
// that w = c a + b; each 64-byte vector holds 4 (or 8) input columns of 16 outputs, lane j output j's.
namespace vnni {

constexpr int MR = 8;  // rows per call: 2 integer accumulators per row, 16 + 4 codes + 2 broadcasts

// Each row of x [M, K] in blocks of XB columns -> int8 codes xq [M, K] and, per (row, block), the scale s (max |x|
// / 127, x ~ s xq) and s sum(xq): with w = c a + b, a block's sum over k of w x is then a s sum(c xq) + b s sum(xq)
// = s sum(w xq), so its only error is the rounding of x.
template <class T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t XB, int8_t* xq, float* scale, float* scaled_sum) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k0 = 0, blk = m * (K / XB); k0 < K; k0 += XB, ++blk) {
        const T* row = x + m * K + k0;
        float amax = 0.f;
        for (int64_t k = 0; k < XB; ++k) amax = std::max(amax, std::abs(static_cast<float>(row[k])));
        const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        for (int64_t k = 0; k < XB; ++k) {
          const int32_t q = static_cast<int32_t>(std::nearbyint(static_cast<float>(row[k]) * inv));
          xq[m * K + k0 + k] = static_cast<int8_t>(q);
          sum += q;
        }
        scale[blk] = s;
        scaled_sum[blk] = s * static_cast<float>(sum);
      }
  });
}

// y[R, 32 or 16] = x @ W.T for one pair of code tiles (nv = 2) or one (nv = 1), over all K. Only the integer
// sums of the current block live in registers; each block's float contribution is added to y in memory (L1), so
// that more rows share each load and unpacking of the codes.
template <int BITS, int R, int nv>
inline void micro(const int8_t* xq, int64_t K, int64_t XB, const float* scale, const float* scaled_sum,
                  const uint8_t* codes, int64_t tile_bytes, const float* coef, int64_t group_size, float* y,
                  int64_t ldy) {
  const int64_t blocks = K / XB, groups = K / group_size;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    __m512i dot[R][nv];
    PIPELINE_UNROLL
    for (int i = 0; i < R; ++i)
      PIPELINE_UNROLL
      for (int j = 0; j < nv; ++j) dot[i][j] = _mm512_setzero_si512();
    const int64_t k_end = (blk + 1) * XB;
    for (int64_t k = blk * XB; k < k_end; k += BITS == 4 ? 8 : 4) {
      __m512i w[nv], w_hi[nv];
      PIPELINE_UNROLL
      for (int j = 0; j < nv; ++j) {
        const __m512i v = _mm512_loadu_si512(codes + j * tile_bytes + k * 2 * BITS);
        if constexpr (BITS == 4) {
          const __m512i low = _mm512_set1_epi8(15);
          w[j] = _mm512_and_si512(v, low);
          w_hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        } else {
          w[j] = v;
        }
      }
      PIPELINE_UNROLL
      for (int i = 0; i < R; ++i) {
        const int8_t* xi = xq + i * K + k;
        const __m512i x0 = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xi));
        PIPELINE_UNROLL
        for (int j = 0; j < nv; ++j) dot[i][j] = _mm512_dpbusd_epi32(dot[i][j], w[j], x0);
        if constexpr (BITS == 4) {
          const __m512i x1 = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xi + 4));
          PIPELINE_UNROLL
          for (int j = 0; j < nv; ++j) dot[i][j] = _mm512_dpbusd_epi32(dot[i][j], w_hi[j], x1);
        }
      }
    }
    const int64_t g = blk * XB / group_size;
    PIPELINE_UNROLL
    for (int j = 0; j < nv; ++j) {
      const float* c = coef + (j * groups + g) * 32;
      const __m512 a = _mm512_loadu_ps(c), b = _mm512_loadu_ps(c + 16);
      PIPELINE_UNROLL
      for (int i = 0; i < R; ++i) {
        const int64_t rb = i * blocks + blk;
        float* yi = y + i * ldy + j * 16;
        __m512 acc = _mm512_fmadd_ps(b, _mm512_set1_ps(scaled_sum[rb]), blk ? _mm512_loadu_ps(yi) : _mm512_setzero_ps());
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][j]), _mm512_mul_ps(a, _mm512_set1_ps(scale[rb])), acc);
        _mm512_storeu_ps(yi, acc);
      }
    }
  }
}

template <int BITS, int nv>
void rows(const int8_t* xq, int64_t M, int64_t K, int64_t XB, const float* scale, const float* scaled_sum,
          const uint8_t* codes, int64_t tile_bytes, const float* coef, int64_t group_size, float* y, int64_t N) {
  const int64_t blocks = K / XB;
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    micro<BITS, MR, nv>(xq + m * K, K, XB, scale + m * blocks, scaled_sum + m * blocks, codes, tile_bytes, coef,
                        group_size, y + m * N, N);
  const int64_t r = M - m;
  const int8_t* xr = xq + m * K;
  const float *sr = scale + m * blocks, *ssr = scaled_sum + m * blocks;
  switch (r) {
#define PIPELINE_TAIL(n)                                                                               \
  case n:                                                                                              \
    micro<BITS, n, nv>(xr, K, XB, sr, ssr, codes, tile_bytes, coef, group_size, y + m * N, N);         \
    break;
    PIPELINE_TAIL(1) PIPELINE_TAIL(2) PIPELINE_TAIL(3) PIPELINE_TAIL(4) PIPELINE_TAIL(5) PIPELINE_TAIL(6)
    PIPELINE_TAIL(7)
#undef PIPELINE_TAIL
    default:
      break;
  }
}

template <int BITS>
void matmul(const int8_t* xq, int64_t M, int64_t K, int64_t XB, const float* scale, const float* scaled_sum,
            const uint8_t* codes, const float* coef, int64_t N, int64_t group_size, float* y) {
  const int64_t tile_bytes = K * 16 * BITS / 8, tile_coef = K / group_size * 32, pairs = (N / 16 + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t t = 2 * p;
      const uint8_t* c = codes + t * tile_bytes;
      const float* cf = coef + t * tile_coef;
      if ((t + 1) * 16 < N)
        rows<BITS, 2>(xq, M, K, XB, scale, scaled_sum, c, tile_bytes, cf, group_size, y + t * 16, N);
      else
        rows<BITS, 1>(xq, M, K, XB, scale, scaled_sum, c, tile_bytes, cf, group_size, y + t * 16, N);
    }
  });
}

}  // namespace vnni
#endif  // PIPELINE_QUANT_VNNI

bool supported() {
#if defined(PIPELINE_QUANT_SIMD)
  return true;
#else
  return false;
#endif
}

// x [M, K] (float32, bfloat16 or float16; computed in float32) -> [M, N] in x's dtype.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& coef, int64_t bits,
                        int64_t group_size) {
  TORCH_CHECK(supported(), "quant_linear: compiled without AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2, "quant_linear: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == (bits == 4 ? 8 : 16) && codes.element_size() == 1 &&
                  codes.is_contiguous() && coef.is_contiguous() && coef.scalar_type() == at::kFloat,
              "quant_linear: codes [N/16, K, ", bits == 4 ? 8 : 16, "] bytes and float32 coefficients, contiguous, as ",
              "pack makes them");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0) * 16;
  TORCH_CHECK(codes.size(1) == K, "quant_linear: x has ", K, " columns, the weight ", codes.size(1));
  TORCH_CHECK(group_size > 0 && K % group_size == 0, "quant_linear: group size ", group_size, " does not divide ", K);
  TORCH_CHECK(coef.numel() == codes.size(0) * (K / group_size) * (bits == 4 ? 32 : 16),
              "quant_linear: coefficients do not match the codes' shape and group size");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, xf.options());
#if defined(PIPELINE_QUANT_SIMD)
  if (M > 0) {
    const auto* c = reinterpret_cast<const uint8_t*>(codes.data_ptr());
    at::Tensor xp = at::empty({M * K}, xf.options());
    pack_rows(xf.data_ptr<float>(), M, K, xp.data_ptr<float>());
    if (bits == 4)
      matmul<4>(xp.data_ptr<float>(), M, K, c, coef.data_ptr<float>(), N, group_size, y.data_ptr<float>());
    else
      matmul<8>(xp.data_ptr<float>(), M, K, c, coef.data_ptr<float>(), N, group_size, y.data_ptr<float>());
  }
#endif
  return y.to(x.scalar_type());
}

bool vnni_supported() {
#if defined(PIPELINE_QUANT_VNNI)
  return true;
#else
  return false;
#endif
}

// x [M, K] (float32 or bfloat16), rounded to int8 per row in blocks of block_size columns, times the weight in
// the layout above -> [M, N] in x's dtype.
at::Tensor quant_linear_vnni(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& coef, int64_t bits,
                              int64_t group_size, int64_t block_size) {
  TORCH_CHECK(vnni_supported(), "quant_linear_vnni: compiled without AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2, "quant_linear_vnni: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear_vnni: bits must be 4 or 8, got ", bits);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(codes.dim() == 4 && codes.size(1) * (bits == 4 ? 8 : 4) == K && codes.size(2) == 16 &&
                  codes.size(3) == 4 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  coef.is_contiguous() && coef.scalar_type() == at::kFloat,
              "quant_linear_vnni: codes [N/16, K/", bits == 4 ? 8 : 4, ", 16, 4] uint8 for ", K,
              " input columns and float32 coefficients, contiguous, as pack_vnni makes them");
  TORCH_CHECK(block_size % 16 == 0 && group_size % block_size == 0 && K % group_size == 0,
              "quant_linear_vnni: block size ", block_size, ", group size ", group_size, " and width ", K,
              " must nest (block a multiple of 16)");
  const int64_t N = codes.size(0) * 16;
  TORCH_CHECK(coef.numel() == N * (K / group_size) * 2,
              "quant_linear_vnni: coefficients do not match the codes' shape and group size");
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(PIPELINE_QUANT_VNNI)
  if (M > 0) {
    const at::Tensor xc = x.contiguous();
    const int64_t blocks = K / block_size;
    const std::unique_ptr<int8_t[]> xq(new int8_t[M * K]);
    const std::unique_ptr<float[]> scale(new float[M * blocks]), scaled_sum(new float[M * blocks]);
    if (x.scalar_type() == at::kBFloat16)
      vnni::quantize_rows(xc.data_ptr<at::BFloat16>(), M, K, block_size, xq.get(), scale.get(), scaled_sum.get());
    else
      vnni::quantize_rows(xc.to(at::kFloat).data_ptr<float>(), M, K, block_size, xq.get(), scale.get(),
                          scaled_sum.get());
    const auto* c = codes.data_ptr<uint8_t>();
    if (bits == 4)
      vnni::matmul<4>(xq.get(), M, K, block_size, scale.get(), scaled_sum.get(), c, coef.data_ptr<float>(), N,
                      group_size, y.data_ptr<float>());
    else
      vnni::matmul<8>(xq.get(), M, K, block_size, scale.get(), scaled_sum.get(), c, coef.data_ptr<float>(), N,
                      group_size, y.data_ptr<float>());
  }
#endif
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(pipeline_quant_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor codes, Tensor coef, int bits, int group_size) -> Tensor");
  m.def("supported() -> bool", &supported);
  m.def("quant_linear_vnni(Tensor x, Tensor codes, Tensor coef, int bits, int group_size, int block_size) -> Tensor");
  m.def("vnni_supported() -> bool", &vnni_supported);
}

TORCH_LIBRARY_IMPL(pipeline_quant_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_vnni", &quant_linear_vnni);
}
