// XLA FFI custom calls for XLA:CPU's decode steps: x [B, K] (float32) times w [K, O] (bfloat16 or
// float32) for few rows B, returned as P partial products [P, B, O] (float32) that the caller sums,
// or for a serving batch's rows register-blocked into one product (`blocked`, P = 1: Blocked);
// bf16 rows times a bf16 weight as pair dot products (Bf16Rows); 1-64 rows times an inputs-last
// weight [O, K] as dot products (RowsDotWeight, float32 or bf16 pairs); the same per
// group of a [G, M, K] x [G, K, O] product (attention over the KV cache); and moves of
// KV-cache slices and embedding rows (UpdateSlice in place, Slice, TakeRows, PutSlots; at the end).
//
// Why: decoding few rows reads every weight once per step, so the product should run at memory
// speed. XLA:CPU's own matmul kernels take no bfloat16 operands (it converts the whole weight to
// float32 first, and in a decode loop holds that copy for the call) and its YNNPACK path reads bf16
// weights at a third to a half of the memory bandwidth at 1-8 rows; its float32 matmul of 2-8
// rows reads weights at 60-80% of the bandwidth its one-row matrix-vector product reaches.
//
// How: P parts (threads of XLA's intra-op pool) take chunks of w's rows in turn and stream them
// whole (contiguous memory the hardware prefetches, plus a software prefetch ahead), eight weight
// rows per pass over a tile of the part's own partial product kept in cache, one from each of eight
// runs of consecutive rows (long streams). bf16 is widened to
// float32 exactly (a 16-bit shift); products and sums are float32 fused multiply-adds, so the
// result is a float32 matmul of the (widened) weight up to summation order. With bf16 rows (a
// bfloat16 model's) and AVX-512-BF16, the products run as pair dot products instead, two exact
// multiply-adds per float32 lane and instruction and no widening (Bf16Rows: streamed for a few
// rows, which on a Zen 4 were near compute-bound at one row; register-blocked beyond, tiles.h).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "threads.h"
#include "tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using mesh_transformer::Failed;
using mesh_transformer::OnThreads;
using namespace mesh_transformer;  // tiles.h

constexpr int64_t kRowsPerPass = 8;      // weight rows accumulated per pass over a tile (B loads
                                         // and stores of it per 8 weight vectors)
constexpr int64_t kTileFloats = 16384;   // one tile of a partial product, all B rows: 64 KiB
constexpr int64_t kPrefetchAhead = 512;  // weights ahead in each row
constexpr int64_t kChunksPerPart = 8;    // row chunks per part: a thread that starts late takes fewer
constexpr int64_t kMaxRows = 64;         // B at most (callers use few)

// One pass: acc[b][o] += sum_r x[b][r] * w_r[o] over the kRowsPerPass rows r, for o in [from, n).
template <typename W, typename X>
void PassScalar(float* acc, int64_t acc_stride, const W* const* w, const X* x, int64_t x_stride, int64_t rows,
                int64_t from, int64_t n) {
  for (int64_t b = 0; b < rows; ++b) {
    const X* xb = x + b * x_stride;
    float* yb = acc + b * acc_stride;
    for (int64_t o = from; o < n; ++o) {
      float sum = yb[o];
      for (int64_t r = 0; r < kRowsPerPass; ++r) sum += Scalar(xb + r) * Scalar(w[r] + o);
      yb[o] = sum;
    }
  }
}

// The same for o in [0, a multiple of 16): returns where it stopped.
template <typename W>
__attribute__((target("avx512f"))) int64_t PassAvx512(float* acc, int64_t acc_stride, const W* const* w,
                                                      const float* x, int64_t x_stride, int64_t rows, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(W);  // one prefetch per cache line of each row
  int64_t o = 0;
  for (; o + 16 <= n; o += 16) {
    if (o % kLine == 0) {
      for (int64_t r = 0; r < kRowsPerPass; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + o + kPrefetchAhead), _MM_HINT_T0);
      }
    }
    __m512 wv[kRowsPerPass];
    for (int64_t r = 0; r < kRowsPerPass; ++r) wv[r] = Load16(w[r] + o);
    for (int64_t b = 0; b < rows; ++b) {
      const float* xb = x + b * x_stride;
      float* yb = acc + b * acc_stride + o;
      __m512 y = _mm512_loadu_ps(yb);
      for (int64_t r = 0; r < kRowsPerPass; ++r) y = _mm512_fmadd_ps(_mm512_set1_ps(xb[r]), wv[r], y);
      _mm512_storeu_ps(yb, y);
    }
  }
  return o;
}

template <typename W>
__attribute__((target("avx2,fma"))) int64_t PassAvx2(float* acc, int64_t acc_stride, const W* const* w,
                                                     const float* x, int64_t x_stride, int64_t rows, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(W);
  int64_t o = 0;
  for (; o + 8 <= n; o += 8) {
    if (o % kLine == 0) {
      for (int64_t r = 0; r < kRowsPerPass; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + o + kPrefetchAhead), _MM_HINT_T0);
      }
    }
    __m256 wv[kRowsPerPass];
    for (int64_t r = 0; r < kRowsPerPass; ++r) wv[r] = Load8(w[r] + o);
    for (int64_t b = 0; b < rows; ++b) {
      const float* xb = x + b * x_stride;
      float* yb = acc + b * acc_stride + o;
      __m256 y = _mm256_loadu_ps(yb);
      for (int64_t r = 0; r < kRowsPerPass; ++r) y = _mm256_fmadd_ps(_mm256_set1_ps(xb[r]), wv[r], y);
      _mm256_storeu_ps(yb, y);
    }
  }
  return o;
}

template <typename W>
void Pass(Isa isa, float* acc, int64_t acc_stride, const W* const* w, const float* x, int64_t x_stride,
          int64_t rows, int64_t n) {
  int64_t done = 0;
  if (isa == Isa::kAvx512) done = PassAvx512(acc, acc_stride, w, x, x_stride, rows, n);
  if (isa == Isa::kAvx2) done = PassAvx2(acc, acc_stride, w, x, x_stride, rows, n);
  PassScalar(acc, acc_stride, w, x, x_stride, rows, done, n);
}

