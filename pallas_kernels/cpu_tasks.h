// Tasks of one FFI call spread over XLA's intra-op thread pool (shared by the CPU kernels).
//
// The calling thread and up to `threads - 1` pool helpers claim task indices from one counter until
// none is left; the call returns when every task has run. A helper that starts after the last task
// was claimed (the pool may run it late) touches only the shared state, which its shared_ptr keeps
// alive. Each thread gets its own Scratch, built once per thread and passed to every task it runs.

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxlongctx {

template <typename Scratch>
void run_tasks(xla::ffi::ThreadPool& pool, int64_t threads, int64_t tasks,
               std::function<void(int64_t task, Scratch& scratch)> run) {
  struct Shared {
    std::function<void(int64_t, Scratch&)> run;
    int64_t tasks;
    std::atomic<int64_t> next{0};
    int64_t done = 0;
    std::mutex mu;
    std::condition_variable all_done;

    void work() {
      int64_t t = next.fetch_add(1);
      if (t >= tasks) return;
      Scratch scratch{};
      int64_t finished = 0;
      for (; t < tasks; t = next.fetch_add(1), ++finished) run(t, scratch);
      std::lock_guard<std::mutex> lock(mu);
      done += finished;
      if (done == tasks) all_done.notify_all();
    }
  };
  auto shared = std::make_shared<Shared>();
  shared->run = std::move(run);
  shared->tasks = tasks;
  const int64_t helpers = std::min(threads, tasks) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([shared] { shared->work(); });
  shared->work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->all_done.wait(lock, [&] { return shared->done == shared->tasks; });
}

}  // namespace jaxlongctx
