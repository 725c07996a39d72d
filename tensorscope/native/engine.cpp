// tensorscope native recording engine: a RecordFunction observer that records
// one row per ATen op a Python TorchDispatchMode would see, at C++ cost.
//
// Driven by tensorscope/recording/engines.py (NativeEngine). Per event:
//   * start callback (inputs valid here): decide visibility, intern the op,
//     the input metas (sizes, strides, dtype, device), storage ids; timestamp.
//   * end callback (outputs valid here): timestamp first (so cpu_ns excludes
//     the probes), then outputs, alias indexes, seq_nr claim, warnings, the
//     non-finite screen.
// Visibility (docs/architecture.md, recording engines): a schema event is kept when no kept event
// encloses it; a CompositeImplicitAutograd op is transparent once it has a
// child (eager decomposed it) and dropped if it ends childless without a
// backend kernel; string events (autograd::engine::evaluate_function...) are
// transparent; BACKWARD_FUNCTION events name the autograd node and carry its
// sequence number for every op inside.
//
// Rows never hold a tensor: ids, ints and interned metas only. Storages are
// identified by data pointer and watched through a c10::weak_intrusive_ptr
// (keeps the StorageImpl object, never its memory), so an address reused after
// a free is a new storage. No Python object is touched on the hot path, so the
// callbacks are safe on threads without the GIL; all shared state is behind one
// mutex (uncontended on the recording thread).

#include <Python.h>
#include <pybind11/pybind11.h>

#include <ATen/SequenceNumber.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/Storage.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <deque>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

// Declared here instead of including torch/csrc/jit/python/pybind_utils.h (~25 CPU-s
// of headers): IValue -> Python object, as torch's own bindings convert them.
namespace torch::jit {
pybind11::object toPyObject(c10::IValue ivalue);
}  // namespace torch::jit

namespace {

constexpr int64_t F_BACKWARD = 8;
constexpr int64_t F_THREW = 16;
constexpr int64_t F_OTHER_THREAD = 32;

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// ---------------------------------------------------------------------------
// Interning of int64 sequences (metas, tuples of meta ids, alias tuples)
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
// Per-op facts, computed once per schema
// ---------------------------------------------------------------------------
struct OpFacts {
  int32_t id = -1;
  bool cia = false;          // has a CompositeImplicitAutograd kernel
  bool backend = false;      // has a kernel of its own for some backend (silu_backward)
  bool writes = false;       // in-place / out=: screens the written outputs
  bool no_screen = false;    // returns uninitialised memory
  bool want_args = false;    // FLOPs need its scalar arguments (conv's transposed, ...)
  bool py_hook = false;      // the Python op hook wants it (c10d collectives)
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

// 56 bytes a row: ids that stay below 2**31 are int32; the rare argument encodings
// (FLOP formulas) live in a sparse side column, not in every row.
struct Row {
  int32_t op, ins, outs, alias, module, node;
  int32_t flags;
  int32_t call;
  int64_t seq_nr, start, dur;
};

// A full block of rows, packed column by column as recording/recorder.py's pack() does: the
// column minus its minimum in the narrowest unsigned type that holds it (uint8/16/32), else the
// raw int64 values with base 0. Ids, flags, call ids and times within a block mostly fit in
// 1-4 bytes, so a packed row is ~20-30 bytes instead of sizeof(Row).
constexpr size_t kBlockRows = 65536;   // default; start(..., block_rows) sets it (the chunk_rows option)
// column order of a packed chunk (engines.py PACKED_COLUMNS: keep in sync)
enum PackedColumn { PC_OP, PC_INS, PC_OUTS, PC_ALIAS, PC_MODULE, PC_CALL, PC_NODE, PC_SEQ_NR, PC_FLAGS, PC_START,
                    PC_DUR, PC_STORAGES, PC_N };

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

struct StorageRec {
  c10::weak_intrusive_ptr<c10::StorageImpl> weak{c10::intrusive_ptr<c10::StorageImpl>()};
  uintptr_t ptr;
  int64_t nbytes, alloc_seq, free_seq;
  int32_t meta, module, call;
};

struct WarnRec {
  int64_t seq;
  std::string msg, file, function;
  int64_t line;
  bool deprecation;
};

struct Frame {
  int kind;          // 0 transparent, 1 kept row, 2 tentative CIA, 3 backward node, 4 hidden (inside kept)
  int64_t row;       // kept/tentative: index into pending rows
  const OpFacts* facts;
  uint64_t gen;
};

// A row under construction (kept or tentative): lives on the thread's stack.
struct Pending {
  Row row;
  std::vector<int64_t> in_metas;
  std::vector<int64_t> in_sids;
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
  const OpFacts* facts = nullptr;
};

struct Engine;

struct RowWarningHandler final : c10::WarningHandler {
  Engine* eng = nullptr;
  int64_t seq = -1;
  c10::WarningHandler* prev = nullptr;
  void process(const c10::Warning& w) override;
};

struct ThreadState {
  std::vector<Frame> frames;
  // kept/tentative rows open on this thread (at most a few), reused across ops: no allocation per op
  std::vector<std::unique_ptr<Pending>> pool;
  size_t npending = 0;
  std::vector<std::unique_ptr<RowWarningHandler>> handlers;
  int64_t node = 0;               // autograd node id of the innermost BACKWARD_FUNCTION (0: forward)
  int64_t node_seq = -1;
  std::vector<std::pair<int64_t, int64_t>> node_stack;
  size_t kept_depth = 0;          // frames of kind 1/2 open
  uint64_t seq_mark = 0;          // autograd's sequence counter after this thread's last row
  int64_t seq_mark_epoch = -1;    // the trace (g.gen) seq_mark belongs to
};

thread_local ThreadState* tls = nullptr;
struct TlsOwner {
  ThreadState* p = nullptr;
  ~TlsOwner() {
    delete p;
    tls = nullptr;
  }
};
thread_local TlsOwner tls_owner;
inline ThreadState& ts() {
  if (C10_UNLIKELY(tls == nullptr)) {
    tls_owner.p = new ThreadState();
    tls = tls_owner.p;
  }
  return *tls;
}

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
  SeqInterner metas;      // [ndim, dtype, dev_type, dev_index, strided, sizes..., strides...]
  std::vector<int64_t> meta_nbytes;
  SeqInterner tuples;
  SeqInterner aliases;
  SeqInterner args;
  std::vector<int64_t> row_args;   // (seq, interned argument encoding) for the rows that have one
  std::unordered_map<std::string, bool> arg_ops;   // "aten::convolution" -> record arguments
  std::unordered_map<std::string, bool> hook_ns;   // namespaces the Python op hook receives
  PyObject* hook = nullptr;                        // hook(seq, name, inputs, outputs) (owned)
  int64_t hook_errors = 0;
  std::atomic<int> paused{0};   // >0 while torch.compile compiles (ops run then are hidden)
  std::unordered_map<std::string, int32_t> node_ids;
  std::vector<std::string> node_names;

