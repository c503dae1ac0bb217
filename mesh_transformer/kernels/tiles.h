// The register-blocked product tiles the kernels share, per instruction set: y [R, C] (+)= x [R, D]
// w [D, C] for a few rows R and a panel of columns C, the weight stored as float32, bfloat16 (its
// bits, uint16_t: widened exactly by a 16-bit shift) or int8 (the integer values), the products
// and sums float32 fused multiply-adds. `Product` covers any rows and columns with them.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace mesh_transformer {

// Weight element access, scalar and vector, per stored type.
inline float Scalar(const float* p) { return *p; }
inline float Scalar(const uint16_t* p) {
  const uint32_t wide = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

inline float Scalar(const int8_t* p) { return static_cast<float>(*p); }

__attribute__((target("avx512f"))) inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 Load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
__attribute__((target("avx512f"))) inline __m512 Load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
__attribute__((target("avx2"))) inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2"))) inline __m256 Load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
__attribute__((target("avx2"))) inline __m256 Load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

enum class Isa { kScalar, kAvx2, kAvx512 };

// The widest the CPU has, or narrower if $MESH_TRANSFORMER_KERNEL_ISA says so ("avx512bf16":
// without AMX, "avx512": without the bf16 pair products either, "avx2", "scalar": how the tests run
// every path on one machine).
inline const char* ForcedIsa() { return std::getenv("MESH_TRANSFORMER_KERNEL_ISA"); }

// Whether an ISA narrower than AVX-512 with its bf16 pair products is forced.
inline bool ForcedBelowBf16Pairs() {
  const char* forced = ForcedIsa();
  return forced != nullptr && std::strcmp(forced, "avx512bf16") != 0;
}

inline Isa Detect() {
  const char* forced = ForcedIsa();
  if (forced != nullptr && std::strcmp(forced, "scalar") == 0) return Isa::kScalar;
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (forced != nullptr && std::strcmp(forced, "avx2") == 0) return avx2 ? Isa::kAvx2 : Isa::kScalar;
  if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  return avx2 ? Isa::kAvx2 : Isa::kScalar;
}

// Whether bf16 x bf16 products can run as pair dot products (AVX-512-BF16's vdpbf16ps: two
// multiply-adds per float32 lane and instruction), unless an ISA is forced.
inline bool DetectBf16Pairs() {
  return !ForcedBelowBf16Pairs() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

constexpr int64_t kBlockRows = 6;  // R at most: 6 x 4 AVX-512 accumulators (24 of 32 registers)

template <typename W, int R, int C>
__attribute__((target("avx512f"))) void TileAvx512(const float* x, int64_t x_stride, const W* w, int64_t w_stride,
                                                   float* y, int64_t y_stride, int64_t depth, bool first) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * y_stride + 16 * c);
  }
  for (int64_t k = 0; k < depth; ++k) {
    const W* wk = w + k * w_stride;
    __m512 wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = Load16(wk + 16 * c);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * x_stride + k]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xr, wv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(y + r * y_stride + 16 * c, acc[r][c]);
  }
}

template <typename W, int R, int C>
__attribute__((target("avx2,fma"))) void TileAvx2(const float* x, int64_t x_stride, const W* w, int64_t w_stride,
                                                  float* y, int64_t y_stride, int64_t depth, bool first) {
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * y_stride + 8 * c);
  }
  for (int64_t k = 0; k < depth; ++k) {
    const W* wk = w + k * w_stride;
    __m256 wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = Load8(wk + 8 * c);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_set1_ps(x[r * x_stride + k]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xr, wv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(y + r * y_stride + 8 * c, acc[r][c]);
  }
}

// Columns [from, to) of the same tile, one at a time (the columns no vector covers, and the
// portable path).
template <typename W>
void TileScalar(const float* x, int64_t x_stride, const W* w, int64_t w_stride, float* y, int64_t y_stride,
                int64_t rows, int64_t from, int64_t to, int64_t depth, bool first) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = from; o < to; ++o) {
      float sum = first ? 0.0f : y[r * y_stride + o];
      for (int64_t k = 0; k < depth; ++k) sum += x[r * x_stride + k] * Scalar(w + k * w_stride + o);
      y[r * y_stride + o] = sum;
    }
  }
}

