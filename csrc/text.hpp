// Utility, below every layer: error text and ODC_CHECK. Depends on c10 only.
//
// Error text without iostreams. Our extension may be built by a toolchain whose
// libstdc++ differs from the one torch loads (seen on the GPU machines: a numeric
// ostream insertion compiled into this library crashed the process); std::to_string
// and string concatenation behave the same under either.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace odc {

inline void cat_one(std::string& s, const std::string& v) { s += v; }
inline void cat_one(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void cat_one(std::string& s, const c10::Device& d) { s += d.str(); }
template <typename T>
std::enable_if_t<std::is_arithmetic_v<T>> cat_one(std::string& s, T v) {
  s += std::to_string(v);
}

template <typename... Args>
std::string cat(const Args&... args) {
  std::string s;
  (cat_one(s, args), ...);
  return s;
}

}  // namespace odc

// TORCH_CHECK-alikes whose message is built by odc::cat. kind: Error, ValueError,
// TypeError, NotImplementedError, DistBackendError (c10's error classes).
#define ODC_CHECK(cond, kind, ...)                                \
  do {                                                            \
    if (C10_UNLIKELY(!(cond))) {                                  \
      C10_THROW_ERROR(kind, ::odc::cat(__VA_ARGS__));             \
    }                                                             \
  } while (0)
