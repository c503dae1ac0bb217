// Sampling's truncation per row, top-k then top-p (nucleus), as a threshold on the logits' order
// keys: which tokens a row may draw from, without sorting its vocabulary.
//
// Why: XLA:CPU has no selection. The library's XLA path finds each threshold by bisection over the
// 2^32 float32 values, 32 masked passes over [B, V]: at a 64-row serving batch of a 50k vocabulary
// top-p 0.9 cost 55 ms a decode step (the 4-layer bench model's whole step at greedy: 34 ms), top-k
// 40 17 ms. A sort of the vocabulary per row is slower still.
//
// How: one pass per row puts each token in a bucket by its unnormalised probability
// e = exp(logit - max) (kStepsPerOctave buckets per power of two, from e's exponent and mantissa
// bits; the largest e first) and sums each bucket's count and mass. The cumulative counts name the
// bucket holding the k-th largest token, the cumulative masses the one where the nucleus ends;
// every token of an earlier bucket has a larger logit than every token of that one (e grows with
// the logit), so only that bucket's tokens are selected among (nth_element for top-k; a
// quickselect on mass for top-p). Masses are summed in double.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using mesh_transformer::Failed;
using mesh_transformer::OnThreads;

constexpr int32_t kNone = std::numeric_limits<int32_t>::min();  // no threshold: every token kept
constexpr int kStepsPerOctave = 8;                               // e's top 3 mantissa bits
constexpr int kOctaves = 64;                                     // e below 2^-63: the last bucket
constexpr int kBuckets = kOctaves * kStepsPerOctave + 1;
constexpr int64_t kSorted = 32;  // a quickselect's range this small is sorted instead

// An int32 ordered as the float32 values are (-inf lowest; -0.0 and 0.0 the same): the library's
// `sampling._order_key`.
inline int32_t OrderKey(float x) {
  if (x == 0.0f) x = 0.0f;
  int32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits < 0 ? bits ^ 0x7FFFFFFF : bits;
}

// e in (0, 1] -> its bucket, 0 for the largest values; 0, NaN and e < 2^-63 -> the last.
inline int Bucket(float e) {
  if (!(e > 0.0f)) return kBuckets - 1;
  uint32_t bits;
  std::memcpy(&bits, &e, sizeof bits);
  const int octave = 127 - static_cast<int>(bits >> 23);  // e in [2^-o, 2^(1-o))
  if (octave < 0) return 0;
  if (octave >= kOctaves) return kBuckets - 1;
  return octave * kStepsPerOctave + (kStepsPerOctave - 1 - static_cast<int>((bits >> 20) & 7));
}

struct Token {
  int32_t key;
  float e;
};

// The largest key v with above + mass(tokens[key >= v]) >= target (the last token a nucleus needs,
// ties with it included); every token outside `tokens` counted in `above` has a larger key. The
// smallest key when rounding leaves the target unreached; kNone when there are no tokens.
int32_t MassSelect(std::vector<Token>& tokens, double above, double target) {
  if (tokens.empty()) return kNone;
  int64_t lo = 0, hi = static_cast<int64_t>(tokens.size());
  while (hi - lo > kSorted) {
    int32_t a = tokens[lo].key, b = tokens[(lo + hi) / 2].key, c = tokens[hi - 1].key;
    const int32_t pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));  // median of three
    // Three-way partition of [lo, hi): keys > pivot, == pivot, < pivot.
    int64_t greater = lo, i = lo, less = hi;
    double greater_mass = 0.0, equal_mass = 0.0;
    while (i < less) {
      const Token t = tokens[i];
      if (t.key > pivot) {
        greater_mass += t.e;
        std::swap(tokens[greater++], tokens[i++]);
      } else if (t.key < pivot) {
        std::swap(tokens[i], tokens[--less]);
      } else {
        equal_mass += t.e;
        ++i;
      }
    }
    if (above + greater_mass >= target) {
      hi = greater;
    } else if (above + greater_mass + equal_mass >= target) {
      return pivot;
    } else {
      above += greater_mass + equal_mass;
      lo = less;
    }
  }
  std::sort(tokens.begin() + lo, tokens.begin() + hi, [](const Token& x, const Token& y) { return x.key > y.key; });
  for (int64_t i = lo; i < hi; ++i) {
    above += tokens[i].e;
    if ((i + 1 == hi || tokens[i + 1].key != tokens[i].key) && above >= target) return tokens[i].key;
  }
  return lo < hi ? tokens[hi - 1].key : kNone;
}