// Every ISA's tiles by [R - 1][C - 1], type-erased.
using TileFn = void (*)(const float*, int64_t, const void*, int64_t, float*, int64_t, int64_t, bool);

template <typename W, int R, int C>
void Avx512Tile(const float* x, int64_t xs, const void* w, int64_t ws, float* y, int64_t ys, int64_t d, bool f) {
  TileAvx512<W, R, C>(x, xs, static_cast<const W*>(w), ws, y, ys, d, f);
}
template <typename W, int R, int C>
void Avx2Tile(const float* x, int64_t xs, const void* w, int64_t ws, float* y, int64_t ys, int64_t d, bool f) {
  TileAvx2<W, R, C>(x, xs, static_cast<const W*>(w), ws, y, ys, d, f);
}

template <typename W>
struct Tiles {
  TileFn avx512[kBlockRows][4] = {};  // C up to 4 vectors of 16
  TileFn avx2[kBlockRows][2] = {};    // C up to 2 vectors of 8 (6 x 2 accumulators of 16 registers)
  Tiles() { Fill(std::make_integer_sequence<int, kBlockRows>{}); }
  template <int... Rs>
  void Fill(std::integer_sequence<int, Rs...>) {
    ((avx512[Rs][0] = &Avx512Tile<W, Rs + 1, 1>, avx512[Rs][1] = &Avx512Tile<W, Rs + 1, 2>,
      avx512[Rs][2] = &Avx512Tile<W, Rs + 1, 3>, avx512[Rs][3] = &Avx512Tile<W, Rs + 1, 4>,
      avx2[Rs][0] = &Avx2Tile<W, Rs + 1, 1>, avx2[Rs][1] = &Avx2Tile<W, Rs + 1, 2>), ...);
  }
};

// Columns per panel (and per SIMD vector) of each path.
inline int64_t Lanes(Isa isa) { return isa == Isa::kAvx512 ? 16 : isa == Isa::kAvx2 ? 8 : 1; }
inline int64_t PanelWidth(Isa isa) { return isa == Isa::kAvx2 ? 16 : 64; }

// y [rows, cols] (+)= x [rows, depth] w [depth, cols] (`first`: y is overwritten), every operand
// row-major with its own row stride: tiles of kBlockRows rows by a panel of PanelWidth columns,
// the columns no vector covers one at a time.
template <typename W>
void Product(Isa isa, const float* x, int64_t x_stride, const W* w, int64_t w_stride, float* y, int64_t y_stride,
             int64_t rows, int64_t cols, int64_t depth, bool first) {
  static const Tiles<W> tiles;
  for (int64_t o0 = 0; o0 < cols; o0 += PanelWidth(isa)) {
    const int64_t width = std::min(PanelWidth(isa), cols - o0);
    const int64_t vectors = isa == Isa::kScalar ? 0 : width / Lanes(isa);
    for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
      const int64_t block = std::min(kBlockRows, rows - r0);
      const float* xs = x + r0 * x_stride;
      float* ys = y + r0 * y_stride + o0;
      if (vectors > 0) {
        const TileFn tile = isa == Isa::kAvx512 ? tiles.avx512[block - 1][vectors - 1]
                                                : tiles.avx2[block - 1][vectors - 1];
        tile(xs, x_stride, w + o0, w_stride, ys, y_stride, depth, first);
      }
      TileScalar(xs, x_stride, w + o0, w_stride, ys, y_stride, block, vectors * Lanes(isa), width, depth, first);
    }
  }
}

