// tensorscope native recording engine: the row buffers and their hand-over to Python.
//
// Rows go to a live block of block_rows rows (the chunk_rows option). A full block is packed
// column by column as recording/recorder.py's pack() does (abi.h, "Packed chunks"): ids, flags,
// call ids and times within a block mostly fit in 1-4 bytes, so a packed row is ~20-30 bytes
// instead of sizeof(Row). take_chunks() moves the packed chunks out, with what was interned since
// the last call (ops, metas, tuples, aliases, argument encodings, nodes, the screen's findings).
// Everything here runs under g.mu.

#include <string>
#include <vector>

#include "engine.h"

namespace tsengine TS_HIDDEN {
namespace {

using namespace tsabi;

template <typename Get>
void pack_col(PackedCol& out, size_t n, Get&& get) {
  out.bytes.clear();
  if (n == 0) {
    out.base = 0;
    out.width = 1;
    return;
  }
  int64_t lo = get(0), hi = lo;
  for (size_t i = 1; i < n; ++i) {
    int64_t v = get(i);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  uint64_t span = uint64_t(hi) - uint64_t(lo);
  out.width = span <= 0xFFu ? 1 : span <= 0xFFFFu ? 2 : span <= 0xFFFFFFFFull ? 4 : 8;
  out.base = out.width == 8 ? 0 : lo;
  out.bytes.resize(n * size_t(out.width));
  uint8_t* b = out.bytes.data();
  switch (out.width) {
    case 1:
      for (size_t i = 0; i < n; ++i) b[i] = uint8_t(get(i) - lo);
      break;
    case 2:
      for (size_t i = 0; i < n; ++i) reinterpret_cast<uint16_t*>(b)[i] = uint16_t(get(i) - lo);
      break;
    case 4:
      for (size_t i = 0; i < n; ++i) reinterpret_cast<uint32_t*>(b)[i] = uint32_t(get(i) - lo);
      break;
    default:
      for (size_t i = 0; i < n; ++i) reinterpret_cast<int64_t*>(b)[i] = get(i);
  }
}

PackedChunk pack_block(const std::vector<Row>& rows, const std::vector<int32_t>& stor, int64_t first_seq) {
  PackedChunk c;
  c.first_seq = first_seq;
  c.rows = int64_t(rows.size());
  size_t n = rows.size();
  const Row* r = rows.data();
  pack_col(c.cols[PC_OP], n, [&](size_t i) { return int64_t(r[i].op); });
  pack_col(c.cols[PC_INS], n, [&](size_t i) { return int64_t(r[i].ins); });
  pack_col(c.cols[PC_OUTS], n, [&](size_t i) { return int64_t(r[i].outs); });
  pack_col(c.cols[PC_ALIAS], n, [&](size_t i) { return int64_t(r[i].alias); });
  pack_col(c.cols[PC_MODULE], n, [&](size_t i) { return int64_t(r[i].module); });
  pack_col(c.cols[PC_CALL], n, [&](size_t i) { return int64_t(r[i].call); });
  pack_col(c.cols[PC_NODE], n, [&](size_t i) { return int64_t(r[i].node); });
  pack_col(c.cols[PC_SEQ_NR], n, [&](size_t i) { return r[i].seq_nr; });
  pack_col(c.cols[PC_FLAGS], n, [&](size_t i) { return int64_t(r[i].flags); });
  pack_col(c.cols[PC_START], n, [&](size_t i) { return r[i].start; });
  pack_col(c.cols[PC_DUR], n, [&](size_t i) { return r[i].dur; });
  const int32_t* sp = stor.data();
  pack_col(c.cols[PC_STORAGES], stor.size(), [&](size_t i) { return int64_t(sp[i]); });
  return c;
}

PyObject* interner_delta(const SeqInterner& in, size_t& taken) {
  // the entries from `taken` on: (arena slice, offsets from that entry on, absolute)
  size_t k = taken < in.size() ? taken : in.size();
  int64_t a0 = in.offsets[k];
  PyObject* r = Py_BuildValue("(NN)", bytes_of(in.arena.data() + a0, (in.arena.size() - size_t(a0)) * 8),
                              bytes_of(in.offsets.data() + k, (in.offsets.size() - k) * 8));
  taken = in.size();
  return r;
}

template <typename T>
PyObject* tail_list(const std::vector<T>& v, size_t& taken, std::string (*name)(const T&)) {
  size_t k = taken < v.size() ? taken : v.size();
  PyObject* l = PyList_New(Py_ssize_t(v.size() - k));
  for (size_t i = k; i < v.size(); ++i) {
    std::string s = name(v[i]);
    PyList_SET_ITEM(l, Py_ssize_t(i - k), PyUnicode_DecodeUTF8(s.data(), Py_ssize_t(s.size()), "replace"));
  }
  taken = v.size();
  return l;
}

std::string op_name(OpFacts* const& f) { return f->name; }
std::string node_name(const std::string& n) { return n; }

// under g.mu: what was interned since the last call (chunks refer to ids that exist when they were
// sealed, so take the chunks first, then the dictionaries)
PyObject* dicts_delta() {
  PyObject* d = PyDict_New();
  auto put = [&](const char* k, PyObject* v) {
    PyDict_SetItemString(d, k, v);
    Py_DECREF(v);
  };
  put("ops", tail_list(g.ops, g.ops_taken, &op_name));
  put("metas", interner_delta(g.metas, g.metas_taken));
  put("tuples", interner_delta(g.tuples, g.tuples_taken));
  put("aliases", interner_delta(g.aliases, g.aliases_taken));
  put("args", interner_delta(g.args, g.args_taken));
  put("nodes", tail_list(g.node_names, g.nodes_taken, &node_name));
  size_t k = g.row_args_taken;
  put("row_args", bytes_of(g.row_args.data() + k, (g.row_args.size() - k) * 8));
  g.row_args_taken = g.row_args.size();
  std::vector<int64_t> nf;   // (seq, count, produced) of the screen's findings since the last call
  for (size_t i = g.nonfinite_taken; i < g.nonfinite.size(); ++i) {
    const auto& e = g.nonfinite[i];
    nf.push_back(e.first);
    nf.push_back(e.second.first);
    nf.push_back(e.second.second);
  }
  g.nonfinite.clear();   // handed over: Python keeps (and spills) them, a NaN loop has one per op
  g.nonfinite_taken = 0;
  put("nonfinite", bytes_of(nf.data(), nf.size() * 8));
  const size_t fk = g.fingerprints_taken;   // engine_screen.h FpRec records since the last call
  put("fingerprints", bytes_of(g.fingerprints.data() + fk, (g.fingerprints.size() - fk) * sizeof(FpRec)));
  g.fingerprints_taken = g.fingerprints.size();
  // the storage records freed and dropped since the last call (abi.h TensorColumn order): handed
  // over, so the engine keeps the live storages only
  put("storages", bytes_of(g.finished.data(), g.finished.size() * 8));
  std::vector<int64_t>().swap(g.finished);   // freed (kept for the next hand-over, the heap grew more: measured)
  return d;
}

// under g.mu: the packed chunks, moved out of the engine
PyObject* chunks_out() {
  PyObject* l = PyList_New(Py_ssize_t(g.chunks.size()));
  for (size_t i = 0; i < g.chunks.size(); ++i) {
    PackedChunk& c = g.chunks[i];
    PyObject* cols = PyTuple_New(PC_N);
    for (int k = 0; k < PC_N; ++k) {
      PackedCol& pc = c.cols[k];
      PyTuple_SET_ITEM(cols, k, Py_BuildValue("(LiN)", (long long)pc.base, int(pc.width),
                                              bytes_of(pc.bytes.data(), pc.bytes.size())));
      std::vector<uint8_t>().swap(pc.bytes);   // freed as soon as copied: no doubled peak
    }
    PyList_SET_ITEM(l, Py_ssize_t(i), Py_BuildValue("(LLN)", (long long)c.first_seq, (long long)c.rows, cols));
  }
  g.chunks.clear();
  g.chunk_bytes = 0;
  g.chunk_rows = 0;
  return l;
}

}  // namespace

// under g.mu: the live block becomes a packed chunk
void seal_block() {
  if (g.block.empty()) return;
  g.chunks.push_back(pack_block(g.block, g.block_stor, g.block_first));
  g.chunk_bytes += int64_t(g.chunks.back().nbytes());
  g.chunk_rows += int64_t(g.block.size());
  if (g.on_full != nullptr && (g.chunk_rows + g.py_rows > g.spill_rows ||
                               int64_t(g.finished.size() / tsabi::TC_N) >= g.handover_records)) {
    g.handover_due = true;
  }
  g.block_first += int64_t(g.block.size());
  g.block.clear();
  g.block_stor.clear();
}

// take_chunks(final): (chunks, dictionaries delta); final also packs the live block
PyObject* py_take_chunks(PyObject*, PyObject* final_o) {
  std::lock_guard<std::mutex> lk(g.mu);
  if (PyObject_IsTrue(final_o)) seal_block();
  PyObject* ch = chunks_out();
  g.n_handovers++;
  return Py_BuildValue("(NN)", ch, dicts_delta());
}

PyObject* py_resident(PyObject*, PyObject*) {
  // bytes the engine holds for the ops rows (packed chunks + the live block) and for storages
  std::lock_guard<std::mutex> lk(g.mu);
  int64_t rows = g.chunk_bytes + int64_t(g.block.capacity() * sizeof(Row) + g.block_stor.capacity() * 4);
  int64_t st = int64_t(g.slots.size() * sizeof(StorageRec) + g.finished.capacity() * 8 +
                       g.free_slots.capacity() * 4);
  int64_t interned = int64_t((g.metas.arena.capacity() + g.tuples.arena.capacity() + g.aliases.arena.capacity()) * 8);
  return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L,s:L,s:L}", "rows", (long long)rows, "storages", (long long)st,
                       "interned", (long long)interned, "n_rows", (long long)g.n_rows, "storage_slots",
                       (long long)g.slots.size(), "storages_made", (long long)g.next_sid, "storages_finished",
                       (long long)(g.finished.size() / tsabi::TC_N), "handovers", (long long)g.n_handovers);
}

}  // namespace tsengine
