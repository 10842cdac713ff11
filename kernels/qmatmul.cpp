// Matrix products on llama.cpp's GGUF blocks, dequantized in registers: y = x @ w.T.
//
// Registers two ops (kernels/qmatmul.py builds and loads this file):
//   zerolayer::qmatmul(x [M, K] float32 or bfloat16, blocks [N, K / 32 * bytes] uint8, kind)
//     -> [M, N] in x's dtype;
//   zerolayer::dequantize(blocks, kind, bfloat16) -> [N, K] float32, the weights qmatmul uses.
// kind: 0 = Q4_0 (w = d * (q - 8)), 1 = Q4_1 (w = d * q + m), 2 = Q8_0 (w = d * q); d and m are
// float16, blocks of 32 weights (layouts in gateway/models/gguf_blocks.py).
//
// A weight is the float32 value the gguf package's dequantization gives: d * q is exact in
// float32 (11 + 8 significant bits at most), so d * q + m is rounded once, fused or not. With
// bfloat16 input the weight is then rounded to bfloat16 (to nearest, ties to even, as
// Tensor.to(torch.bfloat16) rounds the dense weights). Products are summed in float32 and the
// output rounded to x's dtype once: the dense path's weights, summed in another order.
//
// Two implementations of the same arithmetic, chosen at build time: AVX-512 (when compiled with
// -mavx512f -mavx512bw -mf16c; bfloat16 products by vdpbf16ps with -mavx512bf16) and plain C++
// the compiler vectorises for other CPUs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#define ZL_AVX512 1
// How many groups of R rows ahead to prefetch (2 measured a little faster than 1 or 4 on
// whole SmolLM2 decode steps).
#define ZL_AHEAD 2
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2;
constexpr int64_t kTile = 64;  // output rows per cache tile: 64 x 612 bytes at most for SmolLM2

template <int KIND>
constexpr int64_t kBytes = KIND == kQ4_0 ? 18 : (KIND == kQ4_1 ? 20 : 34);  // one block's

int64_t block_bytes(int64_t kind) {
  TORCH_CHECK(kind == kQ4_0 || kind == kQ4_1 || kind == kQ8_0, "unknown block kind ", kind);
  return kind == kQ4_0 ? kBytes<kQ4_0> : (kind == kQ4_1 ? kBytes<kQ4_1> : kBytes<kQ8_0>);
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Round a float32 to the nearest bfloat16 (ties to even), kept as float32. Weights are finite.
inline float round_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&v, &bits, 4);
  return v;
}

// One block's 32 weights into w, element order.
template <int KIND, bool BF16>
inline void dequant_block(const uint8_t* p, float* w) {
  const float d = half_at(p);
  if constexpr (KIND == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(q[j]);
  } else {
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

#ifdef ZL_AVX512

inline __m512 round_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(int(0xFFFF0000u))));
}

