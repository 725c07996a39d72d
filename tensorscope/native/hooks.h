// tensorscope native hooks: what the hooks' two translation units share.
//
//   hooks.cpp          per-op warning capture, the error observer (pybind11 translator), the module
//   hooks_fetcher.cpp  the c10 stack-trace fetcher: constructed-error counter and error sites
//
// Headers are kept to c10 and pybind11 on purpose: <torch/extension.h> or
// torch/csrc/Exceptions.h pull in most of ATen and multiply the build time.

#pragma once

#include <Python.h>

#include <c10/util/Backtrace.h>
#include <c10/util/Exception.h>
#include <c10/util/Lazy.h>

#include <cstdint>
#include <string>
#include <typeinfo>

#include "abi.h"

namespace tshooks TS_HIDDEN {

// c10::Error(SourceLocation, msg) stores its location only inside its lazy
// backtrace, an instance of an anonymous-namespace class of libc10
// (PyTorchStyleBacktrace: OptimisticLazyValue<string>, then the inner
// Backtrace, then the SourceLocation). Formatting that backtrace would
// symbolize the C++ stack (milliseconds), so the location is read through a
// class with the same bases and members. It is used only for objects of
// exactly that dynamic type, and only after a self-test at import threw a
// c10::Error from a known line and read that line back.
struct BacktraceMirror final : c10::OptimisticLazyValue<std::string> {
  c10::Backtrace inner;
  c10::SourceLocation location;

 private:
  std::string compute() const override {
    return std::string();
  }
};

// Set once at import by hooks.cpp's self-test: PyTorchStyleBacktrace's type, whether its layout
// was read back (the location of a known TORCH_CHECK), and why not.
extern const std::type_info* g_style_type;
extern bool g_peek_ok;
extern std::string g_peek_reason;

// hooks_fetcher.cpp: its Python functions (counter_on, sites_on, ...; null-terminated), and the
// engine's error-site reader (abi.h ReadSite), handed over as the site_reader capsule.
extern PyMethodDef kFetcherMethods[];
int read_site(int64_t since_ns, const char** file, const char** function, uint32_t* line);

}  // namespace tshooks
