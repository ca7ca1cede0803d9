// Ranks as threads for tests: runs fn on every rank of a fresh in-process
// group (runtime/comm.h), one thread per rank, and returns what each rank
// threw ("" when it returned normally; an exception that is not a
// runtime::Error is prefixed "unexpected exception: ").
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm.h"
#include "runtime/error.h"

namespace halyard::testing {

// Runs fn(r) for r in [0, n), one thread each, and returns what each threw.
inline std::vector<std::string> run_threads(int n, const std::function<void(int)>& fn) {
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const runtime::Error& e) {
        errors[static_cast<size_t>(r)] = e.what();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = std::string("unexpected exception: ") + e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

inline std::vector<std::string> run_ranks(int n, double timeout_s,
                                          const std::function<void(runtime::Communicator&)>& fn) {
  auto comms = runtime::make_in_process_group(n, timeout_s);
  return run_threads(n, [&](int r) { fn(*comms[static_cast<size_t>(r)]); });
}

inline void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

}  // namespace halyard::testing
