// tensorscope native recording engine: per-op facts and the Python calls an op makes.
//
//  * the facts of a schema, computed once (CompositeImplicitAutograd or a backend kernel, writes,
//    returns uninitialised memory, FLOP arguments wanted, the op hook wanted);
//  * the argument encoding of the ops whose FLOP formulas need arguments (abi.h ArgTag);
//  * the per-op warning handler's record;
//  * the op hook (c10d collectives, capture=: hook(seq, name, inputs, outputs), inputs taken in the
//    start callback) and the hand-over of chunks and finished storage records (on_full) -- the only
//    places the observer takes the GIL;
//  * capture='s copy of what an op will overwrite (pre_copy, in the start callback: a memcpy of the
//    written arguments' memory, nothing dispatched), handed to the pre-hook just before the op hook.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <variant>

#include "engine.h"
#include "engine_known.h"
#include "engine_storages.h"

// Declared here instead of including torch/csrc/jit/python/pybind_utils.h (~25 CPU-s
// of headers): IValue -> Python object, as torch's own bindings convert them.
namespace torch::jit {
pybind11::object toPyObject(c10::IValue ivalue);
}  // namespace torch::jit

namespace tsengine TS_HIDDEN {

void RowWarningHandler::process(const c10::Warning& w) {
  try {
    const auto& loc = w.source_location();
    std::lock_guard<std::mutex> lk(eng->mu);
    eng->warnings.push_back(WarnRec{seq, w.msg(), loc.file ? loc.file : "", loc.function ? loc.function : "",
                                    int64_t(loc.line),
                                    std::holds_alternative<c10::DeprecationWarning>(w.type())});
    eng->n_warnings.store(eng->warnings.size(), std::memory_order_release);
  } catch (...) {
  }
  if (prev != nullptr && prev != this) prev->process(w);
}

// -- op facts (under the mutex) ----------------------------------------------
const char* const kUninit[] = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                               "empty_permuted", "resize_", "resize_as_", "set_", "_resize_output_",
                               "lift_fresh_copy", "_local_scalar_dense", nullptr};

// under g.mu: a schema seen for the first time (facts_for in engine.h looks the cache up)
OpFacts* make_facts(const at::RecordFunction& fn) {
  const char* key = fn.name();
  auto opname = fn.operator_name();
  if (!opname) return nullptr;   // a string event: transparent, never cached (its pointer is not stable)
  auto* f = new OpFacts();
  f->id = int32_t(g.ops.size());
  f->name = opname->name + (opname->overload_name.empty() ? std::string(".default") : "." + opname->overload_name);
  try {
    auto h = c10::Dispatcher::singleton().findOp(*opname);
    if (h) {
      f->cia = h->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
      f->autograd = h->hasKernelForDispatchKey(c10::DispatchKey::Autograd);   // registered for the alias
      for (auto k : {c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::CompositeExplicitAutograd,
                     c10::DispatchKey::CompositeExplicitAutogradNonFunctional, c10::DispatchKey::Meta}) {
        if (h->hasKernelForDispatchKey(k)) f->backend = true;
      }
      if (h->hasSchema()) {
        const auto& sch = h->schema();
        if (!sch.is_vararg()) f->n_args = int32_t(sch.arguments().size());
        if (!sch.is_varret()) f->n_rets = int32_t(sch.returns().size());
        for (const auto& a : sch.arguments()) {
          const auto* ai = a.alias_info();
          const bool w = ai != nullptr && ai->isWrite();
          if (w) f->writes = true;
          f->arg_writes.push_back(w);
        }
        if (sch.is_vararg()) f->arg_writes.clear();
      }
    }
  } catch (...) {
  }
  f->want_args = g.arg_ops.count(opname->name) > 0;
  {
    auto pos = opname->name.find("::");
    f->py_hook = g.hook != nullptr && pos != std::string::npos && g.hook_ns.count(opname->name.substr(0, pos)) > 0;
    f->pre_copy = f->py_hook && f->writes && g.pre_hook != nullptr && g.pre_ns.count(opname->name.substr(0, pos)) > 0;
  }
  std::string base = opname->name.substr(opname->name.find("::") == std::string::npos ? 0 : opname->name.find("::") + 2);
  for (const char* const* u = kUninit; *u; ++u) {
    if (base == *u) f->no_screen = true;
  }
  f->rule = bound_rule(base, opname->overload_name);
  g.ops.push_back(f);
  g.facts_by_name.emplace(key, f);
  return f;
}

