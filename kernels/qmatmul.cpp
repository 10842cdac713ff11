// Matrix products on llama.cpp's GGUF blocks, dequantized in registers: y = x @ w.T.
//
// Registers two ops (gateway/zerolayer/kernels/qmatmul.py builds and loads this file):
//   zerolayer::qmatmul(x [M, K] float32 or bfloat16, blocks [N, K / 32 * bytes] uint8, kind)
//     -> [M, N] in x's dtype;
//   zerolayer::qmatmul_parts(x, [blocks_0, blocks_1, ...], [kind_0, kind_1, ...]) -> the
//     products by the matrices stacked one under the other, each of its own kind, in one call;
//   zerolayer::dequantize(blocks, kind, bfloat16) -> [N, K] float32, the weights qmatmul uses;
//   zerolayer::q8matmul_parts and quantize_q8: the same products with 8-bit activations
//     (q8dot.h, included below).
// kind: 0 = Q4_0 (w = d * (q - 8)), 1 = Q4_1 (w = d * q + m), 2 = Q8_0 (w = d * q), blocks of 32
// weights; 3 = Q4_K (w = d * sc * q - dmin * m), 4 = Q5_K (the same with 5-bit q), 5 = Q6_K
// (w = d * sc * (q - 32)), super-blocks of 256 weights with a scale (and min) per 32 or 16 of
// them; d, dmin and m of the 32-weight types are float16 (layouts in
// gateway/zerolayer/models/gguf_blocks.py). The kernels walk every type in chunks of 32 weights: one
// block of the 32-weight types, an eighth of a K-quant super-block.
//
// A weight is the float32 value the gguf package's dequantization gives: d * q is exact in
// float32 (11 + 8 significant bits at most), so d * q + m is rounded once, fused or not. So are
// the K-quants' (d * sc) * q (11 + 6 + 5 bits; Q6_K 11 + 7 + 6 = 24) and dmin * m (11 + 6):
// d * sc * q - dmin * m is rounded once, as numpy rounds it. With
// bfloat16 input the weight is then rounded to bfloat16 (to nearest, ties to even, as
// Tensor.to(torch.bfloat16) rounds the dense weights). Products are summed in float32 and the
// output rounded to x's dtype once: the dense path's weights, summed in another order.
//
// Three implementations of the same arithmetic, chosen at build time: AVX-512 (when compiled
// with -mavx512f -mavx512bw -mf16c; bfloat16 products by vdpbf16ps with -mavx512bf16), AVX2
// (-mavx2 -mfma -mf16c: a chunk as four 8-float vectors; bfloat16 input widened to float32)
// and plain C++ for other CPUs (e.g. aarch64). The plain C++ is not vectorised well: built for
// AVX2 it was 1.9-6.3x slower than the AVX2 code on SmolLM2's shapes (docs/models.md).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#define ZL_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ZL_AVX2 1
#endif
#if defined(ZL_AVX512) || defined(ZL_AVX2)
#include <immintrin.h>
// How many groups of R rows ahead to prefetch (2 measured a little faster than 1 or 4 on
// whole SmolLM2 decode steps, AVX-512).
#define ZL_AHEAD 2
#endif

