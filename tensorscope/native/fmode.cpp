// tensorscope native function mode: the hot path of modes/function.py in C.
//
// torch calls a TorchFunctionMode through ``mode.__torch_function__(func, types, args, kwargs)``
// (python_arg_parser.cpp for C bindings, overrides.handle_torch_function for Python-level torch
// functions), with the mode popped off the stack meanwhile. The native function mode sets that
// attribute on its instance to ``torch_function`` below, a builtin: no descriptor binding, no
// Python frame. So:
//
//  * a torch function called from C (torch.add, Tensor.add_, Tensor.T) runs with the user's frame
//    on top: C++ warnings turned into Python warnings land on the user's line, "default"/"once"
//    registries key on it, and an exception gets no traceback entry from tracing (nothing to clean);
//  * a Python-level torch function (F.relu, F.softmax, Tensor.backward) handed itself to the mode
//    through handle_torch_function: it is called again through the trampoline of modes/frames.py
//    (a frame that looks like the caller's), so ``warnings.warn(stacklevel=N)`` lands where it
//    would untraced. The trampoline per call site is cached here.
//
// Per outermost recorded call, all in C: classification of ``func`` (a cache; Python
// ``_classify`` on a miss), the user source line (a frame walk with the per-code "internal" verdicts
// of modes/source.py, then a cache keyed by (code object, instruction)), the module path (a walk over
// the Module.__call__ frames, reading ``self`` from the frame's fast locals, with a cache keyed by
// (innermost, outermost) module validated through weak references), autocast only when
// ``torch._C._is_any_autocast_enabled()``, the ``calls`` row in native blocks (handed over as
// bytes), the engine's current call id and ``seq`` through pointers the engine exports, and the
// warning bookkeeping (a counter the Python warning tap bumps). Everything rare calls back into
// Python (``modes/function.py:NativeFunctionMode``): cache misses, errors, warnings, printing,
// other threads, other Python versions' frame layouts.
//
// The frame walks read CPython 3.11's interpreter frames directly (no frame objects created); on
// other versions the walks are done by the Python helpers (same results, Python speed).
//
// A tracer bug never reaches the program: every Python helper's exception is handed to
// ``tracer_error`` and cleared, and the user's function is still called exactly once.

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <unordered_map>
#include <vector>

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && !defined(TS_NO_FAST_FRAMES)
#define TS_FAST_FRAMES 1
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#else
#define TS_FAST_FRAMES 0
#endif

