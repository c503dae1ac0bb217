// Attention of many queries over a KV cache, fused: scores, softmax and the weighted sum of values
// computed tile by tile with the softmax running ("online", as flash attention's), so the scores
// never leave the core's cache. For a prefill on CPU (`layers.Attention._attend`): the queries of
// a prompt over its own keys (causal, left-padded) and, behind a prefix cache, over the keys of a
// shared prefix that every row reads.
//
// Why: XLA:CPU runs attention as separate programs — the scores' product, a masked maximum, the
// exponentials, their sum, the weighted product — each a pass over [queries, keys] scores in
// memory, with its element-wise passes on one thread. An admission of 16 prompts of 128 tokens
// behind a cached 1,000-token prefix (4 layers, d_model 512, float32; the pool's copies of the
// same session already gone): 722 ms with XLA's attention, 580 with this kernel, 336 without
// the prefix.
//
// Decoding (one position per row: a task holds only its kv head's few query heads, at most
// kFewRows) takes a path of its own, `AttendFew`: the scores of every slot a query may see, kept
// for one softmax (no running rescale), keys and values read where they lie in the cache, and the
// slots no query of the task sees (a cache's unwritten tail, a row's left padding) not read at
// all. One call a layer then replaces XLA's two products over the whole cache and the softmax's
// passes between them.
//
// How: a task is one row, one kv head and kQueryRows of its query rows (a kv head's query heads
// times positions); threads take tasks in turn. Per tile of kKeys keys: the scores [rows, keys]
// (the shared tiles' register-blocked product, tiles.h), the mask (a tile no query of the task may
// see is skipped, a tile every query sees is not masked), then per query row the running maximum
// m, the sum l of exp(score - m) and the output o, rescaled by exp(m_old - m) when m grows, and
// o += exp(scores - m) . values. Softmax in float32 as the XLA path's; a masked score is the
// library's NEG (float32's lowest), so a query that may see no key gets the mean of all values,
// as XLA's softmax over NEG scores gives.
//
// Attention sinks (GPT-OSS): a score per query head that joins its softmax's sum and attends to no
// value. The running softmax starts from it (m = sink, l = 1, o = 0), the decode path adds its
// exp(sink - max) to the sum; a query that sees no key then gets 0, as XLA's path gives.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "threads.h"
#include "tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using mesh_transformer::Failed;
using mesh_transformer::OnThreads;
using namespace mesh_transformer;  // tiles.h

constexpr int64_t kQueryRows = 48;  // query rows per task: 8 tiles of kBlockRows
constexpr int64_t kKeys = 256;       // keys per step of the running softmax
constexpr int64_t kFewRows = 16;     // query rows a task takes the decode path (`AttendFew`) with, at most
constexpr float kNeg = std::numeric_limits<float>::lowest();  // the library's NEG (a masked score)
constexpr float kExpLow = -87.33654f;                         // exp(x) below float32's smallest normal: 0
constexpr float kExpHigh = 88.37626f;

// exp(x) for float32 vectors (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial
// in r, times 2^n; within 2 ulp), 0 below kExpLow (never a denormal).
#define EXP_POLYNOMIAL(FMADD, SET1, r) \
  FMADD(FMADD(FMADD(FMADD(FMADD(SET1(1.9875691500e-4f), r, SET1(1.3981999507e-3f)), r, SET1(8.3334519073e-3f)), \
                    r, SET1(4.1665795894e-2f)), r, SET1(1.6666665459e-1f)), r, SET1(5.0000001201e-1f))

__attribute__((target("avx512f"))) inline __m512 ExpAvx512(__m512 x) {
  const __m512 low = _mm512_set1_ps(kExpLow);
  const __mmask16 zero = _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, low), _mm512_set1_ps(kExpHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  const __m512 p = EXP_POLYNOMIAL(_mm512_fmadd_ps, _mm512_set1_ps, r);
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~zero), _mm512_scalef_ps(e, n));
}