  std::vector<Row> block;                 // the live block (kBlockRows at most)
  std::vector<int32_t> block_stor;        // its storage ids: per row n_in then n_out
  int64_t block_first = 0;                // seq of its first row
  size_t block_rows = kBlockRows;         // rows per block
  std::vector<PackedChunk> chunks;        // full blocks, packed, not yet taken
  int64_t chunk_bytes = 0;                // their size
  int64_t chunk_rows = 0;                 // their rows
  // spilling: past spill_rows rows in chunks, on_full() is called on the tracing thread (with the
  // GIL, RecordFunction off) to take them (engines.py writes them out like the python recorder)
  int64_t spill_rows = INT64_MAX;
  PyObject* on_full = nullptr;            // owned
  bool handover_due = false;
  int64_t on_full_errors = 0;
  // what take_dicts() handed over already
  size_t ops_taken = 0, metas_taken = 0, tuples_taken = 0, aliases_taken = 0, args_taken = 0, nodes_taken = 0,
         row_args_taken = 0, nonfinite_taken = 0;
  int64_t n_rows = 0;   // rows committed (= next seq)
  int64_t last_error_seq = -1;
  int32_t last_error_op = -1;
  std::string last_error_file, last_error_func;   // its c10 source location (hooks' site reader)
  int64_t last_error_line = -1;                   // -1: none
  int64_t other_thread_rows = 0;

  std::unordered_map<uintptr_t, int32_t> by_ptr;
  std::deque<StorageRec> storages;   // grows in fixed blocks: no 2x slack, no copy when it grows
  std::vector<int32_t> young;    // live storages first seen as outputs
  std::vector<int32_t> old;      // live storages first seen as inputs
  size_t young_rr = 0, old_rr = 0;

  std::vector<WarnRec> warnings;
  std::atomic<size_t> n_warnings{0};   // warnings.size(), readable without the lock
  size_t warnings_taken = 0;
  std::vector<std::pair<int64_t, std::pair<int64_t, int64_t>>> nonfinite;  // seq -> (count, produced)
  int64_t n_screened = 0, n_fired = 0, n_pre = 0, n_unscreened_device = 0;
  std::unordered_map<const c10::TensorImpl*, std::pair<int64_t, bool>> memo;  // impl -> (version, finite)

  void clear() {
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
    on_full_errors = 0;
    ops_taken = metas_taken = tuples_taken = aliases_taken = args_taken = nodes_taken = row_args_taken = 0;
    nonfinite_taken = 0;
    n_rows = 0;
    last_error_op = -1;
    last_error_seq = -1;
    last_error_line = -1;
    other_thread_rows = 0;
    by_ptr.clear();
    storages.clear();
    young.clear();
    old.clear();
    young_rr = old_rr = 0;
    warnings.clear();
    n_warnings.store(0);
    warnings_taken = 0;
    nonfinite.clear();
    n_screened = n_fired = n_pre = n_unscreened_device = 0;
    memo.clear();
  }
};

Engine g;

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

OpFacts* facts_for(const at::RecordFunction& fn) {
  const char* key = fn.name();
  auto it = g.facts_by_name.find(key);
  if (it != g.facts_by_name.end()) return it->second;
  auto opname = fn.operator_name();
  if (!opname) return nullptr;   // a string event: transparent, never cached (its pointer is not stable)
  auto* f = new OpFacts();
  f->id = int32_t(g.ops.size());
  f->name = opname->name + (opname->overload_name.empty() ? std::string(".default") : "." + opname->overload_name);
  try {
    auto h = c10::Dispatcher::singleton().findOp(*opname);
    if (h) {
      f->cia = h->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
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
          if (ai != nullptr && ai->isWrite()) f->writes = true;
        }
      }
    }
  } catch (...) {
  }
  f->want_args = g.arg_ops.count(opname->name) > 0;
  {
    auto pos = opname->name.find("::");
    f->py_hook = g.hook != nullptr && pos != std::string::npos && g.hook_ns.count(opname->name.substr(0, pos)) > 0;
  }
  std::string base = opname->name.substr(opname->name.find("::") == std::string::npos ? 0 : opname->name.find("::") + 2);
  for (const char* const* u = kUninit; *u; ++u) {
    if (base == *u) f->no_screen = true;
  }
  g.ops.push_back(f);
  g.facts_by_name.emplace(key, f);
  return f;
}

// -- tensors -------------------------------------------------------------------
int32_t meta_of(const at::TensorBase& t, uintptr_t* ptr_out, const c10::StorageImpl** impl_out, int64_t* snbytes) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  int64_t key[64];
  size_t n = 0;
  bool strided = impl->layout() == c10::kStrided && !impl->is_nested();
  bool sym = impl->has_symbolic_sizes_strides();
  int64_t ndim = 0;
  if (!impl->is_nested() && !sym) ndim = impl->dim();
  if (ndim > 28) ndim = 0;
  auto dev = impl->device();
  key[n++] = ndim;
  key[n++] = int64_t(impl->dtype().toScalarType());
  key[n++] = int64_t(dev.type());
  key[n++] = int64_t(dev.index());
  key[n++] = (strided && !sym) ? 1 : 0;
  if (ndim) {
    auto sz = impl->sizes();
    for (int64_t i = 0; i < ndim; ++i) key[n++] = sz[i];
    if (strided) {
      auto st = impl->strides();
      for (int64_t i = 0; i < ndim; ++i) key[n++] = st[i];
    }
  }
  size_t before = g.metas.size();
  int32_t id = g.metas.get(key, n);
  if (size_t(id) == before) {
    int64_t numel = 1;
    for (int64_t i = 0; i < ndim; ++i) numel *= key[5 + i];
    g.meta_nbytes.push_back(numel * int64_t(impl->dtype().itemsize()));
  }
  *ptr_out = 0;
  *impl_out = nullptr;
  *snbytes = 0;
  if (strided && !sym && impl->has_storage() && dev.type() != c10::DeviceType::Meta) {
    try {
      const c10::Storage& s = impl->unsafe_storage();
      c10::StorageImpl* si = s.unsafeGetStorageImpl();
      if (si != nullptr) {
        *ptr_out = reinterpret_cast<uintptr_t>(si->data_ptr().get());
        *impl_out = si;
        *snbytes = int64_t(si->nbytes());
      }
    } catch (...) {
    }
  }
  return id;
}

