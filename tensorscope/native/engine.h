// tensorscope native recording engine: the state its translation units share.
//
//   engine.cpp           the Python API (start/stop, setters, take*, warnings, ...) and the module
//   engine_observer.cpp  the RecordFunction callbacks: visibility, rows, commit (the hot path)
//   engine_ops.cpp       per-op facts (once per schema) and the Python calls an op makes (op hook, spill)
//   engine_buffers.cpp   blocks packed into chunks, and their hand-over with the dictionaries
//   engine_gather.cpp    gather(): list columns as Arrow offsets + values (recording/columns.py)
//   engine_storages.h    metas and storage ids (inline: per op)
//   engine_screen.h      the non-finite screen (inline: per op)
//   abi.h                the layouts shared with Python and with the function mode
//
// One Engine (g), one mutex; the thread-local state of the observer lives in engine_observer.cpp
// alone (a thread_local reached from another file would cost a TLS wrapper call per access).

#pragma once

#include <Python.h>

#include <ATen/record_function.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "abi.h"
#include "engine_screen.h"   // FpRec

namespace tsengine TS_HIDDEN {

using Row = tsabi::OpsRow;
using tsabi::F_BACKWARD;
using tsabi::F_OTHER_THREAD;
using tsabi::F_THREW;
using tsabi::PC_N;

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// ---------------------------------------------------------------------------
// Interning of int64 sequences (metas, tuples of meta ids, alias tuples, argument encodings)
// ---------------------------------------------------------------------------
struct SeqInterner {
  std::vector<int64_t> arena;     // concatenated values
  std::vector<int64_t> offsets{0};
  std::vector<int32_t> table;     // open addressing: id + 1, 0 = empty
  std::vector<uint64_t> hashes;
  size_t mask = 0;

  SeqInterner() { rehash(1024); }