__attribute__((target("avx2,fma"))) inline __m256 ExpAvx2(__m256 x) {
  const __m256 low = _mm256_set1_ps(kExpLow);
  const __m256 keep = _mm256_cmp_ps(x, low, _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, low), _mm256_set1_ps(kExpHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  const __m256 p = EXP_POLYNOMIAL(_mm256_fmadd_ps, _mm256_set1_ps, r);
  const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(e, _mm256_castsi256_ps(two_n)), keep);
}

inline float ExpScalar(float x) { return x < kExpLow ? 0.0f : std::exp(x); }

// The largest of s[0 .. n).
__attribute__((target("avx512f"))) float MaxAvx512(const float* s, int64_t n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + i));
  float out = _mm512_reduce_max_ps(m);
  for (; i < n; ++i) out = std::max(out, s[i]);
  return out;
}

__attribute__((target("avx2"))) float MaxAvx2(const float* s, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float out = *std::max_element(lanes, lanes + 8);
  for (; i < n; ++i) out = std::max(out, s[i]);
  return out;
}

float Max(Isa isa, const float* s, int64_t n) {
  if (isa == Isa::kAvx512) return MaxAvx512(s, n);
  if (isa == Isa::kAvx2) return MaxAvx2(s, n);
  float out = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) out = std::max(out, s[i]);
  return out;
}