void mark_free(int32_t sid, int64_t seq) {
  StorageRec& r = g.storages[size_t(sid)];
  if (r.free_seq < 0) r.free_seq = seq;
  auto it = g.by_ptr.find(r.ptr);
  if (it != g.by_ptr.end() && it->second == sid) g.by_ptr.erase(it);
  r.weak.reset();
}

void sweep_list(std::vector<int32_t>& lst, size_t& rr, size_t budget, int64_t seq) {
  // checks up to `budget` entries (the newest first), drops the freed ones
  size_t n = lst.size();
  if (n == 0) return;
  auto check = [&](size_t i) -> bool {
    StorageRec& r = g.storages[size_t(lst[i])];
    if (r.weak.expired()) {
      mark_free(lst[i], seq);
      lst[i] = lst.back();
      lst.pop_back();
      return true;
    }
    return false;
  };
  if (n <= budget) {
    for (size_t i = lst.size(); i-- > 0;) check(i);
    return;
  }
  size_t newest = budget / 2;
  for (size_t k = 0; k < newest && !lst.empty(); ++k) {
    size_t i = lst.size() - 1 - k;
    if (i < lst.size()) check(i);
  }
  for (size_t k = 0; k < budget - newest && !lst.empty(); ++k) {
    rr = (rr + 1) % lst.size();
    check(rr);
  }
}

int32_t storage_id(const c10::StorageImpl* si, uintptr_t ptr, int32_t meta, int64_t nbytes, bool alloc, int64_t seq) {
  if (!g.want_storages || ptr == 0 || si == nullptr) return -1;
  auto it = g.by_ptr.find(ptr);
  if (it != g.by_ptr.end()) {
    StorageRec& r = g.storages[size_t(it->second)];
    if (!r.weak.expired()) return it->second;   // alive (also: another StorageImpl over the same buffer)
    mark_free(it->second, seq - 1);           // the address was freed and reused
  }
  int32_t sid = int32_t(g.storages.size());
  StorageRec r;
  r.weak = c10::weak_intrusive_ptr<c10::StorageImpl>(
      c10::intrusive_ptr<c10::StorageImpl>::unsafe_reclaim_from_nonowning(const_cast<c10::StorageImpl*>(si)));
  r.ptr = ptr;
  r.meta = meta;
  r.nbytes = nbytes;
  r.alloc_seq = alloc ? seq : -1;
  r.free_seq = -1;
  r.call = int32_t(g.cur_call);
  r.module = int32_t(g.cur_module);
  g.storages.push_back(std::move(r));
  g.by_ptr[ptr] = sid;
  (alloc ? g.young : g.old).push_back(sid);
  return sid;
}

// Tensors among an op's arguments, one level of lists deep. Wrapped numbers (a
// Python scalar the arg parser turned into a 0-d tensor) are scalars to a
// dispatch mode, so they are skipped here too.
inline bool real_tensor(const at::Tensor& t) {
  return t.defined() && !t.unsafeGetTensorImpl()->is_wrapped_number();
}

template <typename F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    if (real_tensor(t)) f(t);
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) {
      if (e.isTensor() && real_tensor(e.toTensor())) f(e.toTensor());
    }
  }
}

// -- non-finite screen -----------------------------------------------------------
template <typename T>
inline bool bad(T x) {
  return !std::isfinite(static_cast<float>(x));
}
inline bool bad(float x) { return !std::isfinite(x); }
inline bool bad(double x) { return !std::isfinite(x); }

// Contiguous runs: an exponent-bits test on the raw integers, counted into a 32-bit accumulator
// per block of 2^20 values: GCC vectorises that loop at -O3 (8x faster than the int64 count at
// -O2 on a 64 KiB weight gradient: 2.2 vs 17.7 us here), so these few functions ask for -O3;
// clang vectorises it at -O2 and ignores the attribute.
#if defined(__GNUC__) && !defined(__clang__)
#define TS_VECTORISE __attribute__((optimize("O3")))
#else
#define TS_VECTORISE
#endif
template <typename U, U kMask, typename Acc = uint32_t>
TS_VECTORISE int64_t count_exp_all_ones(const U* u, int64_t n) {
  int64_t c = 0;
  int64_t i = 0;
  while (i < n) {
    const int64_t e = (n - i) < (int64_t(1) << 20) ? n : i + (int64_t(1) << 20);
    Acc cc = 0;
    for (; i < e; ++i) cc += (u[i] & kMask) == kMask;
    c += cc;
  }
  return c;
}
inline int64_t count_run(const float* p, int64_t n) {
  return count_exp_all_ones<uint32_t, 0x7f800000u>(reinterpret_cast<const uint32_t*>(p), n);
}
inline int64_t count_run(const double* p, int64_t n) {
  return count_exp_all_ones<uint64_t, 0x7ff0000000000000ull, uint64_t>(reinterpret_cast<const uint64_t*>(p), n);
}
inline int64_t count_run(const c10::Half* p, int64_t n) {
  return count_exp_all_ones<uint16_t, 0x7c00u>(reinterpret_cast<const uint16_t*>(p), n);
}
inline int64_t count_run(const c10::BFloat16* p, int64_t n) {
  return count_exp_all_ones<uint16_t, 0x7f80u>(reinterpret_cast<const uint16_t*>(p), n);
}

template <typename T>
int64_t count_strided(const T* base, const int64_t* sz, const int64_t* st, int64_t nd) {
  if (nd == 0) return bad(*base) ? 1 : 0;
  // innermost dim in a tight loop; outer dims by an index vector
  int64_t inner = sz[nd - 1], istr = st[nd - 1];
  int64_t idx[32] = {0};
  int64_t count = 0;
  while (true) {
    int64_t off = 0;
    for (int64_t d = 0; d < nd - 1; ++d) off += idx[d] * st[d];
    const T* p = base + off;
    if (istr == 1) {
      count += count_run(p, inner);
    } else {
      for (int64_t i = 0; i < inner; ++i) count += bad(p[i * istr]) ? 1 : 0;
    }
    int64_t d = nd - 2;
    while (d >= 0) {
      if (++idx[d] < sz[d]) break;
      idx[d] = 0;
      --d;
    }
    if (d < 0) break;
  }
  return count;
}

