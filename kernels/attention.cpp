// Decode attention read in place from a paged KV cache: one query token per row, each row's
// keys and values wherever its page table says they are (no gather into a contiguous copy).
//
// Registers one op in the zerolayer library (gateway/zerolayer/kernels/qmatmul.py builds this
// file beside qmatmul.cpp; gateway/zerolayer/kernels/attention.py calls it):
//   zerolayer::paged_decode_attention(q [B, Hq, hd] float32,
//       k_cache, v_cache [num_pages * page_size, Hkv, hd] bfloat16 or float32 (token-major, one
//       layer's), tables [B, max_pages] int32 (a row's page ids in position order, -1 past its
//       end), seq_lens [B] int32, page_size, scale, window, softcap) -> [B, Hq, hd] float32.
// Row b attends positions [start, seq_lens[b]) with start = max(0, seq_len - window) when
// window > 0 (a sliding layer: the query at seq_len - 1 sees the last `window` positions), else
// 0; position t is token (tables[b][t / page_size] * page_size + t % page_size) of the cache.
// Query head j reads kv head j / (Hq / Hkv) (grouped-query attention). A score is
// scale * q.k, then softcap * tanh(score / softcap) when softcap > 0; softmax over the
// positions; the output is the probabilities' sum of the values. A row of length 0 gives zeros.
//
// f32 arithmetic on bf16 or f32 storage (bf16 widened exactly). One task per (row, kv head,
// partition of kPart positions) computes every query head of the group, so each K and V vector
// is read once per step; a task keeps an online softmax (running max, sum and output) over
// tiles of kTile positions. Rows longer than one partition are split and the partitions merged
// in order afterwards. The partitions depend only on the row's length and window, never on the
// thread count, so the output is the same bits with any number of threads.
//
// AVX2 (+FMA) code when the build has it (the AVX-512 build runs the same 256-bit code, as
// q8dot.h's products do) and head_dim is a multiple of 8; plain C++ otherwise.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define ZL_ATTN_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPart = 512;  // positions a task: longer rows are split, then merged
constexpr int64_t kTile = 32;   // positions scored, then summed, at a time within a task

// Where a row's positions are: the cache's rows (token stride), its page table.
template <typename S>
struct Cache {
  const S* k;
  const S* v;
  int64_t token_stride;  // elements between consecutive tokens (Hkv * hd when contiguous)
  int64_t page_size;
};

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

#ifdef ZL_ATTN_AVX2

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// exp(x) for x <= 0 (scores minus their max), to about 2 ulp: x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by its degree-6 Taylor-like minimax polynomial (Cephes' expf coefficients), times 2^n
// built in the exponent bits. Below -87.3 (exp under float's normal range) it gives 0.
inline __m256 exp_ps(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The sums of eight vectors, as one vector (lane t = hsum(d[t])).
inline __m256 hsum8(const __m256 d[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Scores s[g][t] = scale * q_g . k_t for the tile's n keys (kf: float32 rows, padded to a
// multiple of 8 with a zero row), eight keys at a time against one head.
inline void score_tile(const float* q, int64_t G, int64_t hd, const float* const* kf, int64_t n,
                       float scale, float* s) {
  const __m256 vs = _mm256_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * hd;
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      __m256 d[8];
      for (int t = 0; t < 8; ++t) d[t] = _mm256_setzero_ps();
      const float* const* k = kf + t0;
      for (int64_t i = 0; i < hd; i += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + i);
        for (int t = 0; t < 8; ++t) d[t] = _mm256_fmadd_ps(_mm256_loadu_ps(k[t] + i), qv, d[t]);
      }
      _mm256_storeu_ps(s + g * kTile + t0, _mm256_mul_ps(hsum8(d), vs));
    }
  }
}

