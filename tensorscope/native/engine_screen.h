// tensorscope native recording engine: the non-finite screen (per op, so inline here).
//
// Counts the NaN/Inf values of a CPU float tensor (exactly: an exponent-bits test on the raw
// integers, vectorised), so the observer can say which op first produced one, and gives the
// largest magnitude of a finite one (engine_known.h proves later ops finite from it). Device
// tensors are not screened here (-2: counted and noted); anything else unscreenable is -1.

#pragma once

#include <c10/core/TensorImpl.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "abi.h"

namespace tsengine TS_HIDDEN {

template <typename T>
inline bool bad(T x) {
  return !std::isfinite(static_cast<float>(x));
}
inline bool bad(float x) { return !std::isfinite(x); }
inline bool bad(double x) { return !std::isfinite(x); }
template <typename T>
inline double mag(T x) {
  return std::fabs(double(static_cast<float>(x)));
}
inline double mag(double x) { return std::fabs(x); }

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

// The largest |x| bit pattern of a run (sign bit masked off): for IEEE floats the integer order of
// those patterns is the order of the magnitudes, and a pattern >= the all-ones exponent is a
// NaN/Inf; one vectorised max pass, counted (a second pass) only when it finds one.
template <typename U, U kAbs>
TS_VECTORISE U max_abs_bits(const U* u, int64_t n) {
  // signed lanes (the masked patterns are below the sign bit: pcmpgt, no unsigned fix-up) and 16
  // independent maxima, so the loop is bound by loads, not by one max's latency chain
  using S = std::make_signed_t<U>;
  const S* v = reinterpret_cast<const S*>(u);
  constexpr int kLanes = 16;
  S m[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const S x = S(v[i + j] & S(kAbs));
      m[j] = x > m[j] ? x : m[j];
    }
  }
  S r = 0;
  for (; i < n; ++i) {
    const S x = S(v[i] & S(kAbs));
    r = x > r ? x : r;
  }
  for (int j = 0; j < kLanes; ++j) r = m[j] > r ? m[j] : r;
  return U(r);
}
inline double bits_value(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline double bits_value(uint64_t b) {
  double d;
  std::memcpy(&d, &b, 8);
  return d;
}
// A run's count, via its largest |x| pattern first (m < kInf: every value finite, none counted)
template <typename U, U kAbs, U kInf, typename T, typename Value>
inline int64_t scan_bits(const T* p, int64_t n, double* mx, Value value) {
  const U m = max_abs_bits<U, kAbs>(reinterpret_cast<const U*>(p), n);
  if (m < kInf) {
    *mx = std::max(*mx, value(m));
    return 0;
  }
  return count_run(p, n);
}
inline int64_t scan_run(const float* p, int64_t n, double* mx) {
  return scan_bits<uint32_t, 0x7fffffffu, 0x7f800000u>(p, n, mx, [](uint32_t b) { return bits_value(b); });
}
inline int64_t scan_run(const double* p, int64_t n, double* mx) {
  return scan_bits<uint64_t, 0x7fffffffffffffffull, 0x7ff0000000000000ull>(p, n, mx,
                                                                        [](uint64_t b) { return bits_value(b); });
}
inline int64_t scan_run(const c10::Half* p, int64_t n, double* mx) {
  return scan_bits<uint16_t, 0x7fffu, 0x7c00u>(
      p, n, mx, [](uint16_t b) { return double(static_cast<float>(c10::Half(b, c10::Half::from_bits()))); });
}
inline int64_t scan_run(const c10::BFloat16* p, int64_t n, double* mx) {
  return scan_bits<uint16_t, 0x7fffu, 0x7f80u>(
      p, n, mx, [](uint16_t b) { return double(static_cast<float>(c10::BFloat16(b, c10::BFloat16::from_bits()))); });
}

// mx: the largest finite magnitude seen (only meaningful when the count is 0)
template <typename T>
inline int64_t count_strided(const T* base, const int64_t* sz, const int64_t* st, int64_t nd, double* mx) {
  if (nd == 0) {
    if (bad(*base)) return 1;
    *mx = std::max(*mx, mag(*base));
    return 0;
  }
  // innermost dim in a tight loop; outer dims by an index vector
  int64_t inner = sz[nd - 1], istr = st[nd - 1];
  int64_t idx[32] = {0};
  int64_t count = 0;
  while (true) {
    int64_t off = 0;
    for (int64_t d = 0; d < nd - 1; ++d) off += idx[d] * st[d];
    const T* p = base + off;
    if (istr == 1) {
      count += scan_run(p, inner, mx);
    } else {
      for (int64_t i = 0; i < inner; ++i) {
        if (bad(p[i * istr])) {
          count++;
        } else {
          *mx = std::max(*mx, mag(p[i * istr]));
        }
      }
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

// -1: not screenable (not a plain float CPU tensor); else the number of NaN/Inf values. *max_abs:
// the largest magnitude when that number is 0 and the dtype is real, else -1 (nothing known).
inline int64_t nonfinite_count(const c10::TensorImpl* impl, double* max_abs = nullptr) {
  double unused = -1;
  double* mx = max_abs != nullptr ? max_abs : &unused;
  *mx = -1;
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
  if (impl->numel() == 0) {
    *mx = 0;
    return 0;
  }
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
  double m = 0;
  int64_t c = -1;
  switch (st) {
    case c10::kFloat:
      c = count_strided(reinterpret_cast<const float*>(data) + off, sz, sd, nd, &m);
      break;
    case c10::kDouble:
      c = count_strided(reinterpret_cast<const double*>(data) + off, sz, sd, nd, &m);
      break;
    case c10::kHalf:
      c = count_strided(reinterpret_cast<const c10::Half*>(data) + off, sz, sd, nd, &m);
      break;
    case c10::kBFloat16:
      c = count_strided(reinterpret_cast<const c10::BFloat16*>(data) + off, sz, sd, nd, &m);
      break;
    default:
      break;
  }
  if (c >= 0) {
    if (c == 0) *mx = m;
    return c;
  }
  switch (st) {
    case c10::kComplexFloat: {
      if (nd == 1 && sd[0] == 1)   // dense: real and imaginary parts side by side, one run
        return count_run(reinterpret_cast<const float*>(data) + 2 * off, 2 * sz[0]) > 0 ? 1 : 0;
      // real and imaginary parts: a complex tensor is a float tensor with a trailing dim of 2
      sz[nd] = 2;
      sd[nd] = 1;
      for (int64_t i = 0; i < nd; ++i) sd[i] *= 2;
      return count_strided(reinterpret_cast<const float*>(data) + 2 * off, sz, sd, nd + 1, &m) > 0 ? 1 : 0;
    }
    case c10::kComplexDouble: {
      if (nd == 1 && sd[0] == 1)
        return count_run(reinterpret_cast<const double*>(data) + 2 * off, 2 * sz[0]) > 0 ? 1 : 0;
      sz[nd] = 2;
      sd[nd] = 1;
      for (int64_t i = 0; i < nd; ++i) sd[i] *= 2;
      return count_strided(reinterpret_cast<const double*>(data) + 2 * off, sz, sd, nd + 1, &m) > 0 ? 1 : 0;
    }
    default:
      return -1;
  }
}

// Fingerprints (fingerprints=True): one pass over a real float CPU tensor's values in logical
// (row-major) order, from the same memory the screen reads, nothing dispatched: a bitwise hash and
// float64 statistics of the finite values. The hash is a sum over elements of a mix of (raw bits,
// logical index), so lanes and runs may be summed in any order; recording/fingerprint.py computes
// the same value with numpy for the python engine (keep the two in step).
constexpr uint64_t kFpK1 = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kFpK2 = 0xBF58476D1CE4E5B9ull;
inline uint64_t fp_mix(uint64_t b, uint64_t i) {
  const uint64_t x = (b ^ (i * kFpK1)) * kFpK2;
  return x ^ (x >> 31);
}
struct FpAcc {
  uint64_t h = 0;
  int64_t nf = 0;
  double s = 0, a = 0, m = 0;
};
inline double fp_value(double x) { return x; }
inline double fp_value(float x) { return double(x); }
template <typename T>
inline double fp_value(T x) { return double(static_cast<float>(x)); }

template <typename T> struct FpExp;
template <> struct FpExp<float> { static constexpr uint32_t v = 0x7f800000u; };
template <> struct FpExp<double> { static constexpr uint64_t v = 0x7ff0000000000000ull; };
template <> struct FpExp<c10::Half> { static constexpr uint16_t v = 0x7c00u; };
template <> struct FpExp<c10::BFloat16> { static constexpr uint16_t v = 0x7f80u; };

// One value into lane 0 of fp_run's accumulators, the index mix advanced: fp_run's scalar step, also
// the tail of the vectorised loop (engine_fp_runs.h), so every path adds the same values in order.
template <typename T, typename U>
inline __attribute__((always_inline)) void fp_step1(T x, uint64_t& ik, uint64_t dk, uint64_t& h, double& s,
                                                    double& a, double& m, int64_t& nf) {
  constexpr U kExp = U(FpExp<T>::v);
  U b;
  std::memcpy(&b, &x, sizeof(U));
  const uint64_t z = (uint64_t(b) ^ ik) * kFpK2;
  h += z ^ (z >> 31);
  ik += dk;
  if ((b & kExp) != kExp) {
    const double v = fp_value(x);
    s += v;
    a += std::fabs(v);
    m = std::fabs(v) > m ? std::fabs(v) : m;
  } else {
    nf++;
  }
}

// `n` values from p (memory stride `stride`), the first at logical index i0, the next ones `lstep`
// further each (the hash needs each value's logical index, not the order they are read in).
// Unit-stride runs go four values at a time into four independent accumulators, branch-free (the
// finite test on the exponent bits), so the float64 sums are not one latency chain.
template <typename T, typename U>
TS_VECTORISE void fp_run(const T* p, int64_t n, int64_t stride, uint64_t i0, uint64_t lstep, FpAcc& acc) {
  constexpr U kExp = U(FpExp<T>::v);
  uint64_t h[4] = {0, 0, 0, 0};
  double s[4] = {0, 0, 0, 0}, a[4] = {0, 0, 0, 0}, m[4] = {0, 0, 0, 0};
  int64_t nf = 0;
  uint64_t ik = i0 * kFpK1;   // i * K1, advanced by addition
  const uint64_t dk = lstep * kFpK1;
  int64_t k = 0;
  if (stride == 1) {
    const U* u = reinterpret_cast<const U*>(p);
    const uint64_t dk4 = 4 * dk;
    for (; k + 4 <= n; k += 4) {
      for (int j = 0; j < 4; ++j) {
        const U b = u[k + j];
        const uint64_t z = (uint64_t(b) ^ (ik + uint64_t(j) * dk)) * kFpK2;
        h[j] += z ^ (z >> 31);
        const bool fin = (b & kExp) != kExp;
        const double v = fin ? fp_value(p[k + j]) : 0.0;
        const double av = std::fabs(v);
        s[j] += v;
        a[j] += av;
        m[j] = av > m[j] ? av : m[j];
        nf += fin ? 0 : 1;
      }
      ik += dk4;
    }
  }
  for (; k < n; ++k) fp_step1<T, U>(p[k * stride], ik, dk, h[0], s[0], a[0], m[0], nf);
  acc.h += h[0] + h[1] + h[2] + h[3];
  acc.s += (s[0] + s[1]) + (s[2] + s[3]);
  acc.a += (a[0] + a[1]) + (a[2] + a[3]);
  acc.m = std::max(acc.m, std::max(std::max(m[0], m[1]), std::max(m[2], m[3])));
  acc.nf += nf;
}

// fp_run's unit-stride loop vectorised, where the CPU can: its four lanes as one 256-bit vector of
// each accumulator, each lane adding its values in the same order as fp_run's, so every path gives
// the same bits. Two builds of the one loop (engine_fp_runs.h): AVX2 (+F16C for half), the 64-bit
// multiply of the mix from 32-bit ones; and AVX-512 DQ+VL, the same on 256-bit registers with a
// native 64-bit lane multiply (vpmullq). Chosen at run time: the best the CPU has, capped by
// set_fp_simd (tests force each path and compare).
#if (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11)) && defined(__x86_64__)
#define TS_FP_AVX2 1
#define TS_AVX2 __attribute__((target("avx2,f16c")))
#define TS_AVX512 __attribute__((target("avx2,f16c,avx512f,avx512dq,avx512vl")))
enum FpSimd : int { kFpPortable = 0, kFpAvx2 = 1, kFpAvx512 = 2 };
inline int fp_cpu_simd() {   // the best path this CPU has (asked once)
  static const int level = !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) ? kFpPortable
                           : (__builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) ? kFpAvx512
                                                                                                          : kFpAvx2;
  return level;
}
inline std::atomic<int> fp_simd_cap{kFpAvx512};   // set_fp_simd: the best path allowed (a test forces each)
inline int fp_simd_level() { return std::min(fp_cpu_simd(), fp_simd_cap.load(std::memory_order_relaxed)); }
// four values (every build of the loop inlines these): their raw bits zero-extended to 64 bits, and as doubles
TS_AVX2 inline __attribute__((always_inline)) void fp_load4(const float* p, __m256i* bits, __m256d* v) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  *bits = _mm256_cvtepu32_epi64(b);
  *v = _mm256_cvtps_pd(_mm_castsi128_ps(b));
}
TS_AVX2 inline __attribute__((always_inline)) void fp_load4(const double* p, __m256i* bits, __m256d* v) {
  *bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  *v = _mm256_castsi256_pd(*bits);
}
TS_AVX2 inline __attribute__((always_inline)) void fp_load4(const c10::Half* p, __m256i* bits, __m256d* v) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  *bits = _mm256_cvtepu16_epi64(b);
  *v = _mm256_cvtps_pd(_mm_cvtph_ps(b));
}
TS_AVX2 inline __attribute__((always_inline)) void fp_load4(const c10::BFloat16* p, __m256i* bits, __m256d* v) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  *bits = _mm256_cvtepu16_epi64(b);
  *v = _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(b), 16)));
}
// A run's four lanes of each accumulator, and the loop's constants.
struct FpVec {
  __m256i iv, hv;
  __m256d sv, av, mv;
};
struct FpConst {
  __m256i k2, k2_hi, exp, step;
  __m256d abs_mask;
};
namespace fp_avx2 {
TS_AVX2 inline __attribute__((always_inline)) __m256i fp_mul64(__m256i x, __m256i k, __m256i k_hi) {   // x * k mod 2^64
  const __m256i lo = _mm256_mul_epu32(x, k);
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x, 32), k), _mm256_mul_epu32(x, k_hi));
  return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}
