// User errors and internal checks for the DSL.
//
// A user's mistake (an ill-formed model, a bad config) raises UserError with a
// message in the house shape: the object, the op, the rule broken with both
// numbers, and what is legal. HALYARD_CHECK guards invariants the DSL itself
// maintains; one firing on user input is a bug in Halyard, never the user's.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace halyard {

class UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void internal_error(const char* file, int line, const std::string& what);

// A command-line count, strictly: a whole number >= 1 and nothing else
// ("1e9", "-1", "4x" are errors naming `flag`, not 1, 0 or 4).
int64_t parse_count(const std::string& flag, const std::string& text);

// A command-line integer in [lo, hi], strictly (no exponent, sign only when
// lo < 0, nothing after the digits); the error names `flag` and the range.
int64_t parse_integer(const std::string& flag, const std::string& text, int64_t lo, int64_t hi);

// A finite command-line number >= lo (> lo when !lo_inclusive), strictly:
// "3e-4" and "0.5" are numbers, "nan", "inf", "1x" and "" are errors naming `flag`.
double parse_real(const std::string& flag, const std::string& text, double lo, bool lo_inclusive);

}  // namespace halyard

#define HALYARD_CHECK(cond, msg)                                              \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::ostringstream halyard_check_os_;                                   \
      halyard_check_os_ << "internal error: " #cond " failed: " << msg;       \
      ::halyard::internal_error(__FILE__, __LINE__, halyard_check_os_.str()); \
    }                                                                         \
  } while (0)