namespace {

constexpr int64_t kBlock = 32;  // weights per chunk: the unit every loop below walks in
constexpr int kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5;
constexpr int64_t kTile = 64;  // output rows per cache tile: 64 x 612 bytes at most for SmolLM2

template <int KIND>
constexpr bool kSuper = KIND >= kQ4_K;  // K-quants: super-blocks of 256 weights
template <int KIND>
constexpr int64_t kChunks = kSuper<KIND> ? 8 : 1;  // chunks of 32 weights a block
// One block's bytes.
template <int KIND>
constexpr int64_t kBytes = KIND == kQ4_0   ? 18
                           : KIND == kQ4_1 ? 20
                           : KIND == kQ8_0 ? 34
                           : KIND == kQ4_K ? 144
                           : KIND == kQ5_K ? 176
                                           : 210;

struct Layout {
  int64_t bytes, weights;  // a block's
};

Layout layout(int64_t kind) {
  switch (kind) {
    case kQ4_0: return {kBytes<kQ4_0>, kBlock};
    case kQ4_1: return {kBytes<kQ4_1>, kBlock};
    case kQ8_0: return {kBytes<kQ8_0>, kBlock};
    case kQ4_K: return {kBytes<kQ4_K>, 8 * kBlock};
    case kQ5_K: return {kBytes<kQ5_K>, 8 * kBlock};
    case kQ6_K: return {kBytes<kQ6_K>, 8 * kBlock};
  }
  TORCH_CHECK(false, "unknown block kind ", kind);
}

// Call f with KIND as a compile-time constant.
template <typename F>
void with_kind(int64_t kind, F&& f) {
  switch (kind) {
    case kQ4_0: f(std::integral_constant<int, kQ4_0>{}); return;
    case kQ4_1: f(std::integral_constant<int, kQ4_1>{}); return;
    case kQ8_0: f(std::integral_constant<int, kQ8_0>{}); return;
    case kQ4_K: f(std::integral_constant<int, kQ4_K>{}); return;
    case kQ5_K: f(std::integral_constant<int, kQ5_K>{}); return;
    case kQ6_K: f(std::integral_constant<int, kQ6_K>{}); return;
  }
  TORCH_CHECK(false, "unknown block kind ", kind);
}

// Chunk b of a row: the block holding it, and its index in that block.
template <int KIND>
inline const uint8_t* chunk_block(const uint8_t* row, int64_t b) {
  return row + (b / kChunks<KIND>)*kBytes<KIND>;
}

// Q4_K / Q5_K: the 6-bit scale and min of 32-weight sub-block j (0..7) from the 12 bytes s.
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The K-quants' per-chunk scale and offset: w = a * q - o (Q4_K, Q5_K: a = d * sc,
// o = dmin * m, both exact in float32).
inline void k4_scale(const uint8_t* p, int c, float& a, float& o);

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

inline void k4_scale(const uint8_t* p, int c, float& a, float& o) {
  int sc, m;
  scale_min_k4(p + 4, c, sc, m);
  a = half_at(p) * static_cast<float>(sc);
  o = half_at(p + 2) * static_cast<float>(m);
}

// Q6_K chunk c (0..7): 32 weights from ql (4 low bits) and qh (2 high bits); the 16-weight
// scales 2c and 2c + 1. Within each 128-weight half n, chunk g = c % 4 takes the low nibbles
// of ql bytes 0..31 (g = 0) or 32..63 (g = 1), then their high nibbles (g = 2, 3), and bits
// 2g..2g+1 of qh bytes 0..31.
struct Q6Chunk {
  const uint8_t* ql;
  const uint8_t* qh;
  int lshift, hshift;
  float a0, a1;  // d * scale of weights 0..15 and 16..31
};

inline Q6Chunk q6_chunk(const uint8_t* p, int c) {
  const int n = c / 4, g = c % 4;
  const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192) + 8 * n + 2 * g;
  const float d = half_at(p + 208);
  return {p + 64 * n + 32 * (g & 1), p + 128 + 32 * n, 4 * (g >> 1), 2 * g,
          d * static_cast<float>(sc[0]), d * static_cast<float>(sc[1])};
}

// Round a float32 to the nearest bfloat16 (ties to even), kept as float32. Weights are finite.
inline float round_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&v, &bits, 4);
  return v;
}

