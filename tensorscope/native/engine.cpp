// tensorscope native recording engine: a RecordFunction observer that records
// one row per ATen op a Python TorchDispatchMode would see, at C++ cost.
//
// Driven by tensorscope/recording/engines/native.py (NativeEngine). This file is the Python API and the
// module; engine.h lists the other parts (the observer, the buffers, the storages, the screen)
// and abi.h the layouts shared with Python and with the function mode (fmode.cpp).
//
// Rows never hold a tensor: ids, ints and interned metas only. No Python object is touched on
// the hot path, so the callbacks are safe on threads without the GIL; all shared state is behind
// one mutex (uncontended on the recording thread).

#include <Python.h>

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <torch/csrc/Storage.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "abi_py.h"
#include "engine.h"
#include "engine_storages.h"

namespace tsengine TS_HIDDEN {

Engine g;
std::atomic<tsabi::ReadSite> g_read_site{nullptr};

void Engine::clear() {
  facts_by_name.clear();
  for (auto* f : ops) delete f;
  ops.clear();
  metas = SeqInterner();
  meta_nbytes.clear();
  tuples = SeqInterner();
  aliases = SeqInterner();
  args = SeqInterner();
  row_args.clear();
  node_ids.clear();
  node_names.clear();
  block = std::vector<Row>();
  block_stor = std::vector<int32_t>();
  block_first = 0;
  chunks.clear();
  chunk_bytes = 0;
  chunk_rows = 0;
  handover_due = false;
  py_rows = 0;
  n_handovers = 0;
  on_full_errors = 0;
  ops_taken = metas_taken = tuples_taken = aliases_taken = args_taken = nodes_taken = row_args_taken = 0;
  nonfinite_taken = 0;
  n_rows = 0;
  last_error_op = -1;
  last_error_seq = -1;
  last_error_line = -1;
  other_thread_rows = 0;
  by_ptr.clear();
  slots.clear();
  free_slots.clear();
  next_sid = 0;
  last_slot = -1;
  finished = std::vector<int64_t>();
  young.clear();
  old.clear();
  young_rr = old_rr = 0;
  recent.assign(kRecent, -1);
  recent_pos = 0;
  warnings.clear();
  n_warnings.store(0);
  warnings_taken = 0;
  nonfinite.clear();
  fingerprints.clear();
  fingerprints_taken = 0;
  n_screened = n_fired = n_pre = n_unscreened_device = n_proven = n_inputs_read = 0;
  own_ns.store(0);
  own_rows.store(0);
  memo.clear();
  storage_gen.clear();
  write_clock = 0;
}

namespace {

// set_fingerprints(on): whether the next start() records fingerprints (kept across starts)
PyObject* py_set_fingerprints(PyObject*, PyObject* on) {
  std::lock_guard<std::mutex> lk(g.mu);
  g.want_fp = PyObject_IsTrue(on) == 1;
  Py_RETURN_NONE;
}

// set_fp_simd(best): the best vectorised fingerprint loop allowed: True (default: the best the CPU
// has), "avx2" (not AVX-512), False (the portable loop). Every path gives the same bits (tests
// compare). Returns the vectorised paths this CPU has, best last: ("avx2", "avx512"), ("avx2",) or ().
PyObject* py_set_fp_simd(PyObject*, PyObject* best) {
  static const char* const kNames[] = {"portable", "avx2", "avx512"};
  int cap = -1;
  if (PyBool_Check(best)) {
    cap = best == Py_True ? 2 : 0;
  } else if (PyUnicode_Check(best)) {
    const char* s = PyUnicode_AsUTF8(best);
    if (s == nullptr) return nullptr;
    for (int i = 0; i < 3; ++i)
      if (std::strcmp(s, kNames[i]) == 0) cap = i;
  }
  if (cap < 0) {
    PyErr_SetString(PyExc_ValueError, "set_fp_simd: True, False, \"portable\", \"avx2\" or \"avx512\"");
    return nullptr;
  }
  int have = 0;
#ifdef TS_FP_AVX2
  fp_simd_cap.store(cap);
  have = fp_cpu_simd();
#endif
  PyObject* out = PyTuple_New(have);
  if (out == nullptr) return nullptr;
  for (int i = 0; i < have; ++i) {
    PyObject* name = PyUnicode_FromString(kNames[i + 1]);
    if (name == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, i, name);
  }
  return out;
}

// set_capture(pre_hook or None, max_bytes, seqs, namespaces): for the next start(), copy what an op of
// those namespaces (also hooked) will overwrite before it runs and hand it to pre_hook before the op
// hook (engine_ops.cpp); seqs (may be empty: every op) limits it to the ops near those. Cleared at stop.
PyObject* py_set_capture(PyObject*, PyObject* args) {
  PyObject* fn;
  long long max_bytes;
  PyObject* seqs;
  PyObject* nss;
  if (!PyArg_ParseTuple(args, "OLOO", &fn, &max_bytes, &seqs, &nss)) return nullptr;
  std::unordered_map<std::string, bool> ns;
  {
    PyObject* it = PyObject_GetIter(nss);
    if (it == nullptr) return nullptr;
    while (PyObject* item = PyIter_Next(it)) {
      const char* c = PyUnicode_AsUTF8(item);
      if (c != nullptr) ns.emplace(c, true);
      Py_DECREF(item);
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return nullptr;
  }
  std::vector<int64_t> v;
  PyObject* it = PyObject_GetIter(seqs);
  if (it == nullptr) return nullptr;
  while (PyObject* item = PyIter_Next(it)) {
    v.push_back(PyLong_AsLongLong(item));
    Py_DECREF(item);
  }
  Py_DECREF(it);
  if (PyErr_Occurred()) return nullptr;
  if (g.active) {
    PyErr_SetString(PyExc_RuntimeError, "set_capture: the native engine is recording");
    return nullptr;
  }
  std::sort(v.begin(), v.end());
  std::lock_guard<std::mutex> lk(g.mu);
  Py_CLEAR(g.pre_hook);
  if (fn != Py_None) {
    Py_INCREF(fn);
    g.pre_hook = fn;
  }
  g.pre_left = max_bytes > 0 ? int64_t(max_bytes) : 0;
  g.pre_seqs = std::move(v);
  g.pre_ns = std::move(ns);
  Py_RETURN_NONE;
}

PyObject* py_start(PyObject*, PyObject* args) {
  long long t0;
  int screen, storages, warnings;
  PyObject* arg_ops = nullptr;
  PyObject* hook = Py_None;
  PyObject* hook_ns = Py_None;
  long long spill_rows = -1;
  PyObject* on_full = Py_None;
  long long block_rows = int64_t(tsabi::kBlockRows);
  long long handover_records = tsabi::kHandoverRecords;
  if (!PyArg_ParseTuple(args, "Lppp|OOOLOLL", &t0, &screen, &storages, &warnings, &arg_ops, &hook, &hook_ns,
                        &spill_rows, &on_full, &block_rows, &handover_records))
    return nullptr;
  std::unordered_map<std::string, bool> hns;
  if (hook != Py_None && hook_ns != Py_None) {
    PyObject* it = PyObject_GetIter(hook_ns);
    if (it == nullptr) return nullptr;
    while (PyObject* item = PyIter_Next(it)) {
      const char* c = PyUnicode_AsUTF8(item);
      if (c != nullptr) hns.emplace(c, true);
      Py_DECREF(item);
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return nullptr;
  }
  std::unordered_map<std::string, bool> wanted;
  if (arg_ops != nullptr && arg_ops != Py_None) {
    PyObject* it = PyObject_GetIter(arg_ops);
    if (it == nullptr) return nullptr;
    while (PyObject* item = PyIter_Next(it)) {
      const char* c = PyUnicode_AsUTF8(item);
      if (c != nullptr) wanted.emplace(c, true);
      Py_DECREF(item);
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return nullptr;
  }
  if (g.active) {
    PyErr_SetString(PyExc_RuntimeError, "the native engine is already recording in this process");
    return nullptr;
  }
  try {
    std::lock_guard<std::mutex> lk(g.mu);
    g.clear();
    g.gen++;
    g.t0 = t0;
    g.seq_at_start = at::sequence_number::peek();   // the tracing thread's counter at the start
    g.want_screen = screen;
    g.want_storages = storages;
    g.want_warnings = warnings;
    g.arg_ops = std::move(wanted);
    g.hook_ns = std::move(hns);
    Py_CLEAR(g.hook);
    g.hook_errors = 0;
    if (hook != Py_None && !g.hook_ns.empty()) {
      Py_INCREF(hook);
      g.hook = hook;
    }
    Py_CLEAR(g.on_full);
    g.spill_rows = spill_rows >= 0 ? int64_t(spill_rows) : INT64_MAX;
    g.block_rows = size_t(block_rows < 1 ? 1 : block_rows > (1 << 24) ? (1 << 24) : block_rows);
    g.handover_records = handover_records < 1 ? 1 : int64_t(handover_records);
    if (on_full != Py_None) {
      Py_INCREF(on_full);
      g.on_full = on_full;
    }
    g.cur_module = 0;
    g.cur_call = -1;
    g.paused.store(0);
    g.owner_thread = std::hash<std::thread::id>()(std::this_thread::get_id());
    observer_install();
    g.active = true;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* py_stop(PyObject*, PyObject*) {
  if (g.active) {
    g.active = false;
    try {
      at::removeCallback(g.handle);
    } catch (...) {
    }
    Py_CLEAR(g.hook);
    Py_CLEAR(g.on_full);
    Py_CLEAR(g.pre_hook);
    g.pre_seqs.clear();
    observer_remove_thread_state();
  }
  Py_RETURN_NONE;
}

PyObject* py_set_module(PyObject*, PyObject* o) {
  g.cur_module = PyLong_AsLongLong(o);
  Py_RETURN_NONE;
}
PyObject* py_set_call(PyObject*, PyObject* o) {
  g.cur_call = PyLong_AsLongLong(o);
  Py_RETURN_NONE;
}
PyObject* py_seq(PyObject*, PyObject*) {
  return PyLong_FromLongLong(g.n_rows);
}
PyObject* py_take_error_seq(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> lk(g.mu);
  int64_t s = g.last_error_seq;
  g.last_error_seq = -1;
  if (s < 0) Py_RETURN_NONE;
  int32_t op = g.last_error_op;
  if (op < 0 || size_t(op) >= g.ops.size()) Py_RETURN_NONE;
  if (g.last_error_line < 0) {
    return Py_BuildValue("(LsOOO)", (long long)s, g.ops[size_t(op)]->name.c_str(), Py_None, Py_None, Py_None);
  }
  return Py_BuildValue("(LssLs)", (long long)s, g.ops[size_t(op)]->name.c_str(), g.last_error_file.c_str(),
                       (long long)g.last_error_line, g.last_error_func.c_str());
}
PyObject* py_set_site_reader(PyObject*, PyObject* o) {
  tsabi::ReadSite rs = nullptr;
  if (o != Py_None) {
    void* ptr = PyCapsule_GetPointer(o, tsabi::kSiteReaderCapsule);
    if (ptr == nullptr) return nullptr;
    rs = reinterpret_cast<tsabi::ReadSite>(ptr);
  }
  g_read_site.store(rs, std::memory_order_release);
  Py_RETURN_NONE;
}


// warnings recorded since the last call: [(seq, msg, file, line, function, deprecation)]
PyObject* py_take_warnings(PyObject*, PyObject*) {
  if (g.n_warnings.load(std::memory_order_acquire) == g.warnings_taken) Py_RETURN_NONE;   // per call: no lock
  std::lock_guard<std::mutex> lk(g.mu);
  size_t n = g.warnings.size() - g.warnings_taken;
  PyObject* l = PyList_New(Py_ssize_t(n));
  for (size_t i = 0; i < n; ++i) {
    const WarnRec& w = g.warnings[g.warnings_taken + i];
    PyObject* t = Py_BuildValue("(LNNLNO)", (long long)w.seq,
                                PyUnicode_DecodeUTF8(w.msg.data(), Py_ssize_t(w.msg.size()), "replace"),
                                PyUnicode_DecodeUTF8(w.file.data(), Py_ssize_t(w.file.size()), "replace"),
                                (long long)w.line,
                                PyUnicode_DecodeUTF8(w.function.data(), Py_ssize_t(w.function.size()), "replace"),
                                w.deprecation ? Py_True : Py_False);
    PyList_SET_ITEM(l, Py_ssize_t(i), t);
  }
  g.warnings_taken = g.warnings.size();
  return l;
}

PyObject* py_warnings_pending(PyObject*, PyObject*) {
  return PyBool_FromLong(g.n_warnings.load(std::memory_order_acquire) != g.warnings_taken);
}

PyObject* py_warning_seen(PyObject*, PyObject* o) {
  Py_ssize_t n;
  const char* s = PyUnicode_AsUTF8AndSize(o, &n);
  if (s == nullptr) return nullptr;
  std::lock_guard<std::mutex> lk(g.mu);
  for (const auto& w : g.warnings) {
    if (w.msg.size() == size_t(n) && std::memcmp(w.msg.data(), s, size_t(n)) == 0) Py_RETURN_TRUE;
  }
  Py_RETURN_FALSE;
}

// The rest of what was recorded (storages, screen, counters), once at the end; the rows, the
// dictionaries and the storage records finished so far come through take_chunks(True) before.
// "tensors": the records finished since (the final sweep drops every freed one) and the live ones.
PyObject* py_take(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> lk(g.mu);
  // final sweep: every storage freed by now
  int64_t last = g.n_rows - 1;
  sweep_list(g.young, g.young_rr, size_t(-1) / 2, last);
  sweep_list(g.old, g.old_rr, size_t(-1) / 2, last);
  std::vector<int64_t> st;
  st.swap(g.finished);
  st.reserve(st.size() + (g.young.size() + g.old.size()) * tsabi::TC_N);
  for (int32_t slot : g.young) put_record(st, g.slots[size_t(slot)]);
  for (int32_t slot : g.old) put_record(st, g.slots[size_t(slot)]);
  PyObject* d = PyDict_New();
  auto put = [&](const char* k, PyObject* v) {
    PyDict_SetItemString(d, k, v);
    Py_DECREF(v);
  };
  put("tensors", bytes_of(st.data(), st.size() * 8));
  put("other_thread_rows", PyLong_FromLongLong(g.other_thread_rows));
  put("hook_errors", PyLong_FromLongLong(g.hook_errors));
  put("on_full_errors", PyLong_FromLongLong(g.on_full_errors));
  put("n_rows", PyLong_FromLongLong(g.n_rows));
  PyObject* screen = Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L}", "proven", (long long)g.n_proven, "inputs_screened",
                                   (long long)g.n_inputs_read, "screened", (long long)g.n_screened, "fired",
                                   (long long)g.n_fired, "pre_screened", (long long)g.n_pre, "device_unscreened",
                                   (long long)g.n_unscreened_device);
  put("screen", screen);
  put("own", Py_BuildValue("(LL)", (long long)g.own_ns.load(), (long long)g.own_rows.load()));
  return d;
}

// (storage id, torch.UntypedStorage) of the storages the trace created that are alive now
PyObject* py_live_created(PyObject*, PyObject*) {
  std::vector<std::pair<int32_t, c10::intrusive_ptr<c10::StorageImpl>>> live;
  {
    std::lock_guard<std::mutex> lk(g.mu);
    for (int32_t slot : g.young) {
      const StorageRec& r = g.slots[size_t(slot)];
      auto strong = r.weak.lock();
      if (strong) live.emplace_back(r.sid, std::move(strong));
    }
  }
  PyObject* l = PyList_New(0);
  for (auto& e : live) {
    PyObject* obj = THPStorage_Wrap(c10::Storage(std::move(e.second)));
    if (obj == nullptr) {
      PyErr_Clear();
      continue;
    }
    PyObject* t = Py_BuildValue("(iN)", e.first, obj);
    PyList_Append(l, t);
    Py_DECREF(t);
  }
  return l;
}

PyObject* py_release(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> lk(g.mu);
  if (!g.active) g.clear();
  Py_RETURN_NONE;
}

// callable() with every RecordFunction callback off on this thread (ours and the
// profiler's): tensorscope's own bookkeeping ops stay invisible to other tools
PyObject* py_unobserved(PyObject*, PyObject* callable) {
  at::RecordFunctionGuard off(false);
  return PyObject_CallObject(callable, nullptr);
}

PyObject* py_pause(PyObject*, PyObject* o) {
  if (PyObject_IsTrue(o)) {
    g.paused.fetch_add(1);
  } else if (g.paused.load() > 0) {
    g.paused.fetch_sub(1);
  }
  Py_RETURN_NONE;
}

PyObject* py_active(PyObject*, PyObject*) {
  return PyBool_FromLong(g.active);
}

// The function mode's view of the engine (abi.h FmodeState), exported once as the fmode_state
// capsule: fmode.cpp sets the call/module ids and reads seq per torch-level call without a Python
// round trip.
int fmode_warnings_pending() {
  return g.n_warnings.load(std::memory_order_acquire) != g.warnings_taken;
}
tsabi::FmodeState fmode_state{tsabi::kFmodeStateAbi, &g.cur_call, &g.cur_module, &g.n_rows, &fmode_warnings_pending};

PyMethodDef methods[] = {
    {"set_fingerprints", py_set_fingerprints, METH_O, "set_fingerprints(on): fingerprints for the next start()"},
    {"set_fp_simd", py_set_fp_simd, METH_O, "set_fp_simd(best): the best fingerprint loop allowed; returns the SIMD paths this CPU has"},
    {"set_capture", py_set_capture, METH_VARARGS,
     "set_capture(pre_hook, max_bytes, seqs, namespaces): capture='s copy of written arguments, next start()"},
    {"start", py_start, METH_VARARGS, "start(t0_ns, screen, storages, warnings): install the observer on this thread"},
    {"stop", py_stop, METH_NOARGS, "remove the observer"},
    {"set_module", py_set_module, METH_O, "module id of the running code"},
    {"set_call", py_set_call, METH_O, "call id of the running torch-level call (-1: none)"},
    {"seq", py_seq, METH_NOARGS, "rows recorded so far (the next op's seq)"},
    {"take_error_seq", py_take_error_seq, METH_NOARGS, "(seq, op, cpp_file, cpp_line, cpp_function) of the last row whose kernel threw, once (location None when unknown)"},
    {"set_site_reader", py_set_site_reader, METH_O, "set_site_reader(capsule | None): the hooks' c10 error-site reader"},
    {"take_warnings", py_take_warnings, METH_NOARGS, "warnings recorded since the last call"},
    {"warning_seen", py_warning_seen, METH_O, "whether an op recorded this warning message"},
    {"warnings_pending", py_warnings_pending, METH_NOARGS, "whether take_warnings() has something"},
    {"take", py_take, METH_NOARGS, "storages, screen and counters, as bytes (after take_chunks(True))"},
    {"take_chunks", py_take_chunks, METH_O, "take_chunks(final) -> (packed row chunks, dictionaries added since)"},
    {"resident", py_resident, METH_NOARGS, "bytes held for rows, storages and interned values"},
    {"live_created", py_live_created, METH_NOARGS, "live storages the trace created"},
    {"release", py_release, METH_NOARGS, "free the buffers"},
    {"active", py_active, METH_NOARGS, "whether recording"},
    {"pause", py_pause, METH_O, "pause(True)/pause(False): hide the ops run in between (torch.compile compiling)"},
    {"unobserved", py_unobserved, METH_O, "call f() with RecordFunction off on this thread"},
    {"gather", py_gather, METH_VARARGS, "gather(ids|None, starts, lens, flat, itemsize) -> (int32 offsets, values)"},
    {"abi", tsabi::py_abi, METH_NOARGS, "the layouts shared with Python (abi.h) as a dict"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "tensorscope_engine", "tensorscope native recording engine", -1,
                      methods};

}  // namespace
}  // namespace tsengine

PyMODINIT_FUNC PyInit_tensorscope_engine() {
  using namespace tsengine;
  PyObject* m = PyModule_Create(&moddef);
  if (m == nullptr) return nullptr;
  PyModule_AddIntConstant(m, "F_BACKWARD", F_BACKWARD);
  PyModule_AddIntConstant(m, "F_THREW", F_THREW);
  PyModule_AddIntConstant(m, "F_OTHER_THREAD", F_OTHER_THREAD);
  PyModule_AddIntConstant(m, "ROW_SIZE", sizeof(Row));
  PyModule_AddObject(m, "fmode_state", PyCapsule_New(&fmode_state, tsabi::kFmodeStateCapsule, nullptr));
  PyModule_AddIntConstant(m, "BLOCK_ROWS", tsabi::kBlockRows);
  PyModule_AddIntConstant(m, "PACKED_COLUMNS", PC_N);
  return m;
}
