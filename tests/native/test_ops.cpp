// tensorscope test operator library (tests only; never loaded for users).
//
// Registers ops under the tensorscope_test namespace that throw each c10 error
// kind and emit each c10 warning kind from known source lines (tests find them by
// searching this file for the message), so the native
// and fallback exception/warning paths can be tested deterministically on CPU:
//
//   tensorscope_test::raise_error(Tensor x, str kind) -> Tensor
//   tensorscope_test::warn(Tensor x, str kind) -> Tensor
//   tensorscope_test::swallow(Tensor x, int n) -> Tensor   (n c10::Errors caught in C++)
//
// Kernels are CompositeExplicitAutograd so a TorchDispatchMode sees each op as
// one ATen op. Each op returns a fresh clone of x (the schema promises no alias).

#include <ATen/core/Tensor.h>
#include <ATen/ops/clone.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>

namespace {

at::Tensor raise_error(const at::Tensor& x, c10::string_view kind_sv) {
  std::string kind(kind_sv);
  if (kind == "error") {
    TORCH_CHECK(false, "tensorscope_test: c10::Error raised");
  } else if (kind == "index") {
    TORCH_CHECK_INDEX(false, "tensorscope_test: c10::IndexError raised");
  } else if (kind == "value") {
    TORCH_CHECK_VALUE(false, "tensorscope_test: c10::ValueError raised");
  } else if (kind == "type") {
    TORCH_CHECK_TYPE(false, "tensorscope_test: c10::TypeError raised");
  } else if (kind == "not_implemented") {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "tensorscope_test: c10::NotImplementedError raised");
  } else if (kind == "linalg") {
    TORCH_CHECK_LINALG(false, "tensorscope_test: c10::LinAlgError raised");
  } else if (kind == "oom") {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "tensorscope_test: c10::OutOfMemoryError raised");
  } else if (kind == "buffer") {
    TORCH_CHECK_WITH(BufferError, false, "tensorscope_test: c10::BufferError raised");
  } else if (kind == "internal") {
    TORCH_INTERNAL_ASSERT(false, "tensorscope_test: internal assert");
  } else if (kind == "no_location") {
    // The base constructor: a c10::Error without a source location.
    throw c10::Error("tensorscope_test: c10::Error without location", nullptr);
  } else if (kind == "std") {
    throw std::runtime_error("tensorscope_test: std::runtime_error raised");
  } else if (kind == "warn_then_raise") {
    TORCH_WARN("tensorscope_test: warning before an error");
    TORCH_CHECK(false, "tensorscope_test: error after a warning");
  }
  return x.clone();
}

at::Tensor warn(const at::Tensor& x, c10::string_view kind_sv) {
  std::string kind(kind_sv);
  if (kind == "plain") {
    TORCH_WARN("tensorscope_test: plain warning");
  } else if (kind == "deprecation") {
    TORCH_WARN_DEPRECATION("tensorscope_test: deprecation warning");
  } else if (kind == "verbatim") {
    c10::warn(c10::Warning(c10::UserWarning(), c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, std::string("tensorscope_test: verbatim warning"), /*verbatim=*/true));
  } else if (kind == "twice") {
    TORCH_WARN("tensorscope_test: first of two");
    TORCH_WARN("tensorscope_test: second of two");
  } else if (kind == "once0") {
    // Separate TORCH_WARN_ONCE sites: each fires once per process, so tests
    // that need a fresh one use a different site.
    TORCH_WARN_ONCE("tensorscope_test: warn once (site 0)");
  } else if (kind == "once1") {
    TORCH_WARN_ONCE("tensorscope_test: warn once (site 1)");
  } else if (kind == "once2") {
    TORCH_WARN_ONCE("tensorscope_test: warn once (site 2)");
  } else if (kind == "once3") {
    TORCH_WARN_ONCE("tensorscope_test: warn once (site 3)");
  }
  return x.clone();
}

at::Tensor swallow(const at::Tensor& x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    try {
      TORCH_CHECK(false, "tensorscope_test: swallowed error ", i);
    } catch (const c10::Error&) {
      // Swallowed on purpose: the constructed-error counter must still see it.
    }
  }
  return x.clone();
}

} // namespace

TORCH_LIBRARY(tensorscope_test, m) {
  m.def("raise_error(Tensor x, str kind) -> Tensor");
  m.def("warn(Tensor x, str kind) -> Tensor");
  m.def("swallow(Tensor x, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(tensorscope_test, CompositeExplicitAutograd, m) {
  m.impl("raise_error", &raise_error);
  m.impl("warn", &warn);
  m.impl("swallow", &swallow);
}