// -1: not screenable (not a plain float CPU tensor); else the number of NaN/Inf values
int64_t nonfinite_count(const c10::TensorImpl* impl) {
  if (impl->layout() != c10::kStrided || impl->is_nested() || impl->has_symbolic_sizes_strides()) return -1;
  if (!impl->has_storage()) return -1;
  auto st = impl->dtype().toScalarType();
  bool fl = st == c10::kFloat || st == c10::kDouble || st == c10::kHalf || st == c10::kBFloat16 ||
            st == c10::kComplexFloat || st == c10::kComplexDouble;
  if (!fl) return -1;
  auto dt = impl->device().type();
  if (dt == c10::DeviceType::Meta) return -1;     // no data
  if (dt != c10::DeviceType::CPU) return -2;      // device tensors: not screened here (counted, noted)
  int64_t nd = impl->dim();
  if (nd > 30) return -1;
  if (impl->numel() == 0) return 0;
  const c10::StorageImpl* si = impl->unsafe_storage().unsafeGetStorageImpl();
  if (si == nullptr || si->data_ptr().get() == nullptr) return -1;
  const char* data = static_cast<const char*>(si->data_ptr().get());
  int64_t off = impl->storage_offset();
  int64_t sz[32], sd[32];
  auto sizes = impl->sizes();
  auto strides = impl->strides();
  for (int64_t i = 0; i < nd; ++i) {
    sz[i] = sizes[i];
    sd[i] = strides[i];
  }
  // a dense tensor (contiguous, channels_last, a transpose of one...) covers exactly numel
  // elements from its offset, each once: the count does not depend on the order, so one run
  // over that span (a channels_last activation's innermost dim has stride C: element by element
  // it was ~8x slower than the vectorised run)
  if (nd > 1 && (impl->is_contiguous() || impl->is_non_overlapping_and_dense())) {
    sz[0] = impl->numel();
    sd[0] = 1;
    nd = 1;
  }
  switch (st) {
    case c10::kFloat:
      return count_strided(reinterpret_cast<const float*>(data) + off, sz, sd, nd);
    case c10::kDouble:
      return count_strided(reinterpret_cast<const double*>(data) + off, sz, sd, nd);
    case c10::kHalf:
      return count_strided(reinterpret_cast<const c10::Half*>(data) + off, sz, sd, nd);
    case c10::kBFloat16:
      return count_strided(reinterpret_cast<const c10::BFloat16*>(data) + off, sz, sd, nd);
    case c10::kComplexFloat: {
      if (nd == 1 && sd[0] == 1)   // dense: real and imaginary parts side by side, one run
        return count_run(reinterpret_cast<const float*>(data) + 2 * off, 2 * sz[0]) > 0 ? 1 : 0;
      // real and imaginary parts: a complex tensor is a float tensor with a trailing dim of 2
      sz[nd] = 2;
      sd[nd] = 1;
      for (int64_t i = 0; i < nd; ++i) sd[i] *= 2;
      return count_strided(reinterpret_cast<const float*>(data) + 2 * off, sz, sd, nd + 1) > 0 ? 1 : 0;
    }
    case c10::kComplexDouble: {
      if (nd == 1 && sd[0] == 1)
        return count_run(reinterpret_cast<const double*>(data) + 2 * off, 2 * sz[0]) > 0 ? 1 : 0;
      sz[nd] = 2;
      sd[nd] = 1;
      for (int64_t i = 0; i < nd; ++i) sd[i] *= 2;
      return count_strided(reinterpret_cast<const double*>(data) + 2 * off, sz, sd, nd + 1) > 0 ? 1 : 0;
    }
    default:
      return -1;
  }
}

int64_t version_of(const c10::TensorImpl* impl) {
  try {
    if (const_cast<c10::TensorImpl*>(impl)->is_inference()) return -1;
    return int64_t(impl->version_counter().current_version());
  } catch (...) {
    return -1;
  }
}

