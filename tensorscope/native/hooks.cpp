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
//    the engine reads (tensorscope_read_site) when an op's kernel threw.
//
// Everything on the handler path is thread-local and never touches Python; the
// functions called from Python run with the GIL held. op_begin/op_end are raw
// METH_NOARGS CPython functions because they run around every ATen op.
//
// Headers are kept to c10 and pybind11 on purpose: <torch/extension.h> or
// torch/csrc/Exceptions.h pull in most of ATen and multiply the build time.

#include <Python.h>
#include <pybind11/pybind11.h>

#include <c10/util/Backtrace.h>
#include <c10/util/Exception.h>
#include <c10/util/Lazy.h>
#include <c10/util/Logging.h>
#include <c10/util/Type.h>
#include <torch/csrc/profiler/unwind/unwind.h>
#include <torch/csrc/utils/cpp_stacktraces.h>

#include <dlfcn.h>
#include <execinfo.h>

#include <atomic>
#include <cstring>
#include <ctime>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <typeinfo>
#include <vector>

namespace torch {
// Declared here instead of including torch/csrc/Exceptions.h (see above). It is
// what torch applies to every c10 message before raising it in Python, so the
// message recorded here compares equal to str(exc).
std::string processErrorMsg(std::string str);
} // namespace torch

namespace py = pybind11;

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

const std::type_info* g_style_type = nullptr;
bool g_peek_ok = false;
std::string g_peek_reason = "not tested";

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

// ---------------------------------------------------------------------------
// The stack-trace fetcher: constructed-error counter (opt-in) and error sites
// ---------------------------------------------------------------------------
//
// c10 calls the fetcher (c10::SetStackTraceFetcher) on the throwing thread
// while it constructs a c10::Error, before the throw. Two users:
//
//  * the counter (cpp_errors=True): counts every c10::Error constructed;
//  * error sites (the native engine): the engine's RecordFunction end callback
//    runs while an op's exception unwinds, where std::current_exception() is
//    null, so the exception object is out of reach. For c10::Error(SourceLocation,
//    msg) (TORCH_CHECK and friends) c10 calls the fetcher from the constructor
//    of the error's PyTorchStyleBacktrace, which initializes its `inner` member
//    directly from the fetcher's result: with the return value elided (checked
//    by a self-test), the fetcher's named result *is* that member, so the
//    object that will hold the SourceLocation is known. It is remembered in a
//    thread-local slot; the location is read when the engine's end callback
//    asks (the error is alive: it is the exception unwinding), and the slot
//    entry is dropped when the error dies (the fetcher's result is wrapped in a
//    SiteBacktrace whose destructor runs with it, on whatever thread).
//
// c10 has no getter for the current fetcher, so it cannot be chained to: error
// sites are armed only when the installed fetcher is c10's default (checked by
// constructing an error and looking at its backtrace's type), and disarming
// installs c10's default again (same lambda, same frames skipped). With
// TORCH_SHOW_CPP_STACKTRACES set torch installs its own (eager) fetcher, and
// the location is already in every message: sites stay off.

std::atomic<int64_t> g_constructed{0};
std::mutex g_counter_mu;  // guards the users counts and every SetStackTraceFetcher
int g_counter_users = 0;
int g_site_users = 0;

// What torch installs as the fetcher with TORCH_SHOW_CPP_STACKTRACES set: an
// eager one that symbolizes its own unwinder's frames.
c10::Backtrace torch_eager_fetch() {
  std::vector<void*> frames = torch::unwind::unwind();
  std::vector<torch::unwind::Frame> sym = torch::unwind::symbolize(frames, torch::get_symbolize_mode());
  std::ostringstream oss;
  oss << "C++ CapturedTraceback:" << '\n';
  // The first frames are this fetcher and the std::function glue around it.
  for (size_t i = 3; i < sym.size(); ++i) {
    oss << "#" << i << " " << sym[i].funcname << " from " << sym[i].filename << ":" << sym[i].lineno << '\n';
  }
  return std::make_shared<c10::PrecomputedLazyValue<std::string>>(oss.str());
}

c10::Backtrace c10_default_fetch() {
  return c10::get_lazy_backtrace(/*frames_to_skip=*/1);  // c10's own default (Logging.cpp)
}