// Chunk b's 32 weights of a row into w, element order.
template <int KIND, bool BF16>
inline void dequant_block(const uint8_t* row, int64_t b, float* w) {
  const uint8_t* p = chunk_block<KIND>(row, b);
  const int c = static_cast<int>(b % kChunks<KIND>);
  if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    float a, o;
    k4_scale(p, c, a, o);
    const uint8_t* ql = p + (KIND == kQ4_K ? 16 : 48) + 32 * (c / 2);
    const int shift = 4 * (c & 1);
    for (int j = 0; j < 32; ++j) {
      int q = (ql[j] >> shift) & 15;
      if constexpr (KIND == kQ5_K) q |= ((p[16 + j] >> c) & 1) << 4;
      w[j] = a * static_cast<float>(q) - o;
    }
  } else if constexpr (KIND == kQ6_K) {
    const Q6Chunk k = q6_chunk(p, c);
    for (int j = 0; j < 32; ++j) {
      const int q = (((k.ql[j] >> k.lshift) & 15) | (((k.qh[j] >> k.hshift) & 3) << 4)) - 32;
      w[j] = (j < 16 ? k.a0 : k.a1) * static_cast<float>(q);
    }
  } else if constexpr (KIND == kQ8_0) {
    const float d = half_at(p);
    const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(q[j]);
  } else {
    const float d = half_at(p);
    const float m = KIND == kQ4_1 ? half_at(p + 2) : 0.0f;
    const int off = KIND == kQ4_0 ? 8 : 0;
    const uint8_t* q = p + (KIND == kQ4_1 ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>((q[j] & 15) - off) + m;
      w[j + 16] = d * static_cast<float>((q[j] >> 4) - off) + m;
    }
  }
  if constexpr (BF16) {
    for (int j = 0; j < 32; ++j) w[j] = round_bf16(w[j]);
  }
}

#if defined(ZL_AVX512) || defined(ZL_AVX2)

inline float half_fast(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The R rows a dot product reads (R * row_bytes bytes from row0) are R short streams that the
// hardware prefetcher barely learns before they end: at block b of nb, fetch slice b of the
// rows ZL_AHEAD groups further on (contiguous after these).
inline void prefetch_slice(const uint8_t* row0, int64_t group, int64_t nb, int64_t b) {
  const uint8_t* ahead = row0 + ZL_AHEAD * group;
  for (int64_t off = (b * group / nb) & ~int64_t(63); off < (b + 1) * group / nb; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
}

#endif

#ifdef ZL_AVX512

inline __m512 round_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(int(0xFFFF0000u))));
}

