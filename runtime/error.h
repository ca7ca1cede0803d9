// The runtime's user-facing error.
//
// Raised for what a user can fix: a bad or truncated file, a missing tensor, an
// input of the wrong shape or dtype. The message follows the house shape: it
// opens with "error: " and the object at fault, states the rule broken with the
// numbers involved, and says what is legal or how to fix it. The runtime never
// includes dsl/, so it has its own type rather than reusing halyard::UserError.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace halyard::runtime {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A name or path as the messages show it: in double quotes.
inline std::string quote(std::string_view s) {
  // Built by appends: GCC 12 at -O3 gives a false -Wrestrict on "\"" + string.
  std::string out;
  out.reserve(s.size() + 2);
  out += '"';
  out += s;
  out += '"';
  return out;
}

}  // namespace halyard::runtime