  static uint64_t hash(const int64_t* v, size_t n) {
    uint64_t h = 1469598103934665603ULL ^ n;
    for (size_t i = 0; i < n; ++i) {
      h ^= uint64_t(v[i]) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    }
    return h ? h : 1;
  }
  size_t size() const { return offsets.size() - 1; }
  void rehash(size_t cap) {
    table.assign(cap, 0);
    mask = cap - 1;
    for (size_t id = 0; id < size(); ++id) {
      size_t p = hashes[id] & mask;
      while (table[p]) p = (p + 1) & mask;
      table[p] = int32_t(id + 1);
    }
  }
  int32_t get(const int64_t* v, size_t n) {
    uint64_t h = hash(v, n);
    size_t p = h & mask;
    while (int32_t e = table[p]) {
      size_t id = size_t(e - 1);
      if (hashes[id] == h && size_t(offsets[id + 1] - offsets[id]) == n &&
          std::memcmp(&arena[offsets[id]], v, n * sizeof(int64_t)) == 0) {
        return int32_t(id);
      }
      p = (p + 1) & mask;
    }
    int32_t id = int32_t(size());
    arena.insert(arena.end(), v, v + n);
    offsets.push_back(int64_t(arena.size()));
    hashes.push_back(h);
    table[p] = id + 1;
    if (size() * 2 > table.size()) rehash(table.size() * 2);
    return id;
  }
};

// ---------------------------------------------------------------------------
// Per-op facts, computed once per schema (engine_ops.cpp)
// ---------------------------------------------------------------------------
struct OpFacts {
  int32_t id = -1;
  bool cia = false;          // has a CompositeImplicitAutograd kernel
  bool backend = false;      // has a kernel of its own for some backend (silu_backward)
  bool writes = false;       // in-place / out=: screens the written outputs
  bool no_screen = false;    // returns uninitialised memory
  bool want_args = false;    // FLOPs need its scalar arguments (conv's transposed, ...)
  bool py_hook = false;      // the Python op hook wants it (c10d collectives)
  bool pre_copy = false;     // capture=: what it writes is copied before it runs (set_capture's namespaces)
  bool autograd = false;     // has an autograd kernel: ops it calls before going below autograd are rows
  int8_t rule = 0;           // engine_known.h BoundRule: how a bound on its inputs bounds its outputs
  std::vector<bool> arg_writes;   // per schema argument: written (Tensor(a!)); empty: unknown
  int32_t n_args = -1;       // schema arguments / returns (-1: vararg/varret or unknown): a boxed call's
  int32_t n_rets = -1;       // event carries its whole stack, the op's own values are its tail
  std::string name;          // "aten::add.Tensor"
};

// The op's own arguments and returns. A boxed call (functorch's interpreters re-issue ops boxed)
// hands RecordFunction the whole interpreter stack, values of the callers below the op's own.
using Values = c10::ArrayRef<const c10::IValue>;
inline Values tail(Values v, int32_t n) {
  return (n >= 0 && v.size() > size_t(n)) ? v.slice(v.size() - size_t(n)) : v;
}
inline Values args_of(const at::RecordFunction& fn, const OpFacts* f) { return tail(fn.inputs(), f->n_args); }
inline Values rets_of(const at::RecordFunction& fn, const OpFacts* f) {
  const auto& o = fn.outputs();
  return tail(Values(o.data(), o.size()), f->n_rets);
}

// ---------------------------------------------------------------------------
// Packed chunks (engine_buffers.cpp): layout in abi.h
// ---------------------------------------------------------------------------
struct PackedCol {
  int64_t base = 0;
  int32_t width = 1;            // bytes per value: 1, 2, 4 (unsigned, minus base) or 8 (raw int64)
  std::vector<uint8_t> bytes;
};

struct PackedChunk {
  int64_t first_seq = 0;
  int64_t rows = 0;
  PackedCol cols[PC_N];
  size_t nbytes() const {
    size_t b = sizeof(PackedChunk);
    for (const auto& c : cols) b += c.bytes.capacity();
    return b;
  }
};

struct StorageRec {
  c10::weak_intrusive_ptr<c10::StorageImpl> weak{c10::intrusive_ptr<c10::StorageImpl>()};
  uintptr_t ptr;
  int64_t nbytes, alloc_seq, free_seq;
  int32_t meta, module, call;
  int32_t sid;   // the storage id (creation order); the record lives in a reused slot
};

struct WarnRec {
  int64_t seq;
  std::string msg, file, function;
  int64_t line;
  bool deprecation;
};

struct Engine;

// Per-op warnings: a handler that records and chains to the one it replaced (engine_ops.cpp).
struct RowWarningHandler final : c10::WarningHandler {
  Engine* eng = nullptr;
  int64_t seq = -1;
  c10::WarningHandler* prev = nullptr;
  void process(const c10::Warning& w) override;
};

// A row under construction (kept or tentative): lives in the thread's pool.
struct Pending {
  Row row;
  std::vector<int64_t> in_metas;
  std::vector<int64_t> in_sids;
  std::vector<int32_t> in_slots;   // their records' slots (engine_storages.h), -1: none
  std::vector<uintptr_t> in_ptrs;
  std::vector<const c10::StorageImpl*> in_impls;   // tentative rows: resolved at commit
  std::vector<int64_t> in_nbytes;
  std::vector<int64_t> args_enc;
  int32_t args_id = -1;
  PyObject* py_inputs = nullptr;   // op hook: the inputs as Python objects (owned)
  std::vector<const c10::TensorImpl*> held;   // inputs (not owned: the caller holds them while the op runs)
  uint64_t seq_peek = 0;
  int uncaught = 0;
  c10::WarningHandler* prev_handler = nullptr;
  bool handler_pushed = false;
  bool pre_nonfinite = false;
  int64_t own_pre = -1;   // a sampled row: its start callback's time up to the op's start (-1: not sampled)
  bool shell = false;   // re-issued itself above the Python key (autocast): the inner event is the row
  std::vector<const c10::StorageImpl*> written;   // storages of the written arguments (engine_known.h)
  double bound = -1;   // engine_known.h: a bound on every output's magnitude from its inputs' (-1: none)
  double terms = 1;    // engine_known.h: the terms an output sums over
  const OpFacts* facts = nullptr;
  // capture= (engine_ops.cpp pre_copy): the bytes of the arguments the op writes, copied in its start
  // callback before its kernel ran; handed to the Python pre-hook right before its op hook
  std::vector<int32_t> pre_k;     // their tensor numbers (the op hook's order: defined tensors, lists flattened)
  std::vector<size_t> pre_off;    // pre_k.size() + 1 offsets into pre_buf
  std::unique_ptr<char[]> pre_buf;
  size_t pre_cap = 0;
  PyObject* pre_views = nullptr;  // while the hooks run: {tensor number: memoryview into pre_buf} (owned)
};

// What the screen knows of a float tensor's values: finite or not, and a bound on their magnitude,
// valid while the tensor still shows the same memory region at the same version and no op wrote
// its storage since (engine_known.h). `pin` (a weak reference: the StorageImpl object, never its
// memory) keeps the storage's address from being reused by another storage while the entry lives.
struct Known {
  c10::weak_intrusive_ptr<c10::StorageImpl> pin{c10::intrusive_ptr<c10::StorageImpl>()};
  const c10::StorageImpl* storage = nullptr;
  const void* data = nullptr;
  uint64_t storage_gen = 0;
  int64_t version = -1, offset = 0;
  int32_t meta = -1;
  bool finite = false;
  double bound = -1;
};

struct Engine {
  std::mutex mu;
  bool active = false;
  uint64_t gen = 0;
  at::CallbackHandle handle = 0;
  int64_t t0 = 0;
  uint64_t seq_at_start = 0;
  uint64_t owner_thread = 0;
  bool want_screen = false;
  bool want_storages = true;
  bool want_warnings = true;
  // set from Python (the module hooks and the function mode)
  int64_t cur_module = 0;
  int64_t cur_call = -1;

