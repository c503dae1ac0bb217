// What every kernel of this folder shares: work split over XLA's intra-op thread pool, and an
// error returned as a future.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace mesh_transformer {

// `work(t)` for t in 0 .. n_tasks-1 on n_tasks threads of the pool (this one and n_tasks - 1
// scheduled), done when all return.
template <typename F>
xla::ffi::Future OnThreads(xla::ffi::ThreadPool& pool, int64_t n_tasks, F work) {
  xla::ffi::CountDownPromise done(n_tasks);
  for (int64_t t = 1; t < n_tasks; ++t) {
    pool.Schedule([=]() mutable {
      work(t);
      done.CountDown();
    });
  }
  work(0);
  done.CountDown();
  return xla::ffi::Future(done);
}

// `work(item)` for item in 0 .. n_items-1, taken in turn by up to the pool's threads (one that
// starts late takes fewer), done when all are.
template <typename F>
xla::ffi::Future InTurn(xla::ffi::ThreadPool& pool, int64_t n_items, F work) {
  auto next = std::make_shared<std::atomic<int64_t>>(0);
  const int64_t n_tasks = std::max<int64_t>(1, std::min<int64_t>(n_items, pool.num_threads()));
  return OnThreads(pool, n_tasks, [=](int64_t) {
    for (int64_t item = next->fetch_add(1); item < n_items; item = next->fetch_add(1)) work(item);
  });
}

inline xla::ffi::Future Failed(const char* message) {
  xla::ffi::Promise promise;
  xla::ffi::Future future(promise);
  promise.SetError(xla::ffi::Error::InvalidArgument(message));
  return future;
}

}  // namespace mesh_transformer