// s[i] = exp(s[i] - m) for i < n -> their sum.
__attribute__((target("avx512f"))) float ExpSumAvx512(float* s, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = ExpAvx512(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  float out = _mm512_reduce_add_ps(sum);
  for (; i < n; ++i) out += (s[i] = ExpScalar(s[i] - m));
  return out;
}

__attribute__((target("avx2,fma"))) float ExpSumAvx2(float* s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = ExpAvx2(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float out = 0.0f;
  for (float lane : lanes) out += lane;
  for (; i < n; ++i) out += (s[i] = ExpScalar(s[i] - m));
  return out;
}

float ExpSum(Isa isa, float* s, int64_t n, float m) {
  if (isa == Isa::kAvx512) return ExpSumAvx512(s, n, m);
  if (isa == Isa::kAvx2) return ExpSumAvx2(s, n, m);
  float out = 0.0f;
  for (int64_t i = 0; i < n; ++i) out += (s[i] = ExpScalar(s[i] - m));
  return out;
}

// One part of the keys a task's queries attend to: a row's own slots (mask [T, S] per query
// position) or the shared prefix's (valid per slot, the same for every query).
template <typename W>
struct Keys {
  const W* k;           // [H, n]: key h of slot s at k[h * n + s]
  const W* v;           // [n, H]
  int64_t n;            // slots
  const bool* mask;     // [T, n] (own slots) or nullptr
  const int32_t* used;  // [n] positions, -1: not read (shared slots) or nullptr
};

// How the queries r0 .. r0+rows-1 (position t = r % T) may see slots [j0, j0+n): 0 none, 1 some, 2 all.
template <typename W>
int Visibility(const Keys<W>& keys, int64_t r0, int64_t rows, int64_t positions, int64_t j0, int64_t n) {
  bool any = false, all = true;
  if (keys.used != nullptr) {
    for (int64_t j = j0; j < j0 + n; ++j) {
      if (keys.used[j] >= 0) any = true; else all = false;
    }
    return any ? (all ? 2 : 1) : 0;
  }
  // Query rows repeat their positions every T rows (a kv head's query heads), so at most T of them.
  for (int64_t r = r0; r < r0 + std::min(rows, positions); ++r) {
    const bool* m = keys.mask + (r % positions) * keys.n + j0;
    for (int64_t j = 0; j < n; ++j) {
      if (m[j]) any = true; else all = false;
    }
  }
  return any ? (all ? 2 : 1) : 0;
}

template <typename W>
bool Visible(const Keys<W>& keys, int64_t position, int64_t j) {
  return keys.used != nullptr ? keys.used[j] >= 0 : keys.mask[position * keys.n + j];
}

// Values [n, H] as float32: float32 ones where they are, 16-bit ones widened once per tile.
inline const float* Values(const float* v, int64_t, float*) { return v; }
inline const float* Values(const uint16_t* v, int64_t count, float* wide) {
  for (int64_t i = 0; i < count; ++i) wide[i] = Scalar(v + i);
  return wide;
}

// Per-thread scratch of one task.
struct Scratch {
  std::vector<float> q, keys, values, scores, out, max, sum;
  Scratch(int64_t head_dim)
      : q(kQueryRows * head_dim), keys(kKeys * head_dim), values(kKeys * head_dim), scores(kQueryRows * kKeys),
        out(kQueryRows * head_dim), max(kQueryRows), sum(kQueryRows) {}
};

constexpr int64_t kPanel = 64;  // keys per panel of a packed key tile

// Slots [j0, j0+n) of keys k [H, slots] as float32 panels of kPanel slots, each [H, kPanel]: the
// product's weight rows then lie kPanel floats apart, not a row of the cache apart (behind a
// shared prefix of 1,024 slots every key row was 4 KiB from the next, in one set of the L1 cache:
// 40-45 -> 38-40 ms a layer of that admission in float32), and 16-bit keys are widened once per
// tile, not once per block of query rows.
template <typename W>
void PackKeys(const W* k, int64_t slots, int64_t j0, int64_t n, int64_t head_dim, float* packed) {
  for (int64_t p0 = 0; p0 < n; p0 += kPanel) {
    const int64_t width = std::min(kPanel, n - p0);
    float* panel = packed + p0 * head_dim;
    for (int64_t h = 0; h < head_dim; ++h) {
      const W* from = k + h * slots + j0 + p0;
      for (int64_t j = 0; j < width; ++j) panel[h * kPanel + j] = Scalar(from + j);
    }
  }
}

// o [H] = the mean of every slot's value of both parts (what XLA's softmax gives a query whose
// every score is masked).
template <typename W>
void MeanOfValues(const Keys<W>* parts, int n_parts, int64_t head_dim, float* o) {
  int64_t count = 0;
  std::fill(o, o + head_dim, 0.0f);
  for (int p = 0; p < n_parts; ++p) {
    for (int64_t j = 0; j < parts[p].n; ++j, ++count) {
      for (int64_t h = 0; h < head_dim; ++h) o[h] += Scalar(parts[p].v + j * head_dim + h);
    }
  }
  for (int64_t h = 0; h < head_dim; ++h) o[h] = count ? o[h] / count : 0.0f;
}

// out [rows, H] = softmax(q k / sqrt(H)) v over both parts' keys, for the query rows r0 .. r0+rows-1
// of one row and kv head (q [rows, H], in the cache's type).
template <typename W>
void AttendTask(Isa isa, const W* q, float* out, int64_t r0, int64_t rows, int64_t head_dim, int64_t positions,
                const Keys<W>* parts, int n_parts, const float* sinks, Scratch& s) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (int64_t i = 0; i < rows * head_dim; ++i) s.q[i] = Scalar(q + i) * scale;
  std::fill(s.out.begin(), s.out.begin() + rows * head_dim, 0.0f);
  std::fill(s.max.begin(), s.max.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.sum.begin(), s.sum.end(), 0.0f);
  for (int64_t r = 0; sinks != nullptr && r < rows; ++r) {  // the sink's term: exp(sink - sink) under max = sink
    s.max[r] = sinks[(r0 + r) / positions];
    s.sum[r] = 1.0f;
  }
  for (int p = 0; p < n_parts; ++p) {
    const Keys<W>& keys = parts[p];
    for (int64_t j0 = 0; j0 < keys.n; j0 += kKeys) {
      const int64_t n = std::min(kKeys, keys.n - j0);
      const int seen = Visibility(keys, r0, rows, positions, j0, n);
      if (seen == 0) continue;
      float* scores = s.scores.data();
      PackKeys(keys.k, keys.n, j0, n, head_dim, s.keys.data());
      for (int64_t p0 = 0; p0 < n; p0 += kPanel) {
        Product(isa, s.q.data(), head_dim, s.keys.data() + p0 * head_dim, kPanel, scores + p0, kKeys, rows,
                std::min(kPanel, n - p0), head_dim, true);
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* row = scores + r * kKeys;
        if (seen == 1) {
          for (int64_t j = 0; j < n; ++j) row[j] = Visible(keys, (r0 + r) % positions, j0 + j) ? row[j] : kNeg;
        }
        const float top = std::max(s.max[r], Max(isa, row, n));
        if (top > s.max[r]) {  // rescale what was summed under the old maximum
          const float shrink = ExpScalar(s.max[r] - top);
          s.sum[r] *= shrink;
          float* o = s.out.data() + r * head_dim;
          for (int64_t h = 0; h < head_dim; ++h) o[h] *= shrink;
          s.max[r] = top;
        }
        s.sum[r] += ExpSum(isa, row, n, top);
      }
      const float* values = Values(keys.v + j0 * head_dim, n * head_dim, s.values.data());
      Product(isa, scores, kKeys, values, head_dim, s.out.data(), head_dim, rows, head_dim, n, false);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * head_dim;
    if (s.max[r] == kNeg || s.sum[r] == 0.0f) {  // no key visible: every key weighs the same, as XLA's softmax
      MeanOfValues(parts, n_parts, head_dim, o);
      continue;
    }
    const float inverse = 1.0f / s.sum[r];
    for (int64_t h = 0; h < head_dim; ++h) o[h] = s.out[r * head_dim + h] * inverse;
  }
}

// x rounded to the cache's type W (bfloat16: to nearest, ties to even), as a float.
template <typename W>
float AsStored(float x) {
  if constexpr (std::is_same_v<W, float>) {
    return x;
  } else {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(&x, &bits, sizeof bits);
    return x;
  }
}

constexpr int64_t kPrefetchBytes = 32 << 10;  // a task's keys, all parts (and as many values) fetched ahead, at most
// A decode call's cache of at least this many bytes is taken to be read from memory (a cache that
// fits the cores' L2 caches stays there between steps, where fetching ahead only costs: batch 1's).
constexpr int64_t kPrefetchFrom = 4 << 20;
constexpr int64_t kScoreFloats = 4096;  // scores per block of the decode path (16 KiB), 256 slots at least

// y[r, 0 .. n) += a[r] x[0 .. n) for r < rows (y's rows y_stride apart): each vector of x loaded
// once for all the rows.
template <typename W>
__attribute__((target("avx512f"))) void AxpyRowsAvx512(const float* a, int64_t rows, const W* x, int64_t n, float* y,
                                                       int64_t y_stride) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 xv = Load16(x + j);
    for (int64_t r = 0; r < rows; ++r) {
      float* yr = y + r * y_stride + j;
      _mm512_storeu_ps(yr, _mm512_fmadd_ps(_mm512_set1_ps(a[r]), xv, _mm512_loadu_ps(yr)));
    }
  }
  for (; j < n; ++j) {
    for (int64_t r = 0; r < rows; ++r) y[r * y_stride + j] += a[r] * Scalar(x + j);
  }
}