// -- callbacks -------------------------------------------------------------------
void open_row(ThreadState& s, const at::RecordFunction& fn, const OpFacts* f, int kind, int64_t t_start) {
  if (s.pool.size() <= s.npending) s.pool.emplace_back(new Pending());
  Pending& p = *s.pool[s.npending++];
  p.in_metas.clear();
  p.in_sids.clear();
  p.in_ptrs.clear();
  p.in_impls.clear();
  p.in_nbytes.clear();
  p.args_enc.clear();
  p.held.clear();
  p.py_inputs = nullptr;
  p.pre_nonfinite = false;
  p.handler_pushed = false;
  p.prev_handler = nullptr;
  p.facts = f;
  Row& r = p.row;
  r.op = f->id;
  r.module = int32_t(g.cur_module);
  r.call = int32_t(g.cur_call);
  r.node = int32_t(s.node);
  r.flags = s.node ? int32_t(F_BACKWARD) : 0;
  if (std::hash<std::thread::id>()(std::this_thread::get_id()) != g.owner_thread)
    r.flags |= int32_t(F_OTHER_THREAD);
  r.seq_nr = s.node ? s.node_seq : -1;
  p.seq_peek = at::sequence_number::peek();
  p.uncaught = std::uncaught_exceptions();
  p.args_id = -1;
  if (f->want_args) {
    // tags: 0 tensor(meta) 1 none 2 bool 3 int 4 double(bits) 5 int list 6 other 7 tensor list
    std::vector<int64_t> enc;
    for (const auto& v : args_of(fn, f)) {
      if (v.isTensor() && real_tensor(v.toTensor())) {
        uintptr_t ptr;
        const c10::StorageImpl* si;
        int64_t nb;
        enc.push_back(0);
        enc.push_back(meta_of(v.toTensor(), &ptr, &si, &nb));
      } else if (v.isNone() || (v.isTensor() && !v.toTensor().defined())) {
        enc.push_back(1);
      } else if (v.isBool()) {
        enc.push_back(2);
        enc.push_back(v.toBool());
      } else if (v.isInt()) {
        enc.push_back(3);
        enc.push_back(v.toInt());
      } else if (v.isDouble()) {
        double dv = v.toDouble();
        int64_t bits;
        std::memcpy(&bits, &dv, 8);
        enc.push_back(4);
        enc.push_back(bits);
      } else if (v.isIntList()) {
        auto l = v.toIntVector();
        enc.push_back(5);
        enc.push_back(int64_t(l.size()));
        enc.insert(enc.end(), l.begin(), l.end());
      } else if (v.isBoolList()) {
        auto l = v.toBoolList();
        enc.push_back(8);
        enc.push_back(int64_t(l.size()));
        for (bool b : l) enc.push_back(b);
      } else {
        enc.push_back(6);
      }
    }
    p.args_enc.swap(enc);   // outputs are appended and the whole interned at commit
  }
  for (const auto& v : args_of(fn, f)) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      uintptr_t ptr;
      const c10::StorageImpl* si;
      int64_t nb;
      int32_t m = meta_of(t, &ptr, &si, &nb);
      p.in_metas.push_back(m);
      p.in_ptrs.push_back(ptr);
      // provisional storage id: the seq is only known when the row commits
      // a tentative composite registers its inputs only if it turns out to be a row
      p.in_sids.push_back(kind == 2 ? -1 : storage_id(si, ptr, m, nb, false, g.n_rows));
      if (kind == 2) {
        p.in_impls.push_back(si);
        p.in_nbytes.push_back(nb);
      }
      if (g.want_screen) p.held.push_back(t.unsafeGetTensorImpl());
    });
  }
  if (g.want_screen) {
    // a Python scalar NaN/Inf argument (masked_fill(m, -inf)): the op did not produce it
    for (const auto& v : args_of(fn, f)) {
      if (v.isDouble() && !std::isfinite(v.toDouble())) p.pre_nonfinite = true;
      if (v.isComplexDouble()) {
        auto c = v.toComplexDouble();
        if (!std::isfinite(c.real()) || !std::isfinite(c.imag())) p.pre_nonfinite = true;
      }
      if (v.isTensor() && v.toTensor().defined() && v.toTensor().unsafeGetTensorImpl()->is_wrapped_number() &&
          nonfinite_count(v.toTensor().unsafeGetTensorImpl()) > 0)
        p.pre_nonfinite = true;
    }
  }
  if (g.want_screen && f->writes && !f->no_screen) {
    // in-place / out=: whether what the op overwrites was already non-finite
    for (const c10::TensorImpl* t : p.held) {
      auto it = g.memo.find(t);
      int64_t v = version_of(t);
      if (it != g.memo.end() && v >= 0 && it->second.first == v) {
        if (!it->second.second) p.pre_nonfinite = true;
      } else {
        int64_t c = nonfinite_count(t);
        if (c >= 0) g.n_pre++;
        if (c > 0) p.pre_nonfinite = true;
      }
    }
  }
  r.start = t_start;
  s.frames.push_back(Frame{kind, int64_t(s.npending - 1), f, g.gen});
  s.kept_depth++;
  // per-op warnings: a handler that records and chains to the current one
  if (g.want_warnings) {
    size_t d = s.npending - 1;
    while (s.handlers.size() <= d) s.handlers.emplace_back(new RowWarningHandler());
    RowWarningHandler& h = *s.handlers[d];
    h.eng = &g;
    h.seq = -1;   // set at commit; warnings before that carry the pending row's future seq
    h.prev = c10::WarningUtils::get_warning_handler();
    c10::WarningUtils::set_warning_handler(&h);
    p.prev_handler = h.prev;
    p.handler_pushed = true;
  }
  p.row.start = now_ns();   // after the probes: cpu_ns is the op's own time
}

// under g.mu
void push_node(ThreadState& s, const char* name_c, int64_t sn) {
  std::string name = name_c ? name_c : "?";
  auto it = g.node_ids.find(name);
  int64_t nid;
  if (it == g.node_ids.end()) {
    nid = int64_t(g.node_names.size()) + 1;
    g.node_ids.emplace(name, int32_t(nid));
    g.node_names.push_back(name);
  } else {
    nid = it->second;
  }
  s.node_stack.emplace_back(s.node, s.node_seq);
  s.node = nid;
  s.node_seq = (sn < 0 || sn >= (int64_t(1) << 62)) ? -1 : sn;
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

// functorch (vmap, grad, jvp, jacrev...): an event whose dispatch reaches one of functorch's keys is
// an op on wrapped (batched, grad-wrapped) tensors at a transform's level. The interpreter or the
// batching rule re-issues what really runs (unwrapped tensors, physical shapes) as events of their
// own, which become the rows; a Python dispatch mode, below those keys, sees only those.
const c10::DispatchKeySet kFuncTorchKeys{c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
                                         c10::DispatchKey::FuncTorchDynamicLayerBackMode,
                                         c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::BatchedNestedTensor,
                                         c10::DispatchKey::FuncTorchGradWrapper};

bool functorch_level(const at::RecordFunction& fn, const OpFacts* f) {
  const auto tl = c10::impl::tls_local_dispatch_key_set();
  if (!((tl.included_ - tl.excluded_) & kFuncTorchKeys).empty()) return true;
  c10::DispatchKeySet ks;
  for (const auto& v : args_of(fn, f)) {
    if (v.isTensor()) {
      const auto& t = v.toTensor();
      if (t.defined()) ks = ks | t.key_set();
    } else if (v.isList()) {
      for (const auto& e : v.toListRef()) {
        if (e.isTensor() && e.toTensor().defined()) ks = ks | e.toTensor().key_set();
      }
    }
  }
  return !((ks - tl.excluded_) & kFuncTorchKeys).empty();
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (!g.active) return nullptr;
  try {
    ThreadState& s = ts();
    auto scope = fn.scope();
    if (scope == at::RecordScope::BACKWARD_FUNCTION) {
      std::lock_guard<std::mutex> lk(g.mu);
      push_node(s, fn.name(), fn.seqNr());
      s.frames.push_back(Frame{3, -1, nullptr, g.gen});
      return nullptr;
    }
    // torch.compile compiling: what Dynamo runs to compile is not the program's work
    if (g.paused.load(std::memory_order_relaxed) > 0) {
      s.frames.push_back(Frame{4, -1, nullptr, g.gen});
      return nullptr;
    }
    // C++ that excluded the Python key (Tensor._make_subclass's detach, no_dispatch()) runs
    // ops no dispatch mode can see: they are the binding's internals, not the program's ops
    if (c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Python)) {
      s.frames.push_back(Frame{4, -1, nullptr, g.gen});
      return nullptr;
    }
    // inside a kept op: its children are hidden (unless it is a tentative CIA op)
    if (!s.frames.empty()) {
      // find the innermost kept/tentative frame
      for (size_t i = s.frames.size(); i-- > 0;) {
        int k = s.frames[i].kind;
        if (k == 1 || k == 4) {
          s.frames.push_back(Frame{4, -1, nullptr, g.gen});
          return nullptr;
        }
        if (k == 2) break;
        if (k == 3) break;
      }
    }
    std::unique_lock<std::mutex> lk(g.mu);
    const OpFacts* f = facts_for(fn);
    if (f == nullptr) {
      // autograd's evaluate_function event encloses the node's apply and the engine's
      // output validation (sum_to/view): ops there belong to the node, as a dispatch
      // mode sees them (_current_autograd_node() is set for all of it)
      const char* nm = fn.name();
      static const char kEval[] = "autograd::engine::evaluate_function: ";
      if (nm != nullptr && std::strncmp(nm, kEval, sizeof(kEval) - 1) == 0) {
        push_node(s, nm + sizeof(kEval) - 1, fn.seqNr());
        s.frames.push_back(Frame{3, -1, nullptr, g.gen});
        return nullptr;
      }
      s.frames.push_back(Frame{0, -1, nullptr, g.gen});
      return nullptr;
    }
    if (functorch_level(fn, f)) {   // a transform's logical op: transparent, the physical ops inside are rows
      s.frames.push_back(Frame{0, -1, nullptr, g.gen});
      return nullptr;
    }
    // a tentative CIA parent with a child: it decomposed, so it is transparent
    for (size_t i = s.frames.size(); i-- > 0;) {
      Frame& fr = s.frames[i];
      if (fr.kind == 2) {
        Pending& p = *s.pool[size_t(fr.row)];
        if (p.handler_pushed) {
          c10::WarningUtils::set_warning_handler(p.prev_handler);
          p.handler_pushed = false;
        }
        fr.kind = 0;
        fr.row = -1;
        s.npending--;   // it is always the last pending row
        s.kept_depth--;
        break;
      }
      if (fr.kind == 3 || fr.kind == 1) break;
    }
    int64_t t = now_ns();
    open_row(s, fn, f, f->cia ? 2 : 1, t);
    lk.unlock();
    if (f->py_hook) hook_inputs(*s.pool[s.npending - 1], fn);   // after the lock: it takes the GIL
  } catch (...) {
  }
  return nullptr;
}

