// The host harness's scheduler: blocks in a shuffled order, a block's threads as fibers
// (ucontext), barriers and warp collectives (see cuda_host.h).
#include "scheduler.h"

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace attnx {
namespace host {
namespace {

constexpr size_t kStackBytes = 64 * 1024;
constexpr size_t kPage = 4096;
constexpr size_t kMaxSmem = 227 * 1024;  // an H100's opt-in limit per block

enum class Wait { None, Block, Warp, Done };

struct Fiber {
  ucontext_t ctx;
  ThreadPlace place;
  Wait wait = Wait::None;
  void* slot = nullptr;  // its argument of the warp collective it waits in
  // cp.async: copies not committed yet, and committed groups oldest first
  struct Copy {
    void* dst;
    const void* src;  // null: zero-fill
  };
  std::vector<Copy> uncommitted;
  std::deque<std::vector<Copy>> groups;
};

struct Warp {
  int arrived = 0, live = 0;
  const char* what = nullptr;
  uintptr_t key = 0;
};

// A fiber stack with a PROT_NONE page below it, so an overflow faults.
struct Stack {
  void* base = nullptr;
  Stack() {
    base = mmap(nullptr, kStackBytes + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                -1, 0);
    if (base == MAP_FAILED) throw std::runtime_error("attnx host harness: no memory for stacks");
    mprotect(base, kPage, PROT_NONE);
  }
  Stack(Stack&& o) noexcept : base(o.base) { o.base = nullptr; }
  ~Stack() {
    if (base != nullptr) munmap(base, kStackBytes + kPage);
  }
  char* top() const { return static_cast<char*>(base) + kPage; }
};

struct Block {
  const std::function<void()>* body;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<unsigned char> smem;
  std::deque<int> ready;  // runs front first
  std::mt19937_64 rng;
  ucontext_t scheduler;
  int current = -1, live = 0, at_barrier = 0;
  std::string error;
};

thread_local Block* g_block = nullptr;
thread_local std::vector<Stack> g_stacks;
thread_local std::string g_last_error;
uint64_t g_seed = 0;
uint64_t g_last_blocks = 0;  // 0: every block (set_last_blocks)
bool g_sm90 = true;  // set_sm90
size_t g_last_threads = 0;  // last_launch_threads: of launches with dynamic shared memory
size_t g_smem_optin = 0;    // set_smem_optin
thread_local uint64_t g_launches = 0;

Fiber& self() { return g_block->fibers[g_block->current]; }

// Back to the scheduler until this fiber is released (or the block is abandoned).
void suspend() {
  Block& b = *g_block;
  swapcontext(&b.fibers[b.current].ctx, &b.scheduler);
}

// Stops the block with `message`; the fiber never resumes.
[[noreturn]] void fail(const std::string& message) {
  Block& b = *g_block;
  const ThreadPlace& p = self().place;
  b.error = message + " (block (" + std::to_string(p.block.x) + ", " + std::to_string(p.block.y) +
            ", " + std::to_string(p.block.z) + "), thread " + std::to_string(p.thread.x) + ")";
  suspend();
  __builtin_unreachable();
}

// Released fibers run before any fiber that has not reached the barrier, in a shuffled order.
void release(std::vector<int> ids) {
  Block& b = *g_block;
  std::shuffle(ids.begin(), ids.end(), b.rng);
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    b.fibers[*it].wait = Wait::None;
    b.ready.push_front(*it);
  }
}

void release_block_barrier() {
  Block& b = *g_block;
  std::vector<int> ids;
  for (int i = 0; i < int(b.fibers.size()); ++i)
    if (b.fibers[i].wait == Wait::Block) ids.push_back(i);
  b.at_barrier = 0;
  release(ids);
}

void fiber_main() {
  Block& b = *g_block;
  (*b.body)();
  Fiber& f = self();
  for (const auto& group : f.groups)
    if (!group.empty()) fail("a thread exited with cp.async copies it never waited for");
  if (!f.uncommitted.empty()) fail("a thread exited with cp.async copies it never committed");
  f.wait = Wait::Done;
  --b.live;
  Warp& w = b.warps[f.place.warp];
  --w.live;
  if (w.arrived > 0)  // the others wait in a collective this lane never reached
    fail(std::string("a lane exited while its warp waits in ") + w.what);
  if (b.at_barrier > 0 && b.at_barrier == b.live) release_block_barrier();
  // returning resumes uc_link, the scheduler
}

void run_block(Block& b, dim3 grid, dim3 dim, uint3 idx) {
  const int n = int(dim.x * dim.y * dim.z);
  b.fibers.assign(n, Fiber{});
  b.warps.assign((n + 31) / 32, Warp{});
  b.live = n;
  b.at_barrier = 0;
  std::fill(b.smem.begin(), b.smem.end(), 0xFF);  // NaN in fp32, fp16 and bf16: unwritten reads show
  while (int(g_stacks.size()) < n) g_stacks.emplace_back();
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.place = {uint3{unsigned(i % dim.x), unsigned(i / dim.x % dim.y), unsigned(i / (dim.x * dim.y))},
               idx, dim, grid, i / 32, i % 32};
    ++b.warps[i / 32].live;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = g_stacks[i].top();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &b.scheduler;
    makecontext(&f.ctx, fiber_main, 0);
    order[i] = i;
  }
  std::shuffle(order.begin(), order.end(), b.rng);
  b.ready.assign(order.begin(), order.end());
  while (!b.ready.empty() && b.error.empty()) {
    b.current = b.ready.front();
    b.ready.pop_front();
    swapcontext(&b.scheduler, &b.fibers[b.current].ctx);
  }
  if (b.error.empty() && b.live > 0) {
    b.error = "deadlock: " + std::to_string(b.live) + " threads wait in a barrier that cannot " +
              "complete (block (" + std::to_string(idx.x) + ", " + std::to_string(idx.y) + ", " +
              std::to_string(idx.z) + "))";
  }
}

}  // namespace