// The softmax step for one head given its tile scores s[0..n): rescale what was summed so far
// to the new max, add exp(s - max) and leave those in s (the tile's probabilities, unnormalised).
inline void softmax_step(float* s, int64_t n, float& m, float& l, float* acc, int64_t hd) {
  int64_t t = 0;
  __m256 vm = _mm256_set1_ps(m);
  for (; t + 8 <= n; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + t));
  float mx = hmax(vm);
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  const float corr = std::exp(m - mx);  // 0 on the first tile (m = -inf)
  m = mx;
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {
    const __m256 p = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
    _mm256_storeu_ps(s + t, p);
    sum = _mm256_add_ps(sum, p);
  }
  float tail = 0.0f;
  for (; t < n; ++t) {
    const float e[8] = {s[t] - mx};
    __m256 p = exp_ps(_mm256_loadu_ps(e));
    s[t] = _mm256_cvtss_f32(p);
    tail += s[t];
  }
  l = l * corr + (hsum(sum) + tail);
  if (corr != 1.0f) {
    const __m256 c = _mm256_set1_ps(corr);
    for (int64_t i = 0; i < hd; i += 8) _mm256_storeu_ps(acc + i, _mm256_mul_ps(_mm256_loadu_ps(acc + i), c));
  }
}

// acc[g] += sum_t p[g][t] * v_t for up to 8 heads g0.. at once (GB accumulators in registers,
// each value vector loaded and widened once per head block).
template <typename S, int GB>
inline void pv_block(const float* p, const S* const* vp, int64_t n, int64_t hd, float* acc) {
  for (int64_t i = 0; i < hd; i += 8) {
    __m256 a[GB];
    for (int g = 0; g < GB; ++g) a[g] = _mm256_loadu_ps(acc + g * hd + i);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 v = load8(vp[t] + i);
      for (int g = 0; g < GB; ++g) a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * kTile + t), v, a[g]);
    }
    for (int g = 0; g < GB; ++g) _mm256_storeu_ps(acc + g * hd + i, a[g]);
  }
}

template <typename S>
inline void pv_tile(const float* p, int64_t G, const S* const* vp, int64_t n, int64_t hd, float* acc) {
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const float* pg = p + g0 * kTile;
    float* ag = acc + g0 * hd;
    switch (std::min<int64_t>(8, G - g0)) {
#define ZL_CASE(B) \
  case B: pv_block<S, B>(pg, vp, n, hd, ag); break;
      ZL_CASE(1) ZL_CASE(2) ZL_CASE(3) ZL_CASE(4) ZL_CASE(5) ZL_CASE(6) ZL_CASE(7) ZL_CASE(8)
#undef ZL_CASE
    }
  }
}

// The tile's keys as float32 rows for score_tile: float32 storage read in place, bfloat16
// widened once into scratch; rows n.. up to the next multiple of 8 point at zeros.
inline void key_rows(const float* const* kp, int64_t n, int64_t, float*, const float* zeros,
                     const float** kf) {
  for (int64_t t = 0; t < n; ++t) kf[t] = kp[t];
  for (int64_t t = n; t < ((n + 7) & ~int64_t(7)); ++t) kf[t] = zeros;
}

inline void key_rows(const c10::BFloat16* const* kp, int64_t n, int64_t hd, float* scratch,
                     const float* zeros, const float** kf) {
  for (int64_t t = 0; t < n; ++t) {
    float* row = scratch + t * hd;
    for (int64_t i = 0; i < hd; i += 8) _mm256_storeu_ps(row + i, load8(kp[t] + i));
    kf[t] = row;
  }
  for (int64_t t = n; t < ((n + 7) & ~int64_t(7)); ++t) kf[t] = zeros;
}

#endif  // ZL_ATTN_AVX2

// The plain C++ of the same steps (any head_dim).
namespace portable {

template <typename S>
void score_tile(const float* q, int64_t G, int64_t hd, const S* const* kp, int64_t n, float scale,
                float* s) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t t = 0; t < n; ++t) {
      float d = 0.0f;
      for (int64_t i = 0; i < hd; ++i) d += q[g * hd + i] * widen(kp[t][i]);
      s[g * kTile + t] = scale * d;
    }
}

inline void softmax_step(float* s, int64_t n, float& m, float& l, float* acc, int64_t hd) {
  float mx = m;
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  const float corr = std::exp(m - mx);
  m = mx;
  float sum = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  l = l * corr + sum;
  if (corr != 1.0f)
    for (int64_t i = 0; i < hd; ++i) acc[i] *= corr;
}

template <typename S>
void pv_tile(const float* p, int64_t G, const S* const* vp, int64_t n, int64_t hd, float* acc) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t t = 0; t < n; ++t) {
      const float w = p[g * kTile + t];
      for (int64_t i = 0; i < hd; ++i) acc[g * hd + i] += w * widen(vp[t][i]);
    }
}

}  // namespace portable

