// tensorscope native recording engine: the screen's proofs (per op, so inline here).
//
// Reading every float output for NaN/Inf is the screen's cost (an optimizer step rewrites every
// parameter and moment buffer). An op whose inputs are all known finite, with a bound B on their
// magnitudes, and whose result is bounded by a formula of those bounds (a copy or selection: the
// largest input; a + alpha*b: Ba + |alpha|*Bb; a reduction over n terms: n*Ba*Bb...) cannot
// produce a NaN/Inf while that formula stays below the output dtype's largest finite value: its
// outputs are recorded as screened with a count of 0 ("proven") without reading them, and carry
// the bound on. Rounding: arithmetic proofs keep a 2^16 margin under the largest finite value,
// and a sum of n terms is proven only when n * unit roundoff <= 11 (e^11 < 2^16).
//
// What is known of a tensor (engine.h Known) is valid while it shows the same memory region
// (storage, data pointer, offset, sizes/strides/dtype as its interned meta) at the same version,
// and no op wrote its storage since: every op bumps the write clock of the storages it writes
// (its written arguments when it starts and again when it ends, so an op that throws half-way
// still invalidates them, and every output not a view). Each entry pins its StorageImpl's
// address with a weak reference, so a freed storage's address reused by a new one (with the
// same data pointer, offset and meta: a loop over fresh batches) is never mistaken for it. A write no op makes (through a NumPy
// array or a raw pointer) is invisible here, as it is to autograd's version counter.

#pragma once

#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "engine.h"
#include "engine_screen.h"
#include "engine_storages.h"

