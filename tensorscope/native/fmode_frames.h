// tensorscope native function mode: the frame walks (per outermost call, so inline here).
//
// The user's source line (the per-code "internal" verdicts of recording/source.py, then a cache keyed
// by (code object, instruction)), the module path (the Module.__call__ frames' ``self`` read from
// their fast locals, a cache keyed by (innermost, outermost) module validated through weak
// references) and the trampoline per call site. They read CPython 3.11's interpreter frames
// directly (no frame objects created); on other versions fmode.cpp calls the Python helpers.

#pragma once

#include "fmode.h"

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && !defined(TS_NO_FAST_FRAMES)
#define TS_FAST_FRAMES 1
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#else
#define TS_FAST_FRAMES 0
#endif

namespace tsfmode TS_HIDDEN {

// The frame object ``depth`` frames out from the running one (a new reference; nullptr on failure).
inline PyObject* frame_object(int depth) {
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

// recording/source.py's verdict for a code object, cached here by address (the Python function decides).
inline int code_internal(PyObject* code) {
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
inline int64_t call_on_frame(PyObject* fn, int depth, const char* where) {
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
inline int32_t user_src(_PyInterpreterFrame* f, int depth) {
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

inline PyObject* self_of(_PyInterpreterFrame* f) {
  if (f->f_code->co_nlocalsplus < 1) return nullptr;
  PyObject* o = f->localsplus[0];
  if (o != nullptr && PyCell_Check(o)) o = PyCell_GET(o);
  return o;
}

inline bool is_module_frame_end(_PyInterpreterFrame* f) {
  PyObject* name = f->f_code->co_name;
  return name == S.module_name || (PyUnicode_GET_LENGTH(name) == 8 && PyUnicode_Compare(name, S.module_name) == 0);
}

inline int32_t module_at(_PyInterpreterFrame* f, int depth) {
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
inline PyObject* trampoline(_PyInterpreterFrame* f, int depth) {
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

}  // namespace tsfmode