// out [B, O] += x[:, k_begin:k_end] w[k_begin:k_end, :], one tile of columns at a time:
// `pass(acc, acc_stride, w_rows, x, x_stride, rows, n)` per kRowsPerPass weight rows. The rows are
// read as kRowsPerPass runs of consecutive rows at once, one row of each run per pass, so each of
// the pass's streams continues where it stopped (8 adjacent rows per pass are streams that end and
// restart every row; see `RowsDotWeight` for what long streams are worth); x's values for the
// pass's rows are gathered (0 where a run has no row left).
template <typename W, typename X, typename PassFn>
void Accumulate(const X* x, const W* w, float* out, int64_t rows, int64_t k_size, int64_t o_size, int64_t k_begin,
                int64_t k_end, PassFn pass) {
  const int64_t tile = std::max<int64_t>(64, kTileFloats / rows / 64 * 64);
  const int64_t run = (k_end - k_begin + kRowsPerPass - 1) / kRowsPerPass;
  for (int64_t t0 = 0; t0 < o_size; t0 += tile) {
    const int64_t n = std::min(o_size, t0 + tile) - t0;
    for (int64_t i = 0; i < run; ++i) {
      const W* w_rows[kRowsPerPass];
      X gathered[kRowsPerPass * kMaxRows];
      for (int64_t r = 0; r < kRowsPerPass; ++r) {
        const int64_t k = k_begin + r * run + i;
        w_rows[r] = w + std::min(k, k_end - 1) * o_size + t0;
        for (int64_t b = 0; b < rows; ++b) gathered[b * kRowsPerPass + r] = k < k_end ? x[b * k_size + k] : X{0};
      }
      pass(out + t0, o_size, w_rows, gathered, kRowsPerPass, rows, n);
    }
  }
}

// The same with float32 x and this ISA's passes.
template <typename W>
void Accumulate(Isa isa, const float* x, const W* w, float* out, int64_t rows, int64_t k_size, int64_t o_size,
                int64_t k_begin, int64_t k_end) {
  Accumulate(x, w, out, rows, k_size, o_size, k_begin, k_end,
             [isa](float* acc, int64_t acc_stride, const W* const* w_rows, const float* xs, int64_t x_stride,
                   int64_t n_rows, int64_t n) { Pass(isa, acc, acc_stride, w_rows, xs, x_stride, n_rows, n); });
}

// bf16 rows and weight as pair dot products (AVX-512-BF16): the same pass over the 8 weight rows
// as 4 pairs, 32 columns at a time, whose sums the tile keeps in pair order (tiles.h's TilePairs:
// per 32 columns the low then the high half); the columns after the last 32 one at a time, in
// column order. Returns where the pairs stopped.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) int64_t PassPairs(float* acc, int64_t acc_stride,
                                                                        const uint16_t* const* w, const uint16_t* x,
                                                                        int64_t x_stride, int64_t rows, int64_t n) {
  int64_t o = 0;
  for (; o + 32 <= n; o += 32) {
    for (int64_t r = 0; r < kRowsPerPass; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + o + kPrefetchAhead), _MM_HINT_T0);
    }
    __m512i lo[kRowsPerPass / 2], hi[kRowsPerPass / 2];
    for (int64_t q = 0; q < kRowsPerPass / 2; ++q) {
      const __m512i a = _mm512_loadu_si512(w[2 * q] + o), b = _mm512_loadu_si512(w[2 * q + 1] + o);
      lo[q] = _mm512_unpacklo_epi16(a, b);
      hi[q] = _mm512_unpackhi_epi16(a, b);
    }
    for (int64_t b = 0; b < rows; ++b) {
      const uint16_t* xb = x + b * x_stride;
      float* yb = acc + b * acc_stride + o;
      __m512 ylo = _mm512_loadu_ps(yb), yhi = _mm512_loadu_ps(yb + 16);
      for (int64_t q = 0; q < kRowsPerPass / 2; ++q) {
        int32_t pair;
        std::memcpy(&pair, xb + 2 * q, sizeof pair);
        const __m512bh xq = (__m512bh)_mm512_set1_epi32(pair);
        ylo = _mm512_dpbf16_ps(ylo, xq, (__m512bh)lo[q]);
        yhi = _mm512_dpbf16_ps(yhi, xq, (__m512bh)hi[q]);
      }
      _mm512_storeu_ps(yb, ylo);
      _mm512_storeu_ps(yb + 16, yhi);
    }
  }
  return o;
}

// The same with bf16 x as PassPairs, the sums of each full 32 columns left in pair
// order (`InColumnOrder` puts them back).
void AccumulatePairs(const uint16_t* x, const uint16_t* w, float* out, int64_t rows, int64_t k_size, int64_t o_size,
                     int64_t k_begin, int64_t k_end) {
  Accumulate(x, w, out, rows, k_size, o_size, k_begin, k_end,
             [](float* acc, int64_t acc_stride, const uint16_t* const* w_rows, const uint16_t* xs, int64_t x_stride,
                int64_t n_rows, int64_t n) {
               const int64_t done = PassPairs(acc, acc_stride, w_rows, xs, x_stride, n_rows, n);
               PassScalar(acc, acc_stride, w_rows, xs, x_stride, n_rows, done, n);
             });
}

// Each full 32 columns of y [B, O] from pair order back to column order.
__attribute__((target("avx512f"))) void InColumnOrder(float* y, int64_t rows, int64_t o_size) {
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t o = 0; o + 32 <= o_size; o += 32) {
      float* yo = y + b * o_size + o;
      ToColumnOrder(_mm512_loadu_ps(yo), _mm512_loadu_ps(yo + 16), yo);
    }
  }
}

// Many rows (a serving batch): a register-blocked product. Each thread takes panels of w's columns
// in turn; per block of kDepth weight rows (kept in cache while every row block reads them) a tile
// of R rows x C vectors of columns sums its products in registers (R x C accumulators, C weight
// vectors loaded and widened per weight row for R x C fused multiply-adds) and adds them to y.
constexpr int64_t kDepth = 256;  // weight rows per block: 64 KiB of a 64-column float32 panel

// y [B, O] = x [B, K] w [K, O] for the columns of panel p.
template <typename W>
void BlockedPanel(Isa isa, const float* x, const W* w, float* y, int64_t rows, int64_t k_size, int64_t o_size,
                  int64_t p) {
  const int64_t o0 = p * PanelWidth(isa), width = std::min(o_size, o0 + PanelWidth(isa)) - o0;
  for (int64_t k0 = 0; k0 < k_size; k0 += kDepth) {
    Product(isa, x + k0, k_size, w + k0 * o_size + o0, o_size, y + o0, o_size, rows, width,
            std::min(kDepth, k_size - k0), k0 == 0);
  }
}

template <typename W>
ffi::Future Blocked(ffi::ThreadPool& pool, Isa isa, const float* x, const W* w, float* y, int64_t rows,
                    int64_t k_size, int64_t o_size) {
  const int64_t n_panels = (o_size + PanelWidth(isa) - 1) / PanelWidth(isa);
  return InTurn(pool, n_panels, [=](int64_t p) { BlockedPanel(isa, x, w, y, rows, k_size, o_size, p); });
}