namespace tsengine TS_HIDDEN {

// Below this many elements a tensor is read rather than proven or remembered: the vectorised read
// of 16 KiB costs less than the bookkeeping (map updates, a weak reference) that proving needs.
constexpr double kProveMin = 4096;

enum BoundRule : int8_t {
  BR_NONE = 0,
  BR_SAME,       // copies, selections, sign changes: the largest input
  BR_ADD,        // a + alpha*b (.Tensor and .Scalar overloads): Ba + |alpha|*Bb
  BR_MUL,        // a * b
  BR_DIV_SCALAR, // a / s
  BR_ADDCMUL,    // a + value*b*c
  BR_ZERO,       // zero_: 0
  BR_FILL,       // fill_(self, value): |value|
  BR_MM,         // mm/bmm: K*Ba*Bb (K: the inner size)
  BR_ADDMM,      // addmm/baddbmm: |beta|*Bc + |alpha|*K*Ba*Bb
  BR_SUM,        // sum: numel*Ba
  BR_MEAN,       // mean: numel*Ba (its sum), never empty
  BR_CONV,       // convolution: numel(w)*Bx*Bw + Bb
  BR_CONV_BWD,   // convolution_backward: (numel(go)+numel(w)) * Bgo * max(Bx, Bw, 1)
};

// The rule of an op (make_facts, once per schema): "relu", "add.Tensor"...
inline int8_t bound_rule(const std::string& base, const std::string& overload) {
  static const char* const same[] = {"relu", "relu_", "threshold_backward", "clone", "_to_copy", "copy_", "neg",
                                     "neg_", "abs", "abs_", "max_pool2d_with_indices", "cat", "stack", nullptr};
  for (const char* const* n = same; *n; ++n) {
    if (base == *n) return BR_SAME;
  }
  const bool t = overload == "Tensor" || overload == "Scalar" || overload == "out";
  if ((base == "add" || base == "add_" || base == "sub" || base == "sub_") && t) return BR_ADD;
  if ((base == "mul" || base == "mul_") && t) return BR_MUL;
  if ((base == "div" || base == "div_") && overload == "Scalar") return BR_DIV_SCALAR;
  if ((base == "addcmul" || base == "addcmul_") && (overload.empty() || overload == "out")) return BR_ADDCMUL;
  if (base == "zero_") return BR_ZERO;
  if (base == "fill_" && overload == "Scalar") return BR_FILL;
  if ((base == "mm" || base == "bmm") && (overload.empty() || overload == "out")) return BR_MM;
  if ((base == "addmm" || base == "addmm_" || base == "baddbmm") && (overload.empty() || overload == "out"))
    return BR_ADDMM;
  if (base == "sum" && (overload.empty() || overload == "dim_IntList")) return BR_SUM;
  if (base == "mean" && (overload.empty() || overload == "dim")) return BR_MEAN;
  if (base == "convolution" && overload.empty()) return BR_CONV;
  if (base == "convolution_backward" && overload.empty()) return BR_CONV_BWD;
  return BR_NONE;
}

inline bool real_float(c10::ScalarType st) {
  return st == c10::kFloat || st == c10::kDouble || st == c10::kHalf || st == c10::kBFloat16;
}
inline double max_finite(c10::ScalarType st) {
  switch (st) {
    case c10::kFloat: return double(std::numeric_limits<float>::max());
    case c10::kDouble: return std::numeric_limits<double>::max();
    case c10::kHalf: return 65504.0;
    case c10::kBFloat16: return 3.3895313892515355e38;
    default: return 0;
  }
}
inline double unit_roundoff(c10::ScalarType st) {
  switch (st) {
    case c10::kFloat: return std::ldexp(1.0, -24);
    case c10::kDouble: return std::ldexp(1.0, -53);
    case c10::kHalf: return std::ldexp(1.0, -11);
    case c10::kBFloat16: return std::ldexp(1.0, -8);
    default: return 1;
  }
}

inline uint64_t gen_of(const c10::StorageImpl* si) {
  auto it = g.storage_gen.find(si);
  return it == g.storage_gen.end() ? 0 : it->second;
}
inline void bump(const c10::StorageImpl* si) {
  if (si != nullptr) g.storage_gen[si] = ++g.write_clock;
}
inline const c10::StorageImpl* storage_of(const c10::TensorImpl* t) {
  if (!t->has_storage()) return nullptr;
  return t->unsafe_storage().unsafeGetStorageImpl();
}

// What is known of t (shown through interned meta `meta`), or null
inline const Known* known(const c10::TensorImpl* t, int32_t meta) {
  auto it = g.memo.find(t);
  if (it == g.memo.end()) return nullptr;
  const Known& k = it->second;
  const c10::StorageImpl* si = storage_of(t);
  if (k.meta != meta || si == nullptr || k.storage != si || k.data != si->data_ptr().get() ||
      k.offset != t->storage_offset() || k.version != version_of(t) || k.storage_gen != gen_of(si))
    return nullptr;
  return &k;
}
inline void forget(const c10::TensorImpl* t) { g.memo.erase(t); }
inline void learn(const c10::TensorImpl* t, int32_t meta, bool finite, double bound) {
  const int64_t ver = version_of(t);
  const c10::StorageImpl* si = storage_of(t);
  if (ver < 0 || si == nullptr) {
    forget(t);
    return;
  }
  if (g.memo.size() > 4096 || g.storage_gen.size() > 16384) {   // both at once: entries hold clock values
    g.memo.clear();
    g.storage_gen.clear();
  }
  Known& k = g.memo[t];
  if (k.storage != si || k.pin.expired()) {
    k.pin = c10::weak_intrusive_ptr<c10::StorageImpl>(
        c10::intrusive_ptr<c10::StorageImpl>::unsafe_reclaim_from_nonowning(const_cast<c10::StorageImpl*>(si)));
  }
  k.storage = si;
  k.data = si->data_ptr().get();
  k.storage_gen = gen_of(si);
  k.version = ver;
  k.offset = t->storage_offset();
  k.meta = meta;
  k.finite = finite;
  k.bound = bound;
}

// |value| of a wrapped number (a Python scalar the arg parser made a 0-d CPU tensor), -1 if not finite
// or not a plain number. Read from its memory: an op (item()) would be recorded.
inline double wrapped_abs(const c10::TensorImpl* t) {
  if (t->device().type() != c10::DeviceType::CPU || t->numel() != 1 || !t->has_storage()) return -1;
  const c10::StorageImpl* si = storage_of(t);
  if (si == nullptr || si->data_ptr().get() == nullptr) return -1;
  const char* d = static_cast<const char*>(si->data_ptr().get()) + t->storage_offset() * int64_t(t->dtype().itemsize());
  double v;
  switch (t->dtype().toScalarType()) {
    case c10::kDouble: std::memcpy(&v, d, 8); break;
    case c10::kFloat: {
      float x;
      std::memcpy(&x, d, 4);
      v = x;
      break;
    }
    case c10::kLong: {
      int64_t x;
      std::memcpy(&x, d, 8);
      v = double(x);
      break;
    }
    case c10::kBool: v = *d ? 1 : 0; break;
    default: return -1;
  }
  return std::isfinite(v) ? std::fabs(v) : -1;
}

// Screens t (the count) and learns what it found (a small tensor: not remembered, read again)
inline int64_t screen_and_learn(const c10::TensorImpl* t, int32_t meta, double* bound = nullptr) {
  double mx = -1;
  const int64_t c = nonfinite_count(t, &mx);
  if (c >= 0 && double(t->numel()) >= kProveMin) learn(t, meta, c == 0, c == 0 ? mx : -1);
  if (bound != nullptr) *bound = c == 0 ? mx : -1;
  return c;
}

// The same from a fingerprint just taken of t (fingerprints=True): it read every value already, its
// non-finite count and largest finite magnitude are the screen's (no second read)
inline int64_t learn_from_fingerprint(const c10::TensorImpl* t, int32_t meta, const FpRec& fp) {
  const int64_t c = fp.nonfinite;
  if (double(t->numel()) >= kProveMin) learn(t, meta, c == 0, c == 0 ? fp.max_abs : -1);
  return c;
}

// A bound on the magnitude of every value the op can write, from what is known of its inputs at
// the start (the written targets' before-states learnt by the pre-screen), or -1. `metas`: the
// inputs' interned metas in for_each_tensor order (Pending::in_metas). With a bound, `*terms` is
// the number of terms an output's value sums over (rounding accumulates per term; 1 elementwise).
inline double input_bound(const at::RecordFunction& fn, const OpFacts* f, const std::vector<int64_t>& metas,
                          double* terms) {
  constexpr int kMax = 12;
  double ab[kMax];       // per argument: its bound (tensors, tensor lists, numbers); -1 unknown
  int64_t numel[kMax];   // tensors: the element count
  int64_t inner[kMax];   // tensors: the last dim's size
  const Values args = args_of(fn, f);
  if (args.size() > size_t(kMax)) return -1;
  // an input nothing is known of is read when it is small beside the others (a conv's weight
  // beside its activations): one read of it lets every output be proven, here and in later ops
  double total = 0;
  for (const auto& v : args) for_each_tensor(v, [&](const at::Tensor& t) { total += double(t.numel()); });
  if (total < kProveMin) return -1;   // small inputs, small outputs: reading them costs less than proving
  // convolution_backward's weight: read when the op computes its gradient (output_mask[1]), which
  // has the weight's size, so the read costs what screening that gradient would, and the optimizer
  // step that updates the weight in place later knows it instead of reading it again
  bool read_weight = false;
  if (f->rule == BR_CONV_BWD && args.size() > 10 && args[10].isBoolList()) {
    const auto mask = args[10].toBoolList();
    read_weight = mask.size() > 1 && mask.get(1);
  }
  size_t k = 0;   // index into metas
  bool ok = true;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = args[i];
    ab[i] = -1;
    numel[i] = inner[i] = 0;
    if (v.isTensor() && !v.toTensor().defined()) {
      ab[i] = 0;   // an optional tensor not given (a conv's bias)
    } else if (v.isTensor() && v.toTensor().unsafeGetTensorImpl()->is_wrapped_number()) {
      ab[i] = wrapped_abs(v.toTensor().unsafeGetTensorImpl());   // a Python number: x + 1, buf.mul_(0.9)
      if (ab[i] < 0) return -1;
    } else if (v.isTensor() || v.isList()) {
      double b = 0;
      bool any = false;
      for_each_tensor(v, [&](const at::Tensor& t) {
        const size_t mi = k++;
        if (!ok) return;
        const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
        if (!real_float(impl->dtype().toScalarType()) || mi >= metas.size()) {
          ok = false;
          return;
        }
        const Known* kn = known(impl, int32_t(metas[mi]));
        double tb = kn != nullptr && kn->finite ? kn->bound : -1;
        if (kn == nullptr && impl->numel() <= 64) {   // a scalar or a small tensor: cheaper to read than to track
          if (nonfinite_count(impl, &tb) != 0) tb = -1;
        } else if (kn == nullptr && (double(impl->numel()) * 4 <= total || (read_weight && i == 2))) {
          if (screen_and_learn(impl, int32_t(metas[mi]), &tb) != 0) tb = -1;
          g.n_inputs_read++;
        }
        if (tb < 0) {
          ok = false;
          return;
        }
        b = std::max(b, tb);
        numel[i] += impl->numel();
        inner[i] = impl->dim() > 0 ? impl->sizes()[impl->dim() - 1] : 1;
        any = true;
      });
      if (!ok) return -1;
      if (any || v.isList()) ab[i] = b;
    } else if (v.isDouble()) {
      if (!std::isfinite(v.toDouble())) return -1;
      ab[i] = std::fabs(v.toDouble());
    } else if (v.isInt()) {
      ab[i] = std::fabs(double(v.toInt()));
    } else if (v.isBool()) {
      ab[i] = v.toBool() ? 1 : 0;
    }
  }
  switch (f->rule) {
    case BR_MM: *terms = double(inner[0]); break;
    case BR_ADDMM: *terms = double(inner[1]) + 1; break;
    case BR_SUM:
    case BR_MEAN: *terms = double(numel[0]); break;
    case BR_CONV: *terms = double(numel[1]) + 1; break;
    case BR_CONV_BWD: *terms = double(numel[0] + numel[2]); break;
    default: *terms = 1;
  }
  auto arg = [&](size_t i, double dflt) -> double { return i < args.size() ? ab[i] : dflt; };
  auto need = [&](std::initializer_list<double> xs) {
    for (double x : xs) {
      if (x < 0) return false;
    }
    return true;
  };
  double b = -1;
  switch (f->rule) {
    case BR_SAME: {
      b = 0;
      for (size_t i = 0; i < args.size(); ++i) {
        if (args[i].isTensor() || args[i].isList()) b = std::max(b, ab[i]);
      }
      return b;
    }
    case BR_ADD: {
      const double a0 = arg(0, -1), a1 = arg(1, -1), al = args.size() > 2 ? arg(2, -1) : 1;
      return need({a0, a1, al}) ? a0 + al * a1 : -1;
    }
    case BR_MUL:
      return need({arg(0, -1), arg(1, -1)}) ? arg(0, -1) * arg(1, -1) : -1;
    case BR_DIV_SCALAR:
      return need({arg(0, -1)}) && arg(1, -1) > 0 ? arg(0, -1) / arg(1, -1) : -1;
    case BR_ADDCMUL: {
      const double val = args.size() > 3 ? arg(3, -1) : 1;
      return need({arg(0, -1), arg(1, -1), arg(2, -1), val}) ? arg(0, -1) + val * arg(1, -1) * arg(2, -1) : -1;
    }
    case BR_ZERO:
      return 0;
    case BR_FILL:
      return arg(1, -1);
    case BR_MM:
      if (!need({arg(0, -1), arg(1, -1)})) return -1;
      b = double(inner[0]) * arg(0, -1) * arg(1, -1);
      return b;
    case BR_ADDMM: {
      const double beta = args.size() > 3 ? arg(3, -1) : 1, alpha = args.size() > 4 ? arg(4, -1) : 1;
      if (!need({arg(0, -1), arg(1, -1), arg(2, -1), beta, alpha})) return -1;
      return beta * arg(0, -1) + alpha * double(inner[1]) * arg(1, -1) * arg(2, -1);
    }
    case BR_SUM:
      return need({arg(0, -1)}) ? double(numel[0]) * arg(0, -1) : -1;
    case BR_MEAN:   // computed as a sum, then divided: the sum must not overflow (and empty: NaN)
      return need({arg(0, -1)}) && numel[0] > 0 ? double(numel[0]) * arg(0, -1) : -1;
    case BR_CONV: {
      const double bias = args.size() > 2 && ab[2] >= 0 ? ab[2] : 0;
      if (args.size() > 2 && !args[2].isNone() && ab[2] < 0) return -1;
      return need({arg(0, -1), arg(1, -1)}) ? double(numel[1]) * arg(0, -1) * arg(1, -1) + bias : -1;
    }
    case BR_CONV_BWD:
      if (!need({arg(0, -1), arg(1, -1), arg(2, -1)})) return -1;
      return double(numel[0] + numel[2]) * arg(0, -1) * std::max({arg(1, -1), arg(2, -1), 1.0});
    default:
      return -1;
  }
}

// Whether an output of dtype st is proven finite by bound b (terms: input_bound's, at the start)
inline bool proves(const OpFacts* f, double b, double terms, c10::ScalarType st) {
  if (b < 0 || !std::isfinite(b) || !real_float(st)) return false;
  if (f->rule == BR_SAME || f->rule == BR_ZERO || f->rule == BR_FILL) return b <= max_finite(st);
  if (terms * unit_roundoff(st) > 11) return false;
  return b <= std::ldexp(max_finite(st), -16);
}

}  // namespace tsengine
