// tensorscope native recording engine: gather() for the table builder (recording/columns.py).
//
// Needs no recording state (so not engine.h and its ATen headers): it turns interned list values
// into Arrow list columns in one pass. Declared in engine.h.

#include <Python.h>

#include <c10/macros/Macros.h>

#include <cstdint>
#include <cstring>

#include "abi.h"

namespace tsengine TS_HIDDEN {
namespace {

// gather(ids, starts, lens, flat, itemsize) -> (offsets, values)
//   Row i's list is flat[starts[k] : starts[k] + lens[k]] (items of `itemsize` bytes) with
//   k = ids[i] (int32 or int64 ids), or k = i when ids is None. `offsets` is the int32 Arrow
//   offsets buffer (rows + 1 entries), `values` the concatenated items: one pass, one copy,
//   no per-row Python object. Raises OverflowError past 2**31 items (int32 offsets) and
//   IndexError for an id outside starts/lens or a segment outside flat.
struct BufView {
  Py_buffer b{};
  bool ok = false;
  ~BufView() {
    if (ok) PyBuffer_Release(&b);
  }
  bool get(PyObject* o) {
    if (PyObject_GetBuffer(o, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return false;
    ok = true;
    return true;
  }
};

template <typename T, typename K>
inline void copy_segments(T* dst, const T* src, const int64_t* st, const int32_t* o, int64_t n, K&& key) {
  for (int64_t i = 0; i < n; ++i) {
    const T* s = src + st[key(i)];
    T* d = dst + o[i];
    switch (o[i + 1] - o[i]) {   // most lists hold a few items: no loop for them
      case 4: d[3] = s[3]; [[fallthrough]];
      case 3: d[2] = s[2]; [[fallthrough]];
      case 2: d[1] = s[1]; [[fallthrough]];
      case 1: d[0] = s[0]; [[fallthrough]];
      case 0: break;
      default: std::memcpy(d, s, size_t(o[i + 1] - o[i]) * sizeof(T));
    }
  }
}

}  // namespace

PyObject* py_gather(PyObject*, PyObject* args) {
  PyObject *ids_o, *starts_o, *lens_o, *flat_o;
  Py_ssize_t itemsize;
  if (!PyArg_ParseTuple(args, "OOOOn", &ids_o, &starts_o, &lens_o, &flat_o, &itemsize)) return nullptr;
  BufView ids, starts, lens, flat;
  bool has_ids = ids_o != Py_None;
  if ((has_ids && !ids.get(ids_o)) || !starts.get(starts_o) || !lens.get(lens_o) || !flat.get(flat_o))
    return nullptr;
  if (starts.b.itemsize != 8 || lens.b.itemsize != 8 || starts.b.len != lens.b.len ||
      (has_ids && ids.b.itemsize != 4 && ids.b.itemsize != 8) || itemsize <= 0 || flat.b.len % itemsize != 0) {
    PyErr_SetString(PyExc_ValueError, "gather: starts/lens must be int64 of one length, ids int32/int64");
    return nullptr;
  }
  const int64_t* st = static_cast<const int64_t*>(starts.b.buf);
  const int64_t* ln = static_cast<const int64_t*>(lens.b.buf);
  const int64_t k_max = starts.b.len / 8;
  const int64_t n = has_ids ? ids.b.len / ids.b.itemsize : k_max;
  const int64_t n_flat = flat.b.len / itemsize;
  const bool ids32 = has_ids && ids.b.itemsize == 4;
  auto key = [&](int64_t i) -> int64_t {
    if (!has_ids) return i;
    return ids32 ? int64_t(static_cast<const int32_t*>(ids.b.buf)[i]) : static_cast<const int64_t*>(ids.b.buf)[i];
  };
  for (int64_t k = 0; k < k_max; ++k) {   // every segment once (few: interned values), not per row
    if (ln[k] < 0 || st[k] < 0 || st[k] + ln[k] > n_flat) {
      PyErr_Format(PyExc_IndexError, "gather: segment %lld lies outside the values", (long long)k);
      return nullptr;
    }
  }
  PyObject* off = PyBytes_FromStringAndSize(nullptr, Py_ssize_t((n + 1) * 4));
  if (off == nullptr) return nullptr;
  int32_t* o = reinterpret_cast<int32_t*>(PyBytes_AS_STRING(off));
  int64_t total = 0;
  o[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t k = key(i);
    if (C10_UNLIKELY(uint64_t(k) >= uint64_t(k_max))) {
      Py_DECREF(off);
      PyErr_Format(PyExc_IndexError, "gather: row %lld refers to segment %lld of %lld", (long long)i, (long long)k,
                   (long long)k_max);
      return nullptr;
    }
    total += ln[k];
    if (C10_UNLIKELY(total > INT32_MAX)) {
      Py_DECREF(off);
      PyErr_SetString(PyExc_OverflowError, "gather: more than 2**31 list items in one column chunk");
      return nullptr;
    }
    o[i + 1] = int32_t(total);
  }
  PyObject* vals = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(total * itemsize));
  if (vals == nullptr) {
    Py_DECREF(off);
    return nullptr;
  }
  char* v = PyBytes_AS_STRING(vals);
  const char* f = static_cast<const char*>(flat.b.buf);
  Py_BEGIN_ALLOW_THREADS
  if (itemsize == 8) {
    copy_segments(reinterpret_cast<int64_t*>(v), reinterpret_cast<const int64_t*>(f), st, o, n, key);
  } else if (itemsize == 4) {
    copy_segments(reinterpret_cast<int32_t*>(v), reinterpret_cast<const int32_t*>(f), st, o, n, key);
  } else if (itemsize == 1) {
    copy_segments(reinterpret_cast<int8_t*>(v), reinterpret_cast<const int8_t*>(f), st, o, n, key);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      size_t nb = size_t(o[i + 1] - o[i]) * size_t(itemsize);
      std::memcpy(v, f + st[key(i)] * itemsize, nb);
      v += nb;
    }
  }
  Py_END_ALLOW_THREADS
  return Py_BuildValue("(NN)", off, vals);
}

}  // namespace tsengine
