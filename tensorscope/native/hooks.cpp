// tensorscope native hooks: the C++ side of tensorscope.native.
//
// Observers of PyTorch's C++ -> Python exception and warning path, driven by
// the Python facade (tensorscope/native/__init__.py) from inside the tracer's modes:
//
//  * per-op warning capture: op_begin() pushes a chaining c10::WarningHandler,
//    op_end() pops it and returns the warnings the op raised (message, C++ file,
//    line, function, deprecation and verbatim flags). Every warning is passed on
//    to the handler below, so torch's own PyWarningHandler still turns it into
//    exactly one Python warning that the user's filters see.
//  * error observer: a pybind11 exception translator registered after torch's,
//    so it runs first for every C++ exception that crosses a pybind11 boundary
//    (the path OpOverload.__call__ takes inside a TorchDispatchMode). It records
//    the exception's C++ type, message and "raised from" source location in a
//    thread-local slot and declines, letting torch translate as usual.
//  * the c10 stack-trace fetcher: counts every c10::Error constructed (opt-in,
//    including ones C++ catches and swallows), and for the native engine
//    remembers where each PyTorch-style error keeps its SourceLocation, which
//    the engine reads (read_site, hooks_fetcher.cpp) when an op's kernel threw.
//
// Everything on the handler path is thread-local and never touches Python; the
// functions called from Python run with the GIL held. op_begin/op_end are raw
// METH_NOARGS CPython functions because they run around every ATen op.
////
// This file: the per-op warning capture, the error observer and the module; hooks_fetcher.cpp
// the stack-trace fetcher (hooks.h).

#include <Python.h>
#include <pybind11/pybind11.h>

#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/csrc/utils/cpp_stacktraces.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

#include "abi_py.h"
#include "hooks.h"

namespace torch {
// Declared here instead of including torch/csrc/Exceptions.h (see above). It is
// what torch applies to every c10 message before raising it in Python, so the
// message recorded here compares equal to str(exc).
std::string processErrorMsg(std::string str);
} // namespace torch

namespace py = pybind11;

namespace tshooks TS_HIDDEN {

const std::type_info* g_style_type = nullptr;
bool g_peek_ok = false;
std::string g_peek_reason = "not tested";

namespace {

// ---------------------------------------------------------------------------
// Per-op warning capture
// ---------------------------------------------------------------------------

struct CapturedWarning {
  std::string msg;
  const char* file;
  const char* function;
  uint32_t line;
  bool deprecation;
  bool verbatim;
};

struct OpHandler final : c10::WarningHandler {
  c10::WarningHandler* prev = nullptr;
  std::vector<CapturedWarning> got;
  void process(const c10::Warning& warning) override;
};

// Recent natively captured messages, so the Python-level call tap can drop the
// copy of a C++ warning it already has from an op (bounded: warnings are rare).
constexpr size_t kMaxSeen = 256;

struct ThreadState {
  // Handlers are reused across ops: op_begin only moves an index.
  std::vector<std::unique_ptr<OpHandler>> stack;
  size_t depth = 0;
  // True while a captured warning is being handed down the chain, so an outer
  // OpHandler (an op nested in another) does not record it a second time.
  bool chaining = false;
  // When the outermost torch-level call was entered from a C function with a
  // PyWarningHandler (torch.add, Tensor.add_, ...), warnings are handed to that
  // handler rather than to the one of the call the function mode re-issues, so
  // Python attributes them to the user's frame, not to the mode's.
  c10::WarningHandler* redirect = nullptr;
  std::vector<std::string> seen;

  // Last exception seen by the translator since op_begin cleared it.
  bool err_valid = false;
  std::string err_type;
  std::string err_msg;      // processErrorMsg(what_without_backtrace())
  std::string err_file;
  std::string err_function;
  int64_t err_line = -1;    // -1: no source location
  uint64_t err_serial = 0;