// One task's scratch: pointers and scores of a tile, widened keys, the running state.
struct Scratch {
  std::vector<float> keys, zeros, scores, m, l, acc;
  Scratch(int64_t G, int64_t hd)
      : keys(kTile * hd), zeros(hd, 0.0f), scores(G * kTile), m(G), l(G), acc(G * hd) {}
};

// Positions [p0, p1) of row `table` for the G query heads q [G][hd] reading kv head h: the
// online softmax's max m [G], sum l [G] and unnormalised output acc [G][hd].
template <typename S>
void attend(const float* q, int64_t G, int64_t hd, const Cache<S>& c, const int32_t* table,
            int64_t h, int64_t p0, int64_t p1, float scale, float softcap, bool simd, Scratch& w) {
  const S* kp[kTile];
  const S* vp[kTile];
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.0f);
  std::fill(w.acc.begin(), w.acc.end(), 0.0f);
  float* s = w.scores.data();
  for (int64_t t0 = p0; t0 < p1; t0 += kTile) {
    const int64_t n = std::min(kTile, p1 - t0);
    int64_t page = t0 / c.page_size, off = t0 % c.page_size;  // one division a tile
    for (int64_t t = 0; t < n; ++t) {
      const int64_t token = int64_t(table[page]) * c.page_size + off;
      kp[t] = c.k + token * c.token_stride + h * hd;
      vp[t] = c.v + token * c.token_stride + h * hd;
      if (++off == c.page_size) {
        off = 0;
        ++page;
      }
    }
#ifdef ZL_ATTN_AVX2
    if (simd) {
      const float* kf[kTile];
      key_rows(kp, n, hd, w.keys.data(), w.zeros.data(), kf);
      score_tile(q, G, hd, kf, n, scale, s);
    } else
#endif
    {
      portable::score_tile(q, G, hd, kp, n, scale, s);
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * kTile;
      if (softcap > 0.0f)
        for (int64_t t = 0; t < n; ++t) sg[t] = softcap * std::tanh(sg[t] / softcap);
#ifdef ZL_ATTN_AVX2
      if (simd) softmax_step(sg, n, w.m[g], w.l[g], w.acc.data() + g * hd, hd);
      else
#endif
        portable::softmax_step(sg, n, w.m[g], w.l[g], w.acc.data() + g * hd, hd);
    }
#ifdef ZL_ATTN_AVX2
    if (simd) pv_tile(s, G, vp, n, hd, w.acc.data());
    else
#endif
      portable::pv_tile(s, G, vp, n, hd, w.acc.data());
  }
}

// A unit of work: row b, kv head h, positions [p0, p1); `slot` is its partial's index, or -1
// when it is the row's only partition (written to the output directly).
struct Task {
  int64_t b, h, p0, p1, slot;
};