  std::unordered_map<const char*, OpFacts*> facts_by_name;   // schema name pointer -> facts
  std::vector<OpFacts*> ops;
  SeqInterner metas;      // abi.h MetaKey header, sizes..., strides...
  std::vector<int64_t> meta_nbytes;
  SeqInterner tuples;
  SeqInterner aliases;
  SeqInterner args;
  std::vector<int64_t> row_args;   // (seq, interned argument encoding) for the rows that have one
  std::unordered_map<std::string, bool> arg_ops;   // "aten::convolution" -> record arguments
  std::unordered_map<std::string, bool> hook_ns;   // namespaces the Python op hook receives
  PyObject* hook = nullptr;                        // hook(seq, name, inputs, outputs) (owned)
  int64_t hook_errors = 0;
  // capture= (set_capture, before start): an op of the hooked namespaces that writes an argument has
  // those bytes copied before it runs (pre_copy), then pre_hook(seq, name, {tensor number: memoryview})
  // is called right before its op hook and returns the bytes it may still keep (pre_left)
  PyObject* pre_hook = nullptr;    // owned; cleared at stop
  int64_t pre_left = 0;
  std::vector<int64_t> pre_seqs;   // sorted: only ops whose seq may be one of these; empty: every op
  std::unordered_map<std::string, bool> pre_ns;   // the namespaces whose ops are copied (capture's: aten, prims)
  std::atomic<int> paused{0};   // >0 while torch.compile compiles (ops run then are hidden)
  std::unordered_map<std::string, int32_t> node_ids;
  std::vector<std::string> node_names;

  std::vector<Row> block;                 // the live block (block_rows at most)
  std::vector<int32_t> block_stor;        // its storage ids: per row n_in then n_out
  int64_t block_first = 0;                // seq of its first row
  size_t block_rows = tsabi::kBlockRows;  // rows per block
  std::vector<PackedChunk> chunks;        // full blocks, packed, not yet taken
  int64_t chunk_bytes = 0;                // their size
  int64_t chunk_rows = 0;                 // their rows
  // spilling: past spill_rows rows in chunks, on_full() is called on the tracing thread (with the
  // GIL, RecordFunction off) to take them (engines/native.py writes them out like the python recorder)
  // Also past handover_records finished storage records (64 B each here, ~20 B packed in Python),
  // spilling or not: a long trace of small ops makes one storage per op. on_full returns the rows
  // Python still holds unspilled (py_rows): spill_rows counts them with the chunks here.
  int64_t spill_rows = INT64_MAX;
  int64_t handover_records = tsabi::kHandoverRecords;
  int64_t py_rows = 0;
  int64_t n_handovers = 0;
  PyObject* on_full = nullptr;            // owned
  bool handover_due = false;
  int64_t on_full_errors = 0;
  // what take_chunks() handed over already
  size_t ops_taken = 0, metas_taken = 0, tuples_taken = 0, aliases_taken = 0, args_taken = 0, nodes_taken = 0,
         row_args_taken = 0, nonfinite_taken = 0;
  int64_t n_rows = 0;   // rows committed (= next seq)
  int64_t last_error_seq = -1;
  int32_t last_error_op = -1;
  std::string last_error_file, last_error_func;   // its c10 source location (hooks' site reader)
  int64_t last_error_line = -1;                   // -1: none
  int64_t other_thread_rows = 0;