// Streamed: chunks of w's K rows (each a multiple of kRowsPerPass but the last) go in order to
// whichever of the n_parts threads asks next; each part sums its chunks into its own [rows, O]
// output of out [P, rows, O], zeroed first (a part that gets none adds 0), by `accumulate(own,
// k_begin, k_end)`, then calls `finish(own)`.
template <typename AccumulateFn, typename FinishFn = void (*)(float*)>
ffi::Future Streamed(ffi::ThreadPool& pool, int64_t n_parts, int64_t rows, int64_t k_size, int64_t o_size, float* out,
                     AccumulateFn accumulate, FinishFn finish = [](float*) {}) {
  struct Shared {
    std::atomic<int64_t> next{0};
  };
  auto shared = std::make_shared<Shared>();
  const int64_t chunk =
      std::max<int64_t>(kRowsPerPass, k_size / (kChunksPerPart * n_parts) / kRowsPerPass * kRowsPerPass);
  const int64_t n_chunks = (k_size + chunk - 1) / chunk;
  return OnThreads(pool, n_parts, [=](int64_t p) {
    float* own = out + p * rows * o_size;
    std::fill(own, own + rows * o_size, 0.0f);
    for (int64_t c = shared->next.fetch_add(1); c < n_chunks; c = shared->next.fetch_add(1)) {
      accumulate(own, c * chunk, std::min(k_size, (c + 1) * chunk));
    }
    finish(own);
  });
}

template <typename W>
ffi::Future RowsTimesWeight(ffi::ThreadPool pool, const float* x, int64_t x_count, const W* w, int64_t k_size,
                            int64_t o_size, float* out, int64_t n_parts, int64_t rows, bool blocked) {
  static const Isa isa = Detect();
  if (rows < 1 || x_count != rows * k_size) return Failed("rows x weight: x must be [B, K] with B >= 1");
  if (blocked) {
    if (n_parts != 1) return Failed("rows x weight: the blocked product has one part");
    return Blocked(pool, isa, x, w, out, rows, k_size, o_size);
  }
  if (rows > kMaxRows) return Failed("rows x weight: at most 64 rows streamed");
  return Streamed(pool, n_parts, rows, k_size, o_size, out, [=](float* own, int64_t k_begin, int64_t k_end) {
    Accumulate(isa, x, w, own, rows, k_size, o_size, k_begin, k_end);
  });
}

// bf16 rows times a bf16 weight, register-blocked as `Blocked`: with pair dot products
// (`PairProduct`) where the CPU has them, else float32 tiles on the widened rows. x is copied once
// per call, widened, and for the pairs into rows of even length (a zero after an odd K).
ffi::Future BlockedBf16(ffi::ThreadPool& pool, Isa isa, bool pairs, const uint16_t* x, const uint16_t* w, float* y,
                        int64_t rows, int64_t k_size, int64_t o_size) {
  struct Rows {
    std::vector<uint16_t> pairs;
    std::vector<float> wide;
  };
  auto shared = std::make_shared<Rows>();
  const int64_t stride = k_size + k_size % 2;
  if (pairs) shared->pairs.assign(rows * stride, 0);
  shared->wide.resize(rows * k_size);
  for (int64_t b = 0; b < rows; ++b) {
    if (pairs) std::copy(x + b * k_size, x + (b + 1) * k_size, shared->pairs.data() + b * stride);
    for (int64_t k = 0; k < k_size; ++k) shared->wide[b * k_size + k] = Scalar(x + b * k_size + k);
  }
  const int64_t panel = pairs ? kPairPanel : PanelWidth(isa);
  const int64_t n_panels = (o_size + panel - 1) / panel;
  return InTurn(pool, n_panels, [=](int64_t p) {
    const int64_t o0 = p * panel, width = std::min(o_size, o0 + panel) - o0;
    for (int64_t k0 = 0; k0 < k_size; k0 += kDepth) {
      const int64_t depth = std::min(kDepth, k_size - k0);
      const uint16_t* wk = w + k0 * o_size + o0;
      if (pairs) {
        PairProduct(shared->pairs.data() + k0, stride, shared->wide.data() + k0, k_size, wk, o_size, y + o0, o_size,
                    rows, width, depth, k0 == 0);
      } else {
        Product(isa, shared->wide.data() + k0, k_size, wk, o_size, y + o0, o_size, rows, width, depth, k0 == 0);
      }
    }
  });
}

// Arguments as Bf16's with x bf16: streamed (pair products only; P parts) or blocked (P = 1; pair
// products where the CPU has them, else float32 tiles of the widened rows).
ffi::Future Bf16Rows(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                     ffi::ResultBuffer<ffi::F32> parts, bool blocked) {
  static const Isa isa = Detect();
  static const bool pairs = DetectBf16Pairs();
  const auto dims = parts->dimensions();
  const int64_t n_parts = dims[0], rows = dims[1], k_size = w.dimensions()[0], o_size = w.dimensions()[1];
  if (rows < 1 || x.element_count() != rows * k_size) return Failed("bf16 rows x weight: x must be [B, K], B >= 1");
  const auto* xs = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const auto* ws = reinterpret_cast<const uint16_t*>(w.untyped_data());
  if (blocked) {
    if (n_parts != 1) return Failed("bf16 rows x weight: the blocked product has one part");
    return BlockedBf16(pool, isa, pairs, xs, ws, parts->typed_data(), rows, k_size, o_size);
  }
  if (!pairs) return Failed("bf16 rows x weight: streamed pair products need AVX-512-BF16");
  if (rows > kMaxRows) return Failed("bf16 rows x weight: at most 64 rows streamed");
  // Streamed with pair products, each part's sums put back in column order when it is done.
  return Streamed(
      pool, n_parts, rows, k_size, o_size, parts->typed_data(),
      [=](float* own, int64_t k_begin, int64_t k_end) { AccumulatePairs(xs, ws, own, rows, k_size, o_size, k_begin, k_end); },
      [=](float* own) { InColumnOrder(own, rows, o_size); });
}

ffi::Future Bf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                 ffi::ResultBuffer<ffi::F32> parts, bool blocked) {
  const auto dims = parts->dimensions();
  return RowsTimesWeight(pool, x.typed_data(), x.element_count(), reinterpret_cast<const uint16_t*>(w.untyped_data()),
                         w.dimensions()[0], w.dimensions()[1], parts->typed_data(), dims[0], dims[1], blocked);
}

// float32 and int8 weights (int8: weight-only quantization, the product of the integer values,
// which the caller scales per output column).
template <ffi::DataType T>
ffi::Future Typed(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<T> w, ffi::ResultBuffer<ffi::F32> parts,
                  bool blocked) {
  const auto dims = parts->dimensions();
  return RowsTimesWeight(pool, x.typed_data(), x.element_count(), w.typed_data(), w.dimensions()[0],
                         w.dimensions()[1], parts->typed_data(), dims[0], dims[1], blocked);
}

