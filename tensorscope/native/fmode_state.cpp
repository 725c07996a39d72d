// tensorscope native function mode: its state (State S) between traces and while one records.
//
// configure() starts a trace on this thread, take() hands the calls rows over and stops; the rows
// live in blocks of kBlock calls, packed column by column once no running call points into them
// (each field minus its minimum in the narrowest of 0/1/2/4/8 bytes: a constant field such as
// parent or error costs nothing), like recorder.py packs the Python calls chunks. When the
// recorder spills, take_packed() hands the packed blocks not handed over yet to Python (which
// spills them with the op chunks) and frees them here: take() then hands over only the rest. Also here: the
// caches' upkeep and the containment of a failing Python helper (never the program's problem).

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fmode.h"

namespace tsfmode TS_HIDDEN {

State S;
CallRow* g_spare = nullptr;

namespace {

void spare_rows(CallRow* rows) {
  if (g_spare == nullptr) {
    g_spare = rows;
  } else {
    PyMem_RawFree(rows);
  }
}

void free_block(Block& b) {
  PyMem_RawFree(b.rows);
  b.rows = nullptr;
  for (int k = 0; k < kFields; ++k) {
    PyMem_RawFree(b.data[k]);
    b.data[k] = nullptr;
    b.width[k] = 0;
  }
}

}  // namespace

bool pack_block(Block& b) {
  if (b.rows == nullptr) return true;
  uint8_t* data[kFields] = {};
  int64_t base[kFields];
  uint8_t width[kFields];
  for (int k = 0; k < kFields; ++k) {
    int64_t lo = get_field(b.rows[0], k), hi = lo;
    for (int64_t j = 1; j < kBlock; ++j) {
      int64_t v = get_field(b.rows[j], k);
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
    uint64_t span = uint64_t(hi) - uint64_t(lo);
    uint8_t w = span == 0 ? 0 : span <= 0xFF ? 1 : span <= 0xFFFF ? 2 : span <= 0xFFFFFFFFull ? 4 : 8;
    base[k] = w == 8 ? 0 : lo;
    width[k] = w;
    if (w == 0) continue;
    data[k] = static_cast<uint8_t*>(PyMem_RawMalloc(size_t(kBlock) * w));
    if (data[k] == nullptr) {   // no memory to pack: keep the rows as they are
      for (int i = 0; i < k; ++i) PyMem_RawFree(data[i]);
      return false;
    }
    for (int64_t j = 0; j < kBlock; ++j) {
      uint64_t v = uint64_t(get_field(b.rows[j], k)) - uint64_t(base[k]);
      switch (w) {
        case 1: data[k][j] = uint8_t(v); break;
        case 2: { uint16_t x = uint16_t(v); memcpy(data[k] + 2 * j, &x, 2); break; }
        case 4: { uint32_t x = uint32_t(v); memcpy(data[k] + 4 * j, &x, 4); break; }
        default: memcpy(data[k] + 8 * j, &v, 8); break;
      }
    }
  }
  for (int k = 0; k < kFields; ++k) {
    b.base[k] = base[k];
    b.width[k] = width[k];
    b.data[k] = data[k];
  }
  spare_rows(b.rows);
  b.rows = nullptr;
  return true;
}

void clear_internal_cache() {
  S.internal_cache.clear();
  for (PyObject* c : S.internal_codes) Py_DECREF(c);
  S.internal_codes.clear();
}

void clear_src_cache() {
  S.src_cache.clear();
  for (PyObject* c : S.src_codes) Py_DECREF(c);
  S.src_codes.clear();
}

void clear_caches() {
  clear_src_cache();
  clear_internal_cache();
  for (auto& kv : S.mod_cache) {
    Py_XDECREF(kv.second.wr_inner);
    Py_XDECREF(kv.second.wr_outer);
  }
  S.mod_cache.clear();
  for (auto& kv : S.tramp_cache) Py_DECREF(kv.second);
  S.tramp_cache.clear();
  Py_CLEAR(S.kinds);
}

void free_rows() {
  for (Block& b : S.blocks) free_block(b);
  PyMem_RawFree(g_spare);
  g_spare = nullptr;
  S.blocks.clear();
  S.packed_upto = 0;
  S.taken_upto = 0;
  S.n_calls = 0;
  S.stack.clear();
}

// A Python helper failed: count it (tracer_error), never let it reach the program.
void contain(const char* where) {
  if (!PyErr_Occurred()) return;
  S.tracer_errors++;
  PyObject *t, *v, *tb;
  PyErr_Fetch(&t, &v, &tb);
  PyErr_NormalizeException(&t, &v, &tb);
  if (t != nullptr && !PyErr_GivenExceptionMatches(t, PyExc_Exception)) {
    if (S.pend_t == nullptr) {
      S.pend_t = t;
      S.pend_v = v;
      S.pend_tb = tb;
    } else {
      Py_XDECREF(t);
      Py_XDECREF(v);
      Py_XDECREF(tb);
    }
    S.tracer_errors--;
    return;
  }
  if (S.tracer_error != nullptr && v != nullptr) {
    PyObject* w = PyUnicode_FromString(where);
    if (w != nullptr) {
      PyObject* r = PyObject_CallFunctionObjArgs(S.tracer_error, w, v, nullptr);
      Py_XDECREF(r);
      Py_DECREF(w);
    }
    PyErr_Clear();
  }
  Py_XDECREF(t);
  Py_XDECREF(v);
  Py_XDECREF(tb);
}

// Re-raise a stashed KeyboardInterrupt; true when there was one.
bool raise_pending() {
  if (S.pend_t == nullptr) return false;
  PyErr_Restore(S.pend_t, S.pend_v, S.pend_tb);
  S.pend_t = S.pend_v = S.pend_tb = nullptr;
  return true;
}

// Call helper(args...) -> int; -1 (and the error contained) when it fails.
int64_t call_int(PyObject* fn, const char* where, PyObject* a, PyObject* b) {
  PyObject* r = a == nullptr ? PyObject_CallNoArgs(fn)
                             : (b == nullptr ? PyObject_CallOneArg(fn, a) : PyObject_CallFunctionObjArgs(fn, a, b, nullptr));
  if (r == nullptr) {
    contain(where);
    return -1;
  }
  int64_t v = r == Py_None ? -1 : PyLong_AsLongLong(r);
  Py_DECREF(r);
  if (v == -1 && PyErr_Occurred()) contain(where);
  return v;
}

namespace {

// configure(helper, engine_capsule, t0, want_source, want_modules): start a trace on this thread.
PyObject* py_configure(PyObject*, PyObject* args) {
  PyObject *helper, *cap;
  long long t0;
  int src, mods;
  if (!PyArg_ParseTuple(args, "OOLpp", &helper, &cap, &t0, &src, &mods)) return nullptr;
  if (S.active) {
    PyErr_SetString(PyExc_RuntimeError, "the native function mode is already recording a trace");
    return nullptr;
  }
  auto* eng = static_cast<tsabi::FmodeState*>(PyCapsule_GetPointer(cap, tsabi::kFmodeStateCapsule));
  if (eng == nullptr) return nullptr;
  if (eng->abi != tsabi::kFmodeStateAbi) {
    PyErr_SetString(PyExc_RuntimeError, "native engine/function mode ABI mismatch");
    return nullptr;
  }
  struct Item {
    PyObject** slot;
    const char* name;
  } items[] = {
      {&S.classify, "c_classify"}, {&S.user_src, "c_user_src"}, {&S.module_at, "c_module_at"},
      {&S.autocast, "c_autocast"}, {&S.on_error, "c_on_error"}, {&S.on_warnings, "c_on_warnings"},
      {&S.tracer_error, "c_tracer_error"}, {&S.trampoline_for, "c_trampoline_for"}, {&S.printing, "c_printing"},
      {&S.is_internal, "c_is_internal"}, {&S.any_autocast, "c_any_autocast"},
      {&S.htf_code, "c_htf_code"}, {&S.mod_code, "c_mod_code"}, {&S.cacheable, "c_cacheable"},
  };
  std::vector<PyObject*> got;
  for (auto& it : items) {
    PyObject* v = PyObject_GetAttrString(helper, it.name);
    if (v == nullptr) {
      for (PyObject* g : got) Py_DECREF(g);
      return nullptr;
    }
    got.push_back(v);
  }
  size_t i = 0;
  for (auto& it : items) {
    Py_XSETREF(*it.slot, got[i++]);
  }
  if (S.module_name == nullptr) S.module_name = PyUnicode_InternFromString("<module>");
  Py_INCREF(helper);
  Py_XSETREF(S.helper, helper);
  clear_caches();
  free_rows();
  S.eng = eng;
  S.t0 = t0;
  S.want_source = src;
  S.want_modules = mods;
  S.cur_mid = 0;
  S.tracer_errors = 0;
  S.tick = 0;
  S.own_ns = S.own_calls = S.calls_seen = 0;
  S.owner = PyThread_get_thread_ident();
  S.recording = false;
  S.active = true;
  Py_RETURN_NONE;
}

PyObject* py_set_recording(PyObject*, PyObject* o) {
  S.recording = PyObject_IsTrue(o) == 1;
  Py_RETURN_NONE;
}

// The first n calls rows as one bytes object of CallRow (packed blocks unpacked).
// rows [from, n) as CALL_DTYPE records (blocks start at multiples of kBlock; `from` is one)
PyObject* copy_rows(int64_t from, int64_t n) {
  PyObject* out = PyBytes_FromStringAndSize(nullptr, Py_ssize_t((n - from) * int64_t(sizeof(CallRow))));
  if (out == nullptr) return nullptr;
  char* p = PyBytes_AS_STRING(out) - from * int64_t(sizeof(CallRow));
  for (int64_t done = from; done < n;) {
    int64_t k = std::min(kBlock, n - done);
    const Block& b = S.blocks[size_t(done >> kBlockBits)];
    if (b.rows != nullptr) {
      memcpy(p + done * sizeof(CallRow), b.rows, size_t(k) * sizeof(CallRow));
    } else {
      CallRow* rows = reinterpret_cast<CallRow*>(p) + done;
      for (int64_t j = 0; j < k; ++j) {
        for (int f = 0; f < kFields; ++f) set_field(rows[j], f, packed_field(b, f, j));
      }
    }
    done += k;
  }
  return out;
}

// the packed blocks from S.taken_upto to S.packed_upto (those not handed over yet) as they are:
// per block a tuple of (base, width, bytes), one per calls field (abi.h kCallFieldOrder); each
// block's memory freed once copied (no doubled peak), its slot kept (call ids index blocks), and
// S.taken_upto moved past it. Out of memory: the blocks copied so far (the rest stay here).
PyObject* packed_blocks() {
  const size_t from = S.taken_upto;
  PyObject* l = PyList_New(0);
  if (l == nullptr) return nullptr;
  for (size_t i = from; i < S.packed_upto; ++i) {
    Block& b = S.blocks[i];
    PyObject* cols = PyTuple_New(tsabi::kCallFields);
    bool ok = cols != nullptr;
    for (int c = 0; ok && c < tsabi::kCallFields; ++c) {
      const int k = tsabi::kCallFieldOrder[c];
      const char* d = reinterpret_cast<const char*>(b.data[k]);
      PyObject* col = Py_BuildValue("(LiN)", (long long)b.base[k], int(b.width[k]),
                                    PyBytes_FromStringAndSize(d, Py_ssize_t(kBlock * b.width[k])));
      ok = col != nullptr;
      if (ok) PyTuple_SET_ITEM(cols, c, col);
    }
    if (!ok || PyList_Append(l, cols) < 0) {
      Py_XDECREF(cols);
      PyErr_Clear();
      break;
    }
    Py_DECREF(cols);
    free_block(b);
    S.taken_upto = i + 1;
  }
  return l;
}

// take() -> (tail rows bytes, n_calls, first tail call id, packed blocks): the calls rows not
// handed over yet: the full blocks still packed (~10 bytes a call, packed_blocks, from call
// S.taken_upto * kBlock on) and the rest as CALL_DTYPE records; stops the mode.
PyObject* py_take(PyObject*, PyObject*) {
  S.active = false;
  S.recording = false;
  int64_t n = S.n_calls;
  PyObject* packed = packed_blocks();
  if (packed == nullptr) return nullptr;
  int64_t first = std::min(n, int64_t(S.taken_upto) * kBlock);   // the rows after the blocks handed over
  PyObject* out = copy_rows(first, n);
  if (out == nullptr) {
    Py_DECREF(packed);
    return nullptr;
  }
  free_rows();
  clear_caches();
  Py_CLEAR(S.helper);
  Py_CLEAR(S.classify);
  Py_CLEAR(S.user_src);
  Py_CLEAR(S.module_at);
  Py_CLEAR(S.autocast);
  Py_CLEAR(S.on_error);
  Py_CLEAR(S.on_warnings);
  Py_CLEAR(S.tracer_error);
  Py_CLEAR(S.trampoline_for);
  Py_CLEAR(S.printing);
  Py_CLEAR(S.is_internal);
  Py_CLEAR(S.any_autocast);
  Py_CLEAR(S.htf_code);
  Py_CLEAR(S.mod_code);
  Py_CLEAR(S.cacheable);
  S.eng = nullptr;
  return Py_BuildValue("(NLLN)", out, (long long)n, (long long)first, packed);
}

// take_packed() -> (first call id, packed blocks): while recording, the packed blocks not handed
// over yet (packed_blocks), freed here; the recorder spills them with its op chunks.
PyObject* py_take_packed(PyObject*, PyObject*) {
  if (!S.active) {
    PyErr_SetString(PyExc_RuntimeError, "the native function mode is not recording a trace");
    return nullptr;
  }
  long long first = (long long)(int64_t(S.taken_upto) * kBlock);
  PyObject* packed = packed_blocks();
  if (packed == nullptr) return nullptr;
  return Py_BuildValue("(LN)", first, packed);
}

// field(cid, k): one calls field while recording (k: CALL_FIELDS index), None when out of range
// or handed over (take_packed: the caller reads those rows itself).
PyObject* py_field(PyObject*, PyObject* args) {
  long long cid;
  int k;
  if (!PyArg_ParseTuple(args, "Li", &cid, &k)) return nullptr;
  if (cid < int64_t(S.taken_upto) * kBlock || cid >= S.n_calls) Py_RETURN_NONE;
  if (k < 0 || k >= tsabi::kCallFields) Py_RETURN_NONE;
  long long v = any_field(cid, tsabi::kCallFieldOrder[k]);
  return PyLong_FromLongLong(v);
}

// column(k, from=0): one calls field (k: CALL_FIELDS index) of calls [from, n), n the calls so
// far, as int64 bytes, while recording: what a dataset= spill reads (8 bytes a call, not a copy of
// every row). `from` is at least the calls handed over (take_packed): those are never read here.
PyObject* py_column(PyObject*, PyObject* args) {
  int k;
  long long from = 0;
  if (!PyArg_ParseTuple(args, "i|L", &k, &from)) return nullptr;
  if (k < 0 || k >= tsabi::kCallFields) {
    PyErr_SetString(PyExc_IndexError, "calls field index out of range");
    return nullptr;
  }
  int64_t n = S.n_calls;
  if (from < int64_t(S.taken_upto) * kBlock || from > n) {
    PyErr_SetString(PyExc_IndexError, "calls column start handed over or past the calls recorded");
    return nullptr;
  }
  PyObject* out = PyBytes_FromStringAndSize(nullptr, Py_ssize_t((n - from) * 8));
  if (out == nullptr) return nullptr;
  int64_t* dst = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(out)) - from;
  const int f = tsabi::kCallFieldOrder[k];
  for (int64_t cid = from; cid < n; ++cid) dst[cid] = any_field(cid, f);
  return Py_BuildValue("(NL)", out, (long long)n);
}

PyObject* py_n_calls(PyObject*, PyObject*) {
  return PyLong_FromLongLong(S.n_calls);
}

PyObject* py_active(PyObject*, PyObject*) {
  return PyBool_FromLong(S.active);
}

PyObject* py_stats(PyObject*, PyObject*) {
  long long bytes = 0;
  for (const Block& b : S.blocks) {
    if (b.rows != nullptr) {
      bytes += (long long)(sizeof(CallRow) * kBlock);
    } else {
      for (int k = 0; k < kFields; ++k) bytes += (long long)(b.width[k]) * kBlock;
    }
  }
  return Py_BuildValue("{s:L,s:n,s:n,s:n,s:L,s:n,s:n,s:L,s:(LLL)}", "calls", (long long)S.n_calls,
                       "src_cache", Py_ssize_t(S.src_cache.size()), "module_cache", Py_ssize_t(S.mod_cache.size()),
                       "trampolines", Py_ssize_t(S.tramp_cache.size()), "tracer_errors", (long long)S.tracer_errors,
                       "packed_blocks", Py_ssize_t(S.packed_upto), "taken_blocks", Py_ssize_t(S.taken_upto),
                       "row_bytes", bytes, "own", (long long)S.own_ns, (long long)S.own_calls,
                       (long long)S.calls_seen);
}

}  // namespace

PyMethodDef kStateMethods[] = {
    {"configure", py_configure, METH_VARARGS, "configure(helper, engine_capsule, t0_ns, source, modules)"},
    {"set_recording", py_set_recording, METH_O, "record (True) or pass every call through (False)"},
    {"take", py_take, METH_NOARGS, "(tail rows as bytes, n, first tail id, packed blocks): hand the rows over and stop"},
    {"take_packed", py_take_packed, METH_NOARGS, "(first call id, packed blocks): hand the packed blocks over, recording on"},
    {"field", py_field, METH_VARARGS, "field(call_id, k): a calls field while recording"},
    {"column", py_column, METH_VARARGS, "column(k, from=0): (one calls field of calls [from, n) as int64 bytes, n), recording on"},
    {"n_calls", py_n_calls, METH_NOARGS, "calls recorded so far"},
    {"active", py_active, METH_NOARGS, "whether a trace is configured"},
    {"stats", py_stats, METH_NOARGS, "cache sizes and counters (tests, benchmarks)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace tsfmode
