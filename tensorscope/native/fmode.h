// tensorscope native function mode: the state its translation units share.
//
//   fmode.cpp        __torch_function__ (the hot path, per torch-level call) and the module
//   fmode_state.cpp  configure/take, the calls blocks (packed once full), caches, contained errors
//   fmode_frames.h   the frame walks: user source line, module path, trampoline (inline: per call)
//   abi.h            the calls row, the call kinds, the engine's shared state (FmodeState)
//
// Python.h only (no torch header): the mode talks to the engine through abi.h's FmodeState.

#pragma once

#include <Python.h>

#include <cstdint>
#include <cstring>
#include <ctime>
#include <unordered_map>
#include <utility>
#include <vector>

#include "abi.h"

namespace tsfmode TS_HIDDEN {

using tsabi::CallRow;
using tsabi::CM_N;

// One calls row per recorded call (abi.h CallRow), kBlock rows a block.
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
constexpr uint32_t kOwnSample = 16;   // State::own_ns: one recorded call in this many times the mode's own work
constexpr int kFields = CM_N;   // CallRow's members in order, pad included (abi.h CallMember)
struct Block {
  CallRow* rows = nullptr;
  int64_t base[kFields] = {};
  uint8_t width[kFields] = {};
  uint8_t* data[kFields] = {};
};

inline int64_t get_field(const CallRow& r, int k) {
  using namespace tsabi;
  switch (k) {
    case CM_FUNC: return r.func;
    case CM_MODULE: return r.module;
    case CM_SRC: return r.src;
    case CM_AUTOCAST: return r.autocast;
    case CM_PARENT: return r.parent;
    case CM_ERROR: return r.error;
    case CM_N_OPS: return r.n_ops;
    case CM_PAD: return r.pad;
    case CM_FIRST_SEQ: return r.first_seq;
    case CM_START: return r.start;
    default: return r.dur;
  }
}

inline void set_field(CallRow& r, int k, int64_t v) {
  using namespace tsabi;
  switch (k) {
    case CM_FUNC: r.func = int32_t(v); break;
    case CM_MODULE: r.module = int32_t(v); break;
    case CM_SRC: r.src = int32_t(v); break;
    case CM_AUTOCAST: r.autocast = int32_t(v); break;
    case CM_PARENT: r.parent = int32_t(v); break;
    case CM_ERROR: r.error = int32_t(v); break;
    case CM_N_OPS: r.n_ops = int32_t(v); break;
    case CM_PAD: r.pad = int32_t(v); break;
    case CM_FIRST_SEQ: r.first_seq = v; break;
    case CM_START: r.start = v; break;
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

struct State {
  bool active = false;
  bool recording = false;
  unsigned long owner = 0;
  tsabi::FmodeState* eng = nullptr;
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
  PyObject* is_internal = nullptr;  // code -> bool (recording/source.py; cached below by address)
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
  // blocks below this index were handed over to Python (take_packed, when the recorder spills):
  // their bytes are freed, their slots kept so a call id still indexes its block; never read here
  size_t taken_upto = 0;
  int64_t n_calls = 0;
  std::vector<int32_t> stack;       // open recorded calls
  int32_t cur_mid = 0;              // module id of the innermost outermost call (ModuleTracker.current)
  int64_t tracer_errors = 0;
  // the mode's own time outside the call it wraps (before the call, after it), on a sample of the
  // recorded calls (one in kOwnSample): what sits in the gaps between ops; ``calls_seen`` counts them all
  uint32_t tick = 0;
  int64_t own_ns = 0, own_calls = 0, calls_seen = 0;
  // a KeyboardInterrupt (any non-Exception) raised inside a helper: re-raised to the program once
  // the bookkeeping is consistent, never swallowed
  PyObject *pend_t = nullptr, *pend_v = nullptr, *pend_tb = nullptr;
};

extern State S;
extern CallRow* g_spare;   // the live buffer of the block packed last, kept for the next block

// fmode_state.cpp
bool pack_block(Block& b);
void clear_internal_cache();
void clear_src_cache();
void contain(const char* where);   // a Python helper failed: count it (tracer_error), never let it reach the program
bool raise_pending();              // re-raise a stashed KeyboardInterrupt; true when there was one
int64_t call_int(PyObject* fn, const char* where, PyObject* a = nullptr, PyObject* b = nullptr);
extern PyMethodDef kStateMethods[];   // configure, take, field, column, ... (null-terminated)

// A live row (the running calls' rows, and the current block's, are never packed).
inline CallRow& row(int64_t cid) {
  return S.blocks[size_t(cid >> kBlockBits)].rows[cid & (kBlock - 1)];
}

// One field of any row, live or packed, not handed over (cid >= S.taken_upto * kBlock).
inline int64_t any_field(int64_t cid, int k) {
  const Block& b = S.blocks[size_t(cid >> kBlockBits)];
  int64_t j = cid & (kBlock - 1);
  return b.rows != nullptr ? get_field(b.rows[j], k) : packed_field(b, k, j);
}

inline CallRow* new_row(int64_t cid) {
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

}  // namespace tsfmode