// A block's weights as two vectors (elements 0..15, 16..31). 4-bit types: a 16-entry table of
// the block's 16 possible weights, indexed by the nibbles (permutexvar reads an index's low 4
// bits, so the low nibbles need no mask).
template <int KIND, bool BF16>
inline void dequant_block(const uint8_t* row, int64_t b, __m512& w0, __m512& w1) {
  const uint8_t* p = chunk_block<KIND>(row, b);
  const int c = static_cast<int>(b % kChunks<KIND>);
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    // A table of the chunk's 16 (Q5_K: 32) possible weights, a * q - o rounded once (a * q is
    // exact), indexed by the quants.
    float a, o;
    k4_scale(p, c, a, o);
    const __m512 va = _mm512_set1_ps(a), vo = _mm512_set1_ps(o);
    __m512 t0 = _mm512_fmsub_ps(va, iota, vo);
    const uint8_t* ql = p + (KIND == kQ4_K ? 16 : 48) + 32 * (c / 2);
    const __m128i shift = _mm_cvtsi32_si128(4 * (c & 1));
    const __m512i nib = _mm512_set1_epi32(15);
    __m512i q0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ql)));
    __m512i q1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 16)));
    q0 = _mm512_and_si512(_mm512_srl_epi32(q0, shift), nib);
    q1 = _mm512_and_si512(_mm512_srl_epi32(q1, shift), nib);
    if constexpr (BF16) t0 = round_bf16(t0);
    if constexpr (KIND == kQ4_K) {
      w0 = _mm512_permutexvar_ps(q0, t0);
      w1 = _mm512_permutexvar_ps(q1, t0);
    } else {
      __m512 t1 = _mm512_fmsub_ps(va, _mm512_add_ps(iota, _mm512_set1_ps(16.0f)), vo);
      if constexpr (BF16) t1 = round_bf16(t1);
      const __m128i hshift = _mm_cvtsi32_si128(c);
      const __m512i one = _mm512_set1_epi32(1);
      const uint8_t* qh = p + 16;
      __m512i h0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh)));
      __m512i h1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 16)));
      h0 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h0, hshift), one), 4);
      h1 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h1, hshift), one), 4);
      w0 = _mm512_permutex2var_ps(t0, _mm512_or_si512(q0, h0), t1);
      w1 = _mm512_permutex2var_ps(t0, _mm512_or_si512(q1, h1), t1);
    }
    return;
  } else if constexpr (KIND == kQ6_K) {
    const Q6Chunk k = q6_chunk(p, c);
    const __m128i ls = _mm_cvtsi32_si128(k.lshift), hs = _mm_cvtsi32_si128(k.hshift);
    const __m512i nib = _mm512_set1_epi32(15), two = _mm512_set1_epi32(3);
    const __m512 bias = _mm512_set1_ps(32.0f);
    __m512 v[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i l = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k.ql + 16 * h)));
      const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k.qh + 16 * h)));
      const __m512i q = _mm512_or_si512(_mm512_and_si512(_mm512_srl_epi32(l, ls), nib),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(u, hs), two), 4));
      v[h] = _mm512_sub_ps(_mm512_cvtepi32_ps(q), bias);  // q - 32, exact
    }
    w0 = _mm512_mul_ps(_mm512_set1_ps(k.a0), v[0]);
    w1 = _mm512_mul_ps(_mm512_set1_ps(k.a1), v[1]);
    if constexpr (BF16) {
      w0 = round_bf16(w0);
      w1 = round_bf16(w1);
    }
    return;
  }
  const __m512 d = _mm512_set1_ps(half_fast(p));
  if constexpr (KIND == kQ8_0) {
    const __m128i* q = reinterpret_cast<const __m128i*>(p + 2);
    w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
    if constexpr (BF16) {
      w0 = round_bf16(w0);
      w1 = round_bf16(w1);
    }
  } else {
    __m512 table;
    if constexpr (KIND == kQ4_1) {
      table = _mm512_fmadd_ps(d, iota, _mm512_set1_ps(half_fast(p + 2)));
    } else {
      table = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
    }
    if constexpr (BF16) table = round_bf16(table);
    const uint8_t* q = p + (KIND == kQ4_1 ? 4 : 2);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    w0 = _mm512_permutexvar_ps(bytes, table);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  }
}

// R output rows n..n+R-1 for all M input rows; R * M * 2 accumulators stay in registers.
template <int KIND, bool BF16, int M, int R>
inline void dot_rows(const float* x, int64_t K, const uint8_t* row0, int64_t row_bytes, float* acc_out) {
  __m512 acc[R][M][2];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m][0] = acc[r][m][1] = _mm512_setzero_ps();
  const int64_t nb = K / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_slice(row0, R * row_bytes, nb, b);
    __m512 xs[M][2];
    for (int m = 0; m < M; ++m) {
      xs[m][0] = _mm512_loadu_ps(x + m * K + b * kBlock);
      xs[m][1] = _mm512_loadu_ps(x + m * K + b * kBlock + 16);
    }
    for (int r = 0; r < R; ++r) {
      __m512 w0, w1;
      dequant_block<KIND, BF16>(row0 + r * row_bytes, b, w0, w1);
      for (int m = 0; m < M; ++m) {
        acc[r][m][0] = _mm512_fmadd_ps(w0, xs[m][0], acc[r][m][0]);
        acc[r][m][1] = _mm512_fmadd_ps(w1, xs[m][1], acc[r][m][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      acc_out[r * M + m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m][0], acc[r][m][1]));
}

#ifdef __AVX512BF16__
// bfloat16 input on CPUs with AVX512-BF16: a block's 32 weights rounded to bfloat16 by the
// conversion instruction (to nearest, ties to even: the same as round_bf16 for these values,
// which are never subnormal) and multiplied into float32 sums by vdpbf16ps, two products per
// lane and step. Products of two bfloat16 values are exact in float32; the instruction treats
// subnormal inputs (below 1.2e-38; weights never are) as zero.
template <int KIND>
inline __m512bh block_bf16(const uint8_t* row, int64_t b) {
  if constexpr (kSuper<KIND>) {  // the float32 weights, rounded by the conversion
    __m512 w0, w1;
    dequant_block<KIND, false>(row, b, w0, w1);
    return _mm512_cvtne2ps_pbh(w1, w0);
  }
  const uint8_t* p = row + b * kBytes<KIND>;
  if constexpr (KIND == kQ8_0) {
    const __m512 d = _mm512_set1_ps(half_fast(p));
    const __m128i* q = reinterpret_cast<const __m128i*>(p + 2);
    const __m512 w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    const __m512 w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
    return _mm512_cvtne2ps_pbh(w1, w0);  // elements 0..15 from w0, 16..31 from w1
  } else {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table;
    if constexpr (KIND == kQ4_1) {
      table = _mm512_fmadd_ps(_mm512_set1_ps(half_fast(p)), iota, _mm512_set1_ps(half_fast(p + 2)));
    } else {
      table = _mm512_mul_ps(_mm512_set1_ps(half_fast(p)), _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
    }
    // The 16 possible weights as bfloat16 in the low half; nibbles index them (below 16).
    const __m512i t = _mm512_castsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(table)));
    const uint8_t* q = p + (KIND == kQ4_1 ? 4 : 2);
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i idx = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(15))),
        _mm256_srli_epi16(bytes, 4), 1);
    return reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(idx, t));
  }
}

