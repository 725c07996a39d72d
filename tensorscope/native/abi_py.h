// tensorscope native ABI as Python data: abi() of every library that includes abi.h returns this
// dict (tensorscope/native/_abi.py reads it; tests/native/test_abi.py compares it with Python's
// own definitions). Plain values only: lists of (name, offset, size, kind) tuples, ints, strings.

#pragma once

#include <Python.h>

#include <iterator>

#include "abi.h"

namespace tsabi TS_HIDDEN {

template <size_t N>
inline PyObject* fields_list(const Field (&f)[N]) {
  PyObject* l = PyList_New(Py_ssize_t(N));
  if (l == nullptr) return nullptr;
  for (size_t i = 0; i < N; ++i) {
    const char kind[2] = {f[i].kind, 0};
    PyObject* t = Py_BuildValue("(snns)", f[i].name, Py_ssize_t(f[i].offset), Py_ssize_t(f[i].size), kind);
    if (t == nullptr) {
      Py_DECREF(l);
      return nullptr;
    }
    PyList_SET_ITEM(l, Py_ssize_t(i), t);
  }
  return l;
}

template <size_t N>
inline PyObject* names_list(const char* const (&names)[N]) {
  PyObject* l = PyList_New(Py_ssize_t(N));
  if (l == nullptr) return nullptr;
  for (size_t i = 0; i < N; ++i) {
    PyObject* s = PyUnicode_FromString(names[i]);
    if (s == nullptr) {
      Py_DECREF(l);
      return nullptr;
    }
    PyList_SET_ITEM(l, Py_ssize_t(i), s);
  }
  return l;
}

// {name: value} of an array of {name, value} pairs
template <typename T, size_t N>
inline PyObject* named_values(const T (&items)[N]) {
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
  for (size_t i = 0; i < N; ++i) {
    PyObject* v = PyLong_FromLongLong((long long)items[i].value);
    if (v == nullptr || PyDict_SetItemString(d, items[i].name, v) < 0) {
      Py_XDECREF(v);
      Py_DECREF(d);
      return nullptr;
    }
    Py_DECREF(v);
  }
  return d;
}

// d[key] = v (stolen); false (d released) when v is null or the insert fails
inline bool put(PyObject* d, const char* key, PyObject* v) {
  if (v == nullptr || PyDict_SetItemString(d, key, v) < 0) {
    Py_XDECREF(v);
    return false;
  }
  Py_DECREF(v);
  return true;
}

// The whole ABI as one dict (a new one per call).
inline PyObject* abi_dict() {
  PyObject* d = PyDict_New();
  if (d == nullptr) return nullptr;
  PyObject* call_fields = PyList_New(kCallFields);
  if (call_fields != nullptr) {
    for (int k = 0; k < kCallFields; ++k) {
      PyList_SET_ITEM(call_fields, k, PyUnicode_FromString(kCallRowFields[kCallFieldOrder[k]].name));
    }
  }
  PyObject* widths = PyDict_New();
  if (widths != nullptr) {
    for (const auto& w : kPackedWidths) {
      PyObject* k = PyLong_FromLong(w.width);
      PyObject* v = PyUnicode_FromFormat("%c%d", w.kind, w.width);
      if (k == nullptr || v == nullptr || PyDict_SetItem(widths, k, v) < 0) Py_CLEAR(widths);
      Py_XDECREF(k);
      Py_XDECREF(v);
      if (widths == nullptr) break;
    }
  }
  bool ok = put(d, "row", fields_list(kOpsRowFields)) && put(d, "row_size", PyLong_FromSize_t(sizeof(OpsRow))) &&
            put(d, "flags", named_values(kRowFlags)) &&
            put(d, "packed", Py_BuildValue("{s:N,s:n,s:N}", "columns", names_list(kPackedColumnNames), "block_rows",
                                           Py_ssize_t(kBlockRows), "widths", widths)) &&
            put(d, "tags", named_values(kArgTags)) && put(d, "tensors", names_list(kTensorColumnNames)) &&
            put(d, "meta", Py_BuildValue("{s:N,s:L}", "header", names_list(kMetaKeyNames), "max_ndim",
                                         (long long)kMaxNdim)) &&
            put(d, "call", fields_list(kCallRowFields)) && put(d, "call_size", PyLong_FromSize_t(sizeof(CallRow))) &&
            put(d, "call_fields", call_fields) && put(d, "kinds", named_values(kCallKinds)) &&
            put(d, "kind_bits", PyLong_FromLong(kKindBits)) &&
            put(d, "fmode_state", Py_BuildValue("{s:i,s:s,s:N,s:n}", "abi", kFmodeStateAbi, "capsule",
                                                kFmodeStateCapsule, "fields", fields_list(kFmodeStateFields), "size",
                                                Py_ssize_t(sizeof(FmodeState)))) &&
            put(d, "site_reader", PyUnicode_FromString(kSiteReaderCapsule));
  if (!ok) {
    Py_DECREF(d);
    return nullptr;
  }
  return d;
}

// abi(): the module-level function every library that includes abi.h exports
inline PyObject* py_abi(PyObject*, PyObject*) {
  return abi_dict();
}

}  // namespace tsabi