template <typename S>
void run(const float* q, float* out, int64_t Hq, int64_t Hkv, int64_t hd, const Cache<S>& c,
         const int32_t* tables, int64_t max_pages, const std::vector<int64_t>& start,
         const int32_t* lens, int64_t B, float scale, float softcap) {
  const int64_t G = Hq / Hkv;
#ifdef ZL_ATTN_AVX2
  const bool simd = hd % 8 == 0;
#else
  const bool simd = false;
#endif
  std::vector<Task> tasks;
  int64_t slots = 0;
  std::vector<int64_t> first_slot(B, -1);  // a split row's first partial
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p0 = start[b], p1 = lens[b];
    const int64_t parts = (p1 - p0 + kPart - 1) / kPart;
    if (parts > 1) first_slot[b] = slots;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t j = 0; j < parts; ++j)
        tasks.push_back({b, h, p0 + j * kPart, std::min(p1, p0 + (j + 1) * kPart),
                         parts > 1 ? slots++ : -1});
  }
  std::vector<float> part_m(slots * G), part_l(slots * G), part_acc(slots * G * hd);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t i0, int64_t i1) {
    Scratch w(G, hd);
    for (int64_t i = i0; i < i1; ++i) {
      const Task& t = tasks[i];
      const float* qg = q + (t.b * Hq + t.h * G) * hd;
      attend(qg, G, hd, c, tables + t.b * max_pages, t.h, t.p0, t.p1, scale, softcap, simd, w);
      if (t.slot < 0) {
        float* o = out + (t.b * Hq + t.h * G) * hd;
        for (int64_t g = 0; g < G; ++g) {
          const float inv = 1.0f / w.l[g];
          for (int64_t e = 0; e < hd; ++e) o[g * hd + e] = w.acc[g * hd + e] * inv;
        }
      } else {
        std::copy(w.m.begin(), w.m.end(), part_m.begin() + t.slot * G);
        std::copy(w.l.begin(), w.l.end(), part_l.begin() + t.slot * G);
        std::copy(w.acc.begin(), w.acc.end(), part_acc.begin() + t.slot * G * hd);
      }
    }
  });
  if (slots == 0) return;
  // Split rows: partitions j of (b, h) are slots first + h * parts + j, merged in order.
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      if (first_slot[b] < 0) continue;
      const int64_t parts = (lens[b] - start[b] + kPart - 1) / kPart;
      const int64_t s0 = first_slot[b] + h * parts;
      for (int64_t g = 0; g < G; ++g) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < parts; ++j) mx = std::max(mx, part_m[(s0 + j) * G + g]);
        float l = 0.0f;
        float* o = out + (b * Hq + h * G + g) * hd;
        std::fill(o, o + hd, 0.0f);
        for (int64_t j = 0; j < parts; ++j) {
          const float f = std::exp(part_m[(s0 + j) * G + g] - mx);
          l += part_l[(s0 + j) * G + g] * f;
          const float* a = part_acc.data() + ((s0 + j) * G + g) * hd;
          for (int64_t e = 0; e < hd; ++e) o[e] += a[e] * f;
        }
        const float inv = 1.0f / l;
        for (int64_t e = 0; e < hd; ++e) o[e] *= inv;
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables, const at::Tensor& seq_lens, int64_t page_size,
                                  double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "paged_decode_attention: q [B, Hq, hd] float32");
  const int64_t B = q.size(0), Hq = q.size(1), hd = q.size(2);
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: k_cache and v_cache [tokens, Hkv, hd], one shape");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "paged_decode_attention: k_cache and v_cache both float32 or both bfloat16");
  const int64_t Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == hd, "paged_decode_attention: q's head_dim ", hd, " is not the cache's ",
              k_cache.size(2));
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "paged_decode_attention: ", Hq, " query heads are not groups of ",
              Hkv, " kv heads");
  for (const at::Tensor* t : {&k_cache, &v_cache})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == hd && t->stride(0) == k_cache.stride(0),
                "paged_decode_attention: each token's [Hkv, hd] contiguous, one token stride for K and V");
  TORCH_CHECK(page_size > 0 && k_cache.size(0) % page_size == 0,
              "paged_decode_attention: the cache is not whole pages of ", page_size);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.scalar_type() == at::kInt,
              "paged_decode_attention: tables [B, max_pages] int32");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == B && seq_lens.scalar_type() == at::kInt,
              "paged_decode_attention: seq_lens [B] int32");
  const at::Tensor qc = q.contiguous(), tc = tables.contiguous(), lc = seq_lens.contiguous();
  const int64_t max_pages = tables.size(1), num_pages = k_cache.size(0) / page_size;
  const int32_t* tp = tc.data_ptr<int32_t>();
  const int32_t* lp = lc.data_ptr<int32_t>();
  std::vector<int64_t> start(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lp[b];
    TORCH_CHECK(len >= 0 && len <= max_pages * page_size, "paged_decode_attention: row ", b, "'s length ",
                len, " is outside its table (", max_pages * page_size, " positions)");
    start[b] = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    for (int64_t p = start[b] / page_size; p < (len + page_size - 1) / page_size; ++p)
      TORCH_CHECK(tp[b * max_pages + p] >= 0 && tp[b * max_pages + p] < num_pages, "paged_decode_attention: row ",
                  b, "'s page ", p, " is ", tp[b * max_pages + p], ", not one of the cache's ", num_pages);
  }
  at::Tensor out = at::zeros({B, Hq, hd}, qc.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  if (k_cache.scalar_type() == at::kFloat) {
    const Cache<float> c{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.stride(0), page_size};
    run(qp, op, Hq, Hkv, hd, c, tp, max_pages, start, lp, B, sc, cap);
  } else {
    const Cache<c10::BFloat16> c{k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
                                 k_cache.stride(0), page_size};
    run(qp, op, Hq, Hkv, hd, c, tp, max_pages, start, lp, B, sc, cap);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zerolayer, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor seq_lens, "
      "int page_size, float scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(zerolayer, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