  ~ThreadState() {
    // A tracer bug could leave a handler installed; c10 would keep a dangling
    // pointer for the rest of this thread's life.
    if (depth > 0 && !stack.empty()) {
      c10::WarningUtils::set_warning_handler(stack[0]->prev);
    }
  }
};

// The per-op functions reach the state through a plain pointer: a
// trivially destructible thread_local needs no init-guard wrapper call, only
// the TLS lookup. A second, class-type thread_local owns the state and frees
// it at thread exit; it is touched once per thread.
thread_local ThreadState* tls_ptr = nullptr;

struct ThreadStateOwner {
  std::unique_ptr<ThreadState> state;
  ~ThreadStateOwner() {
    tls_ptr = nullptr;
  }
};
thread_local ThreadStateOwner tls_owner;

C10_NOINLINE ThreadState& tls_slow() {
  tls_owner.state.reset(new ThreadState());
  tls_ptr = tls_owner.state.get();
  return *tls_ptr;
}

inline ThreadState& tls_get() {
  ThreadState* p = tls_ptr;
  return C10_LIKELY(p != nullptr) ? *p : tls_slow();
}

void OpHandler::process(const c10::Warning& warning) {
  ThreadState& t = tls_get();
  if (!t.chaining) {
    try {
      const auto& loc = warning.source_location();
      got.push_back(CapturedWarning{
          warning.msg(),
          loc.file,
          loc.function,
          loc.line,
          std::holds_alternative<c10::DeprecationWarning>(warning.type()),
          warning.verbatim()});
      if (t.seen.size() < kMaxSeen) {
        t.seen.push_back(warning.msg());
      }
    } catch (...) {
      // Out of memory while recording: drop the record, never the warning.
    }
  }
  c10::WarningHandler* next = prev;
  if (t.redirect != nullptr && this == t.stack[0].get()) {
    next = t.redirect;
  }
  if (next == nullptr || next == this) {
    return;
  }
  bool saved = t.chaining;
  t.chaining = true;
  try {
    next->process(warning);
  } catch (...) {
    t.chaining = saved;
    throw;
  }
  t.chaining = saved;
}

// Interned dict keys, created once at import.
PyObject* k_message;
PyObject* k_category;
PyObject* k_cpp_file;
PyObject* k_cpp_line;
PyObject* k_cpp_function;
PyObject* k_deprecation;
PyObject* k_verbatim;
PyObject* k_native;
PyObject* s_user;
PyObject* s_deprecation;

PyObject* str_or_none(const char* s) {
  if (s == nullptr) {
    Py_RETURN_NONE;
  }
  return PyUnicode_DecodeUTF8(s, static_cast<Py_ssize_t>(std::strlen(s)), "replace");
}

int set_item(PyObject* d, PyObject* k, PyObject* v) {
  if (v == nullptr) {
    return -1;
  }
  int rc = PyDict_SetItem(d, k, v);
  Py_DECREF(v);
  return rc;
}

PyObject* warning_dict(const CapturedWarning& w) {
  PyObject* d = PyDict_New();
  if (d == nullptr) {
    return nullptr;
  }
  PyObject* cat = w.deprecation ? s_deprecation : s_user;
  Py_INCREF(cat);
  if (set_item(d, k_message, PyUnicode_DecodeUTF8(w.msg.data(), static_cast<Py_ssize_t>(w.msg.size()), "replace")) < 0 ||
      set_item(d, k_category, cat) < 0 ||
      set_item(d, k_cpp_file, str_or_none(w.file)) < 0 ||
      set_item(d, k_cpp_line, w.file ? PyLong_FromUnsignedLong(w.line) : (Py_INCREF(Py_None), Py_None)) < 0 ||
      set_item(d, k_cpp_function, str_or_none(w.function)) < 0 ||
      set_item(d, k_deprecation, PyBool_FromLong(w.deprecation)) < 0 ||
      set_item(d, k_verbatim, PyBool_FromLong(w.verbatim)) < 0 ||
      set_item(d, k_native, PyBool_FromLong(1)) < 0) {
    Py_DECREF(d);
    return nullptr;
  }
  return d;
}

PyObject* py_op_begin(PyObject*, PyObject*) {
  ThreadState& t = tls_get();
  try {
    if (t.depth == t.stack.size()) {
      t.stack.emplace_back(new OpHandler());
    }
  } catch (...) {
    return PyErr_NoMemory();
  }
  OpHandler* h = t.stack[t.depth++].get();
  h->prev = c10::WarningUtils::get_warning_handler();
  c10::WarningUtils::set_warning_handler(h);
  t.err_valid = false;
  Py_RETURN_NONE;
}

PyObject* py_op_end(PyObject*, PyObject*) {
  ThreadState& t = tls_get();
  if (t.depth == 0) {
    Py_RETURN_NONE;  // unbalanced call: nothing to pop, never fail the op
  }
  OpHandler* h = t.stack[--t.depth].get();
  c10::WarningUtils::set_warning_handler(h->prev);
  if (h->got.empty()) {
    Py_RETURN_NONE;
  }
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(h->got.size()));
  if (out != nullptr) {
    for (size_t i = 0; i < h->got.size(); ++i) {
      PyObject* d = warning_dict(h->got[i]);
      if (d == nullptr) {
        Py_CLEAR(out);
        break;
      }
      PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), d);
    }
  }
  h->got.clear();
  return out;
}