  // Storage records live in slots while their storage is (or, until a list sweep drops it, was)
  // alive; a dropped record's TC_N values go to `finished` and its slot is reused. So the engine
  // holds the live storages, never every storage the trace made: `finished` is handed over with
  // the packed chunks (take_chunks), the rest at take().
  std::unordered_map<uintptr_t, int32_t> by_ptr;   // data pointer -> slot
  std::deque<StorageRec> slots;    // grows in fixed blocks: no 2x slack, no copy when it grows
  std::vector<int32_t> free_slots;
  int32_t next_sid = 0;            // storage ids in creation order
  int32_t last_slot = -1;          // the slot of the last storage_id() answer (-1: none)
  std::vector<int64_t> finished;   // TC_N int64 per dropped record, until handed over
  std::vector<int32_t> young;    // slots of live storages first seen as outputs
  std::vector<int32_t> old;      // slots of live storages first seen as inputs
  size_t young_rr = 0, old_rr = 0;
  // the slots of the storages the last rows named: checked at every row, so a free right after the
  // op that last used a storage (a temporary, a saved tensor autograd releases after its node) is
  // dated exactly (engine_storages.h)
  static constexpr size_t kRecent = 32;
  std::vector<int32_t> recent = std::vector<int32_t>(kRecent, -1);
  size_t recent_pos = 0;

  std::vector<WarnRec> warnings;
  std::atomic<size_t> n_warnings{0};   // warnings.size(), readable without the lock
  size_t warnings_taken = 0;
  std::vector<std::pair<int64_t, std::pair<int64_t, int64_t>>> nonfinite;  // seq -> (count, produced)
  bool want_fp = false;                    // fingerprints=True (set_fingerprints, before start)
  std::vector<FpRec> fingerprints;         // engine_screen.h, one per op with a float output
  size_t fingerprints_taken = 0;
  int64_t n_screened = 0, n_fired = 0, n_pre = 0, n_unscreened_device = 0, n_proven = 0, n_inputs_read = 0;
  // the callbacks' own time around a sample of the rows (one in kOwnSample events): before the op's
  // start and after its end, what sits in the gaps between ops (time outside ops leaves it out)
  std::atomic<int64_t> own_ns{0}, own_rows{0};
  std::unordered_map<const c10::TensorImpl*, Known> memo;
  std::unordered_map<const c10::StorageImpl*, uint64_t> storage_gen;   // the clock at its last write
  uint64_t write_clock = 0;

  void clear();   // engine.cpp
};

extern Engine g;
extern std::atomic<tsabi::ReadSite> g_read_site;   // the hooks' error-site reader (set_site_reader)

// engine_observer.cpp: the callbacks, installed on / removed from the calling thread
void observer_install();
void observer_remove_thread_state();   // after stop: restore handlers a row left pushed, forget the stacks

// engine_ops.cpp
OpFacts* make_facts(const at::RecordFunction& fn);   // under g.mu: the facts of a schema seen first
void encode_args(const at::RecordFunction& fn, const OpFacts* f, std::vector<int64_t>& out);   // under g.mu
void hook_inputs(Pending& p, const at::RecordFunction& fn);
void call_hook(Pending& p, const at::RecordFunction& fn, int64_t seq);
void drop_py_inputs_slow(Pending& p);
void pre_copy(Pending& p, const at::RecordFunction& fn, const OpFacts* f);   // under g.mu
void pre_drop(Pending& p);
void pre_hand_over(Pending& p, int64_t seq);   // with the GIL
void pre_release(Pending& p);                  // with the GIL
void call_on_full();

// The facts of fn's schema (nullptr: a string event), under g.mu.
inline OpFacts* facts_for(const at::RecordFunction& fn) {
  auto it = g.facts_by_name.find(fn.name());
  if (it != g.facts_by_name.end()) return it->second;
  return make_facts(fn);
}

inline void drop_py_inputs(Pending& p) {
  if (p.py_inputs != nullptr) drop_py_inputs_slow(p);
  if (!p.pre_k.empty()) pre_drop(p);
}

// engine_buffers.cpp (under g.mu)
void seal_block();   // the live block becomes a packed chunk
PyObject* py_take_chunks(PyObject*, PyObject* final_o);
PyObject* py_resident(PyObject*, PyObject*);

// engine_gather.cpp
PyObject* py_gather(PyObject*, PyObject* args);

inline PyObject* bytes_of(const void* p, size_t n) {
  return PyBytes_FromStringAndSize(static_cast<const char*>(p), Py_ssize_t(n));
}

}  // namespace tsengine
