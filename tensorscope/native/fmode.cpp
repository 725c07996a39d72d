// tensorscope native function mode: the hot path of recording/function.py in C.
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
//    through handle_torch_function: it is called again through the trampoline of recording/frames.py
//    (a frame that looks like the caller's), so ``warnings.warn(stacklevel=N)`` lands where it
//    would untraced. The trampoline per call site is cached here.
//
// Per outermost recorded call, all in C: classification of ``func`` (a cache; Python
// ``_classify`` on a miss), the user source line (a frame walk with the per-code "internal" verdicts
// of recording/source.py, then a cache keyed by (code object, instruction)), the module path (a walk over
// the Module.__call__ frames, reading ``self`` from the frame's fast locals, with a cache keyed by
// (innermost, outermost) module validated through weak references), autocast only when
// ``torch._C._is_any_autocast_enabled()``, the ``calls`` row in native blocks (handed over as
// bytes), the engine's current call id and ``seq`` through pointers the engine exports, and the
// warning bookkeeping (a counter the Python warning tap bumps). Everything rare calls back into
// Python (``recording/function.py:NativeFunctionMode``): cache misses, errors, warnings, printing,
// other threads, other Python versions' frame layouts.
//
// The frame walks read CPython 3.11's interpreter frames directly (no frame objects created); on
// other versions the walks are done by the Python helpers (same results, Python speed).
//
// This file: __torch_function__ and the module; fmode.h lists the other parts.
//
// A tracer bug never reaches the program: every Python helper's exception is handed to
// ``tracer_error`` and cleared, and the user's function is still called exactly once.

#include <Python.h>

#include <cstdint>
#include <cstring>

#include "abi_py.h"
#include "fmode.h"
#include "fmode_frames.h"

namespace tsfmode TS_HIDDEN {
namespace {

using namespace tsabi;

thread_local int64_t tls_py_warnings = 0;   // Python warnings the tap collected on this thread

// (kind, call_func_id) of func (abi.h CallKind, packed by the Python classifier), cached per function object.
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
    *kind = int(packed & ((1 << kKindBits) - 1));
    *fid = int32_t(packed >> kKindBits);
    return true;
  }
  int64_t packed = PyLong_AsLongLong(v);
  *kind = int(packed & ((1 << kKindBits) - 1));
  *fid = int32_t(packed >> kKindBits);
  return true;
}

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
  int kind = KIND_DIRECT;
  int32_t fid = 0;
  if (!classify(func, &kind, &fid) || kind == KIND_DIRECT) return call_func(func, args, kwargs);

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

  if (kind == KIND_PASS) return call_through(tramp, func, args, kwargs);   // a getter's warning: at the user's line

  // a sampled call: the mode's own time before the call and after it (at return, whatever the path)
  struct OwnTimer {
    int64_t in, t0 = 0, t1 = 0;
    ~OwnTimer() {
      if (t1 != 0) {
        S.own_ns += (t0 - in) + (now_ns() - t1);
        S.own_calls++;
      }
    }
  } own{++S.tick % kOwnSample == 0 ? now_ns() : 0};
  S.calls_seen++;
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
  bool printing = kind == KIND_PRINTING;
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
  if (own.in != 0) {
    own.t0 = t0;
    own.t1 = t1;
  }

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
  if (kind == KIND_LAZY || printing) {
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

// py_warning(): the Python warning tap collected one warning on this thread.
PyObject* py_warning(PyObject*, PyObject*) {
  tls_py_warnings++;
  Py_RETURN_NONE;
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
    {"warning", py_warning, METH_NOARGS, "the warning tap collected a warning on this thread"},
    {"abi", tsabi::py_abi, METH_NOARGS, "the layouts shared with Python (abi.h) as a dict"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "tensorscope_fmode", "tensorscope native function mode", -1, methods};

}  // namespace
}  // namespace tsfmode

PyMODINIT_FUNC PyInit_tensorscope_fmode() {
  using namespace tsfmode;
  PyObject* m = PyModule_Create(&moddef);
  if (m == nullptr) return nullptr;
  if (PyModule_AddFunctions(m, kStateMethods) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  PyModule_AddIntConstant(m, "ROW_SIZE", sizeof(tsabi::CallRow));
  PyModule_AddIntConstant(m, "BLOCK_ROWS", long(kBlock));   // calls a packed block holds
  PyModule_AddIntConstant(m, "FAST_FRAMES", TS_FAST_FRAMES);
  return m;
}
