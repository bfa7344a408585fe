// Tasks of one FFI call spread over threads (shared by the CPU kernels).
//
// The calling thread and up to `threads - 1` helpers claim task indices from one counter until none is
// left; the call returns when every task has run. Each thread gets its own Scratch, built once per
// thread and call and passed to every task it runs.
//
// Helpers are the kernels' own threads (SpinningHelpers), which keep polling for the next call for a
// short while after each one: a decode step makes about 150 kernel calls of 20 to 300 microseconds, and
// waking a sleeping thread of XLA's intra-op pool for each cost tens of microseconds a call (SmolLM2 bf16
// decode on 2 AVX2 cores, quiet: 45.6 tok/s on XLA's pool, 67.3 with these helpers). A call made while
// another thread's call holds the helpers runs its tasks on XLA's pool instead.

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxlongctx {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Persistent helper threads for one caller at a time. `run(helpers, work)` publishes `work` as a new
// generation; each of the first `helpers` threads runs it once unless the caller, done with its own
// share, claims that thread's turn first (a helper still asleep is then not waited for).
class SpinningHelpers {
 public:
  static constexpr auto kSpin = std::chrono::microseconds(300);  // polling after a call, then sleep

  // The process's helpers (created on first use, never destroyed: threads may outlive static destructors).
  static SpinningHelpers& instance(int64_t count) {
    static SpinningHelpers* helpers = new SpinningHelpers(count);
    return *helpers;
  }

  int64_t size() const { return static_cast<int64_t>(slots_.size()); }

  // Runs work() on the calling thread and on up to `helpers` helper threads; returns when every run
  // that started has finished. False (nothing run) when another caller holds the helpers.
  bool run(int64_t helpers, const std::function<void()>& work) {
    std::unique_lock<std::mutex> caller(caller_mu_, std::try_to_lock);
    if (!caller.owns_lock()) return false;
    helpers = std::min(helpers, size());
    work_ = &work;
    const uint64_t g = generation_.load() + 1;
    // every slot's turn is settled in every generation (here: the helpers not asked are skipped), so a
    // helper that read an older generation late cannot claim it
    for (int64_t h = helpers; h < size(); ++h) slots_[h].claimed.store(g);
    generation_.store(g);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      wake_.notify_all();
    }
    work();
    for (int64_t h = 0; h < helpers; ++h) {
      Slot& slot = slots_[h];
      uint64_t seen = slot.claimed.load();
      if (seen < g && slot.claimed.compare_exchange_strong(seen, g)) continue;  // not started: skipped
      for (int64_t i = 1; slot.finished.load(std::memory_order_acquire) != g; ++i) {
        cpu_relax();
        if (i % 4096 == 0) std::this_thread::yield();  // a helper descheduled mid-task (a loaded machine)
      }
    }
    return true;
  }

 private:
  struct Slot {
    alignas(64) std::atomic<uint64_t> claimed{0};  // the last generation this helper ran or was skipped in
    std::atomic<uint64_t> finished{0};             // the last generation it finished running
  };

  explicit SpinningHelpers(int64_t count) : slots_(std::max<int64_t>(count, 0)) {
    for (int64_t h = 0; h < size(); ++h) std::thread([this, h] { loop(h); }).detach();
  }

  void loop(int64_t h) {
    Slot& slot = slots_[h];
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = wait_for_next(seen);
      seen = g;
      uint64_t claimed = slot.claimed.load();
      if (claimed >= g || !slot.claimed.compare_exchange_strong(claimed, g)) continue;  // skipped
      (*work_)();
      slot.finished.store(g, std::memory_order_release);
    }
  }

  // The next generation after `seen`: polled for kSpin, then waited for asleep.
  uint64_t wait_for_next(uint64_t seen) {
    auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0;; ++i) {
      const uint64_t g = generation_.load(std::memory_order_acquire);
      if (g != seen) return g;
      cpu_relax();
      if (i % 256 == 255 && std::chrono::steady_clock::now() - start > kSpin) break;
    }
    std::unique_lock<std::mutex> lock(sleep_mu_);
    sleepers_.fetch_add(1);
    wake_.wait(lock, [&] { return generation_.load() != seen; });
    sleepers_.fetch_sub(1);
    return generation_.load();
  }

  std::vector<Slot> slots_;
  std::mutex caller_mu_;  // one caller at a time
  const std::function<void()>* work_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> sleepers_{0};
  std::mutex sleep_mu_;
  std::condition_variable wake_;
};

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

    int64_t work() {  // the tasks this thread ran
      int64_t t = next.fetch_add(1);
      if (t >= tasks) return 0;
      Scratch scratch{};
      int64_t finished = 0;
      for (; t < tasks; t = next.fetch_add(1), ++finished) run(t, scratch);
      return finished;
    }
  };
  auto shared = std::make_shared<Shared>();
  shared->run = std::move(run);
  shared->tasks = tasks;
  const int64_t helpers = std::min(threads, tasks) - 1;
  if (helpers <= 0) return (void)shared->work();
  const std::function<void()> work = [&shared] { shared->work(); };
  if (SpinningHelpers::instance(pool.num_threads() - 1).run(helpers, work)) return;
  // another caller holds the helpers: XLA's pool (a helper that starts after the last task was claimed
  // touches only the shared state, which its shared_ptr keeps alive)
  auto finish = [](Shared& s, int64_t finished) {
    std::lock_guard<std::mutex> lock(s.mu);
    s.done += finished;
    if (s.done == s.tasks) s.all_done.notify_all();
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([shared, finish] { finish(*shared, shared->work()); });
  finish(*shared, shared->work());
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->all_done.wait(lock, [&] { return shared->done == shared->tasks; });
}

}  // namespace jaxlongctx