inline float half_fast(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// A block's weights as two vectors (elements 0..15, 16..31). 4-bit types: a 16-entry table of
// the block's 16 possible weights, indexed by the nibbles (permutexvar reads an index's low 4
// bits, so the low nibbles need no mask).
template <int KIND, bool BF16>
inline void dequant_block(const uint8_t* p, __m512& w0, __m512& w1) {
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
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
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

// The R rows a dot product reads (R * row_bytes bytes from row0) are R short streams that the
// hardware prefetcher barely learns before they end: at block b of nb, fetch slice b of the
// rows ZL_AHEAD groups further on (contiguous after these).
inline void prefetch_slice(const uint8_t* row0, int64_t group, int64_t nb, int64_t b) {
  const uint8_t* ahead = row0 + ZL_AHEAD * group;
  for (int64_t off = (b * group / nb) & ~int64_t(63); off < (b + 1) * group / nb; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
}

// R output rows n..n+R-1 for all M input rows; R * M * 2 accumulators stay in registers.
template <int KIND, bool BF16, int M, int R>
inline void dot_rows(const float* x, int64_t K, const uint8_t* row0, int64_t row_bytes, float* acc_out) {
  constexpr int64_t bytes = kBytes<KIND>;
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
      dequant_block<KIND, BF16>(row0 + r * row_bytes + b * bytes, w0, w1);
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
inline __m512bh block_bf16(const uint8_t* p) {
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
  constexpr int64_t bytes = kBytes<KIND>;
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
      const __m512bh w = block_bf16<KIND>(row0 + r * row_bytes + b * bytes);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], w, xs[m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc_out[r * M + m] = _mm512_reduce_add_ps(acc[r][m]);
}
#define ZL_DPBF16 1
#endif

#else  // portable

template <int KIND, bool BF16, int M, int R>
inline void dot_rows(const float* x, int64_t K, const uint8_t* row0, int64_t row_bytes, float* acc_out) {
  constexpr int64_t bytes = kBytes<KIND>;
  for (int r = 0; r < R; ++r) {
    float acc[M][kBlock] = {};
    float w[kBlock];
    for (int64_t b = 0; b < K / kBlock; ++b) {
      dequant_block<KIND, BF16>(row0 + r * row_bytes + b * bytes, w);
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

template <int KIND, bool BF16, typename In, typename Out>
void run(const In* x, int64_t M, int64_t K, const uint8_t* blocks, int64_t row_bytes, Out* out,
         int64_t N) {
  // Row chunks of at least 64 outputs per thread: the smallest matrices are not worth waking
  // a second thread for more than that.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    // Input rows in groups of at most 8 (the accumulators of a group stay in registers), each
    // group over a tile of output rows small enough to stay in the core's caches: the weights
    // come from memory once, the later groups re-read them from cache.
    for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
      const int64_t t1 = std::min(n1, t0 + kTile);
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t g = std::min<int64_t>(8, M - m0);
        const In* xg = x + m0 * K;
        Out* og = out + m0 * N;
        switch (g) {
#define ZL_CASE(G) \
  case G: rows_range<KIND, BF16, G>(xg, K, blocks, row_bytes, og, N, t0, t1); break;
          ZL_CASE(1) ZL_CASE(2) ZL_CASE(3) ZL_CASE(4) ZL_CASE(5) ZL_CASE(6) ZL_CASE(7) ZL_CASE(8)
#undef ZL_CASE
        }
      }
    }
  });
}

at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2, "qmatmul: x [M, K] and blocks [N, bytes]");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous(), "qmatmul: blocks uint8");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "qmatmul: x float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  const int64_t bytes = block_bytes(kind);
  TORCH_CHECK(K % kBlock == 0 && blocks.size(1) == K / kBlock * bytes,
              "qmatmul: blocks of ", blocks.size(1), " bytes a row do not hold K = ", K);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
#ifdef ZL_DPBF16
  if (bf16) {
    const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    auto* op = out.data_ptr<at::BFloat16>();
    if (kind == kQ4_0) run<kQ4_0, true>(xb, M, K, bp, blocks.size(1), op, N);
    else if (kind == kQ4_1) run<kQ4_1, true>(xb, M, K, bp, blocks.size(1), op, N);
    else run<kQ8_0, true>(xb, M, K, bp, blocks.size(1), op, N);
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
    auto* op = out.data_ptr<at::BFloat16>();
    if (kind == kQ4_0) run<kQ4_0, true>(xp, M, K, bp, blocks.size(1), op, N);
    else if (kind == kQ4_1) run<kQ4_1, true>(xp, M, K, bp, blocks.size(1), op, N);
    else run<kQ8_0, true>(xp, M, K, bp, blocks.size(1), op, N);
  } else {
    auto* op = out.data_ptr<float>();
    if (kind == kQ4_0) run<kQ4_0, false>(xp, M, K, bp, blocks.size(1), op, N);
    else if (kind == kQ4_1) run<kQ4_1, false>(xp, M, K, bp, blocks.size(1), op, N);
    else run<kQ8_0, false>(xp, M, K, bp, blocks.size(1), op, N);
  }
  return out;
}

template <int KIND, bool BF16>
void dequant_rows(const uint8_t* blocks, int64_t row_bytes, int64_t N, int64_t K, float* out) {
  constexpr int64_t bytes = kBytes<KIND>;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < K / kBlock; ++b)
      dequant_block<KIND, BF16>(blocks + n * row_bytes + b * bytes, out + n * K + b * kBlock);
}

// The weights as the portable dequantization computes them (qmatmul's AVX-512 weights are
// checked against this and the gguf package's values by multiplying an identity).
at::Tensor dequantize(const at::Tensor& blocks, int64_t kind, bool bf16) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "dequantize: blocks [N, bytes] uint8");
  const int64_t bytes = block_bytes(kind);
  TORCH_CHECK(blocks.size(1) % bytes == 0, "dequantize: rows are not whole blocks");
  const int64_t N = blocks.size(0), K = blocks.size(1) / bytes * kBlock;
  at::Tensor out = at::empty({N, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (bf16) {
    if (kind == kQ4_0) dequant_rows<kQ4_0, true>(bp, blocks.size(1), N, K, op);
    else if (kind == kQ4_1) dequant_rows<kQ4_1, true>(bp, blocks.size(1), N, K, op);
    else dequant_rows<kQ8_0, true>(bp, blocks.size(1), N, K, op);
  } else {
    if (kind == kQ4_0) dequant_rows<kQ4_0, false>(bp, blocks.size(1), N, K, op);
    else if (kind == kQ4_1) dequant_rows<kQ4_1, false>(bp, blocks.size(1), N, K, op);
    else dequant_rows<kQ8_0, false>(bp, blocks.size(1), N, K, op);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(zerolayer, m) {
  m.def("qmatmul(Tensor x, Tensor blocks, int kind) -> Tensor");
  m.def("dequantize(Tensor blocks, int kind, bool bfloat16) -> Tensor");
}

TORCH_LIBRARY_IMPL(zerolayer, CPU, m) {
  m.impl("qmatmul", &qmatmul);
  m.impl("dequantize", &dequantize);
}