// One live c10::Error under construction or alive, per entry.
struct SiteEntry {
  const BacktraceMirror* bt;  // its PyTorchStyleBacktrace
  const void* owner;          // the SiteBacktrace inside it
  int64_t t_ns;               // CLOCK_MONOTONIC when constructed
};

struct SiteSlot {
  std::mutex mu;
  static constexpr int kMax = 4;  // errors alive at once on one thread (nested unwinding)
  SiteEntry e[kMax];
  int n = 0;
};

// The slot is owned by a class-type thread_local; a trivially destructible
// pointer and flag reach it, so an error constructed while the thread's
// thread_locals are being destroyed finds no slot rather than a dead one.
thread_local SiteSlot* tls_site_ptr = nullptr;
thread_local bool tls_site_dead = false;
struct SiteOwner {
  std::shared_ptr<SiteSlot> slot;
  ~SiteOwner() {
    tls_site_ptr = nullptr;
    tls_site_dead = true;
  }
};
thread_local SiteOwner tls_site_owner;

// This thread's slot (created on first use), or null while the thread exits.
std::shared_ptr<SiteSlot>* site_slot() {
  if (tls_site_dead) {
    return nullptr;
  }
  if (tls_site_ptr == nullptr) {
    tls_site_owner.slot = std::make_shared<SiteSlot>();
    tls_site_ptr = tls_site_owner.slot.get();
  }
  return &tls_site_owner.slot;
}
thread_local bool tls_probing = false;  // this file's own probes: not counted

struct SiteBacktrace final : c10::LazyValue<std::string> {
  c10::Backtrace inner;
  std::shared_ptr<SiteSlot> slot;
  const std::string& get() const override {
    return inner->get();  // the text c10's default backtrace gives
  }
  ~SiteBacktrace() override {
    if (!slot) {
      return;
    }
    std::lock_guard<std::mutex> g(slot->mu);
    for (int i = 0; i < slot->n; ++i) {
      if (slot->e[i].owner == this) {
        for (int j = i + 1; j < slot->n; ++j) {
          slot->e[j - 1] = slot->e[j];
        }
        slot->n -= 1;
        break;
      }
    }
  }
};

// Set by the self-test: the vtable pointer of PyTorchStyleBacktrace, the
// offset of its inner backtrace, frames to skip so the captured backtrace
// starts where c10's default one does.
const void* g_style_vptr = nullptr;
ptrdiff_t g_inner_off = -1;
size_t g_skip = 2;                // until calibrated: this lambda and site_fetch
const std::type_info* g_c10_lazy_type = nullptr;
bool g_sites_tested = false;
bool g_sites_ok = false;
std::string g_sites_reason = "not tested";
bool g_armed = false;             // error sites installed (g_site_users > 0 and the checks passed)
std::string g_arm_reason = "not armed";
bool g_calibrating = false;       // under g_counter_mu, during the self-test
int g_calibrated_skip = -1;
const void* g_probe_result = nullptr;

int64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// Index, in this thread's stack as seen from the caller of ::backtrace, of the
// first frame inside c10::Error's PyTorch-style constructor.
C10_NOINLINE void calibrate(void* const* frames, int n) {
  for (int i = 0; i < n; ++i) {
    Dl_info info;
    if (dladdr(frames[i], &info) != 0 && info.dli_sname != nullptr) {
      std::string name = c10::demangle(info.dli_sname);
      if (name.rfind("c10::Error::Error(c10::SourceLocation", 0) == 0) {
        g_calibrated_skip = i;
        return;
      }
    }
  }
}