template <int KIND, int M, int R>
inline void dot_rows_bf16(const uint16_t* x, int64_t K, const uint8_t* row0, int64_t row_bytes,
                          float* acc_out) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t nb = K / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_slice(row0, R * row_bytes, nb, b);
    __m512bh xs[M];
    for (int m = 0; m < M; ++m)
      xs[m] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + m * K + b * kBlock));
    for (int r = 0; r < R; ++r) {
      const __m512bh w = block_bf16<KIND>(row0 + r * row_bytes, b);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], w, xs[m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc_out[r * M + m] = _mm512_reduce_add_ps(acc[r][m]);
}
#define ZL_DPBF16 1
#endif

#elif defined(ZL_AVX2)

inline __m256 round_bf16(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(int(0xFFFF0000u))));
}

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// A chunk's 32 quants as int8 (elements 0..15 in lo, 16..31 in hi) into four vectors of 8
// floats, element order (exact).
inline void to_floats(__m128i lo, __m128i hi, __m256 v[4]) {
  v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
  v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
}

// A chunk's weights as four vectors (elements 0..7, ..., 24..31): the quants as floats, then
// d * q (+ m), a * q - o, with the one rounding of the scalar code. Bytes are shifted in
// 16-bit lanes and masked, so no bits cross from a neighbouring byte.
template <int KIND, bool BF16>
inline void dequant_block(const uint8_t* row, int64_t b, __m256 w[4]) {
  const uint8_t* p = chunk_block<KIND>(row, b);
  const int c = static_cast<int>(b % kChunks<KIND>);
  const __m128i nib = _mm_set1_epi8(15);
  if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    float a, o;
    k4_scale(p, c, a, o);
    const uint8_t* ql = p + (KIND == kQ4_K ? 16 : 48) + 32 * (c / 2);
    const __m128i shift = _mm_cvtsi32_si128(4 * (c & 1));
    __m128i lo = _mm_and_si128(_mm_srl_epi16(load16(ql), shift), nib);
    __m128i hi = _mm_and_si128(_mm_srl_epi16(load16(ql + 16), shift), nib);
    if constexpr (KIND == kQ5_K) {
      const __m128i hshift = _mm_cvtsi32_si128(c), one = _mm_set1_epi8(1);
      const uint8_t* qh = p + 16;
      lo = _mm_or_si128(lo, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(load16(qh), hshift), one), 4));
      hi = _mm_or_si128(hi, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(load16(qh + 16), hshift), one), 4));
    }
    to_floats(lo, hi, w);
    const __m256 va = _mm256_set1_ps(a), vo = _mm256_set1_ps(o);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_fmsub_ps(va, w[i], vo);
  } else if constexpr (KIND == kQ6_K) {
    const Q6Chunk k = q6_chunk(p, c);
    const __m128i ls = _mm_cvtsi32_si128(k.lshift), hs = _mm_cvtsi32_si128(k.hshift);
    const __m128i three = _mm_set1_epi8(3), bias = _mm_set1_epi8(32);
    __m128i q[2];
    for (int h = 0; h < 2; ++h) {
      const __m128i l = _mm_and_si128(_mm_srl_epi16(load16(k.ql + 16 * h), ls), nib);
      const __m128i u = _mm_and_si128(_mm_srl_epi16(load16(k.qh + 16 * h), hs), three);
      q[h] = _mm_sub_epi8(_mm_or_si128(l, _mm_slli_epi16(u, 4)), bias);  // q - 32
    }
    to_floats(q[0], q[1], w);
    const __m256 a0 = _mm256_set1_ps(k.a0), a1 = _mm256_set1_ps(k.a1);
    w[0] = _mm256_mul_ps(a0, w[0]);
    w[1] = _mm256_mul_ps(a0, w[1]);
    w[2] = _mm256_mul_ps(a1, w[2]);
    w[3] = _mm256_mul_ps(a1, w[3]);
  } else {
    const __m256 d = _mm256_set1_ps(half_fast(p));
    if constexpr (KIND == kQ8_0) {
      to_floats(load16(p + 2), load16(p + 18), w);
    } else {
      const __m128i q = load16(p + (KIND == kQ4_1 ? 4 : 2));
      __m128i lo = _mm_and_si128(q, nib), hi = _mm_and_si128(_mm_srli_epi16(q, 4), nib);
      if constexpr (KIND == kQ4_0) {
        lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
        hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
      }
      to_floats(lo, hi, w);
    }
    if constexpr (KIND == kQ4_1) {
      const __m256 m = _mm256_set1_ps(half_fast(p + 2));
      for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(d, w[i], m);
    } else {
      for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, w[i]);
    }
  }
  if constexpr (BF16) {
    for (int i = 0; i < 4; ++i) w[i] = round_bf16(w[i]);
  }
}

inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// R output rows n..n+R-1 for all M input rows; one accumulator each (16 registers: the four
// weight vectors and R * M <= 8 sums), x read from cache by the FMAs.
template <int KIND, bool BF16, int M, int R>
inline void dot_rows(const float* x, int64_t K, const uint8_t* row0, int64_t row_bytes, float* acc_out) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t nb = K / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_slice(row0, R * row_bytes, nb, b);
    const float* xb = x + b * kBlock;
    for (int r = 0; r < R; ++r) {
      __m256 w[4];
      dequant_block<KIND, BF16>(row0 + r * row_bytes, b, w);
      for (int m = 0; m < M; ++m)
        for (int i = 0; i < 4; ++i)
          acc[r][m] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xb + m * K + 8 * i), acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc_out[r * M + m] = reduce_add(acc[r][m]);
}

#else  // portable

template <int KIND, bool BF16, int M, int R>
inline void dot_rows(const float* x, int64_t K, const uint8_t* row0, int64_t row_bytes, float* acc_out) {
  for (int r = 0; r < R; ++r) {
    float acc[M][kBlock] = {};
    float w[kBlock];
    for (int64_t b = 0; b < K / kBlock; ++b) {
      dequant_block<KIND, BF16>(row0 + r * row_bytes, b, w);
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < kBlock; ++j) acc[m][j] += w[j] * x[m * K + b * kBlock + j];
    }
    for (int m = 0; m < M; ++m) {
      float s = 0.0f;
      for (int j = 0; j < kBlock; ++j) s += acc[m][j];
      acc_out[r * M + m] = s;
    }
  }
}