// Inputs-last weights (`Generator(matvec=True)`: decoding a few rows): y [B, O] = x [B, K] w [O, K]^T
// for 1-4 rows, each output the dot product of x's rows with one contiguous weight row. Threads
// take chunks of weight rows in turn; a chunk is read as kDotBlock runs of consecutive rows at once,
// one row of each run per block (4 long sequential streams: a Zen 4 core's reads reach 29 GB/s
// over 4 such streams and 15 GB/s over one; blocks of 4 adjacent rows, streams of 2 KiB that end
// and restart, read at 20 GB/s on two cores where these read at 34-37). Per block every row of x
// is read once per 16 (float32) or 32 (bf16) elements and multiplied into kDotBlock x B
// accumulators, each reduced to a sum at the end of the row. No partial products to load and
// store, and nothing to unpack: a bf16 weight row's consecutive pairs are the pairs vdpbf16ps takes.
// With 8 rows of x or more a block takes several passes computing from cache, which share the
// fetching of the next block's rows into L2, so memory and arithmetic overlap (Zen 4, LLaMA-shaped
// decode, the second pass fetching them all: bf16 batch 8 / 16 +21% / +19%, fp32 +9% / +17%; every
// pass a share: Emerald Rapids, fp32 16 rows out of cache +17-24%, GPT-J batch 16 +17-33%).
constexpr int64_t kDotBlock = 4;        // rows per block, one from each run
constexpr int64_t kDotGroup = 4;        // rows of x per pass over a block
constexpr int64_t kDotMaxRows = 64;     // B at most
constexpr int64_t kDotChunkRows = 256;  // weight rows per chunk a thread takes: 4 runs of 64

// Vector steps per element type: float32 multiply-adds, or bf16 pair dot products.
struct F32Dot {
  using T = float;
  static constexpr int64_t kStep = 16;
  __attribute__((target("avx512f"))) static __m512i Load(const T* p, int64_t n) {
    return n >= kStep ? _mm512_castps_si512(_mm512_loadu_ps(p))
                      : _mm512_castps_si512(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p));
  }
  __attribute__((target("avx512f"))) static __m512 Madd(__m512 acc, __m512i x, __m512i w) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(w), acc);
  }
};

struct PairsDot {
  using T = uint16_t;
  static constexpr int64_t kStep = 32;
  __attribute__((target("avx512f,avx512bw"))) static __m512i Load(const T* p, int64_t n) {
    return n >= kStep ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
  }
  __attribute__((target("avx512f,avx512bf16"))) static __m512 Madd(__m512 acc, __m512i x, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
  }
};

#define MESH_TRANSFORMER_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

// One step of DotBlock: acc[b][j] += x[b][k .. k+n) . wr[j][k .. k+n) (n <= Dot::kStep: a masked
// load zeroes what lies past it), with kPrefetch a cache line of each of `next[0:n_next]` fetched.
template <typename Dot, int B, bool kPrefetch>
MESH_TRANSFORMER_DOT_TARGET __attribute__((always_inline)) inline void DotStep(
    __m512 (&acc)[B][kDotBlock], const typename Dot::T* x, int64_t k_size, const typename Dot::T* const* wr,
    int64_t k, int64_t n, const typename Dot::T* const* next, int64_t n_next) {
  if constexpr (kPrefetch) {
    for (int64_t j = 0; j < n_next; ++j) _mm_prefetch(reinterpret_cast<const char*>(next[j] + k), _MM_HINT_T1);
  }
  __m512i wv[kDotBlock];
  for (int64_t j = 0; j < kDotBlock; ++j) wv[j] = Dot::Load(wr[j] + k, n);
  for (int b = 0; b < B; ++b) {
    const __m512i xv = Dot::Load(x + b * k_size + k, n);
    for (int64_t j = 0; j < kDotBlock; ++j) acc[b][j] = Dot::Madd(acc[b][j], xv, wv[j]);
  }
}

// y[b][o[j]] for B rows of x (row stride k_size) and the block's kDotBlock weight rows wr[j] (o[j] at
// o_end or past: not stored); a masked last step zeroes what lies past K. With kPrefetch, the rows
// `next[0:n_next]` (of the next block) are fetched into L2 alongside, a cache line of each per step.
template <typename Dot, int B, bool kPrefetch = false>
MESH_TRANSFORMER_DOT_TARGET __attribute__((always_inline)) inline void DotBlock(
    const typename Dot::T* x, int64_t k_size, const typename Dot::T* const* wr, float* y, int64_t o_size,
    const int64_t* o, int64_t o_end, const typename Dot::T* const* next = nullptr, int64_t n_next = 0) {
  __m512 acc[B][kDotBlock];
  for (int b = 0; b < B; ++b) {
    for (int64_t j = 0; j < kDotBlock; ++j) acc[b][j] = _mm512_setzero_ps();
  }
  // Whole steps unmasked, then the masked last one: one loop body with both kinds of load made
  // GCC keep the accumulators in memory, storing all of them at every step (half the speed).
  int64_t k = 0;
  for (; k + Dot::kStep <= k_size; k += Dot::kStep) {
    DotStep<Dot, B, kPrefetch>(acc, x, k_size, wr, k, Dot::kStep, next, n_next);
  }
  if (k < k_size) DotStep<Dot, B, kPrefetch>(acc, x, k_size, wr, k, k_size - k, next, n_next);
  for (int b = 0; b < B; ++b) {
    for (int64_t j = 0; j < kDotBlock; ++j) {
      if (o[j] < o_end) y[b * o_size + o[j]] = _mm512_reduce_add_ps(acc[b][j]);
    }
  }
}

// y[:, o_begin:o_end] for every row of x: the range as kDotBlock runs of consecutive weight rows,
// one row of each per block, multiplied by x's rows kDotGroup at a time (after the first group the
// block's weight rows are in cache). (One target for both element types: float32 code has
// nothing the compiler could turn into bf16 instructions, so the float32 kernel needs only
// AVX-512F and BW, `DotKernels`.)
template <typename Dot>
MESH_TRANSFORMER_DOT_TARGET void DotRows(const typename Dot::T* x, const typename Dot::T* w, float* y, int64_t rows,
                                         int64_t k_size, int64_t o_size, int64_t o_begin, int64_t o_end) {
  const int64_t run = (o_end - o_begin + kDotBlock - 1) / kDotBlock;
  // With several groups of x's rows, every pass over a block but the first would compute from
  // cache while memory idles: instead the passes share the fetching of the next block's rows into
  // L2, spread over them (row j by pass j * passes / kDotBlock), so memory streams through the
  // block's time and the next block's first pass reads from L2.
  const int64_t passes = rows / kDotGroup;
  const bool prefetching = passes >= 2;
  for (int64_t i = 0; i < run; ++i) {
    int64_t o[kDotBlock];
    const typename Dot::T* wr[kDotBlock];
    const typename Dot::T* next[kDotBlock];
    for (int64_t j = 0; j < kDotBlock; ++j) {
      o[j] = o_begin + j * run + i;
      wr[j] = w + std::min(o[j], o_end - 1) * k_size;
    }
    int64_t b = 0;
    for (int64_t pass = 0; b + kDotGroup <= rows; b += kDotGroup, ++pass) {
      int64_t n_next = 0;
      if (prefetching && i + 1 < run) {
        for (int64_t j = 0; j < kDotBlock; ++j) {
          if (j * passes / kDotBlock == pass) next[n_next++] = w + std::min(o[j] + 1, o_end - 1) * k_size;
        }
      }
      if (n_next > 0) {
        DotBlock<Dot, kDotGroup, true>(x + b * k_size, k_size, wr, y + b * o_size, o_size, o, o_end, next, n_next);
      } else {
        DotBlock<Dot, kDotGroup>(x + b * k_size, k_size, wr, y + b * o_size, o_size, o, o_end);
      }
    }
    const typename Dot::T* xb = x + b * k_size;
    float* yb = y + b * o_size;
    switch (rows - b) {  // the 1-3 rows left
      case 1: DotBlock<Dot, 1>(xb, k_size, wr, yb, o_size, o, o_end); break;
      case 2: DotBlock<Dot, 2>(xb, k_size, wr, yb, o_size, o, o_end); break;
      case 3: DotBlock<Dot, 3>(xb, k_size, wr, yb, o_size, o, o_end); break;
    }
  }
}

