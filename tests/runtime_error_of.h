// What a call throws as runtime::Error ("" when it returns normally), for
// tests that check the text of user-facing errors.
#pragma once

#include <string>

#include "runtime/error.h"

namespace halyard::testing {

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const runtime::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace halyard::testing
