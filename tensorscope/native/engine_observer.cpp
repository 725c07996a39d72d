// tensorscope native recording engine: the RecordFunction callbacks (the hot path).
//
// Per event:
//   * start callback (inputs valid here): decide visibility, intern the op,
//     the input metas (sizes, strides, dtype, device), storage ids; timestamp.
//   * end callback (outputs valid here): timestamp first (so cpu_ns excludes
//     the probes), then outputs, alias indexes, seq_nr claim, warnings, the
//     non-finite screen.
// Visibility (docs/architecture.md, recording engines): a row is an op a Python dispatch mode would
// see, i.e. an event whose dispatch reaches the Python key. A schema event is kept when no kept
// event encloses it, or when the kept event enclosing it is still above the Python key: inside its
// autocast kernel (the casts, and the op re-issued on them: the outer event is then a shell, not a
// row) or inside its autograd kernel before that redispatches below autograd (the clone an in-place
// op saves). Below that (the kernel's own internals) events are hidden. Which level an event starts
// at is read from the thread's excluded dispatch keys, against those when the kept event started.
// A CompositeImplicitAutograd op is transparent once it has a child (eager decomposed it) and
// dropped if it ends childless without a backend kernel; string events
// (autograd::engine::evaluate_function...) are transparent; BACKWARD_FUNCTION events name the
// autograd node and carry its sequence number for every op inside.
//
// No Python object is touched here except through engine_ops.cpp's op hook and spill hand-over
// (which take the GIL), so the callbacks are safe on threads without the GIL; the shared state is
// behind g.mu (uncontended on the recording thread). The thread-local state stays in this file.

#include <ATen/SequenceNumber.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cmath>
#include <exception>
#include <memory>
#include <thread>

#include "engine.h"
#include "engine_known.h"
#include "engine_screen.h"
#include "engine_storages.h"