// bf16 rows from which the inputs-last product runs as AMX tile products where the CPU has them
// (amx.h; K a multiple of 32; the measurements: `DOT` in kernels/__init__.py).
constexpr int64_t kAmxMinRows = 4;

// Weight rows per chunk a thread takes: at most `most`, at least one chunk per thread (a [256, K]
// key projection: two of 128), a multiple of `multiple`.
inline int64_t ChunkRows(ffi::ThreadPool& pool, int64_t o_size, int64_t multiple, int64_t most) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_thread = (o_size + threads - 1) / threads;
  return std::clamp((per_thread + multiple - 1) / multiple * multiple, multiple, most);
}

template <typename Dot>
ffi::Future RowsDotWeight(ffi::ThreadPool& pool, const typename Dot::T* x, const typename Dot::T* w, float* y,
                          int64_t rows, int64_t k_size, int64_t o_size) {
  if constexpr (std::is_same_v<Dot, PairsDot>) {
    if (rows >= kAmxMinRows && k_size % kAmxDepth == 0 && o_size >= 16 && DetectAmx()) {
      // chunks of whole blocks of 16 weight rows; the last (under 16) rows by the pair kernel
      auto pairs = std::make_shared<const std::vector<uint32_t>>(AmxPairRows(x, rows, k_size));
      const int64_t tiled = o_size / 16 * 16, chunk = ChunkRows(pool, tiled, 16, kDotChunkRows);
      const int64_t n_chunks = (tiled + chunk - 1) / chunk;
      return InTurn(pool, n_chunks + (tiled < o_size), [=](int64_t c) {
        if (c == n_chunks) return DotRows<Dot>(x, w, y, rows, k_size, o_size, tiled, o_size);
        AmxRowsDotWeight(pairs->data(), w, y, rows, k_size, o_size, c * chunk, std::min(tiled, (c + 1) * chunk));
      });
    }
  }
  const int64_t chunk = ChunkRows(pool, o_size, kDotBlock, kDotChunkRows);
  const int64_t n_chunks = (o_size + chunk - 1) / chunk;
  return InTurn(pool, n_chunks, [=](int64_t c) {
    DotRows<Dot>(x, w, y, rows, k_size, o_size, c * chunk, std::min(o_size, (c + 1) * chunk));
  });
}

// x [B, K], w [O, K] of one dtype (float32, or bf16 as pair products); result y [B, O] float32.
template <typename Dot, ffi::DataType T>
ffi::Future DotTyped(ffi::ThreadPool pool, ffi::Buffer<T> x, ffi::Buffer<T> w, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t rows = y->dimensions()[0], o_size = w.dimensions()[0], k_size = w.dimensions()[1];
  if (rows < 1 || rows > kDotMaxRows || x.element_count() != rows * k_size || y->dimensions()[1] != o_size) {
    return Failed("rows . weight: x must be [B, K] with 1 <= B <= 64, w [O, K], y [B, O]");
  }
  return RowsDotWeight<Dot>(pool, reinterpret_cast<const typename Dot::T*>(x.untyped_data()),
                            reinterpret_cast<const typename Dot::T*>(w.untyped_data()), y->typed_data(), rows, k_size,
                            o_size);
}

// y [G, M, O] = x [G, M, K] times w [G, K, O], group by group (attention over a KV cache: one
// group per row and kv head): threads take whole groups in turn.
template <typename W>
ffi::Future GroupedRowsTimesWeight(ffi::ThreadPool pool, const float* x, const W* w, float* y, int64_t groups,
                                   int64_t rows, int64_t k_size, int64_t o_size) {
  static const Isa isa = Detect();
  if (rows < 1 || rows > kMaxRows) return Failed("grouped rows x weight: at most 64 rows per group");
  return InTurn(pool, groups, [=](int64_t g) {
    float* out = y + g * rows * o_size;
    std::fill(out, out + rows * o_size, 0.0f);
    Accumulate(isa, x + g * rows * k_size, w + g * k_size * o_size, out, rows, k_size, o_size, 0, k_size);
  });
}

using F32x3 = ffi::Buffer<ffi::F32, 3>;
using Bf16x3 = ffi::Buffer<ffi::BF16, 3>;

ffi::Future Bf16Grouped(ffi::ThreadPool pool, F32x3 x, Bf16x3 w, ffi::Result<F32x3> y) {
  const auto x_dims = x.dimensions(), w_dims = w.dimensions();
  return GroupedRowsTimesWeight(pool, x.typed_data(), reinterpret_cast<const uint16_t*>(w.untyped_data()),
                                y->typed_data(), x_dims[0], x_dims[1], w_dims[1], w_dims[2]);
}

ffi::Future F32Grouped(ffi::ThreadPool pool, F32x3 x, F32x3 w, ffi::Result<F32x3> y) {
  const auto x_dims = x.dimensions(), w_dims = w.dimensions();
  return GroupedRowsTimesWeight(pool, x.typed_data(), w.typed_data(), y->typed_data(), x_dims[0], x_dims[1],
                                w_dims[1], w_dims[2]);
}

// y [M, O] = x [M, K] times w [E, K, O] by expert: x's rows grouped, sizes[e] rows for expert e in
// turn (a mixture of experts' token copies sorted by expert, `layers.MoE`). Each expert's weight is
// read only where rows chose it: XLA:CPU's ragged_dot multiplies every row by every expert and
// masks (E times the products; a decode step read all E weights where its rows chose k). A group
// of at most kExpertStreamed rows streams its expert's weight whole (one task: a decode step's few
// rows per expert); a larger one (a prefill's), or every one where `blocked` (training: each sum
// then runs in the same order whatever rows a device holds), is register-blocked, one task per
// panel of columns. Rows past the sizes' sum (none, as `layers.MoE` calls it) are zero.
constexpr int64_t kExpertStreamed = 8;