// under g.mu: the live block becomes a packed chunk
void seal_block() {
  if (g.block.empty()) return;
  g.chunks.push_back(pack_block(g.block, g.block_stor, g.block_first));
  g.chunk_bytes += int64_t(g.chunks.back().nbytes());
  g.chunk_rows += int64_t(g.block.size());
  if (g.on_full != nullptr && g.chunk_rows > g.spill_rows) g.handover_due = true;
  g.block_first += int64_t(g.block.size());
  g.block.clear();
  g.block_stor.clear();
}

// The hooks library's tensorscope_read_site (set_site_reader): the source location of the newest
// c10::Error alive on this thread constructed since a time, read while the kernel's exception unwinds.
using ReadSite = int (*)(int64_t, const char**, const char**, uint32_t*);
std::atomic<ReadSite> g_read_site{nullptr};

void note_error_site(int64_t since) {
  // under g.mu, only for a row whose kernel threw
  g.last_error_line = -1;
  ReadSite rs = g_read_site.load(std::memory_order_acquire);
  const char* file = nullptr;
  const char* func = nullptr;
  uint32_t line = 0;
  if (rs == nullptr || rs(since, &file, &func, &line) == 0 || file == nullptr) return;
  try {
    g.last_error_file = file;
    g.last_error_func = func != nullptr ? func : "";
    g.last_error_line = int64_t(line);
  } catch (...) {
    g.last_error_line = -1;
  }
}