namespace tsengine TS_HIDDEN {
namespace {

struct Frame {
  int kind;          // 0 transparent, 1 kept row, 2 tentative CIA, 3 backward node, 4 hidden (inside kept)
  int64_t row;       // kept/tentative: index into pending rows
  const OpFacts* facts;
  uint64_t gen;
  uint64_t excluded = 0;   // kept/tentative: the thread's excluded dispatch keys when it started (raw)
  bool autograd = false;   // kept/tentative: its dispatch runs its autograd kernel
};

// Whether an event starting now, inside kept row `fr`, is an op of its own to a dispatch mode: it
// starts above the Python key. Autocast kernels exclude their key and call the op anew (casts first);
// autograd kernels call ops (the clone an in-place op saves) before they exclude autograd and
// redispatch; the kernel below runs with autograd excluded.
inline bool above_python(const Frame& fr) {
  const c10::DispatchKeySet now = c10::impl::tls_local_dispatch_key_set().excluded_;
  const c10::DispatchKeySet added = now - c10::DispatchKeySet(c10::DispatchKeySet::RAW, fr.excluded);
  if (!(added & c10::autocast_dispatch_keyset).empty()) return true;
  if (!(added & c10::autograd_dispatch_keyset).empty()) return false;
  return fr.autograd;
}

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
  uint32_t tick = 0;              // start callbacks so far: every kOwnSample-th times its own work
};
// one start callback in this many times the callbacks' own work (two clock reads more, 1/16 of the time)
constexpr uint32_t kOwnSample = 16;

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

// -- callbacks -------------------------------------------------------------------
void open_row(ThreadState& s, const at::RecordFunction& fn, const OpFacts* f, int kind, int64_t t_start) {
  if (s.pool.size() <= s.npending) s.pool.emplace_back(new Pending());
  Pending& p = *s.pool[s.npending++];
  p.in_metas.clear();
  p.in_sids.clear();
  p.in_slots.clear();
  p.in_ptrs.clear();
  p.in_impls.clear();
  p.in_nbytes.clear();
  p.args_enc.clear();
  p.held.clear();
  p.py_inputs = nullptr;
  p.pre_nonfinite = false;
  p.shell = false;
  p.written.clear();
  p.bound = -1;
  if (!p.pre_k.empty()) pre_drop(p);
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
  if (f->want_args) encode_args(fn, f, p.args_enc);   // outputs are appended and the whole interned at commit
  const Values args = args_of(fn, f);
  c10::DispatchKeySet keys;
  for (size_t ai = 0; ai < args.size(); ++ai) {
    const bool written = f->writes && (f->arg_writes.size() != args.size() || f->arg_writes[ai]);
    for_each_tensor(args[ai], [&](const at::Tensor& t) {
      keys = keys | t.key_set();
      uintptr_t ptr;
      const c10::StorageImpl* si;
      int64_t nb;
      int32_t m = meta_of(t, &ptr, &si, &nb);
      p.in_metas.push_back(m);
      p.in_ptrs.push_back(ptr);
      // provisional storage id: the seq is only known when the row commits
      // a tentative composite registers its inputs only if it turns out to be a row
      p.in_sids.push_back(kind == 2 ? -1 : storage_id(si, ptr, m, nb, false, g.n_rows));
      p.in_slots.push_back(kind == 2 ? -1 : g.last_slot);
      if (kind == 2) {
        p.in_impls.push_back(si);
        p.in_nbytes.push_back(nb);
      }
      if (g.want_screen) p.held.push_back(t.unsafeGetTensorImpl());
      if (written && g.want_screen) p.written.push_back(si);
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
    for (size_t k = 0; k < p.held.size(); ++k) {
      const c10::TensorImpl* t = p.held[k];
      const Known* kn = known(t, int32_t(p.in_metas[k]));
      if (kn != nullptr) {
        if (!kn->finite) p.pre_nonfinite = true;
      } else {
        int64_t c = screen_and_learn(t, int32_t(p.in_metas[k]));
        if (c >= 0) g.n_pre++;
        if (c > 0) p.pre_nonfinite = true;
      }
    }
  }
  // a bound on what the op can write, from what is known of its inputs (engine_known.h)
  if (g.want_screen && f->rule != BR_NONE && !f->no_screen) {
    p.bound = input_bound(fn, f, p.in_metas, &p.terms);
  }
  // capture=: what the op will overwrite, copied before it runs (engine_ops.cpp)
  if (C10_UNLIKELY(f->pre_copy)) pre_copy(p, fn, f);
  for (const c10::StorageImpl* si : p.written) bump(si);   // again at commit: an op that throws still wrote
  r.start = t_start;
  {
    const auto tl = c10::impl::tls_local_dispatch_key_set();
    const bool ag = f->autograd && !(((keys | tl.included_) - tl.excluded_) & c10::autograd_dispatch_keyset).empty();
    s.frames.push_back(Frame{kind, int64_t(s.npending - 1), f, g.gen, tl.excluded_.raw_repr(), ag});
  }
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
    const int64_t t_in = C10_UNLIKELY(++s.tick % kOwnSample == 0) ? now_ns() : 0;
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
    // inside a kept op: its kernel's children are hidden, those of its autocast/autograd kernels are
    // rows (above_python); inside a tentative CIA op: a child (it decomposed)
    int64_t parent = -1;   // the kept row this event is an op of its own inside
    if (!s.frames.empty()) {
      // find the innermost kept/tentative frame
      for (size_t i = s.frames.size(); i-- > 0;) {
        const Frame& fr = s.frames[i];
        int k = fr.kind;
        if (k == 4 || (k == 1 && !above_python(fr))) {
          s.frames.push_back(Frame{4, -1, nullptr, g.gen});
          return nullptr;
        }
        if (k == 1) {
          parent = fr.row;
          break;
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
    // autocast re-issues the op on the cast inputs: the outer event never reaches the Python key
    if (parent >= 0 && s.pool[size_t(parent)]->facts == f) s.pool[size_t(parent)]->shell = true;
    // a tentative CIA parent with a child: it decomposed, so it is transparent
    PyObject* stale = nullptr;   // its op hook's inputs: released after the lock (the GIL comes first)
    for (size_t i = s.frames.size(); i-- > 0;) {
      Frame& fr = s.frames[i];
      if (fr.kind == 2) {
        Pending& p = *s.pool[size_t(fr.row)];
        stale = p.py_inputs;
        p.py_inputs = nullptr;
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
    Pending& opened = *s.pool[s.npending - 1];
    opened.own_pre = t_in ? opened.row.start - t_in : -1;
    lk.unlock();
    if (stale != nullptr) {
      PyGILState_STATE st = PyGILState_Ensure();
      Py_DECREF(stale);
      PyGILState_Release(st);
    }
    if (f->py_hook) hook_inputs(*s.pool[s.npending - 1], fn);   // after the lock: it takes the GIL
  } catch (...) {
  }
  return nullptr;
}

// under g.mu, only for a row whose kernel threw: the hooks' reader gives its c10 source location
void note_error_site(int64_t since) {
  g.last_error_line = -1;
  tsabi::ReadSite rs = g_read_site.load(std::memory_order_acquire);
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
    sweep_recent(seq - 1);
    sweep_list(g.young, g.young_rr, 32, seq - 1, 256);
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
      p.in_slots[i] = g.last_slot;
    }
  }
  for (size_t i = 0; i < p.in_sids.size(); ++i) {
    stor.push_back(int32_t(p.in_sids[i]));
    note_recent(p.in_slots[i]);
    n_stor++;
  }
  r.ins = g.tuples.get(p.in_metas.data(), p.in_metas.size());
  if (g.want_screen) {
    for (const c10::StorageImpl* si : p.written) bump(si);
  }
  int64_t out_metas[64];
  int64_t alias[64];
  size_t n_out = 0;
  int64_t count = 0;
  bool screened_any = false;
  bool device_out = false;
  bool fp_done = false;
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
      note_recent(g.last_slot);
      n_stor++;
      n_out++;
      FpRec fr{seq, 0, 0, 0, 0, 0};   // the first fresh or written float output (engine_screen.h)
      bool fp_here = false;
      if (g.want_fp && !fp_done && !p.facts->no_screen && (a < 0 || p.facts->writes)) {
        if ((fp_done = fp_here = fingerprint(t.unsafeGetTensorImpl(), &fr))) g.fingerprints.push_back(fr);
      }
      if (!g.want_screen) return;
      const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      if (a < 0) bump(si);   // new memory: what was known of its address is stale (written ones: p.written)
      if (!p.facts->no_screen && (a < 0 || p.facts->writes)) {
        if (p.bound >= 0 && impl->device().type() == c10::DeviceType::CPU &&
            proves(p.facts, p.bound, p.terms, impl->dtype().toScalarType())) {
          g.n_proven++;   // finite by its inputs' bound: not read
          learn(impl, m, true, p.bound);
          return;
        }
        int64_t c = fp_here ? learn_from_fingerprint(impl, m, fr) : screen_and_learn(impl, m);
        if (c == -2) {
          device_out = true;
        } else if (c >= 0) {
          screened_any = true;
          g.n_screened++;
          count += c;
        } else {
          forget(impl);
        }
      } else {
        forget(impl);   // a view, or uninitialised memory: nothing known
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
    enc.push_back(tsabi::TAG_OUTPUTS);
    size_t k = 0;
    for (const auto& v : outs) {
      if (v.isTensor()) {
        const auto& t = v.toTensor();
        if (real_tensor(t) && k < n_out) {
          enc.push_back(tsabi::TAG_TENSOR);
          enc.push_back(out_metas[k++]);
        } else {
          enc.push_back(tsabi::TAG_NONE);
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
    const int64_t own_pre = p.own_pre;   // read now: the op hook below may reuse the slot
    s.npending--;   // reused by the next row only after this one is committed
    s.kept_depth--;
    if (p.handler_pushed) c10::WarningUtils::set_warning_handler(p.prev_handler);
    if (fr.gen != g.gen || !g.active) {
      drop_py_inputs(p);
      return;
    }
    if ((fr.kind == 2 && !p.facts->backend) || p.shell) {   // a childless composite eager ran as a
      drop_py_inputs(p);                                    // decomposition; an op autocast re-issued
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
    // a row inside another (the clone an in-place op's autograd kernel saves): the enclosing op's
    // own time starts after it, as a dispatch mode times it
    if (s.npending > 0) s.pool[s.npending - 1]->row.start = now_ns();
    if (own_pre >= 0) {   // a sampled row: its callbacks' time outside the op
      g.own_ns.fetch_add(own_pre + (now_ns() - t_end), std::memory_order_relaxed);
      g.own_rows.fetch_add(1, std::memory_order_relaxed);
    }
  } catch (...) {
  }
}
}  // namespace

void observer_install() {
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
}

void observer_remove_thread_state() {
  ThreadState& s = ts();
  // restore any handler a row left pushed (an op still running when the trace stops)
  for (size_t i = s.npending; i-- > 0;) {
    Py_CLEAR(s.pool[i]->py_inputs);
    if (s.pool[i]->handler_pushed) c10::WarningUtils::set_warning_handler(s.pool[i]->prev_handler);
  }
  for (auto& q : s.pool) {   // capture='s copies end with the trace
    pre_drop(*q);
    q->pre_buf.reset();
    q->pre_cap = 0;
  }
  s.npending = 0;
  s.frames.clear();
  s.node_stack.clear();
  s.node = 0;
  s.kept_depth = 0;
}

}  // namespace tsengine