template <typename W>
ffi::Future ExpertRowsTimesWeight(ffi::ThreadPool pool, const float* x, const W* w, const int32_t* sizes, float* y,
                                  int64_t experts, int64_t m, int64_t k_size, int64_t o_size, bool blocked) {
  static const Isa isa = Detect();
  struct Task {
    int64_t start, rows, expert, panel;  // panel -1: the group streamed whole
  };
  auto tasks = std::make_shared<std::vector<Task>>();
  const int64_t n_panels = (o_size + PanelWidth(isa) - 1) / PanelWidth(isa);
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = std::min<int64_t>(std::max<int32_t>(sizes[e], 0), m - start);
    if (rows <= 0) continue;
    if (rows <= kExpertStreamed && !blocked) {
      tasks->push_back({start, rows, e, -1});
    } else {
      for (int64_t p = 0; p < n_panels; ++p) tasks->push_back({start, rows, e, p});
    }
    start += rows;
  }
  std::fill(y + start * o_size, y + m * o_size, 0.0f);
  return InTurn(pool, static_cast<int64_t>(tasks->size()), [=](int64_t t) {
    const Task& task = (*tasks)[t];
    const float* rows_x = x + task.start * k_size;
    const W* w_e = w + task.expert * k_size * o_size;
    float* rows_y = y + task.start * o_size;
    if (task.panel < 0) {
      std::fill(rows_y, rows_y + task.rows * o_size, 0.0f);
      Accumulate(isa, rows_x, w_e, rows_y, task.rows, k_size, o_size, 0, k_size);
    } else {
      BlockedPanel(isa, rows_x, w_e, rows_y, task.rows, k_size, o_size, task.panel);
    }
  });
}

template <ffi::DataType T>
ffi::Future ExpertsTyped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32, 2> x, ffi::Buffer<T, 3> w,
                         ffi::Buffer<ffi::S32, 1> sizes, ffi::Result<ffi::Buffer<ffi::F32, 2>> y, bool blocked) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd[1] != wd[1] || sizes.dimensions()[0] != wd[0] || yd[0] != xd[0] || yd[1] != wd[2]) {
    return Failed("expert rows x weight: x [M, K], w [E, K, O], sizes [E], y [M, O]");
  }
  using W = std::conditional_t<T == ffi::F32, float, std::conditional_t<T == ffi::S8, int8_t, uint16_t>>;
  return ExpertRowsTimesWeight(pool, x.typed_data(), reinterpret_cast<const W*>(w.untyped_data()),
                               sizes.typed_data(), y->typed_data(), wd[0], xd[0], wd[1], wd[2], blocked);
}

// The weight gradient of ExpertRowsTimesWeight: dw [E, K, O], expert e's the product of its rows
// of x, transposed, and of g: xt [K, M] (x transposed) times g [M, O] over the group's M_e columns
// of xt (zeros for an expert no row chose). Register-blocked as `Blocked`: threads take (expert,
// panel of O) in turn; per block of kDepth of the group's rows (their g kept in cache while every
// tile of xt's rows reads them) the tiles sum in registers.
ffi::Future ExpertWeightGradient(ffi::ThreadPool pool, ffi::Buffer<ffi::F32, 2> xt, ffi::Buffer<ffi::F32, 2> g,
                                 ffi::Buffer<ffi::S32, 1> sizes, ffi::Result<ffi::Buffer<ffi::F32, 3>> dw) {
  static const Isa isa = Detect();
  const auto xd = xt.dimensions(), gd = g.dimensions(), wd = dw->dimensions();
  const int64_t k_size = xd[0], m = xd[1], o_size = gd[1], experts = wd[0];
  if (gd[0] != m || sizes.dimensions()[0] != experts || wd[1] != k_size || wd[2] != o_size) {
    return Failed("expert weight gradient: xt [K, M], g [M, O], sizes [E], dw [E, K, O]");
  }
  auto starts = std::make_shared<std::vector<int64_t>>(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) {
    (*starts)[e + 1] = std::min<int64_t>(m, (*starts)[e] + std::max<int32_t>(sizes.typed_data()[e], 0));
  }
  const int64_t n_panels = (o_size + PanelWidth(isa) - 1) / PanelWidth(isa);
  const float* x = xt.typed_data();
  const float* gs = g.typed_data();
  float* out = dw->typed_data();
  return InTurn(pool, experts * n_panels, [=](int64_t task) {
    const int64_t e = task / n_panels, o0 = (task % n_panels) * PanelWidth(isa);
    const int64_t width = std::min(o_size, o0 + PanelWidth(isa)) - o0, start = (*starts)[e];
    const int64_t rows = (*starts)[e + 1] - start;
    float* y = out + e * k_size * o_size + o0;
    if (rows == 0) {
      for (int64_t k = 0; k < k_size; ++k) std::fill(y + k * o_size, y + k * o_size + width, 0.0f);
      return;
    }
    for (int64_t d0 = 0; d0 < rows; d0 += kDepth) {
      Product(isa, x + start + d0, m, gs + (start + d0) * o_size + o0, o_size, y, o_size, k_size, width,
              std::min(kDepth, rows - d0), d0 == 0);
    }
  });
}

// Data movement on a KV cache or an embedding table, which XLA:CPU runs badly there: a 16-bit
// dynamic-update-slice over float32 copies of the whole array, or (on its bits) as fusions that
// rewrite the whole array (a decode step then copied every layer's cache, a bfloat16 serving
// batch's decode call and each admitted row copied them again); a 16-bit gather after a copy of
// the whole table, hoisted out of the decode loop and made once per call; a window of a serving
// batch's cache sliced element by element (1-3 GB/s).
using Starts = ffi::Buffer<ffi::S32, 1>;
using Ids = ffi::Buffer<ffi::S32, 1>;
using SlotIds = ffi::Buffer<ffi::S32, 2>;

// The block of `sizes` at `src_first` of a row-major array of `src_dims`, to be copied to
// `dst_first` of one of `dst_dims` (elements of `width` bytes), as runs: the trailing axes the
// block spans whole, plus the axis before them, are one memcpy each.
struct Block {
  std::vector<int64_t> sizes, dst_first, src_first, dst_stride, src_stride;
  int64_t split = 0, run = 1, runs = 0;  // the runs cover axes split .. rank-1
  size_t width = 0;

  Block(const std::vector<int64_t>& dst_dims, std::vector<int64_t> dst_first_, const std::vector<int64_t>& src_dims,
        std::vector<int64_t> src_first_, std::vector<int64_t> sizes_, size_t width_)
      : sizes(std::move(sizes_)), dst_first(std::move(dst_first_)), src_first(std::move(src_first_)), width(width_) {
    const int64_t rank = static_cast<int64_t>(sizes.size());
    dst_stride.assign(rank, 1);
    src_stride.assign(rank, 1);
    for (int64_t d = rank - 2; d >= 0; --d) {
      dst_stride[d] = dst_stride[d + 1] * dst_dims[d + 1];
      src_stride[d] = src_stride[d + 1] * src_dims[d + 1];
    }
    split = rank - 1;
    run = rank ? sizes[rank - 1] : 1;
    while (split > 0 && sizes[split] == dst_dims[split] && sizes[split] == src_dims[split]) run *= sizes[--split];
    runs = run ? 1 : 0;
    for (int64_t d = 0; d < split; ++d) runs *= sizes[d];
  }

  size_t bytes() const { return static_cast<size_t>(runs * run) * width; }

