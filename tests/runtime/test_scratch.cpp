// Kernel scratch stacks (runtime/scratch.h): blocks leave in any order, a
// stack keeps exactly its deepest nesting, and each thread has its own.
#include "runtime/scratch.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

using namespace halyard::runtime;

TEST(Scratch, BlocksFreedOutOfOrderLeaveWithTheBlocksAboveThem) {
  if (!scratch::stacks_enabled()) GTEST_SKIP() << "this build serves kernel scratch from malloc (ASan)";
  const int64_t before = scratch::in_use();
  void* a = scratch::allocate(1000);
  const int64_t after_a = scratch::in_use();
  void* b = scratch::allocate(3 << 20);
  void* c = scratch::allocate(5);
  for (void* p : {a, b, c}) EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 128, 0u);
  EXPECT_GE(static_cast<char*>(b) - static_cast<char*>(a), 1000);
  EXPECT_GE(static_cast<char*>(c) - static_cast<char*>(b), 3 << 20);
  const int64_t deepest = scratch::in_use();
  scratch::release(b);  // under c: stays
  EXPECT_EQ(scratch::in_use(), deepest);
  scratch::release(c);  // c, then b
  EXPECT_EQ(scratch::in_use(), after_a);
  void* d = scratch::allocate(3 << 20);  // reuses b's place
  EXPECT_EQ(d, b);
  scratch::release(d);
  scratch::release(a);
  EXPECT_EQ(scratch::in_use(), before);
  EXPECT_GE(scratch::high_water(), deepest);
}

TEST(Scratch, EachThreadHasItsOwnStackAndMayFreeAnothersBlocks) {
  if (!scratch::stacks_enabled()) GTEST_SKIP() << "this build serves kernel scratch from malloc (ASan)";
  const int64_t mine = scratch::in_use(), resident = scratch::resident();
  void* theirs = nullptr;
  int64_t their_use = 0, their_after = -1;
  std::thread t([&] {
    theirs = scratch::allocate(1 << 20);
    their_use = scratch::in_use();
  });
  t.join();
  EXPECT_EQ(scratch::in_use(), mine);  // not on this thread's stack
  EXPECT_GE(their_use, 1 << 20);
  scratch::release(theirs);  // its thread has ended; the block is marked freed, nothing breaks

  // A live thread's block freed here leaves its stack at that thread's next call.
  std::mutex m;
  std::condition_variable cv;
  int phase = 0;
  std::thread u([&] {
    std::unique_lock<std::mutex> lock(m);
    theirs = scratch::allocate(2 << 20);
    their_use = scratch::in_use();
    phase = 1;
    cv.notify_all();
    cv.wait(lock, [&] { return phase == 2; });
    scratch::release(scratch::allocate(1));
    their_after = scratch::in_use();
    EXPECT_GE(scratch::resident(), resident + (2 << 20));  // this thread's stack, alive
  });
  {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return phase == 1; });
    scratch::release(theirs);
    phase = 2;
    cv.notify_all();
  }
  u.join();
  EXPECT_GE(their_use, 2 << 20);
  EXPECT_EQ(their_after, 0);
}

TEST(Scratch, ArraysAreZeroedAndAligned) {
  scratch::Array<float> a(1000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 128, 0u);
  for (float x : a) EXPECT_EQ(x, 0.0f);
  a[999] = 1;
  EXPECT_EQ(a.size(), 1000u);
  scratch::Array<float> none(0);
  EXPECT_EQ(none.size(), 0u);
}

TEST(Scratch, TrimHandsBackThePagesAboveTheTop) {
  if (!scratch::stacks_enabled()) GTEST_SKIP() << "this build serves kernel scratch from malloc (ASan)";
  void* keep = scratch::allocate(4096);
  scratch::release(scratch::allocate(8 << 20));
  EXPECT_GE(scratch::high_water(), 8 << 20);
  scratch::trim();
  EXPECT_EQ(scratch::high_water(), scratch::in_use());
  EXPECT_LT(scratch::high_water(), 1 << 20);
  scratch::release(keep);
}
