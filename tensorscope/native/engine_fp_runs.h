// engine_screen.h's vectorised fingerprint loop, included there once per instruction set (no include
// guard): inside a namespace that defines fp_mul64 (x * k mod 2^64 per 64-bit lane) and with
// TS_FP_TARGET set to the target attribute its code is compiled for. Every inclusion is the same
// loop, lanes and combining order, so all of them give fp_run's bits; only the multiply differs.
// (A template on the multiply alone cannot do it: a function's target attribute cannot depend on a
// template argument, and an AVX-512 multiply does not inline into an AVX2-only function.)

// One step of a run: four values into the four lanes of each accumulator.
template <typename T>
TS_FP_TARGET inline __attribute__((always_inline)) void fp_step4(const T* p, const FpConst& c, FpVec& r, __m256i& nfv) {
  __m256i bits;
  __m256d v;
  fp_load4(p, &bits, &v);
  const __m256i z = fp_mul64(_mm256_xor_si256(bits, r.iv), c.k2, c.k2_hi);
  r.hv = _mm256_add_epi64(r.hv, _mm256_xor_si256(z, _mm256_srli_epi64(z, 31)));
  r.iv = _mm256_add_epi64(r.iv, c.step);
  const __m256i bad = _mm256_cmpeq_epi64(_mm256_and_si256(bits, c.exp), c.exp);   // all ones: NaN/Inf
  v = _mm256_andnot_pd(_mm256_castsi256_pd(bad), v);                              // those count as 0.0
  const __m256d x = _mm256_and_pd(v, c.abs_mask);
  r.sv = _mm256_add_pd(r.sv, v);
  r.av = _mm256_add_pd(r.av, x);
  r.mv = _mm256_max_pd(x, r.mv);   // x > m ? x : m, as fp_run
  nfv = _mm256_sub_epi64(nfv, bad);
}