  // Copies runs first .. last-1. Each run's offsets are stepped from the previous run's, and a run
  // of 2, 4 or 8 bytes (one token written into a cache whose slots are the last axis: keys stored
  // [B, kv heads, head dim, slots]) is one fixed-size move: recomputing every offset over all axes
  // and a memcpy call of a variable size cost 8-11 ns a run, 185 us for a 16-row float32 token.
  void Copy(char* dst, const char* src, int64_t first, int64_t last) const {
    std::vector<int64_t> at(std::max<int64_t>(split, 0), 0);  // run `first`'s index over axes 0 .. split-1
    for (int64_t d = split - 1, r = first; d >= 0; --d) {
      at[d] = r % sizes[d];
      r /= sizes[d];
    }
    int64_t to = 0, from = 0;
    for (int64_t d = 0; d < static_cast<int64_t>(sizes.size()); ++d) {
      const int64_t i = d < split ? at[d] : 0;
      to += (dst_first[d] + i) * dst_stride[d];
      from += (src_first[d] + i) * src_stride[d];
    }
    switch (static_cast<size_t>(run) * width) {
      case 2: return CopyRuns<2>(dst, src, to, from, at, last - first);
      case 4: return CopyRuns<4>(dst, src, to, from, at, last - first);
      case 8: return CopyRuns<8>(dst, src, to, from, at, last - first);
      default: return CopyRuns<0>(dst, src, to, from, at, last - first);
    }
  }

 private:
  // `n` runs from the one at element offsets `to` / `from` (index `at` over axes 0 .. split-1);
  // kBytes: each run's size when fixed, 0 for run x width.
  template <size_t kBytes>
  void CopyRuns(char* dst, const char* src, int64_t to, int64_t from, std::vector<int64_t>& at, int64_t n) const {
    const size_t bytes = kBytes ? kBytes : static_cast<size_t>(run) * width;
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(dst + to * static_cast<int64_t>(width), src + from * static_cast<int64_t>(width), bytes);
      for (int64_t d = split - 1; d >= 0; --d) {  // the next run: the last of axes 0 .. split-1 fastest
        to += dst_stride[d];
        from += src_stride[d];
        if (++at[d] < sizes[d]) break;
        at[d] = 0;
        to -= sizes[d] * dst_stride[d];
        from -= sizes[d] * src_stride[d];
      }
    }
  }
};

constexpr size_t kBytesPerCopyTask = 1 << 20;  // smaller copies stay on the calling thread

// Threads for a copy of `bytes` in `parts` independent parts: one per MiB, at most the pool's
// threads and the parts (at least one).
int64_t CopyTasks(ffi::ThreadPool& pool, size_t bytes, int64_t parts) {
  return std::clamp<int64_t>(static_cast<int64_t>(bytes / kBytesPerCopyTask), 1,
                             std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), parts)));
}

// The block copied on as many of the pool's threads as it has MiB (at least one).
ffi::Future CopyOnThreads(ffi::ThreadPool& pool, const Block& block, char* dst, const char* src) {
  const int64_t n_tasks = CopyTasks(pool, block.bytes(), block.runs);
  return OnThreads(pool, n_tasks, [block, dst, src, n_tasks](int64_t t) {
    block.Copy(dst, src, block.runs * t / n_tasks, block.runs * (t + 1) / n_tasks);
  });
}

std::vector<int64_t> Dims(ffi::AnyBuffer::Dimensions dims) { return {dims.begin(), dims.end()}; }

// Each start clamped so that `sizes` fit in `dims`, as XLA's dynamic slices do.
std::vector<int64_t> Clamped(const Starts& starts, const std::vector<int64_t>& dims,
                             const std::vector<int64_t>& sizes) {
  std::vector<int64_t> first(dims.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    first[d] = std::clamp<int64_t>(starts.typed_data()[d], 0, dims[d] - sizes[d]);
  }
  return first;
}

bool Fits(const std::vector<int64_t>& sizes, const std::vector<int64_t>& dims) {
  if (sizes.size() != dims.size()) return false;
  for (size_t d = 0; d < dims.size(); ++d) {
    if (sizes[d] > dims[d]) return false;
  }
  return true;
}

// x with `update` written at `starts` (one per axis, clamped), in place: the result aliases x.
ffi::Future UpdateSlice(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer update, Starts starts,
                        ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = Dims(x.dimensions()), sizes = Dims(update.dimensions());
  if (!Fits(sizes, dims) || starts.element_count() != dims.size()) {
    return Failed("update slice: the update does not fit the array, or the starts' rank differs");
  }
  char* target = static_cast<char*>(out->untyped_data());
  if (target != x.untyped_data()) std::memcpy(target, x.untyped_data(), x.size_bytes());
  const Block block(dims, Clamped(starts, dims, sizes), sizes, std::vector<int64_t>(sizes.size(), 0), sizes,
                    ffi::ByteWidth(x.element_type()));
  return CopyOnThreads(pool, block, target, static_cast<const char*>(update.untyped_data()));
}

// The block of x at `starts` (clamped) the result's shape.
ffi::Future Slice(ffi::ThreadPool pool, ffi::AnyBuffer x, Starts starts, ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = Dims(x.dimensions()), sizes = Dims(out->dimensions());
  if (!Fits(sizes, dims) || starts.element_count() != dims.size()) {
    return Failed("slice: the slice does not fit the array, or the starts' rank differs");
  }
  const Block block(sizes, std::vector<int64_t>(sizes.size(), 0), dims, Clamped(starts, dims, sizes), sizes,
                    ffi::ByteWidth(x.element_type()));
  return CopyOnThreads(pool, block, static_cast<char*>(out->untyped_data()),
                       static_cast<const char*>(x.untyped_data()));
}

// Rows `ids` (clamped to the table) of a table [V, ...]: out [N, ...].
ffi::Error TakeRows(ffi::AnyBuffer table, Ids ids, ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = table.dimensions();
  const bool one_row_per_id = dims.size() >= 1 && dims[0] >= 1 &&
                              out->element_count() == ids.element_count() * (table.element_count() / dims[0]);
  if (!one_row_per_id) {
    return ffi::Error::InvalidArgument("take rows: the result is not one table row per id");
  }
  const size_t row = table.size_bytes() / dims[0];
  const char* source = static_cast<const char*>(table.untyped_data());
  char* target = static_cast<char*>(out->untyped_data());
  for (size_t i = 0; i < ids.element_count(); ++i) {
    std::memcpy(target + i * row, source + std::clamp<int64_t>(ids.typed_data()[i], 0, dims[0] - 1) * row, row);
  }
  return ffi::Error::Success();
}