// The arguments of an op whose FLOP formula needs them (abi.h ArgTag); the outputs are appended at
// commit (engine_observer.cpp) and the whole interned then.
void encode_args(const at::RecordFunction& fn, const OpFacts* f, std::vector<int64_t>& out) {
  using namespace tsabi;
  std::vector<int64_t> enc;
  for (const auto& v : args_of(fn, f)) {
    if (v.isTensor() && real_tensor(v.toTensor())) {
      uintptr_t ptr;
      const c10::StorageImpl* si;
      int64_t nb;
      enc.push_back(TAG_TENSOR);
      enc.push_back(meta_of(v.toTensor(), &ptr, &si, &nb));
    } else if (v.isNone() || (v.isTensor() && !v.toTensor().defined())) {
      enc.push_back(TAG_NONE);
    } else if (v.isBool()) {
      enc.push_back(TAG_BOOL);
      enc.push_back(v.toBool());
    } else if (v.isInt()) {
      enc.push_back(TAG_INT);
      enc.push_back(v.toInt());
    } else if (v.isDouble()) {
      double dv = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &dv, 8);
      enc.push_back(TAG_DOUBLE);
      enc.push_back(bits);
    } else if (v.isIntList()) {
      auto l = v.toIntVector();
      enc.push_back(TAG_INT_LIST);
      enc.push_back(int64_t(l.size()));
      enc.insert(enc.end(), l.begin(), l.end());
    } else if (v.isBoolList()) {
      auto l = v.toBoolList();
      enc.push_back(TAG_BOOL_LIST);
      enc.push_back(int64_t(l.size()));
      for (bool b : l) enc.push_back(b);
    } else {
      enc.push_back(TAG_OTHER);
    }
  }
  out.swap(enc);
}


// op hook: the inputs as Python objects, taken in the start callback (the only place they are valid)
void hook_inputs(Pending& p, const at::RecordFunction& fn) {
  PyGILState_STATE st = PyGILState_Ensure();
  try {
    auto ins = args_of(fn, p.facts);
    PyObject* l = PyList_New(Py_ssize_t(ins.size()));
    for (size_t i = 0; i < ins.size(); ++i) {
      PyList_SET_ITEM(l, Py_ssize_t(i), torch::jit::toPyObject(ins[i]).release().ptr());
    }
    p.py_inputs = l;
  } catch (...) {
    PyErr_Clear();
    g.hook_errors++;
  }
  PyGILState_Release(st);
  p.row.start = now_ns();
}

// -- capture=: the written arguments before the op --------------------------------------------
// Rows that can commit between an op's start and its own commit (the clone its autograd kernel saves,
// autocast's casts): a seq asked for is looked for this far past the next seq.
constexpr int64_t kPreSlack = 64;

void pre_drop(Pending& p) {
  p.pre_k.clear();
  p.pre_off.clear();
  if (p.pre_cap > (size_t(1) << 20)) {   // a large copy is not kept for the next op
    p.pre_buf.reset();
    p.pre_cap = 0;
  }
}