template <typename W>
__attribute__((target("avx2,fma"))) void AxpyRowsAvx2(const float* a, int64_t rows, const W* x, int64_t n, float* y,
                                                      int64_t y_stride) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 xv = Load8(x + j);
    for (int64_t r = 0; r < rows; ++r) {
      float* yr = y + r * y_stride + j;
      _mm256_storeu_ps(yr, _mm256_fmadd_ps(_mm256_set1_ps(a[r]), xv, _mm256_loadu_ps(yr)));
    }
  }
  for (; j < n; ++j) {
    for (int64_t r = 0; r < rows; ++r) y[r * y_stride + j] += a[r] * Scalar(x + j);
  }
}

template <typename W>
void AxpyRows(Isa isa, const float* a, int64_t rows, const W* x, int64_t n, float* y, int64_t y_stride) {
  if (isa == Isa::kAvx512) return AxpyRowsAvx512(a, rows, x, n, y, y_stride);
  if (isa == Isa::kAvx2) return AxpyRowsAvx2(a, rows, x, n, y, y_stride);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) y[r * y_stride + j] += a[r] * Scalar(x + j);
  }
}

// Slots [lo, hi) of a part outside of which none of the query rows r0 .. r0+rows-1 sees a key
// (lo == hi: it sees none).
template <typename W>
std::pair<int64_t, int64_t> VisibleSlots(const Keys<W>& keys, int64_t r0, int64_t rows, int64_t positions) {
  int64_t lo = keys.n, hi = 0;
  const int64_t masks = keys.used != nullptr ? 1 : std::min(rows, positions);
  for (int64_t r = r0; r < r0 + masks; ++r) {
    for (int64_t j = 0; j < keys.n; ++j) {
      if (Visible(keys, r % positions, j)) {
        lo = std::min(lo, j);
        break;
      }
    }
    for (int64_t j = keys.n - 1; j >= lo; --j) {
      if (Visible(keys, r % positions, j)) {
        hi = std::max(hi, j + 1);
        break;
      }
    }
  }
  return {std::min(lo, hi), hi};
}

