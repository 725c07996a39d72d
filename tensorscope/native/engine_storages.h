// tensorscope native recording engine: tensor metas and storage ids (per op, so inline here).
//
// A storage is identified by its data pointer and watched through a c10::weak_intrusive_ptr (keeps
// the StorageImpl object, never its memory), so an address reused after a free is a new storage.
// Frees are found by sweeping the live lists a few entries per row (young: first seen as an
// output, old: first seen as an input), and fully at the end of the trace. A record lives in a
// slot (reused) until the sweep drops it from its list; then its values go to g.finished, which
// take_chunks hands over with the packed chunks (so the recorder spills them with the ops): the
// engine holds the live storages only. All under g.mu.

#pragma once

#include <ATen/core/ivalue.h>

#include "engine.h"

namespace tsengine TS_HIDDEN {

// The interned meta id of t (abi.h MetaKey header, sizes, strides) and its storage's data pointer,
// StorageImpl and size (0 / null / 0 when it has none we can watch).
inline int32_t meta_of(const at::TensorBase& t, uintptr_t* ptr_out, const c10::StorageImpl** impl_out,
                       int64_t* snbytes) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  int64_t key[64];
  size_t n = 0;
  bool strided = impl->layout() == c10::kStrided && !impl->is_nested();
  bool sym = impl->has_symbolic_sizes_strides();
  int64_t ndim = 0;
  if (!impl->is_nested() && !sym) ndim = impl->dim();
  if (ndim > tsabi::kMaxNdim) ndim = 0;
  auto dev = impl->device();
  key[n++] = ndim;                                   // MK_NDIM
  key[n++] = int64_t(impl->dtype().toScalarType());  // MK_DTYPE
  key[n++] = int64_t(dev.type());                    // MK_DEV_TYPE
  key[n++] = int64_t(dev.index());                   // MK_DEV_INDEX
  key[n++] = (strided && !sym) ? 1 : 0;              // MK_STRIDED
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
    for (int64_t i = 0; i < ndim; ++i) numel *= key[tsabi::MK_HEADER + i];
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

inline void mark_free(int32_t slot, int64_t seq) {
  StorageRec& r = g.slots[size_t(slot)];
  if (r.free_seq < 0) r.free_seq = seq;
  auto it = g.by_ptr.find(r.ptr);
  if (it != g.by_ptr.end() && it->second == slot) g.by_ptr.erase(it);
  r.weak.reset();
}

// one record's TC_N values (abi.h TensorColumn order) appended to `out`
inline void put_record(std::vector<int64_t>& out, const StorageRec& r) {
  size_t k = out.size();
  out.resize(k + tsabi::TC_N);
  int64_t* o = out.data() + k;
  o[tsabi::TC_META] = r.meta;
  o[tsabi::TC_NBYTES] = r.nbytes;
  o[tsabi::TC_ALLOC_SEQ] = r.alloc_seq;
  o[tsabi::TC_FREE_SEQ] = r.free_seq;
  o[tsabi::TC_MODULE] = r.module;
  o[tsabi::TC_CALL] = r.call;
  o[tsabi::TC_PTR] = int64_t(r.ptr);
  o[tsabi::TC_SID] = r.sid;
}

// a freed record leaves its list: its values join `finished` (handed over with the chunks), its
// slot is reused (and forgotten by the recent rows, so a reused slot is not checked for them)
inline void drop_record(int32_t slot) {
  put_record(g.finished, g.slots[size_t(slot)]);
  for (auto& s : g.recent)
    if (s == slot) s = -1;
  g.free_slots.push_back(slot);
}

// checks up to `budget` entries (the newest first), every entry while there are at most `all` of
// them (a free dated exactly: live bytes per op are compared with the allocator's events), drops
// the freed ones
inline void sweep_list(std::vector<int32_t>& lst, size_t& rr, size_t budget, int64_t seq, size_t all = 0) {
  size_t n = lst.size();
  if (n == 0) return;
  if (n <= all) budget = n;
  auto check = [&](size_t i) -> bool {
    StorageRec& r = g.slots[size_t(lst[i])];
    if (r.weak.expired()) {
      mark_free(lst[i], seq);
      drop_record(lst[i]);
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

// the storages of the last rows (Engine::recent): checked every row, freed ones dated `seq`
inline void sweep_recent(int64_t seq) {
  for (int32_t slot : g.recent) {
    if (slot < 0) continue;
    StorageRec& r = g.slots[size_t(slot)];
    if (r.free_seq < 0 && r.weak.expired()) mark_free(slot, seq);   // the list sweep drops it later
  }
}

inline void note_recent(int32_t slot) {
  if (slot < 0) return;
  g.recent[g.recent_pos] = slot;
  g.recent_pos = (g.recent_pos + 1) % Engine::kRecent;
}

// the storage id of (si, ptr), registering a new storage; its slot in g.last_slot (-1: none)
inline int32_t storage_id(const c10::StorageImpl* si, uintptr_t ptr, int32_t meta, int64_t nbytes, bool alloc,
                          int64_t seq) {
  g.last_slot = -1;
  if (!g.want_storages || ptr == 0 || si == nullptr) return -1;
  auto it = g.by_ptr.find(ptr);
  if (it != g.by_ptr.end()) {
    StorageRec& r = g.slots[size_t(it->second)];
    if (!r.weak.expired()) {   // alive (also: another StorageImpl over the same buffer)
      g.last_slot = it->second;
      return r.sid;
    }
    mark_free(it->second, seq - 1);           // the address was freed and reused
  }
  int32_t sid = g.next_sid++;
  int32_t slot;
  if (!g.free_slots.empty()) {
    slot = g.free_slots.back();
    g.free_slots.pop_back();
  } else {
    slot = int32_t(g.slots.size());
    g.slots.emplace_back();
  }
  StorageRec& r = g.slots[size_t(slot)];
  r.weak = c10::weak_intrusive_ptr<c10::StorageImpl>(
      c10::intrusive_ptr<c10::StorageImpl>::unsafe_reclaim_from_nonowning(const_cast<c10::StorageImpl*>(si)));
  r.ptr = ptr;
  r.meta = meta;
  r.nbytes = nbytes;
  r.alloc_seq = alloc ? seq : -1;
  r.free_seq = -1;
  r.call = int32_t(g.cur_call);
  r.module = int32_t(g.cur_module);
  r.sid = sid;
  g.by_ptr[ptr] = slot;
  (alloc ? g.young : g.old).push_back(slot);
  g.last_slot = slot;
  return sid;
}

// Tensors among an op's arguments, one level of lists deep. Wrapped numbers (a
// Python scalar the arg parser turned into a 0-d tensor) are scalars to a
// dispatch mode, so they are skipped here too.
inline bool real_tensor(const at::Tensor& t) {
  return t.defined() && !t.unsafeGetTensorImpl()->is_wrapped_number();
}

template <typename F>
inline void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    if (real_tensor(t)) f(t);
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) {
      if (e.isTensor() && real_tensor(e.toTensor())) f(e.toTensor());
    }
  }
}

}  // namespace tsengine