// under g.mu, in the start callback (before the kernel): the bytes each written CPU strided tensor
// argument spans from its storage offset (repro_capture.span_elements), within g.pre_left in all
void pre_copy(Pending& p, const at::RecordFunction& fn, const OpFacts* f) {
  if (!g.pre_seqs.empty()) {
    auto it = std::lower_bound(g.pre_seqs.begin(), g.pre_seqs.end(), g.n_rows);
    if (it == g.pre_seqs.end() || *it > g.n_rows + kPreSlack) return;
  }
  const Values args = args_of(fn, f);
  if (f->arg_writes.size() != args.size()) return;   // vararg: which argument is written is unknown
  int64_t left = g.pre_left;
  size_t used = 0;
  int32_t k = 0;   // the tensor number, as the op hook's inputs list them (InputCapture._tensors)
  auto one = [&](const c10::IValue& v, bool w) {
    if (!v.isTensor() || !real_tensor(v.toTensor())) return;
    const int32_t kk = k++;
    if (!w) return;
    const c10::TensorImpl* t = v.toTensor().unsafeGetTensorImpl();
    if (t->device().type() != c10::DeviceType::CPU || t->layout() != c10::kStrided || t->is_nested() ||
        t->has_symbolic_sizes_strides() || !t->has_storage() || t->numel() == 0)
      return;
    int64_t span = 1;
    for (int64_t d = 0; d < t->dim(); ++d) span += (t->sizes()[d] - 1) * t->strides()[d];
    const int64_t n = span * int64_t(t->itemsize());
    const c10::StorageImpl* si = t->unsafe_storage().unsafeGetStorageImpl();
    if (n <= 0 || n > left || si == nullptr || si->data_ptr().get() == nullptr) return;
    const int64_t from = t->storage_offset() * int64_t(t->itemsize());
    if (from + n > int64_t(si->nbytes())) return;
    if (p.pre_off.empty()) p.pre_off.push_back(0);
    if (used + size_t(n) > p.pre_cap) {
      const size_t cap = std::max(used + size_t(n), 2 * p.pre_cap);
      std::unique_ptr<char[]> b(new char[cap]);
      if (used) std::memcpy(b.get(), p.pre_buf.get(), used);
      p.pre_buf = std::move(b);
      p.pre_cap = cap;
    }
    std::memcpy(p.pre_buf.get() + used, static_cast<const char*>(si->data_ptr().get()) + from, size_t(n));
    used += size_t(n);
    left -= n;
    p.pre_k.push_back(kk);
    p.pre_off.push_back(used);
  };
  for (size_t ai = 0; ai < args.size(); ++ai) {
    const c10::IValue& v = args[ai];
    const bool w = f->arg_writes[ai];
    if (v.isList()) {
      for (const auto& e : v.toListRef()) one(e, w);
    } else {
      one(v, w);
    }
  }
}

void drop_py_inputs_slow(Pending& p) {
  PyGILState_STATE st = PyGILState_Ensure();
  Py_CLEAR(p.py_inputs);
  PyGILState_Release(st);
}

// With the GIL: pre_hook(seq, name, {tensor number: memoryview of the copy}) (the views are released
// after the op hook ran: pre_release); its result is the bytes it may still keep.
void pre_hand_over(Pending& p, int64_t seq) {
  PyObject* ph = g.pre_hook;
  if (ph == nullptr) return;
  PyObject* d = PyDict_New();
  if (d == nullptr) {
    PyErr_Clear();
    return;
  }
  for (size_t i = 0; i < p.pre_k.size(); ++i) {
    PyObject* key = PyLong_FromLong(long(p.pre_k[i]));
    PyObject* mv = PyMemoryView_FromMemory(p.pre_buf.get() + p.pre_off[i], Py_ssize_t(p.pre_off[i + 1] - p.pre_off[i]),
                                           PyBUF_READ);
    if (key != nullptr && mv != nullptr) PyDict_SetItem(d, key, mv);
    Py_XDECREF(key);
    Py_XDECREF(mv);
  }
  p.pre_views = d;
  Py_INCREF(ph);
  PyObject* r = PyObject_CallFunction(ph, "LsO", (long long)seq, p.facts->name.c_str(), d);
  Py_DECREF(ph);
  if (r == nullptr) {
    PyErr_Clear();
    g.hook_errors++;
    return;
  }
  if (PyLong_Check(r)) {
    const long long left = PyLong_AsLongLong(r);
    if (!PyErr_Occurred()) g.pre_left = left > 0 ? int64_t(left) : 0;
  }
  PyErr_Clear();
  Py_DECREF(r);
}