struct Scratch {
  std::vector<uint16_t> bucket;
  std::vector<int32_t> keys;
  std::vector<Token> tokens;
};

// One row's threshold: tokens with keys >= it survive top-k then top-p.
int32_t RowFloor(const float* logits, const float* e, int64_t vocab, int32_t top_k, float top_p, Scratch& s) {
  const bool by_k = top_k > 0 && top_k < vocab, by_p = top_p < 1.0f;
  if (!by_k && !by_p) return kNone;
  int64_t count[kBuckets] = {0};
  double mass[kBuckets] = {0.0};
  s.bucket.resize(vocab);
  for (int64_t i = 0; i < vocab; ++i) {
    const int b = Bucket(e[i]);
    s.bucket[i] = static_cast<uint16_t>(b);
    ++count[b];
    mass[b] += b == kBuckets - 1 ? 0.0 : e[i];
  }
  int32_t k_floor = kNone;
  if (by_k) {  // the k-th largest key
    int64_t before = 0;
    int b = 0;
    while (before + count[b] < top_k) before += count[b++];
    s.keys.clear();
    for (int64_t i = 0; i < vocab; ++i) {
      if (s.bucket[i] == b) s.keys.push_back(OrderKey(logits[i]));
    }
    const auto nth = s.keys.begin() + (top_k - before - 1);
    std::nth_element(s.keys.begin(), nth, s.keys.end(), std::greater<int32_t>());
    k_floor = *nth;
  }
  if (!by_p) return k_floor;
  s.tokens.clear();
  double above = 0.0, target;
  if (by_k) {  // the nucleus of the top-k tokens' distribution
    double total = 0.0;
    for (int64_t i = 0; i < vocab; ++i) {
      const int32_t key = OrderKey(logits[i]);
      if (key < k_floor) continue;
      const float p = s.bucket[i] == kBuckets - 1 ? 0.0f : e[i];
      s.tokens.push_back({key, p});
      total += p;
    }
    target = top_p * total;
  } else {
    double total = 0.0;
    for (int b = 0; b < kBuckets; ++b) total += mass[b];
    target = top_p * total;
    int b = 0;
    while (b < kBuckets - 1 && above + mass[b] < target) above += mass[b++];
    for (int64_t i = 0; i < vocab; ++i) {
      if (s.bucket[i] == b) s.tokens.push_back({OrderKey(logits[i]), b == kBuckets - 1 ? 0.0f : e[i]});
    }
  }
  return std::max(k_floor, MassSelect(s.tokens, above, target));
}

// logits [B, V] float32, e [B, V] = exp(logits - each row's max), top_k [B] (0: none), top_p [B]
// (1: none) -> floor [B] int32: a row keeps the tokens whose order key is >= its floor.
ffi::Future TruncationFloor(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> e,
                            ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p,
                            ffi::ResultBuffer<ffi::S32> floor) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || e.dimensions().size() != 2 || e.dimensions()[0] != dims[0] ||
      e.dimensions()[1] != dims[1] || top_k.element_count() != dims[0] || top_p.element_count() != dims[0] ||
      floor->element_count() != dims[0]) {
    return Failed("truncation floor: logits and e must be [B, V], top_k, top_p and the floor [B]");
  }
  const int64_t rows = dims[0], vocab = dims[1];
  const int64_t n_tasks = std::clamp<int64_t>(pool.num_threads(), 1, std::max<int64_t>(rows, 1));
  const float *l = logits.typed_data(), *x = e.typed_data(), *p = top_p.typed_data();
  const int32_t* k = top_k.typed_data();
  int32_t* out = floor->typed_data();
  return OnThreads(pool, n_tasks, [=](int64_t t) {
    Scratch scratch;
    for (int64_t r = rows * t / n_tasks; r < rows * (t + 1) / n_tasks; ++r) {
      out[r] = RowFloor(l + r * vocab, x + r * vocab, vocab, k[r], p[r], scratch);
    }
  });
}

}  // namespace

// Arguments: logits [B, V] float32, e [B, V] float32, top_k int32 [B], top_p float32 [B];
// result: floor int32 [B].
XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshTransformerTruncationFloor, TruncationFloor,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