// The cache lines of x[0 .. n) fetched ahead, to the cache level kHint names (_MM_HINT_T0 / T1:
// an enum in GCC's headers, a macro in Clang's).
template <auto kHint, typename W>
void Prefetch(const W* x, int64_t n) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(x + n);
  for (uintptr_t line = reinterpret_cast<uintptr_t>(x) & ~uintptr_t{63}; line < end; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(line), kHint);
  }
}

// AttendTask for a few query rows (rows <= kFewRows: a decode step's query heads of one kv head):
// the scores of all the slots any of them sees at once (q [rows, H] times the keys as they lie in
// the cache, [H, slots]), masked, a softmax per row (its probabilities rounded to the cache's type,
// as `layers.Attention._attend_block` rounds them for its product), and the weighted sum of the
// values read in place. Slots outside the visible range of each part are never read. `scratch`:
// the thread's.
template <typename W>
void AttendFew(Isa isa, const W* q, float* out, int64_t r0, int64_t rows, int64_t head_dim, int64_t positions,
               const Keys<W>* parts, int n_parts, const float* sinks, bool prefetch, std::vector<float>& scratch) {
  std::pair<int64_t, int64_t> range[2];
  int64_t width = 0;
  for (int p = 0; p < n_parts; ++p) {
    range[p] = VisibleSlots(parts[p], r0, rows, positions);
    width += range[p].second - range[p].first;
  }
  scratch.resize(rows * (head_dim + width));
  float* q_by_dim = scratch.data();  // [H, rows]: q / sqrt(H), column h for `AxpyRows`
  float* scores = q_by_dim + rows * head_dim;  // [rows, width]: each part's visible slots in turn
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < head_dim; ++h) q_by_dim[h * rows + r] = Scalar(q + r * head_dim + h) * scale;
  }
  // With `prefetch` (a cache read from memory, `kPrefetchFrom`), short keys and values (a decode
  // step's: each key row's part a few cache lines) asked for all at once, the keys into L1, the
  // values into L2: the reads below then wait on about one memory latency instead of one per
  // short run (B 16, 64 of 128 slots written, out of cache: 440 -> 300 us a call on an Emerald
  // Rapids Xeon). Longer runs are left to the hardware's prefetchers.
  if (prefetch && width * head_dim * static_cast<int64_t>(sizeof(W)) <= kPrefetchBytes) {
    for (int p = 0; p < n_parts; ++p) {
      const auto [lo, hi] = range[p];
      if (lo == hi) continue;
      for (int64_t h = 0; h < head_dim; ++h) Prefetch<_MM_HINT_T0>(parts[p].k + h * parts[p].n + lo, hi - lo);
      Prefetch<_MM_HINT_T1>(parts[p].v + lo * head_dim, (hi - lo) * head_dim);
    }
  }
  for (int64_t p = 0, at = 0; p < n_parts; at += range[p].second - range[p].first, ++p) {
    const auto [lo, hi] = range[p];
    if (lo == hi) continue;
    // Blocks of slots, key row by key row: each key row's part of a block is read as one run (a
    // [H, slots] cache walked in 64-slot panels is read as runs of 256 bytes: slower than XLA's
    // products over a 2,048-slot cache), the block's scores (kScoreFloats) staying in the L1 cache.
    const int64_t columns = std::max<int64_t>(256, kScoreFloats / rows);
    for (int64_t c0 = lo; c0 < hi; c0 += columns) {
      const int64_t n = std::min(columns, hi - c0);
      float* block = scores + at + c0 - lo;
      for (int64_t r = 0; r < rows; ++r) std::fill(block + r * width, block + r * width + n, 0.0f);
      for (int64_t h = 0; h < head_dim; ++h) {
        AxpyRows(isa, q_by_dim + h * rows, rows, parts[p].k + h * parts[p].n + c0, n, block, width);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* row = scores + r * width + at - lo;  // (a loop the compiler vectorises: no call, no branch)
      if (parts[p].used != nullptr) {
        const int32_t* used = parts[p].used;
        for (int64_t j = lo; j < hi; ++j) row[j] = used[j] >= 0 ? row[j] : kNeg;
      } else {
        const bool* seen = parts[p].mask + ((r0 + r) % positions) * parts[p].n;
        for (int64_t j = lo; j < hi; ++j) row[j] = seen[j] ? row[j] : kNeg;
      }
    }
  }
  float sums[kFewRows];
  for (int64_t r = 0; r < rows; ++r) {  // the probabilities, in the cache's type as XLA's path (and HF's) has them
    float* row = scores + r * width;
    const float sink = sinks != nullptr ? sinks[(r0 + r) / positions] : kNeg;
    const float top = std::max(width > 0 ? Max(isa, row, width) : kNeg, sink);
    sums[r] = top == kNeg ? 0.0f : ExpSum(isa, row, width, top) + (sinks != nullptr ? ExpScalar(sink - top) : 0.0f);
    for (int64_t j = 0; sums[r] > 0.0f && j < width; ++j) row[j] = AsStored<W>(row[j] / sums[r]);
  }
  std::fill(out, out + rows * head_dim, 0.0f);
  for (int64_t p = 0, at = 0; p < n_parts; at += range[p].second - range[p].first, ++p) {
    const auto [lo, hi] = range[p];
    if (lo == hi) continue;
    Product(isa, scores + at, width, parts[p].v + lo * head_dim, head_dim, out, head_dim, rows, head_dim, hi - lo,
            false);
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (sums[r] == 0.0f) MeanOfValues(parts, n_parts, head_dim, out + r * head_dim);  // no key visible
  }
}