namespace {

// The state the recording engine exports (engine.cpp, "function mode" section).
struct EngineShared {
  int abi;
  int64_t* cur_call;
  int64_t* cur_module;
  int64_t* n_rows;
  int (*warnings_pending)();
};

enum Kind { DIRECT = 0, RECORD = 1, PASS = 2, LAZY = 3, PRINTING = 4 };

// One calls row (recording/recorder.py CALL_FIELDS; keep CALL_DTYPE in modes/function.py in sync).
struct CallRow {
  int32_t func, module, src, autocast, parent, error, n_ops, pad;
  int64_t first_seq, start, dur;
};
constexpr int64_t kBlockBits = 14;
constexpr int64_t kBlock = int64_t(1) << kBlockBits;

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

struct ModEntry {
  PyObject* wr_inner;   // weak references (owned)
  PyObject* wr_outer;
  int32_t mid;
};

struct KeyHash {
  size_t operator()(const std::pair<const void*, const void*>& k) const {
    return std::hash<const void*>()(k.first) * 31u ^ std::hash<const void*>()(k.second);
  }
};

// A block of kBlock rows: live rows while calls in it may still change, then packed column by column
// (each field minus its minimum in the narrowest of 0/1/2/4/8 bytes: a constant field such as
// parent or error costs nothing), like recorder.py packs the Python calls chunks.
constexpr int kFields = 11;   // CallRow's members in order, pad included
struct Block {
  CallRow* rows = nullptr;
  int64_t base[kFields] = {};
  uint8_t width[kFields] = {};
  uint8_t* data[kFields] = {};
};

inline int64_t get_field(const CallRow& r, int k) {
  switch (k) {
    case 0: return r.func;
    case 1: return r.module;
    case 2: return r.src;
    case 3: return r.autocast;
    case 4: return r.parent;
    case 5: return r.error;
    case 6: return r.n_ops;
    case 7: return r.pad;
    case 8: return r.first_seq;
    case 9: return r.start;
    default: return r.dur;
  }
}

inline void set_field(CallRow& r, int k, int64_t v) {
  switch (k) {
    case 0: r.func = int32_t(v); break;
    case 1: r.module = int32_t(v); break;
    case 2: r.src = int32_t(v); break;
    case 3: r.autocast = int32_t(v); break;
    case 4: r.parent = int32_t(v); break;
    case 5: r.error = int32_t(v); break;
    case 6: r.n_ops = int32_t(v); break;
    case 7: r.pad = int32_t(v); break;
    case 8: r.first_seq = v; break;
    case 9: r.start = v; break;
    default: r.dur = v; break;
  }
}

inline int64_t packed_field(const Block& b, int k, int64_t j) {
  const uint8_t* d = b.data[k];
  uint64_t v = 0;
  switch (b.width[k]) {
    case 0: break;
    case 1: v = d[j]; break;
    case 2: { uint16_t x; memcpy(&x, d + 2 * j, 2); v = x; break; }
    case 4: { uint32_t x; memcpy(&x, d + 4 * j, 4); v = x; break; }
    default: { uint64_t x; memcpy(&x, d + 8 * j, 8); v = x; break; }
  }
  return b.base[k] + int64_t(v);
}

// The live buffer of the block packed last, kept for the next block: a fresh 900 kB allocation
// would be mmap'ed and page-faulted in again every 16k calls.
CallRow* g_spare = nullptr;
void spare_rows(CallRow* rows) {
  if (g_spare == nullptr) {
    g_spare = rows;
  } else {
    PyMem_RawFree(rows);
  }
}

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

void free_block(Block& b) {
  PyMem_RawFree(b.rows);
  b.rows = nullptr;
  for (int k = 0; k < kFields; ++k) {
    PyMem_RawFree(b.data[k]);
    b.data[k] = nullptr;
  }
}

struct State {
  bool active = false;
  bool recording = false;
  unsigned long owner = 0;
  EngineShared* eng = nullptr;
  int64_t t0 = 0;
  bool want_source = true;
  bool want_modules = true;
  // Python helpers (owned references)
  PyObject* helper = nullptr;       // the NativeFunctionMode (methods below are looked up once)
  PyObject* classify = nullptr;     // func -> (kind, call_func_id)
  PyObject* user_src = nullptr;     // frame -> src id (the Python walk)
  PyObject* module_at = nullptr;    // frame -> module id (ModuleTracker.at)
  PyObject* autocast = nullptr;     // () -> autocast id
  PyObject* on_error = nullptr;     // (cid, exc, cleaned) -> error id or None
  PyObject* on_warnings = nullptr;  // (cid, n_tap_items) -> number of warnings recorded
  PyObject* tracer_error = nullptr; // (where, exc)
  PyObject* trampoline_for = nullptr;  // frame -> function
  PyObject* printing = nullptr;     // (paused: bool) -> None
  PyObject* is_internal = nullptr;  // code -> bool (modes/source.py; cached below by address)
  PyObject* any_autocast = nullptr; // torch._C._is_any_autocast_enabled
  PyObject* htf_code = nullptr;     // torch.overrides.handle_torch_function.__code__
  PyObject* mod_code = nullptr;     // Module._wrapped_call_impl.__code__
  PyObject* module_name = nullptr;  // "<module>"
  PyObject* cacheable = nullptr;    // (inner, outer) -> whether the module path may be cached
  // caches
  PyObject* kinds = nullptr;        // dict func -> int (kind | fid << 3)
  std::unordered_map<std::pair<const void*, const void*>, int32_t, KeyHash> src_cache;
  std::vector<PyObject*> src_codes;  // strong refs: a cached code's address is never reused
  // code object -> "internal" verdict, keyed by address (a dict keyed by the code object hashes
  // it: name, consts (recursively), names... ~0.5 us for Module._call_impl, per frame walked)
  std::unordered_map<const void*, bool> internal_cache;
  std::vector<PyObject*> internal_codes;   // strong refs, as src_codes
  std::unordered_map<std::pair<const void*, const void*>, ModEntry, KeyHash> mod_cache;
  std::unordered_map<std::pair<const void*, const void*>, PyObject*, KeyHash> tramp_cache;  // owned fns
  // rows
  std::vector<struct Block> blocks;
  size_t packed_upto = 0;           // blocks below this index are packed
  int64_t n_calls = 0;
  std::vector<int32_t> stack;       // open recorded calls
  int32_t cur_mid = 0;              // module id of the innermost outermost call (ModuleTracker.current)
  int64_t tracer_errors = 0;
  // a KeyboardInterrupt (any non-Exception) raised inside a helper: re-raised to the program once
  // the bookkeeping is consistent, never swallowed
  PyObject *pend_t = nullptr, *pend_v = nullptr, *pend_tb = nullptr;
};

State S;
thread_local int64_t tls_py_warnings = 0;   // Python warnings the tap collected on this thread

// A live row (the running calls' rows, and the current block's, are never packed).
CallRow& row(int64_t cid) {
  return S.blocks[size_t(cid >> kBlockBits)].rows[cid & (kBlock - 1)];
}

// One field of any row, live or packed.
int64_t any_field(int64_t cid, int k) {
  const Block& b = S.blocks[size_t(cid >> kBlockBits)];
  int64_t j = cid & (kBlock - 1);
  return b.rows != nullptr ? get_field(b.rows[j], k) : packed_field(b, k, j);
}

CallRow* new_row(int64_t cid) {
  size_t b = size_t(cid >> kBlockBits);
  if (b >= S.blocks.size()) {
    Block blk;
    blk.rows = g_spare != nullptr ? g_spare : static_cast<CallRow*>(PyMem_RawMalloc(sizeof(CallRow) * kBlock));
    g_spare = nullptr;
    if (blk.rows == nullptr) return nullptr;
    S.blocks.push_back(blk);
    // pack the full blocks no running call points into (rows of running calls still change)
    int64_t open = S.stack.empty() ? cid : int64_t(S.stack.front());
    while (S.packed_upto + 1 < S.blocks.size() && int64_t(S.packed_upto + 1) * kBlock <= open) {
      if (!pack_block(S.blocks[S.packed_upto])) break;
      S.packed_upto++;
    }
  }
  return &row(cid);
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
int64_t call_int(PyObject* fn, const char* where, PyObject* a = nullptr, PyObject* b = nullptr) {
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

// (kind, call_func_id) of func, cached per function object.
bool classify(PyObject* func, int* kind, int32_t* fid) {
  if (S.kinds == nullptr) {
    S.kinds = PyDict_New();
    if (S.kinds == nullptr) {
      contain("function mode (classify)");
      return false;
    }
  }
  PyObject* v = PyDict_GetItemWithError(S.kinds, func);   // borrowed
  if (v == nullptr) {
    if (PyErr_Occurred()) {   // an unhashable callable: classify it every time
      PyErr_Clear();
    }
    int64_t packed = call_int(S.classify, "function mode (classify)", func);
    if (packed < 0) return false;
    PyObject* pv = PyLong_FromLongLong(packed);
    if (pv == nullptr || PyDict_SetItem(S.kinds, func, pv) < 0) PyErr_Clear();
    Py_XDECREF(pv);
    *kind = int(packed & 7);
    *fid = int32_t(packed >> 3);
    return true;
  }
  int64_t packed = PyLong_AsLongLong(v);
  *kind = int(packed & 7);
  *fid = int32_t(packed >> 3);
  return true;
}

// The frame object ``depth`` frames out from the running one (a new reference; nullptr on failure).
PyObject* frame_object(int depth) {
  PyFrameObject* f = PyEval_GetFrame();   // borrowed
  Py_XINCREF(f);
  while (f != nullptr && depth-- > 0) {
    PyFrameObject* b = PyFrame_GetBack(f);   // new reference
    Py_DECREF(f);
    f = b;
  }
  return reinterpret_cast<PyObject*>(f);
}

#if TS_FAST_FRAMES
inline _PyInterpreterFrame* skip_incomplete(_PyInterpreterFrame* f) {
  while (f != nullptr && _PyFrame_IsIncomplete(f)) f = f->previous;
  return f;
}
inline _PyInterpreterFrame* back(_PyInterpreterFrame* f) {
  return f == nullptr ? nullptr : skip_incomplete(f->previous);
}
inline _PyInterpreterFrame* current_frame() {
  PyThreadState* ts = PyThreadState_Get();
  return skip_incomplete(ts->cframe->current_frame);
}

// modes/source.py's verdict for a code object, cached here by address (the Python function decides).
int code_internal(PyObject* code) {
  auto it = S.internal_cache.find(code);
  if (it != S.internal_cache.end()) return it->second;
  PyObject* r = PyObject_CallOneArg(S.is_internal, code);
  if (r == nullptr) {
    contain("source line");
    return -1;
  }
  int out = PyObject_IsTrue(r);
  Py_DECREF(r);
  if (out < 0) {
    contain("source line");
    return -1;
  }
  if (S.internal_cache.size() >= 65536) clear_internal_cache();
  Py_INCREF(code);
  S.internal_codes.push_back(code);
  S.internal_cache.emplace(code, out != 0);
  return out;
}

// ``fn(frame)`` for the frame ``depth`` out from the running one, as an int (-1: failed, contained as ``where``)
int64_t call_on_frame(PyObject* fn, int depth, const char* where) {
  PyObject* fo = frame_object(depth);
  if (fo == nullptr) {
    contain(where);
    return -1;
  }
  int64_t v = call_int(fn, where, fo);
  Py_DECREF(fo);
  return v;
}

// user source id for code running at ``f`` (the caller, ``depth`` frames out from the running one)
int32_t user_src(_PyInterpreterFrame* f, int depth) {
  _PyInterpreterFrame* user = nullptr;   // the first frame of user code, its line cached below
  for (_PyInterpreterFrame* u = f; u != nullptr; u = back(u)) {
    int in = code_internal(reinterpret_cast<PyObject*>(u->f_code));
    if (in < 0) break;
    if (in) continue;
    auto key = std::make_pair(static_cast<const void*>(u->f_code), static_cast<const void*>(u->prev_instr));
    auto it = S.src_cache.find(key);
    if (it != S.src_cache.end()) return it->second;
    user = u;
    break;   // a miss: the Python walk names it, the cache keeps it
  }
  int64_t id = call_on_frame(S.user_src, depth, "source line");
  if (id < 0) return 0;
  if (user != nullptr) {
    if (S.src_cache.size() >= 65536) clear_src_cache();
    auto key = std::make_pair(static_cast<const void*>(user->f_code), static_cast<const void*>(user->prev_instr));
    if (S.src_cache.emplace(key, int32_t(id)).second) {
      Py_INCREF(user->f_code);
      S.src_codes.push_back(reinterpret_cast<PyObject*>(user->f_code));
    }
  }
  return int32_t(id);
}

PyObject* self_of(_PyInterpreterFrame* f) {
  if (f->f_code->co_nlocalsplus < 1) return nullptr;
  PyObject* o = f->localsplus[0];
  if (o != nullptr && PyCell_Check(o)) o = PyCell_GET(o);
  return o;
}

bool is_module_frame_end(_PyInterpreterFrame* f) {
  PyObject* name = f->f_code->co_name;
  return name == S.module_name || (PyUnicode_GET_LENGTH(name) == 8 && PyUnicode_Compare(name, S.module_name) == 0);
}

int32_t module_at(_PyInterpreterFrame* f, int depth) {
  PyObject* inner = nullptr;
  PyObject* outer = nullptr;
  int n = 64;
  for (_PyInterpreterFrame* u = f; u != nullptr && n; u = back(u), --n) {
    if (reinterpret_cast<PyObject*>(u->f_code) == S.mod_code) {
      PyObject* s = self_of(u);
      if (s == nullptr) {
        inner = outer = nullptr;
        n = -1;   // unreadable: let Python decide
        break;
      }
      if (inner == nullptr) inner = s;
      outer = s;
    } else if (is_module_frame_end(u)) {
      break;
    }
  }
  if (n >= 0 && inner == nullptr) return 0;
  if (inner != nullptr) {
    auto key = std::make_pair(static_cast<const void*>(inner), static_cast<const void*>(outer));
    auto it = S.mod_cache.find(key);
    if (it != S.mod_cache.end() && PyWeakref_GET_OBJECT(it->second.wr_inner) == inner &&
        PyWeakref_GET_OBJECT(it->second.wr_outer) == outer) {
      return it->second.mid;
    }
  }
  int64_t mid = call_on_frame(S.module_at, depth, "module path");
  if (mid < 0) return 0;
  if (inner != nullptr && S.cacheable != nullptr) {
    // cached only for plain modules: a compiled graph (GraphModule) or an OptimizedModule wrapper on
    // the stack makes the path depend on more than the two ends
    PyObject* ok = PyObject_CallFunctionObjArgs(S.cacheable, inner, outer, nullptr);
    if (ok == nullptr) contain("module path");
    if (ok == Py_True) {
      PyObject* wi = PyWeakref_NewRef(inner, nullptr);
      PyObject* wo = wi != nullptr ? PyWeakref_NewRef(outer, nullptr) : nullptr;
      if (wi != nullptr && wo != nullptr) {
        if (S.mod_cache.size() >= 65536) {
          for (auto& kv : S.mod_cache) {
            Py_XDECREF(kv.second.wr_inner);
            Py_XDECREF(kv.second.wr_outer);
          }
          S.mod_cache.clear();
        }
        auto key = std::make_pair(static_cast<const void*>(inner), static_cast<const void*>(outer));
        auto it = S.mod_cache.find(key);
        if (it != S.mod_cache.end()) {
          Py_XDECREF(it->second.wr_inner);
          Py_XDECREF(it->second.wr_outer);
          it->second = ModEntry{wi, wo, int32_t(mid)};
        } else {
          S.mod_cache.emplace(key, ModEntry{wi, wo, int32_t(mid)});
        }
      } else {
        Py_XDECREF(wi);
        Py_XDECREF(wo);
        PyErr_Clear();
      }
    }
    Py_XDECREF(ok);
  }
  return int32_t(mid);
}

// The trampoline for the caller frame ``f`` (``depth`` out from the running one); borrowed.
PyObject* trampoline(_PyInterpreterFrame* f, int depth) {
  auto key = std::make_pair(static_cast<const void*>(f->f_code), static_cast<const void*>(f->prev_instr));
  auto it = S.tramp_cache.find(key);
  if (it != S.tramp_cache.end() && PyFunction_GET_GLOBALS(it->second) == f->f_globals) return it->second;
  PyObject* fo = frame_object(depth);
  if (fo == nullptr) {
    contain("function mode (trampoline)");
    return nullptr;
  }
  PyObject* fn = PyObject_CallOneArg(S.trampoline_for, fo);
  Py_DECREF(fo);
  if (fn == nullptr) {
    contain("function mode (trampoline)");
    return nullptr;
  }
  if (S.tramp_cache.size() >= 4096) {
    for (auto& kv : S.tramp_cache) Py_DECREF(kv.second);
    S.tramp_cache.clear();
  }
  if (it != S.tramp_cache.end()) {
    Py_DECREF(it->second);
    it->second = fn;
  } else {
    S.tramp_cache.emplace(key, fn);   // the function holds the code object: its address stays unique
  }
  return fn;
}
#endif

inline PyObject* call_func(PyObject* func, PyObject* args, PyObject* kwargs) {
  if (args == nullptr || !PyTuple_Check(args)) {
    PyObject* t = args == nullptr ? PyTuple_New(0) : PySequence_Tuple(args);
    if (t == nullptr) return nullptr;
    PyObject* r = PyObject_Call(func, t, (kwargs != nullptr && kwargs != Py_None) ? kwargs : nullptr);
    Py_DECREF(t);
    return r;
  }
  return PyObject_Call(func, args, (kwargs != nullptr && kwargs != Py_None) ? kwargs : nullptr);
}

PyObject* call_through(PyObject* tramp, PyObject* func, PyObject* args, PyObject* kwargs) {
  if (tramp == nullptr) return call_func(func, args, kwargs);
  PyObject* a = args;
  PyObject* k = kwargs;
  PyObject* empty_t = nullptr;
  PyObject* empty_d = nullptr;
  if (a == nullptr) a = empty_t = PyTuple_New(0);
  if (k == nullptr || k == Py_None) k = empty_d = PyDict_New();
  PyObject* r = nullptr;
  if (a != nullptr && k != nullptr) {
    PyObject* stack[3] = {func, a, k};
    r = PyObject_Vectorcall(tramp, stack, 3, nullptr);
  }
  Py_XDECREF(empty_t);
  Py_XDECREF(empty_d);
  return r;
}

// torch_function(func, types, args=(), kwargs=None): the mode's __torch_function__.
PyObject* torch_function(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs < 2 || nargs > 4) {
    PyErr_SetString(PyExc_TypeError, "__torch_function__(func, types, args=(), kwargs=None)");
    return nullptr;
  }
  PyObject* func = argv[0];
  PyObject* args = nargs > 2 ? argv[2] : nullptr;
  PyObject* kwargs = nargs > 3 ? argv[3] : nullptr;
  if (!S.active || !S.recording || PyThread_get_thread_ident() != S.owner) {
    return call_func(func, args, kwargs);
  }
  int kind = DIRECT;
  int32_t fid = 0;
  if (!classify(func, &kind, &fid) || kind == DIRECT) return call_func(func, args, kwargs);

#if TS_FAST_FRAMES
  _PyInterpreterFrame* top = current_frame();
  _PyInterpreterFrame* caller = top;
  int depth = 0;
  bool htf = top != nullptr && reinterpret_cast<PyObject*>(top->f_code) == S.htf_code;
  if (htf) {   // a Python-level torch function handed itself to the mode: its caller is the user's
    caller = back(back(top));
    depth = 2;
  }
  PyObject* tramp = (htf && caller != nullptr) ? trampoline(caller, depth) : nullptr;
  Py_XINCREF(tramp);   // the cache may be cleared before the call returns
#else
  PyObject* tramp = nullptr;
  bool htf = false;
  int depth = 0;
  {
    PyFrameObject* top = PyEval_GetFrame();
    if (top != nullptr) {
      PyCodeObject* c = PyFrame_GetCode(top);
      htf = reinterpret_cast<PyObject*>(c) == S.htf_code;
      Py_DECREF(c);
    }
    if (htf) {
      depth = 2;
      PyObject* fo = frame_object(2);
      if (fo != nullptr) {
        tramp = PyObject_CallOneArg(S.trampoline_for, fo);
        Py_DECREF(fo);
        if (tramp == nullptr) contain("function mode (trampoline)");
      } else {
        contain("function mode (trampoline)");
      }
    }
  }
#endif
  struct TrampRef {
    PyObject* p;
    ~TrampRef() { Py_XDECREF(p); }
  } tramp_ref{tramp};

  if (kind == PASS) return call_through(tramp, func, args, kwargs);   // a getter's warning: at the user's line

  int64_t cid = S.n_calls;
  CallRow* r = new_row(cid);
  if (r == nullptr) return call_through(tramp, func, args, kwargs);
  int32_t parent = S.stack.empty() ? -1 : S.stack.back();
  int32_t src = 0;
  if (parent >= 0) {
    src = row(parent).src;   // nested calls inherit the user line and the module
  } else {
#if TS_FAST_FRAMES
    if (S.want_source) src = user_src(caller, depth);
    if (S.want_modules) {
      S.cur_mid = module_at(caller, depth);
      *S.eng->cur_module = S.cur_mid;
    }
#else
    if (S.want_source || S.want_modules) {
      PyObject* fo = frame_object(depth);
      if (fo != nullptr) {
        if (S.want_source) {
          int64_t v = call_int(S.user_src, "source line", fo);
          src = v < 0 ? 0 : int32_t(v);
        }
        if (S.want_modules) {
          int64_t v = call_int(S.module_at, "module path", fo);
          S.cur_mid = v < 0 ? 0 : int32_t(v);
          *S.eng->cur_module = S.cur_mid;
        }
        Py_DECREF(fo);
      } else {
        contain("source line");
      }
    }
#endif
  }
  int32_t ac = 0;
  {
    PyObject* on = PyObject_CallNoArgs(S.any_autocast);
    if (on == nullptr) {
      contain("function mode (autocast)");
    } else {
      if (on == Py_True) {
        int64_t v = call_int(S.autocast, "function mode (autocast)");
        ac = v < 0 ? 0 : int32_t(v);
      }
      Py_DECREF(on);
    }
  }
  r->func = fid;
  r->module = S.cur_mid;
  r->src = src;
  r->autocast = ac;
  r->parent = parent;
  r->error = -1;
  r->n_ops = 0;
  r->pad = 0;
  r->first_seq = *S.eng->n_rows;
  r->start = 0;   // set right before the call (one clock read for start and duration)
  r->dur = 0;
  S.n_calls = cid + 1;
  S.stack.push_back(int32_t(cid));
  *S.eng->cur_call = cid;
  int64_t warn0 = tls_py_warnings;

  if (S.pend_t != nullptr) {   // interrupted while preparing the row: undo it, the call never ran
    S.n_calls = cid;
    S.stack.pop_back();
    *S.eng->cur_call = parent;
    raise_pending();
    return nullptr;
  }
  bool printing = kind == PRINTING;
  if (printing) {
    PyObject* x = PyObject_CallOneArg(S.printing, Py_True);
    if (x == nullptr) contain("function mode (printing)");
    Py_XDECREF(x);
  }
  int64_t t0 = now_ns();
  r = &row(cid);
  r->start = t0 - S.t0;
  PyObject* result = call_through(tramp, func, args, kwargs);
  int64_t t1 = now_ns();

  // from here on the row is finished whatever happens (the call stack and the engine's call id too)
  CallRow& rr = row(cid);
  rr.dur = t1 - t0;
  rr.n_ops = int32_t(*S.eng->n_rows - rr.first_seq);
  if (!S.stack.empty() && S.stack.back() == int32_t(cid)) S.stack.pop_back();
  *S.eng->cur_call = S.stack.empty() ? -1 : S.stack.back();

  bool raised = result == nullptr;
  bool warned = false;
  PyObject *et = nullptr, *ev = nullptr, *etb = nullptr;
  if (raised) {
    PyErr_Fetch(&et, &ev, &etb);
    PyErr_NormalizeException(&et, &ev, &etb);
    if (ev != nullptr && etb != nullptr) PyException_SetTraceback(ev, etb);
  }
  if (printing) {
    PyObject* x = PyObject_CallOneArg(S.printing, Py_False);
    if (x == nullptr) contain("function mode (printing)");
    Py_XDECREF(x);
  }
  if (raised && ev != nullptr) {
    PyObject* c = PyLong_FromLongLong(cid);
    if (c != nullptr) {
      PyObject* r2 = PyObject_CallFunctionObjArgs(S.on_error, c, ev, htf ? Py_True : Py_False, nullptr);
      if (r2 == nullptr) {
        contain("function mode (error)");
      } else {
        if (r2 != Py_None) {
          int64_t eid = PyLong_AsLongLong(r2);
          if (eid == -1 && PyErr_Occurred()) contain("function mode (error)");
          else row(cid).error = int32_t(eid);
        }
        Py_DECREF(r2);
      }
      Py_DECREF(c);
    } else {
      contain("function mode (error)");
    }
    {   // on_error cleaned the traceback (the trampoline's entries): continue with the cleaned chain
      PyObject* tb = PyException_GetTraceback(ev);
      Py_XDECREF(etb);
      etb = tb;
    }
  }
  if (parent < 0) {
    int64_t n_py = tls_py_warnings - warn0;
    if (n_py > 0 || S.eng->warnings_pending()) {
      PyObject* c = PyLong_FromLongLong(cid);
      PyObject* n = PyLong_FromLongLong(n_py);
      if (c != nullptr && n != nullptr) {
        int64_t got = call_int(S.on_warnings, "function mode (warnings)", c, n);
        warned = got > 0;
      } else {
        contain("function mode (warnings)");
      }
      Py_XDECREF(c);
      Py_XDECREF(n);
    }
    tls_py_warnings = warn0;   // consumed (on_warnings took them off the tap)
  }
  if (kind == LAZY || printing) {
    // conversions that may dispatch: forgotten when nothing ran, nothing raised and nothing nested
    CallRow& lr = row(cid);
    if (!warned && S.n_calls == cid + 1 && lr.n_ops == 0 && lr.error < 0) S.n_calls = cid;
  }
  if (raised) {
    if (S.pend_t != nullptr) {   // the program's own exception is already on its way out
      Py_CLEAR(S.pend_t);
      Py_CLEAR(S.pend_v);
      Py_CLEAR(S.pend_tb);
    }
    PyErr_Restore(et, ev, etb);
    return nullptr;
  }
  if (S.pend_t != nullptr) {
    Py_DECREF(result);
    raise_pending();
    return nullptr;
  }
  return result;
}

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
  auto* eng = static_cast<EngineShared*>(PyCapsule_GetPointer(cap, "tensorscope_engine.fmode_state"));
  if (eng == nullptr) return nullptr;
  if (eng->abi != 1) {
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
  S.owner = PyThread_get_thread_ident();
  S.recording = false;
  S.active = true;
  Py_RETURN_NONE;
}

PyObject* py_set_recording(PyObject*, PyObject* o) {
  S.recording = PyObject_IsTrue(o) == 1;
  Py_RETURN_NONE;
}

// take() -> (rows bytes, n_calls): the calls rows as CALL_DTYPE records; stops the mode.
// The first n calls rows as one bytes object of CallRow (packed blocks unpacked).
PyObject* copy_rows(int64_t n) {
  PyObject* out = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(n * int64_t(sizeof(CallRow))));
  if (out == nullptr) return nullptr;
  char* p = PyBytes_AS_STRING(out);
  for (int64_t done = 0; done < n;) {
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

// (rows so far as bytes, n) without stopping: a dataset= spill decodes ops while the trace runs,
// and their source lines and call names come from these rows.
PyObject* py_take(PyObject*, PyObject*) {
  S.active = false;
  S.recording = false;
  int64_t n = S.n_calls;
  PyObject* out = copy_rows(n);
  if (out == nullptr) return nullptr;
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
  return Py_BuildValue("(NL)", out, (long long)n);
}

// field(cid, k): one calls field while recording (k: CALL_FIELDS index), None when out of range.
PyObject* py_field(PyObject*, PyObject* args) {
  long long cid;
  int k;
  if (!PyArg_ParseTuple(args, "Li", &cid, &k)) return nullptr;
  if (cid < 0 || cid >= S.n_calls) Py_RETURN_NONE;
  static const int kOrder[10] = {0, 1, 2, 8, 6, 3, 4, 5, 9, 10};   // CALL_FIELDS -> CallRow members
  if (k < 0 || k >= 10) Py_RETURN_NONE;
  long long v = any_field(cid, kOrder[k]);
  return PyLong_FromLongLong(v);
}

// column(k): one calls field (k: CALL_FIELDS index) of every call so far, as int64 bytes, while
// recording: what a dataset= spill reads (8 bytes a call, not a copy of every row).
PyObject* py_column(PyObject*, PyObject* args) {
  int k;
  if (!PyArg_ParseTuple(args, "i", &k)) return nullptr;
  static const int kOrder[10] = {0, 1, 2, 8, 6, 3, 4, 5, 9, 10};   // CALL_FIELDS -> CallRow members
  if (k < 0 || k >= 10) {
    PyErr_SetString(PyExc_IndexError, "calls field index out of range");
    return nullptr;
  }
  int64_t n = S.n_calls;
  PyObject* out = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(n * 8));
  if (out == nullptr) return nullptr;
  int64_t* dst = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(out));
  const int f = kOrder[k];
  for (int64_t cid = 0; cid < n; ++cid) dst[cid] = any_field(cid, f);
  return Py_BuildValue("(NL)", out, (long long)n);
}

PyObject* py_n_calls(PyObject*, PyObject*) {
  return PyLong_FromLongLong(S.n_calls);
}

// py_warning(): the Python warning tap collected one warning on this thread.
PyObject* py_warning(PyObject*, PyObject*) {
  tls_py_warnings++;
  Py_RETURN_NONE;
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
  return Py_BuildValue("{s:L,s:n,s:n,s:n,s:L,s:n,s:L}", "calls", (long long)S.n_calls, "src_cache", Py_ssize_t(S.src_cache.size()),
                       "module_cache", Py_ssize_t(S.mod_cache.size()), "trampolines", Py_ssize_t(S.tramp_cache.size()),
                       "tracer_errors", (long long)S.tracer_errors, "packed_blocks", Py_ssize_t(S.packed_upto),
                       "row_bytes", bytes);
}

// torch checks ``mode.__torch_function__.__self__ is mode`` (python_arg_parser.cpp dispatch_on_mode):
// the builtin is bound to the mode object (a PyCFunction's self; still no descriptor, no frame).
PyMethodDef bound_def = {"__torch_function__",
                         reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(torch_function)), METH_FASTCALL,
                         "the native function mode's __torch_function__(func, types, args=(), kwargs=None)"};