// Every run of fp_strided when the innermost dim has memory stride 1 (contiguous, channels_last...):
// the runs of fp_run, one after another in the same order, each with fp_run's lanes and its tail
// and combining step, without a call per run (a channels_last activation is runs of C values).
// Short runs without a tail go two at a time (independent chains; both combined by one hadd),
// their results added to the totals in run order.
template <typename T, typename U>
TS_FP_TARGET __attribute__((noinline)) void fp_runs(const T* base, int64_t nk, const int64_t* sz, const int64_t* st,
                                                  const int64_t* ls, FpAcc& acc) {
  constexpr U kExp = U(FpExp<T>::v);
  FpConst c;
  c.k2 = _mm256_set1_epi64x(int64_t(kFpK2));
  c.k2_hi = _mm256_srli_epi64(c.k2, 32);
  c.exp = _mm256_set1_epi64x(int64_t(uint64_t(kExp)));
  c.abs_mask = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
  const int64_t n = sz[0];
  const uint64_t dk = uint64_t(ls[0]) * kFpK1;
  c.step = _mm256_set1_epi64x(int64_t(4 * dk));
  const __m256i lane_k = _mm256_set_epi64x(int64_t(3 * dk), int64_t(2 * dk), int64_t(dk), 0);
  int64_t idx[32] = {0};
  __m256i hsum = _mm256_setzero_si256(), nfv = _mm256_setzero_si256();   // order-free: summed over runs
  __m256d mall = _mm256_setzero_pd();
  double acc_s = acc.s, acc_a = acc.a;   // in registers across the runs (acc is written once, at the end)
  int64_t nf = 0;
  const bool pairs = n % 4 == 0 && n <= 256;
  int64_t off = 0;   // the current run: its first value's memory offset and logical index, kept
  uint64_t l = 0;     // up to date by advance() (one add per run, not a sum over the dims)
  auto at = [&](uint64_t* li) -> const T* {
    *li = l;
    return base + off;
  };
  auto advance = [&]() -> bool {   // the next run; false past the last
    int64_t d = 1;
    while (d < nk) {
      if (++idx[d] < sz[d]) {
        off += st[d];
        l += uint64_t(ls[d]);
        return true;
      }
      idx[d] = 0;
      off -= (sz[d] - 1) * st[d];
      l -= uint64_t((sz[d] - 1) * ls[d]);
      ++d;
    }
    return false;
  };
  bool more = true;
  while (more) {
    uint64_t li;
    const T* p = at(&li);
    FpVec r{_mm256_add_epi64(_mm256_set1_epi64x(int64_t(li * kFpK1)), lane_k), _mm256_setzero_si256(),
            _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    more = advance();
    if (pairs && more) {
      const T* pq = at(&li);
      FpVec q{_mm256_add_epi64(_mm256_set1_epi64x(int64_t(li * kFpK1)), lane_k), _mm256_setzero_si256(),
              _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
      more = advance();
      for (int64_t k = 0; k < n; k += 4) {
        fp_step4(p + k, c, r, nfv);
        fp_step4(pq + k, c, q, nfv);
      }
      hsum = _mm256_add_epi64(hsum, _mm256_add_epi64(r.hv, q.hv));
      // [r0+r1, q0+q1, r2+r3, q2+q3] -> [(r0+r1)+(r2+r3), (q0+q1)+(q2+q3)]: each run's combine
      const __m256d s4 = _mm256_hadd_pd(r.sv, q.sv), a4 = _mm256_hadd_pd(r.av, q.av);
      const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
      const __m128d a2 = _mm_add_pd(_mm256_castpd256_pd128(a4), _mm256_extractf128_pd(a4, 1));
      acc_s += _mm_cvtsd_f64(s2);
      acc_s += _mm_cvtsd_f64(_mm_unpackhi_pd(s2, s2));
      acc_a += _mm_cvtsd_f64(a2);
      acc_a += _mm_cvtsd_f64(_mm_unpackhi_pd(a2, a2));
      mall = _mm256_max_pd(mall, _mm256_max_pd(r.mv, q.mv));   // a maximum: in any order
      continue;
    }
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) fp_step4(p + k, c, r, nfv);
    hsum = _mm256_add_epi64(hsum, r.hv);
    if (k == n) {   // no tail (C a multiple of 4): the lanes combined in registers, (l0 + l1) + (l2 + l3)
      const __m128d s2 = _mm_hadd_pd(_mm256_castpd256_pd128(r.sv), _mm256_extractf128_pd(r.sv, 1));
      const __m128d a2 = _mm_hadd_pd(_mm256_castpd256_pd128(r.av), _mm256_extractf128_pd(r.av, 1));
      acc_s += _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
      acc_a += _mm_cvtsd_f64(_mm_add_sd(a2, _mm_unpackhi_pd(a2, a2)));
      mall = _mm256_max_pd(mall, r.mv);
      continue;
    }
    alignas(32) uint64_t iks[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(iks), r.iv);
    uint64_t ik = iks[0];   // lane 0's index mix: the tail's first value
    alignas(32) double s[4], a[4], m[4];
    _mm256_store_pd(s, r.sv);
    _mm256_store_pd(a, r.av);
    _mm256_store_pd(m, r.mv);
    uint64_t h0 = 0;
    for (; k < n; ++k) fp_step1<T, U>(p[k], ik, dk, h0, s[0], a[0], m[0], nf);   // fp_run's tail: lane 0
    acc.h += h0;
    acc_s += (s[0] + s[1]) + (s[2] + s[3]);
    acc_a += (a[0] + a[1]) + (a[2] + a[3]);
    acc.m = std::max(acc.m, std::max(std::max(m[0], m[1]), std::max(m[2], m[3])));
  }
  acc.s = acc_s;
  acc.a = acc_a;
  alignas(32) double mm[4];
  _mm256_store_pd(mm, mall);
  acc.m = std::max(acc.m, std::max(std::max(mm[0], mm[1]), std::max(mm[2], mm[3])));
  alignas(32) uint64_t hh[4];
  alignas(32) int64_t cc[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(hh), hsum);
  _mm256_store_si256(reinterpret_cast<__m256i*>(cc), nfv);
  acc.h += hh[0] + hh[1] + hh[2] + hh[3];
  acc.nf += nf + cc[0] + cc[1] + cc[2] + cc[3];
}