#endif

template <typename Out>
inline void store(Out* out, int64_t N, int64_t n, int M, int R, const float* sums) {
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[m * N + n + r] = static_cast<Out>(sums[r * M + m]);
}

// Input as float32 (widened from bfloat16 if need be), or bfloat16 bits for vdpbf16ps.
template <int KIND, bool BF16, int M, int R, typename In>
inline void dot(const In* x, int64_t K, const uint8_t* row0, int64_t row_bytes, float* sums) {
#ifdef ZL_DPBF16
  if constexpr (std::is_same_v<In, uint16_t>) {
    dot_rows_bf16<KIND, M, R>(x, K, row0, row_bytes, sums);
    return;
  } else
#endif
  {
    dot_rows<KIND, BF16, M, R>(x, K, row0, row_bytes, sums);
  }
}

// Output rows [n0, n1): R at a time, then one at a time.
template <int KIND, bool BF16, int M, typename In, typename Out>
void rows_range(const In* x, int64_t K, const uint8_t* blocks, int64_t row_bytes, Out* out,
                int64_t N, int64_t n0, int64_t n1) {
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
  float sums[R * M];
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    dot<KIND, BF16, M, R>(x, K, blocks + n * row_bytes, row_bytes, sums);
    store(out, N, n, M, R, sums);
  }
  for (; n < n1; ++n) {
    dot<KIND, BF16, M, 1>(x, K, blocks + n * row_bytes, row_bytes, sums);
    store(out, N, n, M, 1, sums);
  }
}

// One matrix of a product: its blocks, its kind, and the output columns it fills.
struct Part {
  const uint8_t* blocks;
  int64_t row_bytes, kind, rows, first;  // first: its first output column
};

// Output rows [n0, n1) of one part (n counted from the part's first row), in cache tiles.
template <int KIND, bool BF16, typename In, typename Out>
void tiles(const In* x, int64_t M, int64_t K, const Part& p, Out* out, int64_t N, int64_t n0,
           int64_t n1) {
  // Input rows in groups of at most 8 (the accumulators of a group stay in registers), each
  // group over a tile of output rows small enough to stay in the core's caches: the weights
  // come from memory once, the later groups re-read them from cache.
  for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
    const int64_t t1 = std::min(n1, t0 + kTile);
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t g = std::min<int64_t>(8, M - m0);
      const In* xg = x + m0 * K;
      Out* og = out + m0 * N + p.first;
      switch (g) {
#define ZL_CASE(G) \
  case G: rows_range<KIND, BF16, G>(xg, K, p.blocks, p.row_bytes, og, N, t0, t1); break;
        ZL_CASE(1) ZL_CASE(2) ZL_CASE(3) ZL_CASE(4) ZL_CASE(5) ZL_CASE(6) ZL_CASE(7) ZL_CASE(8)
#undef ZL_CASE
      }
    }
  }
}

// x @ [w_0; w_1; ...].T: the parts' output rows laid side by side in one [M, N] output, split
// between threads as one range of N (a part of another kind is another inner loop, not
// another call or another wake of the thread team).
template <bool BF16, typename In, typename Out>
void run(const In* x, int64_t M, int64_t K, const std::vector<Part>& parts, Out* out, int64_t N) {
  // Chunks of at least 64 outputs per thread: the smallest matrices are not worth waking a
  // second thread for more than that.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (const Part& p : parts) {
      const int64_t a = std::max(n0, p.first), b = std::min(n1, p.first + p.rows);
      if (a >= b) continue;
      with_kind(p.kind, [&](auto k) {
        tiles<decltype(k)::value, BF16>(x, M, K, p, out, N, a - p.first, b - p.first);
      });
    }
  });
}