// bf16 x bf16, as pair dot products: y [R, 32 C] (+)= x [R, D] w [D, 32 C], x and w bf16 bits,
// x's row holding D rounded up to even entries (the last one 0 where D is odd), each float32 lane
// summing x[k] w[k] + x[k+1] w[k+1] per instruction (both products exact in float32, as in the
// FMA tiles; denormals flushed). Two weight rows of 32 columns interleave by 16-bit unpacks, which
// work within 128-bit lanes: the low half's float32 lane 4l + i holds column 8l + i of the 32, the
// high half's column 8l + 4 + i; the accumulators are put back in column order on load and store.
__attribute__((target("avx512f"))) inline void ToPairOrder(__m512 y0, __m512 y1, __m512& lo, __m512& hi) {
  lo = _mm512_permutex2var_ps(y0, _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27), y1);
  hi = _mm512_permutex2var_ps(y0, _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31), y1);
}
__attribute__((target("avx512f"))) inline void ToColumnOrder(__m512 lo, __m512 hi, float* y) {
  _mm512_storeu_ps(y, _mm512_permutex2var_ps(lo, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21,
                                                                   22, 23), hi));
  _mm512_storeu_ps(y + 16, _mm512_permutex2var_ps(lo, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15,
                                                                        28, 29, 30, 31), hi));
}

template <int R, int C>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void TilePairs(const uint16_t* x, int64_t x_stride,
                                                                     const uint16_t* w, int64_t w_stride, float* y,
                                                                     int64_t y_stride, int64_t depth, bool first) {
  __m512 lo[R][C], hi[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) {
      const float* yc = y + r * y_stride + 32 * c;
      if (first) {
        lo[r][c] = hi[r][c] = _mm512_setzero_ps();
      } else {
        ToPairOrder(_mm512_loadu_ps(yc), _mm512_loadu_ps(yc + 16), lo[r][c], hi[r][c]);
      }
    }
  }
  for (int64_t k = 0; k < depth; k += 2) {
    __m512i wlo[C], whi[C];
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(w + k * w_stride + 32 * c);
      const __m512i b = k + 1 < depth ? _mm512_loadu_si512(w + (k + 1) * w_stride + 32 * c) : _mm512_setzero_si512();
      wlo[c] = _mm512_unpacklo_epi16(a, b);
      whi[c] = _mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * x_stride + k, sizeof pair);
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) {
        lo[r][c] = _mm512_dpbf16_ps(lo[r][c], xr, (__m512bh)wlo[c]);
        hi[r][c] = _mm512_dpbf16_ps(hi[r][c], xr, (__m512bh)whi[c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) ToColumnOrder(lo[r][c], hi[r][c], y + r * y_stride + 32 * c);
  }
}

using PairTileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t, bool);

struct PairTiles {
  PairTileFn tiles[kBlockRows][2] = {};  // [R - 1][C - 1]: C up to 2 chunks of 32 columns (a 64-column panel)
  PairTiles() { Fill(std::make_integer_sequence<int, kBlockRows>{}); }
  template <int... Rs>
  void Fill(std::integer_sequence<int, Rs...>) {
    ((tiles[Rs][0] = &TilePairs<Rs + 1, 1>, tiles[Rs][1] = &TilePairs<Rs + 1, 2>), ...);
  }
};

constexpr int64_t kPairPanel = 64;  // columns per panel of the pair tiles: 2 chunks of 32

// y [rows, cols] (+)= x [rows, depth] w [depth, cols] with pair tiles where 32 columns fit, the
// columns after them by `Product`'s float32 tiles: x both as bf16 pairs (`pairs`, even row
// stride) and widened (`wide`, the same values).
inline void PairProduct(const uint16_t* pairs, int64_t pairs_stride, const float* wide, int64_t wide_stride,
                        const uint16_t* w, int64_t w_stride, float* y, int64_t y_stride, int64_t rows, int64_t cols,
                        int64_t depth, bool first) {
  static const PairTiles table;
  for (int64_t o0 = 0; o0 < cols; o0 += kPairPanel) {
    const int64_t width = std::min(kPairPanel, cols - o0), chunks = width / 32;
    for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
      const int64_t block = std::min(kBlockRows, rows - r0);
      float* ys = y + r0 * y_stride + o0;
      if (chunks > 0) {
        table.tiles[block - 1][chunks - 1](pairs + r0 * pairs_stride, pairs_stride, w + o0, w_stride, ys, y_stride,
                                           depth, first);
      }
      if (width > 32 * chunks) {
        Product(Isa::kAvx512, wide + r0 * wide_stride, wide_stride, w + o0 + 32 * chunks, w_stride, ys + 32 * chunks,
                y_stride, block, width - 32 * chunks, depth, first);
      }
    }
  }
}

}  // namespace mesh_transformer
