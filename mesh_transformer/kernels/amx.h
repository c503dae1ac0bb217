// AMX (Intel's Advanced Matrix Extensions: Sapphire Rapids, Emerald Rapids and later Xeons): bf16
// rows times an inputs-last bf16 weight as tile products, for a bfloat16 model's decode step.
//
// Why: at 8-64 rows the AVX-512-BF16 pair dot products of `RowsDotWeight` are compute-bound (on
// an Emerald Rapids Xeon 16 rows read the weights at 5.6-6 GB/s, a third of its memory bandwidth),
// where one AMX tile product (TDPBF16PS) does 16 x 16 x 32 multiply-adds. torch's oneDNN runs its
// bf16 products on AMX; without this, a bf16 decode batch of 16 ran at 1.07x transformers there.
//
// How: y^T = w x^T a block at a time. The A tiles are 16 weight rows by 32 bf16 values of K, read
// where the weight lies (its rows are contiguous in K: inputs-last); the B tile is 16 pairs of K
// by 16 rows of x, from a copy of x made once per call in AMX's pair-interleaved layout (each
// group of 16 rows, the last padded with zero rows); a C tile holds 16 outputs x 16 rows in
// float32. Each task takes a chunk of weight rows: kAmxBlocks blocks of 16 at a time, every group
// of x's rows against them while they are in cache, then the next. Products of bf16 pairs are exact
// in float32 and summed in float32 (the instruction flushes denormals), so the result is the
// pair kernels' up to summation order.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "tiles.h"

namespace mesh_transformer {

constexpr int64_t kAmxRows = 16;    // rows of x per group (a C tile's columns)
constexpr int64_t kAmxDepth = 32;   // bf16 values of K per tile product
constexpr int64_t kAmxBlocks = 4;   // blocks of 16 weight rows per pass (C tiles 0-3)

// Whether this CPU has AMX-TILE and AMX-BF16, the OS saves their state (XCR0 bits 17-18) and lets
// this process use the tile data (Linux asks each process to request it: arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). Asked once per process; no ISA forced.
inline bool DetectAmx() {
  static const bool usable = [] {
    if (ForcedIsa() != nullptr) return false;
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = edx & (1u << 24), bf16 = edx & (1u << 22);
    if (!tile || !bf16 || !__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return false;  // OSXSAVE
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
#ifdef SYS_arch_prctl
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return usable;
}

// x [rows, K] bf16 -> its groups of kAmxRows rows, each [K / 2][kAmxRows][2]: the pairs of K of
// every row side by side, as a B tile reads them (zero rows past the last).
inline std::vector<uint32_t> AmxPairRows(const uint16_t* x, int64_t rows, int64_t k_size) {
  const int64_t groups = (rows + kAmxRows - 1) / kAmxRows, pairs = k_size / 2;
  std::vector<uint32_t> out(groups * pairs * kAmxRows, 0);
  for (int64_t b = 0; b < rows; ++b) {
    const auto* row = x + b * k_size;
    uint32_t* group = out.data() + (b / kAmxRows) * pairs * kAmxRows + b % kAmxRows;
    for (int64_t q = 0; q < pairs; ++q) {
      uint32_t pair;
      std::memcpy(&pair, row + 2 * q, sizeof(pair));
      group[q * kAmxRows] = pair;
    }
  }
  return out;
}

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (16 outputs x 16 rows, float32); 4-5: A (16 weight rows x 32 bf16); 6: B (16
// pairs x 16 rows).
inline AmxConfig AmxTiles() {
  AmxConfig config;
  for (int t = 0; t < 7; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  return config;
}

// A stored C tile c (y^T for 16 weight rows from o0 and a group's 16 rows) into y [rows, o_size]:
// the group's `valid` rows from row b0. (The tile instructions name their tiles by constants.)
inline void AmxScatter(const float (&c)[16][16], float* y, int64_t o_size, int64_t o0, int64_t b0, int64_t valid) {
  for (int64_t b = 0; b < valid; ++b) {
    float* yb = y + (b0 + b) * o_size + o0;
    for (int64_t i = 0; i < 16; ++i) yb[i] = c[i][b];
  }
}

// y[:, o0:o0 + 16 kBlocks] for every row of x (`pairs`: AmxPairRows(x)): C tiles 0 .. kBlocks-1,
// every group of x's rows against the same weight rows while they are in cache. (The tile
// instructions name their tiles by constants, hence a template of 4 or 1 blocks.)
template <int kBlocks>
__attribute__((target("amx-tile,amx-bf16"))) inline void AmxPass(const uint32_t* pairs, const uint16_t* w, float* y,
                                                                int64_t rows, int64_t k_size, int64_t o_size,
                                                                int64_t o0) {
  static_assert(kBlocks == 1 || kBlocks == kAmxBlocks);
  const int64_t stride = k_size * 2, group_pairs = k_size / 2 * kAmxRows;
  const uint16_t* w0 = w + o0 * k_size;
  alignas(64) float c[kBlocks][16][16];
  for (int64_t b0 = 0; b0 < rows; b0 += kAmxRows) {
    const uint32_t* group = pairs + b0 / kAmxRows * group_pairs;
    _tile_zero(0);
    if constexpr (kBlocks > 1) {
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t k = 0; k < k_size; k += kAmxDepth) {
      _tile_loadd(6, group + k / 2 * kAmxRows, 64);
      _tile_loadd(4, w0 + k, stride);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (kBlocks > 1) {
        _tile_loadd(5, w0 + 16 * k_size + k, stride);
        _tile_dpbf16ps(1, 5, 6);
        _tile_loadd(4, w0 + 32 * k_size + k, stride);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(5, w0 + 48 * k_size + k, stride);
        _tile_dpbf16ps(3, 5, 6);
      }
    }
    _tile_stored(0, c[0], 64);
    if constexpr (kBlocks > 1) {
      _tile_stored(1, c[1], 64);
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
    }
    for (int64_t i = 0; i < kBlocks; ++i) AmxScatter(c[i], y, o_size, o0 + 16 * i, b0, std::min(kAmxRows, rows - b0));
  }
}

// y[:, o_begin:o_end] for every row of x (`pairs`: AmxPairRows(x)), o_end - o_begin a multiple of
// 16 and k_size of kAmxDepth: passes of kAmxBlocks blocks, then single blocks. The tile
// configuration is loaded here and released when done: the thread may run other code between tasks.
__attribute__((target("amx-tile,amx-bf16"))) inline void AmxRowsDotWeight(const uint32_t* pairs, const uint16_t* w,
                                                                         float* y, int64_t rows, int64_t k_size,
                                                                         int64_t o_size, int64_t o_begin,
                                                                         int64_t o_end) {
  static const AmxConfig config = AmxTiles();
  _tile_loadconfig(&config);
  int64_t o0 = o_begin;
  for (; o0 + kAmxBlocks * 16 <= o_end; o0 += kAmxBlocks * 16) AmxPass<kAmxBlocks>(pairs, w, y, rows, k_size, o_size, o0);
  for (; o0 + 16 <= o_end; o0 += 16) AmxPass<1>(pairs, w, y, rows, k_size, o_size, o0);
  _tile_release();
}

}  // namespace mesh_transformer
