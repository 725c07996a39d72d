// tensorscope native hooks: the c10 stack-trace fetcher (constructed-error counter and error sites).
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

#include <Python.h>

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
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "hooks.h"

namespace tshooks TS_HIDDEN {
namespace {

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

}  // namespace

// The C entry point the native engine calls (through the "site_reader"
// capsule) from its end callback when an op's kernel threw: the location of
// the newest c10::Error alive on this thread constructed at or after
// since_ns, or 0. The strings are c10 SourceLocation literals.
int read_site(int64_t since_ns, const char** file, const char** function, uint32_t* line) {
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

namespace {

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

}  // namespace

PyMethodDef kFetcherMethods[] = {
    {"counter_on", py_counter_on, METH_NOARGS, "Install the counting fetcher (refcounted); returns the count."},
    {"counter_off", py_counter_off, METH_NOARGS, "Restore torch's fetcher when the last user leaves; returns the count."},
    {"constructed", py_constructed, METH_NOARGS, "c10::Error objects constructed while counting."},
    {"counter_users", py_counter_users, METH_NOARGS, "Captures currently counting."},
    {"sites_on", py_sites_on, METH_NOARGS, "Arm error sites (refcounted): (armed, reason)."},
    {"sites_off", py_sites_off, METH_NOARGS, "Disarm error sites when the last user leaves (c10's default fetcher again)."},
    {"fetcher_probe", py_fetcher_probe, METH_NOARGS, "(inner backtrace type, what()) of a c10::Error constructed now."},
    {"site_count", py_site_count, METH_NOARGS, "c10 errors alive on this thread whose site is remembered."},
    {nullptr, nullptr, 0, nullptr}};

static_assert(std::is_same<decltype(&read_site), tsabi::ReadSite>::value, "read_site is an abi.h ReadSite");

}  // namespace tshooks