void commit(ThreadState& s, Pending& p, const at::RecordFunction& fn, int64_t t_end) {
  // under g.mu
  Row& r = p.row;
  int64_t seq = g.n_rows;
  r.dur = t_end - r.start;
  r.start -= g.t0;
  if (std::uncaught_exceptions() > p.uncaught) {
    r.flags |= int32_t(F_THREW);
    g.last_error_seq = seq;
    g.last_error_op = r.op;
    note_error_site(t_end - r.dur);
  }
  // forward: the op claims the newest autograd node when the sequence counter advanced since this
  // thread's previous row (the python engine's rule: a node created between two ops, by a custom
  // autograd.Function or torch.compile's CompiledFunction, belongs to the op that follows it)
  const uint64_t now = at::sequence_number::peek();
  const uint64_t mark = s.seq_mark_epoch == int64_t(g.gen) ? s.seq_mark
                       : (r.flags & F_OTHER_THREAD) ? p.seq_peek : g.seq_at_start;
  if (!(r.flags & F_BACKWARD)) {
    r.seq_nr = now > mark ? int64_t(now - 1) : -1;
  }
  s.seq_mark = now;
  s.seq_mark_epoch = int64_t(g.gen);
  // storage sweep: frees since the last row are dated to the row before this one
  if (g.want_storages) {
    sweep_list(g.young, g.young_rr, 32, seq - 1);
    sweep_list(g.old, g.old_rr, 4, seq - 1);
  }
  if (g.block.size() >= g.block_rows) seal_block();
  if (g.block.capacity() == 0) {
    g.block.reserve(g.block_rows);
    g.block_stor.reserve(g.block_rows * 3);
  }
  auto& stor = g.block_stor;
  int32_t n_stor = 0;
  if (!p.in_impls.empty()) {
    for (size_t i = 0; i < p.in_sids.size(); ++i) {
      p.in_sids[i] = storage_id(p.in_impls[i], p.in_ptrs[i], int32_t(p.in_metas[i]), p.in_nbytes[i], false, seq);
    }
  }
  for (size_t i = 0; i < p.in_sids.size(); ++i) {
    stor.push_back(int32_t(p.in_sids[i]));
    n_stor++;
  }
  r.ins = g.tuples.get(p.in_metas.data(), p.in_metas.size());
  int64_t out_metas[64];
  int64_t alias[64];
  size_t n_out = 0;
  int64_t count = 0;
  bool screened_any = false;
  bool device_out = false;
  const auto outs = rets_of(fn, p.facts);
  for (const auto& v : outs) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (n_out >= 64) return;
      uintptr_t ptr;
      const c10::StorageImpl* si;
      int64_t nb;
      int32_t m = meta_of(t, &ptr, &si, &nb);
      out_metas[n_out] = m;
      int64_t a = -1;
      if (ptr) {
        for (size_t i = 0; i < p.in_ptrs.size(); ++i) {
          if (p.in_ptrs[i] == ptr) {
            a = int64_t(i);
            break;
          }
        }
      }
      alias[n_out] = a;
      stor.push_back(storage_id(si, ptr, m, nb, true, seq));
      n_stor++;
      n_out++;
      if (g.want_screen && !p.facts->no_screen && (a < 0 || p.facts->writes)) {
        int64_t c = nonfinite_count(t.unsafeGetTensorImpl());
        if (c == -2) {
          device_out = true;
        } else if (c >= 0) {
          screened_any = true;
          g.n_screened++;
          count += c;
          int64_t ver = version_of(t.unsafeGetTensorImpl());
          if (ver >= 0) {
            if (g.memo.size() > 4096) g.memo.clear();
            g.memo[t.unsafeGetTensorImpl()] = {ver, c == 0};
          }
        }
      }
    });
  }
  if (device_out) g.n_unscreened_device++;
  r.outs = g.tuples.get(out_metas, n_out);
  r.alias = g.aliases.get(alias, n_out);
  (void)n_stor;
  if (p.facts->want_args) {
    // outputs in schema order, undefined ones as None (conv backward's output_mask)
    auto& enc = p.args_enc;
    enc.push_back(9);
    size_t k = 0;
    for (const auto& v : outs) {
      if (v.isTensor()) {
        const auto& t = v.toTensor();
        if (real_tensor(t) && k < n_out) {
          enc.push_back(0);
          enc.push_back(out_metas[k++]);
        } else {
          enc.push_back(1);
        }
      }
    }
    p.args_id = g.args.get(enc.data(), enc.size());
    g.row_args.push_back(seq);
    g.row_args.push_back(p.args_id);
  }
  if (screened_any && count > 0) {
    g.n_fired++;
    bool inputs_bad = p.pre_nonfinite;
    if (!inputs_bad) {
      for (const c10::TensorImpl* t : p.held) {
        bool written = false;
        if (p.facts->writes) {
          // the written target's before-state is pre_nonfinite
          for (const auto& v : outs) {
            for_each_tensor(v, [&](const at::Tensor& o) {
              if (o.unsafeGetTensorImpl() == t) written = true;
            });
          }
        }
        if (written) continue;
        if (nonfinite_count(t) > 0) {
          inputs_bad = true;
          break;
        }
      }
    }
    g.nonfinite.push_back({seq, {count, inputs_bad ? 0 : 1}});
  }
  if (r.flags & F_OTHER_THREAD) g.other_thread_rows++;
  g.block.push_back(r);
  g.n_rows = seq + 1;
  // the row's warnings: they were recorded with seq -1 while it ran
  for (size_t i = g.warnings.size(); i-- > g.warnings_taken;) {
    if (g.warnings[i].seq != -1) break;
    g.warnings[i].seq = seq;
  }
}

void drop_py_inputs(Pending& p) {
  if (p.py_inputs == nullptr) return;
  PyGILState_STATE st = PyGILState_Ensure();
  Py_CLEAR(p.py_inputs);
  PyGILState_Release(st);
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
  PyGILState_Release(st);
}

// The packed chunks passed spill_rows: hand them to Python now (engines.py writes them to disk,
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

void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  int64_t t_end = now_ns();
  ThreadState* sp = tls;
  if (sp == nullptr || sp->frames.empty()) return;
  ThreadState& s = *sp;
  try {
    Frame fr = s.frames.back();
    s.frames.pop_back();
    if (fr.kind == 3) {
      if (!s.node_stack.empty()) {
        int64_t inner = s.node, inner_seq = s.node_seq;
        s.node = s.node_stack.back().first;
        s.node_seq = s.node_stack.back().second;
        s.node_stack.pop_back();
        // evaluate_function carries no sequence number: take its node's
        if (s.node == inner && s.node_seq < 0) s.node_seq = inner_seq;
      }
      return;
    }
    if (fr.kind != 1 && fr.kind != 2) return;
    Pending& p = *s.pool[size_t(fr.row)];
    s.npending--;   // reused by the next row only after this one is committed
    s.kept_depth--;
    if (p.handler_pushed) c10::WarningUtils::set_warning_handler(p.prev_handler);
    if (fr.gen != g.gen || !g.active) {
      drop_py_inputs(p);
      return;
    }
    if (fr.kind == 2 && !p.facts->backend) {   // a childless composite eager ran as a decomposition
      drop_py_inputs(p);
      return;
    }
    int64_t seq;
    {
      std::lock_guard<std::mutex> lk(g.mu);
      commit(s, p, fn, t_end);
      seq = g.n_rows - 1;
    }
    if (p.py_inputs != nullptr) call_hook(p, fn, seq);
    if (C10_UNLIKELY(g.handover_due) && !(p.row.flags & (F_THREW | F_OTHER_THREAD))) call_on_full();
  } catch (...) {
  }
}