const ThreadPlace& place() { return self().place; }

unsigned char* dynamic_smem_base() { return g_block->smem.data(); }

bool in_dynamic_smem(const void* ptr, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(ptr);
  const unsigned char* base = g_block->smem.data();
  return p >= base && p + bytes <= base + g_block->smem.size();
}

void misuse(const char* message) { fail(message); }

void async_copy(void* dst, const void* src) {
  if (!in_dynamic_smem(dst, 16) || reinterpret_cast<uintptr_t>(dst) % 16 != 0)
    fail("cp.async to an address that is not 16-byte aligned dynamic shared memory");
  if (reinterpret_cast<uintptr_t>(src) % 16 != 0)
    fail("cp.async from a global address that is not 16-byte aligned");
  self().uncommitted.push_back({dst, src});
}

void async_commit() {
  Fiber& f = self();
  f.groups.push_back(std::move(f.uncommitted));
  f.uncommitted.clear();
}

void async_wait(int n) {
  Fiber& f = self();
  while (int(f.groups.size()) > n) {
    for (const Fiber::Copy& c : f.groups.front()) {
      if (c.src != nullptr)
        std::memcpy(c.dst, c.src, 16);
      else
        std::memset(c.dst, 0, 16);
    }
    f.groups.pop_front();
  }
}

void block_barrier() {
  Block& b = *g_block;
  Fiber& f = self();
  if (b.warps[f.place.warp].arrived > 0)
    fail(std::string("__syncthreads while the warp's other lanes wait in ") +
         b.warps[f.place.warp].what);
  if (b.at_barrier + 1 == b.live) {
    release_block_barrier();
    return;  // the last thread to arrive goes on
  }
  f.wait = Wait::Block;
  ++b.at_barrier;
  suspend();
}

void warp_collective(const char* what, uintptr_t key, void* slot, const WarpWork& work) {
  Block& b = *g_block;
  Fiber& f = self();
  Warp& w = b.warps[f.place.warp];
  if (w.arrived == 0) {
    w.what = what;
    w.key = key;
  } else if (std::strcmp(w.what, what) != 0 || w.key != key) {
    fail(std::string("warp lanes diverge: one calls ") + what + ", another " + w.what +
         " (or the same call with other arguments)");
  }
  f.wait = Wait::Warp;
  f.slot = slot;
  if (++w.arrived < w.live) {
    suspend();
    return;
  }
  if (w.live != 32) fail(std::string(what) + " with exited lanes");
  void* slots[32];
  const int first = f.place.warp * 32;
  std::vector<int> others;
  for (int l = 0; l < 32; ++l) {
    slots[l] = b.fibers[first + l].slot;
    if (first + l != b.current) others.push_back(first + l);
  }
  work(slots);
  w.arrived = 0;
  f.wait = Wait::None;
  release(others);
}

cudaError_t run(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
  const size_t threads = size_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || threads % 32 != 0 || smem > smem_optin()) {
    g_last_error = "invalid launch: " + std::to_string(threads) + " threads (whole warps, at most " +
                   "1024), " + std::to_string(smem) + " bytes of shared memory (at most " +
                   std::to_string(smem_optin()) + ")";
    return cudaErrorInvalidConfiguration;
  }
  if (smem > 0) g_last_threads = threads;  // a tile kernel's launch (last_launch_threads)
  Block b;
  b.body = &body;
  b.smem.resize(std::max<size_t>(smem, 1));
  b.rng.seed(g_seed * 0x9E3779B97F4A7C15ull + g_launches++);
  std::vector<uint3> blocks;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) blocks.push_back(uint3{x, y, z});
  if (g_last_blocks > 0 && blocks.size() > g_last_blocks)
    blocks.erase(blocks.begin(), blocks.end() - ptrdiff_t(g_last_blocks));
  std::shuffle(blocks.begin(), blocks.end(), b.rng);
  Block* outer = g_block;
  g_block = &b;
  for (const uint3& idx : blocks) {
    run_block(b, grid, block, idx);
    if (!b.error.empty()) break;
  }
  g_block = outer;
  if (!b.error.empty()) {
    g_last_error = b.error;
    return cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}

const char* last_error() { return g_last_error.c_str(); }

void set_seed(uint64_t seed) { g_seed = seed; }

void set_last_blocks(uint64_t n) { g_last_blocks = n; }

void set_sm90(bool sm90) { g_sm90 = sm90; }

bool sm90() { return g_sm90; }

void set_smem_optin(size_t bytes) { g_smem_optin = bytes; }

size_t smem_optin() {
  return g_smem_optin ? g_smem_optin : g_sm90 ? kMaxSmem : size_t(163) * 1024;
}

size_t last_launch_threads() { return g_last_threads; }

}  // namespace host
}  // namespace attnx