// q [B, K, M, H] (M = G x T: a kv head's G query heads, each at T positions), k [B, K, H, S],
// v [B, K, S, H], mask [B, T, S], shared_k [K, H, U], shared_v [K, U, H], shared_used [B, U]
// (U may be 0), sinks [K, G] or nullptr -> out [B, K, M, H] float32.
template <typename W>
ffi::Future Attend(ffi::ThreadPool pool, const W* q, const W* k, const W* v, const bool* mask, const W* shared_k,
                   const W* shared_v, const int32_t* shared_used, const float* sinks, float* out, int64_t batch,
                   int64_t kv_heads, int64_t m, int64_t head_dim, int64_t positions, int64_t slots,
                   int64_t shared_slots) {
  static const Isa isa = Detect();
  const int64_t blocks = (m + kQueryRows - 1) / kQueryRows, n_tasks = batch * kv_heads * blocks;
  struct Shared {
    std::atomic<int64_t> next{0};
  };
  auto shared = std::make_shared<Shared>();
  const int64_t n_threads = std::max<int64_t>(1, std::min<int64_t>(n_tasks, pool.num_threads()));
  const bool few = m <= kFewRows;
  const bool prefetch =
      (batch * kv_heads * slots + kv_heads * shared_slots) * head_dim * 2 * static_cast<int64_t>(sizeof(W)) >=
      kPrefetchFrom;
  return OnThreads(pool, n_threads, [=](int64_t) {
    thread_local std::vector<float> few_scratch;
    std::unique_ptr<Scratch> scratch = few ? nullptr : std::make_unique<Scratch>(head_dim);
    for (int64_t task = shared->next.fetch_add(1); task < n_tasks; task = shared->next.fetch_add(1)) {
      const int64_t group = task / blocks, b = group / kv_heads, kv = group % kv_heads;
      const int64_t r0 = (task % blocks) * kQueryRows, rows = std::min(kQueryRows, m - r0);
      const Keys<W> parts[2] = {
          {shared_k + kv * head_dim * shared_slots, shared_v + kv * shared_slots * head_dim, shared_slots, nullptr,
           shared_used + b * shared_slots},
          {k + group * head_dim * slots, v + group * slots * head_dim, slots, mask + b * positions * slots, nullptr},
      };
      const int64_t at = (group * m + r0) * head_dim;
      const float* head_sinks = sinks != nullptr ? sinks + kv * (m / positions) : nullptr;  // this kv head's G
      if (few) {
        AttendFew(isa, q + at, out + at, r0, rows, head_dim, positions, parts, 2, head_sinks, prefetch, few_scratch);
      } else {
        AttendTask(isa, q + at, out + at, r0, rows, head_dim, positions, parts, 2, head_sinks, *scratch);
      }
    }
  });
}