// The fetcher's body. Its named result is returned from its only return, so
// it is constructed in the caller's result slot (checked by the self-test).
C10_NOINLINE c10::Backtrace site_fetch(bool count, bool sites) {
  c10::Backtrace r;
  if (C10_UNLIKELY(g_calibrating)) {
    void* frames[16];
    calibrate(frames, ::backtrace(frames, 16));
  }
  if (count && !tls_probing) {
    g_constructed.fetch_add(1, std::memory_order_relaxed);
  }
  if (!sites) {
    r = c10::get_lazy_backtrace(g_skip);
    return r;
  }
  auto wrap = std::make_shared<SiteBacktrace>();
  wrap->inner = c10::get_lazy_backtrace(g_skip);
  r = wrap;
  // The result slot is a heap object's member for PyTorchStyleBacktrace; a
  // stack temporary (caffe2-style errors pass the result as an argument) is
  // a few frames above this one and is left alone.
  const char* here = reinterpret_cast<const char*>(&r);
  const char* local = reinterpret_cast<const char*>(&here);
  if (g_inner_off < 0 || (here > local - (1 << 16) && here < local + (1 << 16))) {
    return r;
  }
  const char* obj = here - g_inner_off;
  if (*reinterpret_cast<const void* const*>(obj) != g_style_vptr) {
    return r;
  }
  try {
    std::shared_ptr<SiteSlot>* slot = site_slot();
    if (slot == nullptr) {
      return r;
    }
    wrap->slot = *slot;
    SiteSlot& s = **slot;
    std::lock_guard<std::mutex> g(s.mu);
    if (s.n == SiteSlot::kMax) {  // keep the newest
      for (int j = 1; j < s.n; ++j) {
        s.e[j - 1] = s.e[j];
      }
      s.n -= 1;
    }
    s.e[s.n++] = SiteEntry{reinterpret_cast<const BacktraceMirror*>(obj), wrap.get(), mono_ns()};
  } catch (...) {
    // Out of memory: no site for this error, never a different error.
  }
  return r;
}

void self_test_sites();

void install_locked() {
  const bool eager = torch::get_cpp_stacktraces_enabled();
  const bool count = g_counter_users > 0;
  const bool sites = g_site_users > 0 && g_sites_ok && !eager && g_armed;
  if ((count || sites) && !eager && !g_sites_tested) {
    self_test_sites();  // the frames to skip (and the sites' facts), once
  }
  if (!count && !sites) {
    if (eager) {
      c10::SetStackTraceFetcher(std::function<c10::Backtrace()>(torch_eager_fetch));
    } else {
      c10::SetStackTraceFetcher(std::function<c10::Backtrace()>([]() { return c10_default_fetch(); }));
    }
  } else if (eager) {
    c10::SetStackTraceFetcher(std::function<c10::Backtrace()>([]() {
      g_constructed.fetch_add(1, std::memory_order_relaxed);
      return torch_eager_fetch();
    }));
  } else {
    c10::SetStackTraceFetcher(std::function<c10::Backtrace()>([count, sites]() { return site_fetch(count, sites); }));
  }
}

// The inner backtrace type of an error constructed now (the current fetcher's result type).
const std::type_info* probe_fetcher_type() {
  tls_probing = true;
  const std::type_info* out = nullptr;
  try {
    TORCH_CHECK(false, "tensorscope fetcher probe");
  } catch (const c10::Error& e) {
    const c10::Backtrace& bt = e.backtrace();
    if (bt && g_peek_ok && typeid(*bt) == *g_style_type) {
      const auto* m = reinterpret_cast<const BacktraceMirror*>(bt.get());
      if (m->inner) {
        out = &typeid(*m->inner);
      }
    }
  }
  tls_probing = false;
  return out;
}

// Under g_counter_mu, with c10's default fetcher installed.
void self_test_sites() {
  g_sites_tested = true;
  if (!g_peek_ok) {
    g_sites_reason = "no source-location layout: " + g_peek_reason;
    return;
  }
  // 1. frames to skip; the object a PyTorchStyleBacktrace is (first word)
  g_calibrating = true;
  c10::SetStackTraceFetcher(std::function<c10::Backtrace()>([]() { return site_fetch(false, false); }));
  uint32_t expected_line = 0;
  const void* vptr = nullptr;
  try {
    expected_line = __LINE__; TORCH_CHECK(false, "tensorscope native self-test");
  } catch (const c10::Error& e) {
    const void* obj = e.backtrace().get();
    if (obj != nullptr && typeid(*e.backtrace()) == *g_style_type) {
      vptr = *reinterpret_cast<const void* const*>(obj);
      const auto* m = reinterpret_cast<const BacktraceMirror*>(obj);
      g_inner_off = reinterpret_cast<const char*>(&m->inner) - reinterpret_cast<const char*>(obj);
    }
  }
  g_calibrating = false;
  if (vptr == nullptr || g_calibrated_skip < 0) {
    c10::SetStackTraceFetcher(std::function<c10::Backtrace()>([]() { return c10_default_fetch(); }));
    g_inner_off = -1;
    g_sites_reason = vptr == nullptr ? "c10::Error carries no PyTorch-style backtrace"
                                     : "the fetcher is not called from c10::Error's constructor";
    return;
  }
  g_style_vptr = vptr;
  g_skip = size_t(g_calibrated_skip);
  // 2. the fetcher's result is the backtrace's member, and the location is read back
  c10::SetStackTraceFetcher(std::function<c10::Backtrace()>([]() { return site_fetch(false, true); }));
  bool ok = false;
  try {
    expected_line = __LINE__; TORCH_CHECK(false, "tensorscope native self-test");
  } catch (const c10::Error& e) {
    SiteSlot* s = tls_site_ptr;
    const auto* m = reinterpret_cast<const BacktraceMirror*>(e.backtrace().get());
    if (s != nullptr) {
      std::lock_guard<std::mutex> g(s->mu);
      ok = s->n > 0 && s->e[s->n - 1].bt == m && m->location.line == expected_line &&
           m->location.file != nullptr && std::strcmp(m->location.file, __FILE__) == 0;
    }
  }
  c10::SetStackTraceFetcher(std::function<c10::Backtrace()>([]() { return c10_default_fetch(); }));
  bool dropped = tls_site_ptr == nullptr || tls_site_ptr->n == 0;
  if (!ok || !dropped) {
    g_inner_off = -1;
    g_style_vptr = nullptr;
    g_sites_reason = !ok ? "the fetcher's result is not the backtrace's member in this build"
                         : "the error's backtrace outlived it";
    return;
  }
  g_sites_ok = true;
  g_sites_reason = "ok";
}