// The parts of a product with K inputs, checked; N: their output rows together.
std::vector<Part> parts_of(int64_t K, at::TensorList blocks, at::IntArrayRef kinds, int64_t& N) {
  TORCH_CHECK(!blocks.empty() && blocks.size() == kinds.size(), "qmatmul: one kind a part");
  std::vector<Part> parts;
  N = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const at::Tensor& b = blocks[i];
    TORCH_CHECK(b.dim() == 2 && b.scalar_type() == at::kByte && b.is_contiguous(),
                "qmatmul: blocks [N, bytes] uint8");
    const Layout lay = layout(kinds[i]);
    TORCH_CHECK(K % lay.weights == 0 && b.size(1) == K / lay.weights * lay.bytes,
                "qmatmul: blocks of ", b.size(1), " bytes a row do not hold K = ", K);
    parts.push_back({b.data_ptr<uint8_t>(), b.size(1), kinds[i], b.size(0), N});
    N += b.size(0);
  }
  return parts;
}

at::Tensor qmatmul_parts(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef kinds) {
  TORCH_CHECK(x.dim() == 2, "qmatmul: x [M, K]");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "qmatmul: x float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  int64_t N = 0;
  const std::vector<Part> parts = parts_of(K, blocks, kinds, N);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
#ifdef ZL_DPBF16
  if (bf16) {
    const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    run<true>(xb, M, K, parts, out.data_ptr<at::BFloat16>(), N);
    return out;
  }
#endif
  // bfloat16 input widened here (exact) rather than by a torch op: one dispatch less per call.
  std::vector<float> widened;
  const float* xp;
  if (bf16) {
    widened.resize(M * K);
    const at::BFloat16* src = xc.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) widened[i] = static_cast<float>(src[i]);
    xp = widened.data();
  } else {
    xp = xc.data_ptr<float>();
  }
  if (bf16) {
    run<true>(xp, M, K, parts, out.data_ptr<at::BFloat16>(), N);
  } else {
    run<false>(xp, M, K, parts, out.data_ptr<float>(), N);
  }
  return out;
}

at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& blocks, int64_t kind) {
  return qmatmul_parts(x, {blocks}, {kind});
}

template <int KIND, bool BF16>
void dequant_rows(const uint8_t* blocks, int64_t row_bytes, int64_t N, int64_t K, float* out) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < K / kBlock; ++b)
      dequant_block<KIND, BF16>(blocks + n * row_bytes, b, out + n * K + b * kBlock);
}

// The weights as the portable dequantization computes them (qmatmul's AVX-512 weights are
// checked against this and the gguf package's values by multiplying an identity).
at::Tensor dequantize(const at::Tensor& blocks, int64_t kind, bool bf16) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "dequantize: blocks [N, bytes] uint8");
  const Layout lay = layout(kind);
  TORCH_CHECK(blocks.size(1) % lay.bytes == 0, "dequantize: rows are not whole blocks");
  const int64_t N = blocks.size(0), K = blocks.size(1) / lay.bytes * lay.weights;
  at::Tensor out = at::empty({N, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_kind(kind, [&](auto k) {
    if (bf16) dequant_rows<decltype(k)::value, true>(bp, blocks.size(1), N, K, op);
    else dequant_rows<decltype(k)::value, false>(bp, blocks.size(1), N, K, op);
  });
  return out;
}

#include "q8dot.h"  // the products with 8-bit activations

}  // namespace

TORCH_LIBRARY(zerolayer, m) {
  m.def("qmatmul(Tensor x, Tensor blocks, int kind) -> Tensor");
  m.def("qmatmul_parts(Tensor x, Tensor[] blocks, int[] kinds) -> Tensor");
  m.def("dequantize(Tensor blocks, int kind, bool bfloat16) -> Tensor");
  m.def("q8matmul_parts(Tensor x, Tensor[] blocks, int[] kinds) -> Tensor");
  m.def("quantize_q8(Tensor x, int block) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(zerolayer, CPU, m) {
  m.impl("qmatmul", &qmatmul);
  m.impl("qmatmul_parts", &qmatmul_parts);
  m.impl("dequantize", &dequantize);
  m.impl("q8matmul_parts", &q8matmul_parts);
  m.impl("quantize_q8", &quantize_q8);
}