// ---------------------------------------------------------------------------
// Python API
// ---------------------------------------------------------------------------
PyObject* py_start(PyObject*, PyObject* args) {
  long long t0;
  int screen, storages, warnings;
  PyObject* arg_ops = nullptr;
  PyObject* hook = Py_None;
  PyObject* hook_ns = Py_None;
  long long spill_rows = -1;
  PyObject* on_full = Py_None;
  long long block_rows = int64_t(kBlockRows);
  if (!PyArg_ParseTuple(args, "Lppp|OOOLOL", &t0, &screen, &storages, &warnings, &arg_ops, &hook, &hook_ns,
                        &spill_rows, &on_full, &block_rows))
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
    if (on_full != Py_None) {
      Py_INCREF(on_full);
      g.on_full = on_full;
    }
    g.cur_module = 0;
    g.cur_call = -1;
    g.paused.store(0);
    g.owner_thread = std::hash<std::thread::id>()(std::this_thread::get_id());
    ThreadState& s = ts();
    s.frames.clear();
    s.npending = 0;
    s.node = 0;
    s.node_seq = -1;
    s.node_stack.clear();
    s.kept_depth = 0;
    // thread-local: autograd's worker threads inherit it with the rest of the
    // ThreadLocalState; other Python threads are not recorded (said in the summary)
    g.handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_start, &on_end)
            .needsInputs(true)
            .needsOutputs(true)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
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
    ThreadState& s = ts();
    // restore any handler a row left pushed (an op still running when the trace stops)
    Py_CLEAR(g.hook);
    Py_CLEAR(g.on_full);
    for (size_t i = s.npending; i-- > 0;) {
      Py_CLEAR(s.pool[i]->py_inputs);
      if (s.pool[i]->handler_pushed) c10::WarningUtils::set_warning_handler(s.pool[i]->prev_handler);
    }
    s.npending = 0;
    s.frames.clear();
    s.node_stack.clear();
    s.node = 0;
    s.kept_depth = 0;
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
  ReadSite rs = nullptr;
  if (o != Py_None) {
    void* ptr = PyCapsule_GetPointer(o, "tensorscope.site_reader");
    if (ptr == nullptr) return nullptr;
    rs = reinterpret_cast<ReadSite>(ptr);
  }
  g_read_site.store(rs, std::memory_order_release);
  Py_RETURN_NONE;
}

PyObject* bytes_of(const void* p, size_t n) {
  return PyBytes_FromStringAndSize(static_cast<const char*>(p), Py_ssize_t(n));
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
  g.nonfinite_taken = g.nonfinite.size();
  put("nonfinite", bytes_of(nf.data(), nf.size() * 8));
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

// take_chunks(final): (chunks, dictionaries delta); final also packs the live block
PyObject* py_take_chunks(PyObject*, PyObject* final_o) {
  std::lock_guard<std::mutex> lk(g.mu);
  if (PyObject_IsTrue(final_o)) seal_block();
  PyObject* ch = chunks_out();
  return Py_BuildValue("(NN)", ch, dicts_delta());
}

PyObject* py_resident(PyObject*, PyObject*) {
  // bytes the engine holds for the ops rows (packed chunks + the live block) and for storages
  std::lock_guard<std::mutex> lk(g.mu);
  int64_t rows = g.chunk_bytes + int64_t(g.block.capacity() * sizeof(Row) + g.block_stor.capacity() * 4);
  int64_t st = int64_t(g.storages.size() * sizeof(StorageRec));
  int64_t interned = int64_t((g.metas.arena.capacity() + g.tuples.arena.capacity() + g.aliases.arena.capacity()) * 8);
  return Py_BuildValue("{s:L,s:L,s:L,s:L}", "rows", (long long)rows, "storages", (long long)st, "interned",
                       (long long)interned, "n_rows", (long long)g.n_rows);
}

// The rest of what was recorded (storages, screen, counters), once at the end; the rows and
// dictionaries come through take_chunks(True) before.
PyObject* py_take(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> lk(g.mu);
  // final sweep: every storage freed by now
  int64_t last = g.n_rows - 1;
  sweep_list(g.young, g.young_rr, size_t(-1) / 2, last);
  sweep_list(g.old, g.old_rr, size_t(-1) / 2, last);
  size_t ns = g.storages.size();
  std::vector<int64_t> st(ns * 7);
  for (size_t i = 0; i < ns; ++i) {
    const StorageRec& r = g.storages[i];
    int64_t* o = &st[i * 7];
    o[0] = r.meta;
    o[1] = r.nbytes;
    o[2] = r.alloc_seq;
    o[3] = r.free_seq;
    o[4] = r.module;
    o[5] = r.call;
    o[6] = int64_t(r.ptr);
  }
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
  PyObject* screen = Py_BuildValue("{s:L,s:L,s:L,s:L}", "screened", (long long)g.n_screened, "fired",
                                   (long long)g.n_fired, "pre_screened", (long long)g.n_pre, "device_unscreened",
                                   (long long)g.n_unscreened_device);
  put("screen", screen);
  return d;
}

// ---------------------------------------------------------------------------
// Table building (recording/build.py): list columns as Arrow offsets + values
// ---------------------------------------------------------------------------
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

// (storage id, torch.UntypedStorage) of the storages the trace created that are alive now
PyObject* py_live_created(PyObject*, PyObject*) {
  std::vector<std::pair<int32_t, c10::intrusive_ptr<c10::StorageImpl>>> live;
  {
    std::lock_guard<std::mutex> lk(g.mu);
    for (int32_t sid : g.young) {
      auto strong = g.storages[size_t(sid)].weak.lock();
      if (strong) live.emplace_back(sid, std::move(strong));
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

// ---------------------------------------------------------------------------
// function mode (owner: fnmode): the state native/fmode.cpp reads and writes per torch-level call,
// exported once as a capsule so the C function mode sets the call/module ids and reads seq without
// a Python round trip. Keep in sync with EngineShared in fmode.cpp (bump abi on any change).
// ---------------------------------------------------------------------------
int fmode_warnings_pending() {
  return g.n_warnings.load(std::memory_order_acquire) != g.warnings_taken;
}
struct FmodeShared {
  int abi;
  int64_t* cur_call;
  int64_t* cur_module;
  int64_t* n_rows;
  int (*warnings_pending)();
};
FmodeShared fmode_shared{1, &g.cur_call, &g.cur_module, &g.n_rows, &fmode_warnings_pending};
// --- end of the function mode section ---------------------------------------

PyMethodDef methods[] = {
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
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "tensorscope_engine", "tensorscope native recording engine", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit_tensorscope_engine() {
  PyObject* m = PyModule_Create(&moddef);
  if (m == nullptr) return nullptr;
  PyModule_AddIntConstant(m, "F_BACKWARD", F_BACKWARD);
  PyModule_AddIntConstant(m, "F_THREW", F_THREW);
  PyModule_AddIntConstant(m, "F_OTHER_THREAD", F_OTHER_THREAD);
  PyModule_AddIntConstant(m, "ROW_SIZE", sizeof(Row));
  PyModule_AddObject(m, "fmode_state", PyCapsule_New(&fmode_shared, "tensorscope_engine.fmode_state", nullptr));  // fnmode
  PyModule_AddIntConstant(m, "BLOCK_ROWS", kBlockRows);
  PyModule_AddIntConstant(m, "PACKED_COLUMNS", PC_N);
  return m;
}