PyObject* py_counter_on(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> g(g_counter_mu);
  try {
    if (g_counter_users++ == 0) {
      install_locked();
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return PyLong_FromLongLong(g_constructed.load());
}

PyObject* py_counter_off(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> g(g_counter_mu);
  try {
    if (g_counter_users > 0 && --g_counter_users == 0) {
      install_locked();
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return PyLong_FromLongLong(g_constructed.load());
}

// sites_on() -> (armed: bool, reason: str). Refcounted; each call is paired
// with one sites_off(), armed or not.
PyObject* py_sites_on(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> g(g_counter_mu);
  std::string reason;
  try {
    if (g_site_users++ == 0) {
      if (torch::get_cpp_stacktraces_enabled()) {
        reason = "TORCH_SHOW_CPP_STACKTRACES is set: locations are in the messages";
      } else {
        if (g_c10_lazy_type == nullptr) {
          c10::Backtrace plain = c10::get_lazy_backtrace(0);
          g_c10_lazy_type = &typeid(*plain);
        }
        // With the counter on, the fetcher is this file's (it checks nothing: it was asked for).
        const std::type_info* cur = g_counter_users > 0 ? g_c10_lazy_type : probe_fetcher_type();
        if (cur == nullptr) {
          reason = "no source-location layout: " + g_peek_reason;
        } else if (*cur != *g_c10_lazy_type) {
          reason = "another stack-trace fetcher is installed (" + c10::demangle(cur->name()) + "); it is left alone";
        } else {
          if (!g_sites_tested) {
            self_test_sites();
          }
          reason = g_sites_reason;
          if (g_sites_ok) {
            g_armed = true;
            install_locked();
          }
        }
      }
      g_arm_reason = reason;
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return Py_BuildValue("(Ns)", PyBool_FromLong(g_armed), g_arm_reason.c_str());
}

PyObject* py_sites_off(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> g(g_counter_mu);
  try {
    if (g_site_users > 0 && --g_site_users == 0 && g_armed) {
      g_armed = false;
      install_locked();
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* py_constructed(PyObject*, PyObject*) {
  return PyLong_FromLongLong(g_constructed.load());
}

PyObject* py_counter_users(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> g(g_counter_mu);
  return PyLong_FromLong(g_counter_users);
}

// The C entry point the native engine calls (through the "site_reader"
// capsule) from its end callback when an op's kernel threw: the location of
// the newest c10::Error alive on this thread constructed at or after
// since_ns, or 0. The strings are c10 SourceLocation literals.
extern "C" int tensorscope_read_site(int64_t since_ns, const char** file, const char** function, uint32_t* line) {
  SiteSlot* s = tls_site_ptr;
  if (s == nullptr) {
    return 0;
  }
  std::lock_guard<std::mutex> g(s->mu);
  for (int i = s->n - 1; i >= 0; --i) {
    if (s->e[i].t_ns < since_ns) {
      return 0;
    }
    const c10::SourceLocation& loc = s->e[i].bt->location;
    if (loc.file != nullptr) {
      *file = loc.file;
      *function = loc.function;
      *line = loc.line;
      return 1;
    }
  }
  return 0;
}

// fetcher_probe() -> (inner backtrace type, what()) of a c10::Error constructed
// here now: what the installed fetcher gives (the tests compare it armed and not).
PyObject* py_fetcher_probe(PyObject*, PyObject*) {
  std::string type, what;
  tls_probing = true;
  try {
    TORCH_CHECK(false, "tensorscope fetcher probe");
  } catch (const c10::Error& e) {
    try {
      const c10::Backtrace& bt = e.backtrace();
      if (bt && g_peek_ok && typeid(*bt) == *g_style_type) {
        const auto* m = reinterpret_cast<const BacktraceMirror*>(bt.get());
        type = m->inner ? c10::demangle(typeid(*m->inner).name()) : "";
      }
      what = e.what();
    } catch (...) {
    }
  }
  tls_probing = false;
  return Py_BuildValue("(ss)", type.c_str(), what.c_str());
}

PyObject* py_site_count(PyObject*, PyObject*) {
  SiteSlot* s = tls_site_ptr;
  if (s == nullptr) {
    return PyLong_FromLong(0);
  }
  std::lock_guard<std::mutex> g(s->mu);
  return PyLong_FromLong(s->n);
}

PyMethodDef kMethods[] = {
    {"op_begin", py_op_begin, METH_NOARGS, "Push the per-op warning handler and clear the error slot."},
    {"op_end", py_op_end, METH_NOARGS, "Pop the per-op handler; the op's warnings as dicts, or None."},
    {"call_begin", py_call_begin, METH_O, "call_begin(redirect): enter the outermost torch-level call; True if op warnings go to its PyWarningHandler."},
    {"call_end", py_call_end, METH_NOARGS, "Leave the outermost torch-level call."},
    {"native_seen", py_native_seen, METH_O, "Whether a C++ warning with this message was captured at an op since call_begin."},
    {"depth", py_depth, METH_NOARGS, "Open op_begin calls on this thread."},
    {"reset_thread", py_reset_thread, METH_NOARGS, "Unwind this thread's open handlers; returns how many were open."},
    {"last_error", py_last_error, METH_NOARGS, "(serial, cpp_type, message, file, line, function) of the last exception the translator saw, or None."},
    {"clear_error", py_clear_error, METH_NOARGS, "Forget the last exception."},
    {"capture_open", py_capture_open, METH_NOARGS, "Count an open capture (enables the translator)."},
    {"capture_close", py_capture_close, METH_NOARGS, "Uncount an open capture."},
    {"counter_on", py_counter_on, METH_NOARGS, "Install the counting fetcher (refcounted); returns the count."},
    {"counter_off", py_counter_off, METH_NOARGS, "Restore torch's fetcher when the last user leaves; returns the count."},
    {"constructed", py_constructed, METH_NOARGS, "c10::Error objects constructed while counting."},
    {"counter_users", py_counter_users, METH_NOARGS, "Captures currently counting."},
    {"sites_on", py_sites_on, METH_NOARGS, "Arm error sites (refcounted): (armed, reason)."},
    {"sites_off", py_sites_off, METH_NOARGS, "Disarm error sites when the last user leaves (c10's default fetcher again)."},
    {"fetcher_probe", py_fetcher_probe, METH_NOARGS, "(inner backtrace type, what()) of a c10::Error constructed now."},
    {"site_count", py_site_count, METH_NOARGS, "c10 errors alive on this thread whose site is remembered."},
    {nullptr, nullptr, 0, nullptr}};

PyObject* intern(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) {
    throw py::error_already_set();
  }
  return o;
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
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
  if (PyModule_AddFunctions(m.ptr(), kMethods) < 0) {
    throw py::error_already_set();
  }
  self_test_peek();
  m.attr("peek_ok") = py::bool_(g_peek_ok);
  m.attr("peek_reason") = py::str(g_peek_reason);
  m.attr("cpp_stacktraces") = py::bool_(torch::get_cpp_stacktraces_enabled());
  // What the native engine calls when an op's kernel threw (tensorscope_read_site).
  m.attr("site_reader") = py::capsule(reinterpret_cast<void*>(&tensorscope_read_site), "tensorscope.site_reader");
  // Registered after torch's translators, so pybind11 tries this one first.
  py::register_exception_translator(&translator);
}