template <ffi::DataType T>
ffi::Future Typed(ffi::ThreadPool pool, ffi::Buffer<T, 4> q, ffi::Buffer<T, 4> k, ffi::Buffer<T, 4> v,
                  ffi::Buffer<ffi::PRED, 3> mask, ffi::Buffer<T, 3> shared_k, ffi::Buffer<T, 3> shared_v,
                  ffi::Buffer<ffi::S32, 2> shared_used, ffi::Buffer<ffi::F32, 2> sinks,
                  ffi::Result<ffi::Buffer<ffi::F32, 4>> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions(),
             sk = shared_k.dimensions(), sv = shared_v.dimensions(), su = shared_used.dimensions(),
             sd = sinks.dimensions();
  const int64_t b = qd[0], kv = qd[1], m = qd[2], h = qd[3], s = kd[3], t = md[1], u = sk[2];
  const bool ok = kd[0] == b && kd[1] == kv && kd[2] == h && vd[0] == b && vd[1] == kv && vd[2] == s && vd[3] == h &&
                  md[0] == b && md[2] == s && t >= 1 && m % t == 0 && sk[0] == kv && sk[1] == h && sv[0] == kv &&
                  sv[1] == u && sv[2] == h && su[0] == b && su[1] == u && sd[0] == kv && (sd[1] == 0 || sd[1] * t == m);
  if (!ok) {
    return Failed("attention: q [B, K, M, H], k [B, K, H, S], v [B, K, S, H], mask [B, T, S] (T dividing M), "
                  "shared k [K, H, U], shared v [K, U, H], shared positions [B, U], sinks [K, M / T] or [K, 0]");
  }
  using W = std::conditional_t<T == ffi::F32, float, uint16_t>;  // bfloat16 as its bits
  auto data = [](auto& buffer) { return reinterpret_cast<const W*>(buffer.untyped_data()); };
  return Attend<W>(pool, data(q), data(k), data(v), reinterpret_cast<const bool*>(mask.untyped_data()),
                   data(shared_k), data(shared_v), shared_used.typed_data(), sd[1] > 0 ? sinks.typed_data() : nullptr,
                   out->typed_data(), b, kv, m, h, t, s, u);
}

// Arguments: q, k, v, mask, shared k, shared v, shared positions, sinks (see Attend); result: float32 out.
template <ffi::DataType T>
auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .template Arg<ffi::Buffer<T, 4>>()
      .template Arg<ffi::Buffer<T, 4>>()
      .template Arg<ffi::Buffer<T, 4>>()
      .template Arg<ffi::Buffer<ffi::PRED, 3>>()
      .template Arg<ffi::Buffer<T, 3>>()
      .template Arg<ffi::Buffer<T, 3>>()
      .template Arg<ffi::Buffer<ffi::S32, 2>>()
      .template Arg<ffi::Buffer<ffi::F32, 2>>()
      .template Ret<ffi::Buffer<ffi::F32, 4>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerF32Attention, Typed<ffi::F32>, Binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerBf16Attention, Typed<ffi::BF16>, Binding<ffi::BF16>());