#define TS_FP_TARGET TS_AVX2
#include "engine_fp_runs.h"
#undef TS_FP_TARGET
}  // namespace fp_avx2
namespace fp_avx512 {
TS_AVX512 inline __attribute__((always_inline)) __m256i fp_mul64(__m256i x, __m256i k, __m256i) {   // the same, vpmullq
  return _mm256_mullo_epi64(x, k);
}
#define TS_FP_TARGET TS_AVX512
#include "engine_fp_runs.h"
#undef TS_FP_TARGET
}  // namespace fp_avx512
#endif


// Every element once, in memory order (dims sorted by stride, adjacent ones merged where both the
// memory and the logical strides allow: a contiguous or channels_last tensor is one or a few long
// unit-stride runs), each hashed with its logical (row-major) index.
template <typename T, typename U>
inline void fp_strided(const T* base, const int64_t* sizes, const int64_t* strides, int64_t nd, FpAcc& acc) {
  int64_t sz[32], st[32], ls[32];
  int64_t k = 0;
  int64_t logical = 1;
  for (int64_t d = nd - 1; d >= 0; --d) {   // row-major logical strides; size-1 dims dropped
    if (sizes[d] != 1) {
      sz[k] = sizes[d];
      st[k] = strides[d];
      ls[k] = logical;
      ++k;
    }
    logical *= sizes[d];
  }
  // k dims, innermost-logical first; sort by memory stride ascending (insertion sort: nd <= 30)
  for (int64_t i = 1; i < k; ++i) {
    for (int64_t j = i; j > 0 && st[j] < st[j - 1]; --j) {
      std::swap(sz[j], sz[j - 1]);
      std::swap(st[j], st[j - 1]);
      std::swap(ls[j], ls[j - 1]);
    }
  }
  int64_t m = 0;   // merge: dim j+1 continues dim m in memory and in logical order
  for (int64_t j = 1; j < k; ++j) {
    if (m >= 0 && st[j] == st[m] * sz[m] && ls[j] == ls[m] * sz[m]) {
      sz[m] *= sz[j];
    } else {
      ++m;
      sz[m] = sz[j];
      st[m] = st[j];
      ls[m] = ls[j];
    }
  }
  const int64_t nk = k == 0 ? 0 : m + 1;
  if (nk == 0) {
    fp_run<T, U>(base, 1, 1, 0, 1, acc);
    return;
  }
#ifdef TS_FP_AVX2
  if (st[0] == 1) {
    const int simd = fp_simd_level();
    if (simd == kFpAvx512) {
      fp_avx512::fp_runs<T, U>(base, nk, sz, st, ls, acc);
      return;
    }
    if (simd == kFpAvx2) {
      fp_avx2::fp_runs<T, U>(base, nk, sz, st, ls, acc);
      return;
    }
  }
#endif
  // dim 0 is the innermost (smallest memory stride): a tight run; the others by an index vector
  int64_t idx[32] = {0};
  while (true) {
    int64_t off = 0;
    uint64_t li = 0;
    for (int64_t d = 1; d < nk; ++d) {
      off += idx[d] * st[d];
      li += uint64_t(idx[d] * ls[d]);
    }
    fp_run<T, U>(base + off, sz[0], st[0], li, uint64_t(ls[0]), acc);
    int64_t d = 1;
    while (d < nk) {
      if (++idx[d] < sz[d]) break;
      idx[d] = 0;
      ++d;
    }
    if (d >= nk) break;
  }
}