// x [*A, M, *C] (M on axis `axis`) with update [N, *A', W, *C] (A' as many elements as A)
// written at slots [N, W] of its M axis (a slot outside 0 .. M-1 is not written), in place: the
// result aliases x. A row's consecutive slots taking consecutive positions are one run, one memcpy
// per element of A (a prefix cache's pool storing an admission's prompts: on its bits XLA:CPU
// copied the whole pool twice, 64 MB a layer, for 2,560 positions).
ffi::Future PutSlots(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer update, SlotIds slots,
                     ffi::RemainingArgs /*after: what the store waits for*/, ffi::Result<ffi::AnyBuffer> out,
                     int64_t axis) {
  const auto dims = Dims(x.dimensions()), u = Dims(update.dimensions()), s = Dims(slots.dimensions());
  const auto product = [](const std::vector<int64_t>& d, int64_t from, int64_t to) {
    int64_t p = 1;
    for (int64_t i = from; i < to; ++i) p *= d[i];
    return p;
  };
  const int64_t rank = static_cast<int64_t>(dims.size());
  if (axis < 1 || axis >= rank || static_cast<int64_t>(u.size()) != rank || s[0] != u[0] || s[1] != u[axis] ||
      product(u, 1, axis) != product(dims, 0, axis) || product(u, axis + 1, rank) != product(dims, axis + 1, rank) ||
      x.element_type() != update.element_type()) {
    return Failed("put slots: x must be [*A, M, *C], update [N, *A, W, *C] of x's dtype, slots [N, W]");
  }
  const int64_t a_size = product(dims, 0, axis), m = dims[axis], c = product(dims, axis + 1, rank), n = u[0],
                w = u[axis];
  char* target = static_cast<char*>(out->untyped_data());
  if (target != x.untyped_data()) std::memcpy(target, x.untyped_data(), x.size_bytes());
  struct Run { int64_t row, position, slot, length; };
  auto runs = std::make_shared<std::vector<Run>>();
  int64_t slots_written = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t p = 0; p < w; ++p) {
      const int64_t slot = slots.typed_data()[i * w + p];
      if (slot < 0 || slot >= m) continue;
      ++slots_written;
      Run* last = runs->empty() ? nullptr : &runs->back();
      if (last && last->row == i && last->position + last->length == p && last->slot + last->length == slot) {
        ++last->length;
      } else {
        runs->push_back({i, p, slot, 1});
      }
    }
  }
  const size_t width = ffi::ByteWidth(x.element_type()), bytes = slots_written * a_size * c * width;
  const int64_t n_tasks = CopyTasks(pool, bytes, a_size);
  const char* source = static_cast<const char*>(update.untyped_data());
  return OnThreads(pool, n_tasks, [=](int64_t t) {
    for (int64_t a = a_size * t / n_tasks; a < a_size * (t + 1) / n_tasks; ++a) {
      for (const Run& r : *runs) {
        const int64_t to = (a * m + r.slot) * c, from = ((r.row * a_size + a) * w + r.position) * c;
        std::memcpy(target + to * width, source + from * width, r.length * c * width);
      }
    }
  });
}

}  // namespace

// Arguments: x [B, K] float32, w [K, O] (bfloat16, float32 or int8); attribute blocked; result:
// parts [P, B, O] float32 (P = 1 when blocked).
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerBf16RowsTimesWeight, Bf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("blocked"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerF32RowsTimesWeight, Typed<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("blocked"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerI8RowsTimesWeight, Typed<ffi::S8>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("blocked"));

// Arguments: x [B, K] bfloat16, w [K, O] bfloat16; attribute blocked; result: parts [P, B, O]
// float32 (P = 1 when blocked).
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerBf16RowsTimesBf16Weight, Bf16Rows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("blocked"));

// Arguments: x [B, K], w [O, K] (inputs-last), both float32 or both bfloat16; result: y [B, O] float32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerF32RowsDotF32Weight, (DotTyped<F32Dot, ffi::F32>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerBf16RowsDotBf16Weight, (DotTyped<PairsDot, ffi::BF16>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Arguments: x [M, K] float32, w [E, K, O] (float32, bfloat16 or int8), sizes [E] int32; attribute
// blocked; result: y [M, O] float32.
template <ffi::DataType T>
auto ExpertsBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .template Arg<ffi::Buffer<ffi::F32, 2>>()
      .template Arg<ffi::Buffer<T, 3>>()
      .template Arg<ffi::Buffer<ffi::S32, 1>>()
      .template Ret<ffi::Buffer<ffi::F32, 2>>()
      .template Attr<bool>("blocked");
}

// Arguments: xt [K, M], g [M, O] float32, sizes [E] int32; result: dw [E, K, O] float32.
auto ExpertGradientBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32, 2>>()
      .Arg<ffi::Buffer<ffi::F32, 2>>()
      .Arg<ffi::Buffer<ffi::S32, 1>>()
      .Ret<ffi::Buffer<ffi::F32, 3>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerExpertWeightGradient, ExpertWeightGradient, ExpertGradientBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerF32ExpertRowsTimesWeight, ExpertsTyped<ffi::F32>,
                              ExpertsBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerBf16ExpertRowsTimesWeight, ExpertsTyped<ffi::BF16>,
                              ExpertsBinding<ffi::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerI8ExpertRowsTimesWeight, ExpertsTyped<ffi::S8>,
                              ExpertsBinding<ffi::S8>());

// Which inputs-last kernels run here: 1 float32 (AVX-512F and BW), 2 bf16 (and AVX-512-BF16); none
// with a narrower ISA forced.
extern "C" int MeshTransformerDotKernels() {
  const bool wide = mesh_transformer::Detect() == mesh_transformer::Isa::kAvx512 && __builtin_cpu_supports("avx512bw");
  const bool forced = mesh_transformer::ForcedBelowBf16Pairs();
  return (wide && !forced ? 1 : 0) | (mesh_transformer::DetectBf16Pairs() ? 2 : 0);
}

// Whether `MeshTransformerBf16RowsTimesBf16Weight` runs pair products here (else float32 tiles).
extern "C" int MeshTransformerBf16Pairs() { return mesh_transformer::DetectBf16Pairs() ? 1 : 0; }

// Whether inputs-last bf16 products of kAmxMinRows rows or more run as AMX tile products here.
extern "C" int MeshTransformerAmx() { return mesh_transformer::DetectBf16Pairs() && mesh_transformer::DetectAmx() ? 1 : 0; }

// Arguments: x [G, M, K] float32, w [G, K, O] bfloat16 or float32; result: y [G, M, O] float32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerBf16GroupedRowsTimesWeight, Bf16Grouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32x3>()
                                  .Arg<Bf16x3>()
                                  .Ret<F32x3>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerF32GroupedRowsTimesWeight, F32Grouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32x3>()
                                  .Arg<F32x3>()
                                  .Ret<F32x3>());

// Arguments: x, update (same dtype and rank), starts (int32 [rank]); the result aliases x
// (`input_output_aliases={0: 0}`).
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerUpdateSlice, UpdateSlice,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Starts>()
                                  .Ret<ffi::AnyBuffer>());

// Arguments: x, starts (int32 [rank]); result: the slice (x's dtype and rank).
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerSlice, Slice,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Starts>()
                                  .Ret<ffi::AnyBuffer>());

// Arguments: x [*A, M, *C], update [N, *A, W, *C] (x's dtype), slots (int32 [N, W]); attribute
// axis (M's); the result aliases x.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerPutSlots, PutSlots,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<SlotIds>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("axis"));

// Arguments: table [V, ...], ids (int32 [N]); result: [N, ...] (the table's dtype).
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerTakeRows, TakeRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Ids>()
                                  .Ret<ffi::AnyBuffer>());