// call_begin(redirect: bool): entering the outermost torch-level call. The
// facade passes redirect=True only when the called function is a C binding:
// then the handler current now is the PyWarningHandler that binding installed
// before it handed the call to the function mode. (For a Python function, the
// handler current now belongs to some scope further out, and its warnings are
// emitted, untraced too, by the C calls inside that function.)
PyObject* py_call_begin(PyObject*, PyObject* arg) {
  ThreadState& t = tls_get();
  t.seen.clear();
  t.redirect = nullptr;
  if (PyObject_IsTrue(arg) == 1 && t.depth == 0) {
    c10::WarningHandler* cur = c10::WarningUtils::get_warning_handler();
    // Only torch's PyWarningHandler emits Python warnings at its scope's end;
    // any other handler (c10's base one prints to stderr) is left alone.
    // Compared mangled (demangling allocates; this runs once per call).
    if (cur != nullptr &&
        std::strcmp(typeid(*cur).name(), "N5torch16PyWarningHandler15InternalHandlerE") == 0) {
      t.redirect = cur;
    }
  }
  PyErr_Clear();
  return PyBool_FromLong(t.redirect != nullptr);
}

PyObject* py_call_end(PyObject*, PyObject*) {
  ThreadState& t = tls_get();
  t.redirect = nullptr;
  Py_RETURN_NONE;
}

PyObject* py_native_seen(PyObject*, PyObject* arg) {
  Py_ssize_t n = 0;
  const char* s = PyUnicode_AsUTF8AndSize(arg, &n);
  if (s == nullptr) {
    return nullptr;
  }
  for (const auto& m : tls_get().seen) {
    if (m.size() == static_cast<size_t>(n) && std::memcmp(m.data(), s, n) == 0) {
      Py_RETURN_TRUE;
    }
  }
  Py_RETURN_FALSE;
}