struct FpRec {
  int64_t seq;
  uint64_t hash;
  int64_t nonfinite;
  double sum, abs_sum, max_abs;
};

// false: not a real float CPU tensor with data (nothing recorded)
inline bool fingerprint(const c10::TensorImpl* impl, FpRec* out) {
  if (impl->layout() != c10::kStrided || impl->is_nested() || impl->has_symbolic_sizes_strides()) return false;
  if (!impl->has_storage() || impl->device().type() != c10::DeviceType::CPU) return false;
  const auto st = impl->dtype().toScalarType();
  if (!(st == c10::kFloat || st == c10::kDouble || st == c10::kHalf || st == c10::kBFloat16)) return false;
  int64_t nd = impl->dim();
  if (nd > 30) return false;
  FpAcc acc;
  const int64_t numel = impl->numel();
  if (numel > 0) {
    const c10::StorageImpl* si = impl->unsafe_storage().unsafeGetStorageImpl();
    if (si == nullptr || si->data_ptr().get() == nullptr) return false;
    const char* data = static_cast<const char*>(si->data_ptr().get());
    const int64_t off = impl->storage_offset();
    int64_t sz[32], sd[32];
    for (int64_t i = 0; i < nd; ++i) {
      sz[i] = impl->sizes()[i];
      sd[i] = impl->strides()[i];
    }
    switch (st) {
      case c10::kFloat:
        fp_strided<float, uint32_t>(reinterpret_cast<const float*>(data) + off, sz, sd, nd, acc);
        break;
      case c10::kDouble:
        fp_strided<double, uint64_t>(reinterpret_cast<const double*>(data) + off, sz, sd, nd, acc);
        break;
      case c10::kHalf:
        fp_strided<c10::Half, uint16_t>(reinterpret_cast<const c10::Half*>(data) + off, sz, sd, nd, acc);
        break;
      default:
        fp_strided<c10::BFloat16, uint16_t>(reinterpret_cast<const c10::BFloat16*>(data) + off, sz, sd, nd, acc);
        break;
    }
  }
  out->hash = fp_mix(acc.h, uint64_t(numel));
  out->nonfinite = acc.nf;
  out->sum = acc.s;
  out->abs_sum = acc.a;
  out->max_abs = acc.m;
  return true;
}

inline int64_t version_of(const c10::TensorImpl* impl) {
  try {
    if (const_cast<c10::TensorImpl*>(impl)->is_inference()) return -1;
    return int64_t(impl->version_counter().current_version());
  } catch (...) {
    return -1;
  }
}

}  // namespace tsengine