PyObject* py_bind(PyObject*, PyObject* mode) {
  return PyCFunction_NewEx(&bound_def, mode, nullptr);
}

PyMethodDef methods[] = {
    {"bind", py_bind, METH_O, "bind(mode): the builtin __torch_function__ bound to mode (set it on the instance)"},
    {"torch_function", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(torch_function)), METH_FASTCALL,
     "torch_function(func, types, args=(), kwargs=None): the native function mode's __torch_function__"},
    {"configure", py_configure, METH_VARARGS, "configure(helper, engine_capsule, t0_ns, source, modules)"},
    {"set_recording", py_set_recording, METH_O, "record (True) or pass every call through (False)"},
    {"take", py_take, METH_NOARGS, "(calls rows as bytes, n): hand the rows over and stop"},
    {"field", py_field, METH_VARARGS, "field(call_id, k): a calls field while recording"},
    {"column", py_column, METH_VARARGS, "(one calls field of every call so far as int64 bytes, n), recording on"},
    {"n_calls", py_n_calls, METH_NOARGS, "calls recorded so far"},
    {"warning", py_warning, METH_NOARGS, "the warning tap collected a warning on this thread"},
    {"active", py_active, METH_NOARGS, "whether a trace is configured"},
    {"stats", py_stats, METH_NOARGS, "cache sizes and counters (tests, benchmarks)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "tensorscope_fmode", "tensorscope native function mode", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_tensorscope_fmode() {
  PyObject* m = PyModule_Create(&moddef);
  if (m == nullptr) return nullptr;
  PyModule_AddIntConstant(m, "ROW_SIZE", sizeof(CallRow));
  PyModule_AddIntConstant(m, "FAST_FRAMES", TS_FAST_FRAMES);
  return m;
}
