// Tasks dealt to threads as they free up, not in fixed shares: on a machine shared with other
// work (a cloud VM, a busy laptop) one thread often runs slower than the others for part of a
// call, and a static split makes the whole call wait for it.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace attnx::cpu {

// Runs of consecutive tasks of [0, n), taken by any thread. Guided sizes (what is left over
// twice the thread count): early runs are long, so a thread keeps its per-head operands packed
// across many tasks (the backward's; the forward packs K and V for all threads beforehand),
// and the last ones are single tasks, so threads finish together.
class TaskQueue {
 public:
  TaskQueue(int64_t n, int64_t threads) : n_(n), threads_(std::max<int64_t>(1, threads)) {}

  // Sets [begin, end) to the next run; false once every task is taken.
  bool take(int64_t& begin, int64_t& end) {
    int64_t b = next_.load(std::memory_order_relaxed);
    while (b < n_) {
      const int64_t e = b + std::max<int64_t>(1, (n_ - b) / (2 * threads_));
      if (next_.compare_exchange_weak(b, e, std::memory_order_relaxed)) {
        begin = b, end = e;
        return true;
      }
    }
    return false;
  }

 private:
  const int64_t n_, threads_;
  std::atomic<int64_t> next_{0};
};

// One thread's view of the queue: its tasks one at a time, in runs taken as it needs them.
class Tasks {
 public:
  explicit Tasks(TaskQueue& queue) : queue_(queue) {}
  bool next(int64_t& task) {
    if (cur_ == end_ && !queue_.take(cur_, end_)) return false;
    task = cur_++;
    return true;
  }

 private:
  TaskQueue& queue_;
  int64_t cur_ = 0, end_ = 0;
};

// worker(tasks) on each of at::parallel_for's threads: a worker sets up its per-thread state
// once, then runs `for (int64_t task; tasks.next(task);)`. Nested in a parallel region, one
// worker runs and takes every task.
template <typename Worker>
void parallel_tasks(int64_t n, Worker&& worker) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  TaskQueue queue(n, threads);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Tasks tasks(queue);
    worker(tasks);
  });
}

}  // namespace attnx::cpu