// The identities of a dict's (key, value) pairs in order, folded into one 64-bit value: the leak
// finder asks whether sys.modules (thousands of entries) is unchanged since its last classification
// in one C pass instead of building two lists of names and ids. Same question as comparing those
// lists (an object's identity is its address), up to a 2^-64 chance of a collision.
PyObject* py_dict_identity(PyObject*, PyObject* d) {
  if (!PyDict_Check(d)) {
    PyErr_SetString(PyExc_TypeError, "dict_identity() takes a dict");
    return nullptr;
  }
  auto mix = [](uint64_t x) {   // splitmix64's finaliser
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  uint64_t h = uint64_t(PyDict_Size(d));
  Py_ssize_t pos = 0;
  PyObject* k;
  PyObject* v;
  while (PyDict_Next(d, &pos, &k, &v)) {
    h = mix(h ^ uint64_t(reinterpret_cast<uintptr_t>(k)));
    h = mix(h ^ uint64_t(reinterpret_cast<uintptr_t>(v)));
  }
  return PyLong_FromUnsignedLongLong(h);
}

PyObject* py_depth(PyObject*, PyObject*) {
  return PyLong_FromSize_t(tls_get().depth);
}

// Restores the handler found below the first op_begin of this thread, for a
// capture closed while ops were still open (an interrupted trace).
PyObject* py_reset_thread(PyObject*, PyObject*) {
  ThreadState& t = tls_get();
  size_t was = t.depth;
  if (t.depth > 0) {
    c10::WarningUtils::set_warning_handler(t.stack[0]->prev);
    for (size_t i = 0; i < t.depth; ++i) {
      t.stack[i]->got.clear();
    }
    t.depth = 0;
  }
  t.redirect = nullptr;
  t.chaining = false;
  t.err_valid = false;
  t.seen.clear();
  return PyLong_FromSize_t(was);
}

// ---------------------------------------------------------------------------
// Error observer
// ---------------------------------------------------------------------------

// Number of captures open in the process; the translator records only then.
// (pybind11 offers no way to unregister a translator: it stays, inert.)
std::atomic<int64_t> g_active{0};

bool peek_location(const c10::Error& e, c10::SourceLocation& out) {
  if (!g_peek_ok) {
    return false;
  }
  const c10::Backtrace& bt = e.backtrace();
  if (!bt) {
    return false;
  }
  const c10::LazyValue<std::string>* obj = bt.get();
  if (typeid(*obj) != *g_style_type) {
    return false;  // an Error built from (msg, backtrace): no location
  }
  out = reinterpret_cast<const BacktraceMirror*>(obj)->location;
  return out.file != nullptr;
}

void self_test_peek() {
  uint32_t expected_line = 0;
  try {
    expected_line = __LINE__; TORCH_CHECK(false, "tensorscope native self-test");
  } catch (const c10::Error& e) {
    const c10::Backtrace& bt = e.backtrace();
    if (!bt) {
      g_peek_reason = "c10::Error carries no backtrace object";
      return;
    }
    const c10::LazyValue<std::string>* obj = bt.get();
    std::string name = c10::demangle(typeid(*obj).name());
    if (name.find("PyTorchStyleBacktrace") == std::string::npos) {
      g_peek_reason = "unexpected backtrace type " + name;
      return;
    }
    const auto* m = reinterpret_cast<const BacktraceMirror*>(obj);
    // Compare the integer first: if the layout were different, the pointers
    // beside it would not be safe to read.
    if (m->location.line != expected_line || m->location.file == nullptr ||
        m->location.function == nullptr ||
        std::strcmp(m->location.file, __FILE__) != 0 ||
        std::strstr(m->location.function, "self_test_peek") == nullptr) {
      g_peek_reason = "source-location layout differs in this torch build";
      return;
    }
    g_style_type = &typeid(*obj);
    g_peek_ok = true;
    g_peek_reason = "ok";
    return;
  }
  g_peek_reason = "TORCH_CHECK did not throw";
}

void record_exception(std::exception_ptr p) {
  ThreadState& t = tls_get();
  try {
    std::rethrow_exception(p);
  } catch (const c10::Error& e) {
    t.err_type = c10::demangle(typeid(e).name());
    t.err_msg = torch::processErrorMsg(e.what_without_backtrace());
    c10::SourceLocation loc{nullptr, nullptr, 0};
    if (peek_location(e, loc)) {
      t.err_file = loc.file;
      t.err_function = loc.function ? loc.function : "";
      t.err_line = loc.line;
    } else {
      t.err_file.clear();
      t.err_function.clear();
      t.err_line = -1;
    }
  } catch (const py::error_already_set&) {
    return;  // a Python exception on its way back: keep the C++ one it came from
  } catch (const std::exception& e) {
    const char* raw = typeid(e).name();
    if (std::strcmp(raw, "12python_error") == 0) {
      return;  // torch's wrapper of a pending Python exception, likewise
    }
    t.err_type = c10::demangle(raw);
    t.err_msg = e.what();
    t.err_file.clear();
    t.err_function.clear();
    t.err_line = -1;
  } catch (...) {
    return;  // not a std::exception: nothing to describe
  }
  t.err_valid = true;
  t.err_serial += 1;
}

void translator(std::exception_ptr p) {
  if (!p) {
    return;
  }
  if (g_active.load(std::memory_order_relaxed) > 0) {
    try {
      record_exception(p);
    } catch (...) {
      // Recording must never change which exception the user gets.
    }
  }
  std::rethrow_exception(p);  // decline: torch's translator handles it
}

// last_error() -> (serial, cpp_type, message, file, line, function) | None
PyObject* py_last_error(PyObject*, PyObject*) {
  ThreadState& t = tls_get();
  if (!t.err_valid) {
    Py_RETURN_NONE;
  }
  PyObject* file = Py_None;
  PyObject* func = Py_None;
  PyObject* line = Py_None;
  if (t.err_line >= 0) {
    file = PyUnicode_DecodeUTF8(t.err_file.data(), static_cast<Py_ssize_t>(t.err_file.size()), "replace");
    func = PyUnicode_DecodeUTF8(t.err_function.data(), static_cast<Py_ssize_t>(t.err_function.size()), "replace");
    line = PyLong_FromLongLong(t.err_line);
  } else {
    Py_INCREF(file);
    Py_INCREF(func);
    Py_INCREF(line);
  }
  PyObject* type = PyUnicode_DecodeUTF8(t.err_type.data(), static_cast<Py_ssize_t>(t.err_type.size()), "replace");
  PyObject* msg = PyUnicode_DecodeUTF8(t.err_msg.data(), static_cast<Py_ssize_t>(t.err_msg.size()), "replace");
  if (!file || !func || !line || !type || !msg) {
    Py_XDECREF(file);
    Py_XDECREF(func);
    Py_XDECREF(line);
    Py_XDECREF(type);
    Py_XDECREF(msg);
    return nullptr;
  }
  return Py_BuildValue("(KNNNNN)", static_cast<unsigned long long>(t.err_serial), type, msg, file, line, func);
}

PyObject* py_clear_error(PyObject*, PyObject*) {
  tls_get().err_valid = false;
  Py_RETURN_NONE;
}

PyObject* py_capture_open(PyObject*, PyObject*) {
  return PyLong_FromLongLong(g_active.fetch_add(1) + 1);
}

PyObject* py_capture_close(PyObject*, PyObject*) {
  int64_t now = g_active.fetch_sub(1) - 1;
  if (now < 0) {
    g_active.store(0);
    now = 0;
  }
  return PyLong_FromLongLong(now);
}

PyMethodDef kMethods[] = {
    {"op_begin", py_op_begin, METH_NOARGS, "Push the per-op warning handler and clear the error slot."},
    {"op_end", py_op_end, METH_NOARGS, "Pop the per-op handler; the op's warnings as dicts, or None."},
    {"call_begin", py_call_begin, METH_O, "call_begin(redirect): enter the outermost torch-level call; True if op warnings go to its PyWarningHandler."},
    {"call_end", py_call_end, METH_NOARGS, "Leave the outermost torch-level call."},
    {"native_seen", py_native_seen, METH_O, "Whether a C++ warning with this message was captured at an op since call_begin."},
    {"depth", py_depth, METH_NOARGS, "Open op_begin calls on this thread."},
    {"dict_identity", py_dict_identity, METH_O, "The identities of a dict's (key, value) pairs in order, as one 64-bit value."},
    {"reset_thread", py_reset_thread, METH_NOARGS, "Unwind this thread's open handlers; returns how many were open."},
    {"last_error", py_last_error, METH_NOARGS, "(serial, cpp_type, message, file, line, function) of the last exception the translator saw, or None."},
    {"clear_error", py_clear_error, METH_NOARGS, "Forget the last exception."},
    {"capture_open", py_capture_open, METH_NOARGS, "Count an open capture (enables the translator)."},
    {"capture_close", py_capture_close, METH_NOARGS, "Uncount an open capture."},
    {"abi", tsabi::py_abi, METH_NOARGS, "the layouts shared with Python (abi.h) as a dict"},
    {nullptr, nullptr, 0, nullptr}};

PyObject* intern(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) {
    throw py::error_already_set();
  }
  return o;
}
}  // namespace
}  // namespace tshooks

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace tshooks;
  m.doc() = "tensorscope native hooks: per-op c10 warning capture, c10 error observer, stack-trace fetcher (counter, error sites)";
  k_message = intern("message");
  k_category = intern("category");
  k_cpp_file = intern("cpp_file");
  k_cpp_line = intern("cpp_line");
  k_cpp_function = intern("cpp_function");
  k_deprecation = intern("deprecation");
  k_verbatim = intern("verbatim");
  k_native = intern("native");
  s_user = intern("UserWarning");
  s_deprecation = intern("DeprecationWarning");
  if (PyModule_AddFunctions(m.ptr(), kMethods) < 0 || PyModule_AddFunctions(m.ptr(), kFetcherMethods) < 0) {
    throw py::error_already_set();
  }
  self_test_peek();
  m.attr("peek_ok") = py::bool_(g_peek_ok);
  m.attr("peek_reason") = py::str(g_peek_reason);
  m.attr("cpp_stacktraces") = py::bool_(torch::get_cpp_stacktraces_enabled());
  // What the native engine calls when an op's kernel threw (read_site, abi.h ReadSite).
  tsabi::ReadSite reader = &read_site;
  m.attr("site_reader") = py::capsule(reinterpret_cast<void*>(reader), tsabi::kSiteReaderCapsule);
  // Registered after torch's translators, so pybind11 tries this one first.
  py::register_exception_translator(&translator);
}