// With the GIL: the views of the copy end (memoryview.release()); one still exported elsewhere cannot
// be released, so its memory is left allocated (never reused under it) and counted as a hook error.
void pre_release(Pending& p) {
  PyObject* d = p.pre_views;
  p.pre_views = nullptr;
  bool leaked = false;
  if (d != nullptr) {
    PyObject* key;
    PyObject* mv;
    Py_ssize_t pos = 0;
    while (PyDict_Next(d, &pos, &key, &mv)) {
      PyObject* r = PyObject_CallMethod(mv, "release", nullptr);
      if (r == nullptr) {
        PyErr_Clear();
        leaked = true;
      }
      Py_XDECREF(r);
    }
    Py_DECREF(d);
  }
  if (leaked) {
    (void)p.pre_buf.release();
    p.pre_cap = 0;
    g.hook_errors++;
  }
  pre_drop(p);
}

// hook(seq, "ns::op.overload", inputs, outputs): outputs None when the kernel threw.
// Never raises into the op: a failing hook is counted (hook_errors) and cleared.
void call_hook(Pending& p, const at::RecordFunction& fn, int64_t seq) {
  PyGILState_STATE st = PyGILState_Ensure();
  PyObject* outs = nullptr;
  try {
    if (p.row.flags & F_THREW) {
      Py_INCREF(Py_None);
      outs = Py_None;
    } else {
      const auto o = rets_of(fn, p.facts);
      outs = PyTuple_New(Py_ssize_t(o.size()));
      for (size_t i = 0; i < o.size(); ++i) {
        PyTuple_SET_ITEM(outs, Py_ssize_t(i), torch::jit::toPyObject(o[i]).release().ptr());
      }
    }
    if (!p.pre_k.empty()) pre_hand_over(p, seq);
    PyObject* hook = g.hook;
    if (hook != nullptr) {
      Py_INCREF(hook);
      PyObject* r = PyObject_CallFunction(hook, "LsOO", (long long)seq, p.facts->name.c_str(), p.py_inputs, outs);
      Py_DECREF(hook);
      if (r == nullptr) {
        PyErr_Clear();
        g.hook_errors++;
      } else {
        Py_DECREF(r);
      }
    }
  } catch (...) {
    PyErr_Clear();
    g.hook_errors++;
  }
  Py_XDECREF(outs);
  Py_CLEAR(p.py_inputs);
  pre_release(p);
  PyGILState_Release(st);
}

// The packed chunks passed spill_rows: hand them to Python now (engines/native.py writes them to disk,
// or as dataset parts). Only on the tracing thread, between two ops, after the row committed;
// with RecordFunction off (nothing it runs is an op of the program, for us or a profiler) and the
// thread's Python error state kept.
void call_on_full() {
  PyGILState_STATE st = PyGILState_Ensure();   // lock order everywhere: the GIL, then g.mu
  PyObject* cb = nullptr;
  {
    std::lock_guard<std::mutex> lk(g.mu);
    if (g.handover_due && g.on_full != nullptr) {
      cb = g.on_full;
      Py_INCREF(cb);
    }
    g.handover_due = false;
  }
  if (cb != nullptr) {
    at::RecordFunctionGuard off(false);
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyObject* r = PyObject_CallNoArgs(cb);
    if (r != nullptr && PyLong_Check(r)) {   // the rows Python still holds unspilled
      long long held = PyLong_AsLongLong(r);
      if (held == -1 && PyErr_Occurred()) {
        PyErr_Clear();
      } else {
        std::lock_guard<std::mutex> lk(g.mu);
        g.py_rows = held < 0 ? 0 : int64_t(held);
      }
    }
    if (r == nullptr) {
      // a Ctrl-C that landed in the hand-over belongs to the program: raised again at its next check
      bool interrupt = PyErr_ExceptionMatches(PyExc_KeyboardInterrupt);
      PyErr_Clear();
      if (interrupt) {
        PyErr_SetInterrupt();
      } else {
        g.on_full_errors++;
      }
    } else {
      Py_DECREF(r);
    }
    PyErr_Restore(et, ev, etb);
    Py_DECREF(cb);
  }
  PyGILState_Release(st);
}

}  // namespace tsengine
