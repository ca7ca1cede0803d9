// Per-thread scratch stacks; contract in runtime/scratch.h.
#include "runtime/scratch.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

namespace halyard::runtime::scratch {
namespace {

constexpr size_t kAlign = 128;
// Address space, not memory: pages count once touched. 64 GiB a thread
// leaves room for hundreds of threads in x86-64's 128 TiB.
constexpr size_t kReserve = size_t{1} << 36;

size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Stack;

// Every thread's stack with its reservation, for resident().
std::mutex stacks_mu;
std::vector<Stack*>& stacks() {
  static auto* all = new std::vector<Stack*>;  // outlives threads' exits at shutdown
  return *all;
}

// Before every block; kAlign bytes, so the block after it stays aligned.
struct alignas(kAlign) Header {
  Stack* owner;      // nullptr: the block came from malloc
  size_t below;      // the stack's top before this block
  size_t prev_live;  // the block allocated before it (its offset + 1; 0: none)
  std::atomic<bool> freed;
};
static_assert(sizeof(Header) == kAlign);

struct Stack {
  char* base = nullptr;
  bool refused = false;  // the address space was refused: malloc from then on
  std::atomic<size_t> top{0}, high{0};  // read by resident() and trim() from other threads
  size_t last = 0;  // the newest block's offset + 1 (0: none)

  ~Stack() {
    if (!base) return;
    {
      std::lock_guard<std::mutex> lock(stacks_mu);
      std::vector<Stack*>& all = stacks();
      all.erase(std::find(all.begin(), all.end(), this));
    }
    // Blocks still held (released later from another thread, or never)
    // keep the reservation: unmapping it would pull memory from under them.
    if (last == 0) munmap(base, kReserve);
  }
  Header* at(size_t off) { return reinterpret_cast<Header*>(base + off); }
  // Blocks freed out of order leave when the blocks above them have.
  void pop() {
    while (last) {
      Header* h = at(last - 1);
      if (!h->freed.load(std::memory_order_acquire)) break;
      top.store(h->below, std::memory_order_relaxed);
      last = h->prev_live;
    }
  }
  Header* push(size_t bytes) {
    if (!base && !refused) {
      void* p = mmap(nullptr, kReserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) {
        refused = true;
      } else {
        base = static_cast<char*>(p);
        std::lock_guard<std::mutex> lock(stacks_mu);
        stacks().push_back(this);
      }
    }
    pop();
    const size_t need = sizeof(Header) + round_up(bytes);
    const size_t at_top = top.load(std::memory_order_relaxed);
    if (!base || need > kReserve - at_top) return nullptr;
    Header* h = at(at_top);
    h->owner = this;
    h->below = at_top;
    h->prev_live = last;
    h->freed.store(false, std::memory_order_relaxed);
    last = at_top + 1;
    top.store(at_top + need, std::memory_order_relaxed);
    if (at_top + need > high.load(std::memory_order_relaxed)) high.store(at_top + need, std::memory_order_relaxed);
    return h;
  }
};

thread_local Stack stack;

}  // namespace

bool stacks_enabled() {
  // ASan keeps its own books on malloc's blocks; kernels' scratch goes
  // there so that an overrun past a block is still caught.
#if defined(__SANITIZE_ADDRESS__)
  return false;
#elif defined(__has_feature)
  return !__has_feature(address_sanitizer);
#else
  return true;
#endif
}

void* allocate(size_t bytes) {
  Header* h = stacks_enabled() ? stack.push(bytes) : nullptr;
  if (!h) {
    void* p = std::aligned_alloc(kAlign, sizeof(Header) + round_up(bytes));
    if (!p) return nullptr;
    h = new (p) Header{nullptr, 0, 0, {false}};
  }
  return h + 1;
}

void release(void* p) {
  if (!p) return;
  Header* h = static_cast<Header*>(p) - 1;
  if (!h->owner) {
    h->~Header();
    std::free(h);
    return;
  }
  h->freed.store(true, std::memory_order_release);
  if (h->owner == &stack) stack.pop();  // another thread's stack pops it on its next call
}

int64_t in_use() { return static_cast<int64_t>(stack.top.load()); }
int64_t high_water() { return static_cast<int64_t>(stack.high.load()); }

void trim() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::lock_guard<std::mutex> lock(stacks_mu);
  for (Stack* s : stacks()) {
    const size_t keep = (s->top.load() + page - 1) / page * page, high = s->high.load();
    if (high > keep) madvise(s->base + keep, high - keep, MADV_DONTNEED);
    s->high.store(s->top.load());
  }
}

int64_t resident() {
  std::lock_guard<std::mutex> lock(stacks_mu);
  int64_t sum = 0;
  for (const Stack* s : stacks()) sum += static_cast<int64_t>(s->high.load());
  return sum;
}

}  // namespace halyard::runtime::scratch
