// Products on GGUF blocks with 8-bit activations: each input row quantized once per call to
// int8 blocks (symmetric, d = max|x| / 127, rounded to nearest even), the weights' quants
// multiplied into exact int32 sums, scaled once per block. ggml-cpu's q8_K / q8_0 scheme,
// written from the block layouts: faster than dequantizing every weight to float (the float
// path of qmatmul.cpp, kept bit-exact for the float32 parity mode), at the price of the
// activations' rounding (benchmarks/kl.py measures its distance to the float path).
//
// Included by qmatmul.cpp inside its namespace, after the block layouts and Part. Registers
// (there) zerolayer::q8matmul_parts(x, blocks, kinds), the int8 twin of qmatmul_parts, and
// zerolayer::quantize_q8(x, block) -> (d, q, bsum), the activations as the products read them.
//
// Activation blocks: 256 values (the K-quants' super-block) for Q4_K / Q5_K / Q6_K, 32 for
// Q4_0 / Q4_1 / Q8_0, each with sums of 16 (Q4_K / Q5_K subtract dmin * m times them, Q4_0 and
// Q4_1 take the block's sum). A block's integer sum per weight block:
//   Q4_K, Q5_K: d * dy * sum_j sc_j * sum(q * y) - dmin * dy * sum_j m_j * sum(y)  (q unsigned)
//   Q6_K:       d * dy * sum_g sc_g * sum((q - 32) * y)                              (16 a scale)
//               (AVX2: sum_g sc_g * sum(q * y) - 32 * sum_g sc_g * bsum_g, q unsigned, the same integer)
//   Q8_0:       d * dy * sum(q * y); Q4_0: q - 8 in place of q; Q4_1: d * dy * sum(q * y) + m * dy * sum(y)
// No int16 saturation: 0 <= q <= 63 (Q6_K; Q5_K 31), |y| <= 127, so maddubs' pairs are at most
// 2 * 63 * 127 = 16,002; Q8_0's signed q (|q| <= 128) is multiplied with the sign trick
// (|q| times y with q's sign), pairs at most 2 * 128 * 127 = 32,512 < 32,767.
//
// The AVX-512 build runs the 256-bit code (AVX-512 implies AVX2); VNNI's dpbusd is not used.

template <int QK>
struct Q8 {  // one activation block
  float d;
  int16_t bsum[QK / 16];  // sums of the quants, 16 at a time
  int8_t q[QK];
};

// x [K] -> K / QK blocks. d * q approximates x; the rounding is np.rint's (nearest, ties even).
template <int QK>
void quantize_row_q8(const float* x, int64_t K, Q8<QK>* y) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + QK * b;
    float amax = 0.0f;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
    y[b].d = amax / 127.0f;
    const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
#if defined(ZL_AVX512) || defined(ZL_AVX2)
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int i = 0; i < QK; i += 32) {
      __m256i v[4];
      for (int k = 0; k < 4; ++k)
        v[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * k), vinv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256i a = _mm256_packs_epi32(v[0], v[1]), c = _mm256_packs_epi32(v[2], v[3]);
      const __m256i bytes =
          _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, c), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].q + i), bytes);
    }
#else
    for (int i = 0; i < QK; ++i) y[b].q[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
#endif
    for (int g = 0; g < QK / 16; ++g) {
      int s = 0;
      for (int l = 0; l < 16; ++l) s += y[b].q[16 * g + l];
      y[b].bsum[g] = static_cast<int16_t>(s);
    }
  }
}

template <int KIND>
constexpr int kActBlock = kSuper<KIND> ? 256 : 32;

#if defined(ZL_AVX512) || defined(ZL_AVX2)

inline float q8_hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// sum(w * y) by pairs of int16 (w signed, |w| <= 128): |w| times y with w's sign.
inline __m256i mul_signed(__m256i w, __m256i y) {
  return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
}

// One weight row's K-quant super-blocks against M activation rows: the block's quants
// unpacked once (eight vectors of 32, unsigned, Q6_K's too) and reused
// for every activation row.
template <int KIND, int M>
void q8_row_k(const uint8_t* row, int64_t nb, const Q8<256>* const* y, float* out) {
  __m256 acc[M];
  __m128 accm[M];
  for (int m = 0; m < M; ++m) {
    acc[m] = _mm256_setzero_ps();
    accm[m] = _mm_setzero_ps();
  }
  const __m256i m4 = _mm256_set1_epi8(15);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + kBytes<KIND> * b;
    _mm_prefetch(reinterpret_cast<const char*>(p + 4 * kBytes<KIND>), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + 4 * kBytes<KIND> + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + 4 * kBytes<KIND> + 128), _MM_HINT_T0);
    __m256i q[8];       // weights 32i .. 32i + 31
    __m256i scale[8];   // int16 scales of q[i]: low lane weights 0..15, high lane 16..31
    float d, dmin = 0.0f;
    __m128i mins = _mm_setzero_si128();  // Q4_K / Q5_K: the 8 mins as int16
    __m256i sc16 = _mm256_setzero_si256();  // Q6_K: the 16 scales as int16
    if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
      d = half_fast(p);
      dmin = half_fast(p + 2);
      // The 12 bytes of 6-bit scales and mins rearranged as 8 scale bytes, then 8 min bytes
      // (scale_min_k4 for all eight at once).
      uint32_t u[4];
      std::memcpy(u, p + 4, 12);
      const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
      u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
      const uint32_t low_mins = u[1] & k1;
      u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
      u[2] = low_mins;
      u[0] &= k1;
      const __m256i both = _mm256_cvtepu8_epi16(_mm_set_epi32(int(u[3]), int(u[2]), int(u[1]), int(u[0])));
      mins = _mm256_extracti128_si256(both, 1);
      const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(both));
      for (int c = 0; c < 8; ++c)  // int16 scale c in every lane: its bytes 2c, 2c + 1
        scale[c] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>((2 * c) | ((2 * c + 1) << 8))));
      const uint8_t* ql = p + (KIND == kQ4_K ? 16 : 48);
      for (int j = 0; j < 4; ++j) {
        const __m256i bits = load32(ql + 32 * j);
        q[2 * j] = _mm256_and_si256(bits, m4);
        q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
      }
      if constexpr (KIND == kQ5_K) {
        const __m256i qh = load32(p + 16), one = _mm256_set1_epi8(1);
        for (int c = 0; c < 8; ++c)
          q[c] = _mm256_or_si256(
              q[c], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, c), one), 4));
      }
    } else {  // Q6_K
      d = half_fast(p + 208);
      const uint8_t* ql = p;
      const uint8_t* qh = p + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
      const __m256i m3 = _mm256_set1_epi8(3);
      for (int n = 0; n < 2; ++n) {
        const __m256i l0 = load32(ql + 64 * n), l1 = load32(ql + 64 * n + 32), h = load32(qh + 32 * n);
        const __m256i lows[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                                 _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                 _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
        for (int g = 0; g < 4; ++g) {  // q unsigned (0..63): the -32 is taken out with the bsums
          const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * g), m3), 4);
          q[4 * n + g] = _mm256_or_si256(lows[g], hi);
        }
      }
      sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
      for (int c = 0; c < 8; ++c)
        scale[c] = _mm256_setr_m128i(_mm_set1_epi16(sc[2 * c]), _mm_set1_epi16(sc[2 * c + 1]));
    }
    for (int m = 0; m < M; ++m) {
      const Q8<256>& a = y[m][b];
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      for (int c = 0; c < 8; c += 2) {
        const __m256i p0 = _mm256_maddubs_epi16(q[c], load32(a.q + 32 * c));
        const __m256i p1 = _mm256_maddubs_epi16(q[c + 1], load32(a.q + 32 * c + 32));
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(scale[c], p0));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(scale[c + 1], p1));
      }
      if constexpr (KIND == kQ6_K)  // sum_g sc_g * sum((q - 32) * y) = ... - 32 * sum_g sc_g * bsum_g
        s0 = _mm256_sub_epi32(s0, _mm256_slli_epi32(_mm256_madd_epi16(sc16, load32(a.bsum)), 5));
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc[m]);
      if constexpr (KIND != kQ6_K) {  // sum_c m_c * (sum of y over chunk c)
        const __m256i bs = load32(a.bsum);
        const __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
        accm[m] = _mm_fmadd_ps(_mm_set1_ps(dmin * a.d), _mm_cvtepi32_ps(_mm_madd_epi16(mins, pairs)), accm[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    __m128 s = _mm_add_ps(accm[m], _mm_movehl_ps(accm[m], accm[m]));
    out[m] = q8_hsum(acc[m]) - _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
}

// One weight row's 32-weight blocks (Q4_0, Q4_1, Q8_0) against M activation rows.
template <int KIND, int M>
void q8_row_32(const uint8_t* row, int64_t nb, const Q8<32>* const* y, float* out) {
  __m256 acc[M];
  float accm[M];
  for (int m = 0; m < M; ++m) {
    acc[m] = _mm256_setzero_ps();
    accm[m] = 0.0f;
  }
  const __m128i m4 = _mm_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + kBytes<KIND> * b;
    _mm_prefetch(reinterpret_cast<const char*>(p + 8 * kBytes<KIND>), _MM_HINT_T0);
    const float d = half_fast(p);
    __m256i q;
    if constexpr (KIND == kQ8_0) {
      q = load32(p + 2);
    } else {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (KIND == kQ4_1 ? 4 : 2)));
      q = _mm256_setr_m128i(_mm_and_si128(bytes, m4), _mm_and_si128(_mm_srli_epi16(bytes, 4), m4));
      if constexpr (KIND == kQ4_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
    }
    const float mn = KIND == kQ4_1 ? half_fast(p + 2) : 0.0f;
    for (int m = 0; m < M; ++m) {
      const Q8<32>& a = y[m][b];
      const __m256i ya = load32(a.q);
      __m256i pr;
      if constexpr (KIND == kQ4_1) pr = _mm256_maddubs_epi16(q, ya);  // q unsigned
      else pr = mul_signed(q, ya);
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(_mm256_madd_epi16(pr, ones)), acc[m]);
      if constexpr (KIND == kQ4_1) accm[m] += mn * a.d * static_cast<float>(a.bsum[0] + a.bsum[1]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = q8_hsum(acc[m]) + accm[m];
}

#else  // portable: the same integer sums, one weight at a time

// Weight i of a block as an integer, and the block's scale of it (the K-quants' sc).
template <int KIND>
inline void q8_weights(const uint8_t* p, int qv[], int sc[]) {
  if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    const uint8_t* ql = p + (KIND == kQ4_K ? 16 : 48);
    for (int c = 0; c < 8; ++c) {
      int s, m;
      scale_min_k4(p + 4, c, s, m);
      for (int l = 0; l < 32; ++l) {
        int q = (ql[32 * (c / 2) + l] >> (4 * (c & 1))) & 15;
        if constexpr (KIND == kQ5_K) q |= ((p[16 + l] >> c) & 1) << 4;
        qv[32 * c + l] = q;
        sc[32 * c + l] = s;
      }
    }
  } else if constexpr (KIND == kQ6_K) {
    const int8_t* s = reinterpret_cast<const int8_t*>(p + 192);
    for (int c = 0; c < 8; ++c) {
      const int n = c / 4, g = c % 4;
      const uint8_t* ql = p + 64 * n + 32 * (g & 1);
      const uint8_t* qh = p + 128 + 32 * n;
      for (int l = 0; l < 32; ++l) {
        qv[32 * c + l] = (((ql[l] >> (4 * (g >> 1))) & 15) | (((qh[l] >> (2 * g)) & 3) << 4)) - 32;
        sc[32 * c + l] = s[2 * c + l / 16];
      }
    }
  } else if constexpr (KIND == kQ8_0) {
    for (int l = 0; l < 32; ++l) qv[l] = reinterpret_cast<const int8_t*>(p + 2)[l];
  } else {
    const uint8_t* q = p + (KIND == kQ4_1 ? 4 : 2);
    const int off = KIND == kQ4_0 ? 8 : 0;
    for (int l = 0; l < 16; ++l) {
      qv[l] = (q[l] & 15) - off;
      qv[l + 16] = (q[l] >> 4) - off;
    }
  }
}

template <int KIND, int M>
void q8_row(const uint8_t* row, int64_t nb, const Q8<kActBlock<KIND>>* const* y, float* out) {
  constexpr int QK = kActBlock<KIND>;
  float acc[M] = {};
  int qv[QK], sc[QK];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + kBytes<KIND> * b;
    q8_weights<KIND>(p, qv, sc);
    for (int m = 0; m < M; ++m) {
      const Q8<QK>& a = y[m][b];
      int sum = 0;
      if constexpr (kSuper<KIND>) {
        for (int i = 0; i < QK; ++i) sum += sc[i] * qv[i] * a.q[i];
      } else {
        for (int i = 0; i < QK; ++i) sum += qv[i] * a.q[i];
      }
      if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
        int sm = 0;
        for (int c = 0; c < 8; ++c) {
          int s, mn;
          scale_min_k4(p + 4, c, s, mn);
          sm += mn * (a.bsum[2 * c] + a.bsum[2 * c + 1]);
        }
        acc[m] += half_at(p) * a.d * static_cast<float>(sum) - half_at(p + 2) * a.d * static_cast<float>(sm);
      } else if constexpr (KIND == kQ6_K) {
        acc[m] += half_at(p + 208) * a.d * static_cast<float>(sum);
      } else {
        acc[m] += half_at(p) * a.d * static_cast<float>(sum);
        if constexpr (KIND == kQ4_1) acc[m] += half_at(p + 2) * a.d * static_cast<float>(a.bsum[0] + a.bsum[1]);
      }
    }
  }
  for (int m = 0; m < M; ++m) out[m] = acc[m];
}

#endif

// One weight row against M activation rows: out[m] for m < M.
template <int KIND, int M>
inline void q8_dot_row(const uint8_t* row, int64_t nb, const Q8<kActBlock<KIND>>* const* y, float* out) {
#if defined(ZL_AVX512) || defined(ZL_AVX2)
  if constexpr (kSuper<KIND>) q8_row_k<KIND, M>(row, nb, y, out);
  else q8_row_32<KIND, M>(row, nb, y, out);
#else
  q8_row<KIND, M>(row, nb, y, out);
#endif
}

// The activations of a call, quantized once: every input row in both block sizes a part needs.
struct Q8Input {
  int64_t M, K;
  std::vector<Q8<256>> k;  // [M][K / 256], when a part is a K-quant
  std::vector<Q8<32>> b;   // [M][K / 32], when a part is Q4_0 / Q4_1 / Q8_0
  template <int QK>
  const Q8<QK>* rows(int64_t m) const {
    if constexpr (QK == 256) return k.data() + m * (K / 256);
    else return b.data() + m * (K / 32);
  }
};

// Output rows [n0, n1) of one part, 64-row tiles, input rows in groups of at most 8.
template <int KIND>
void q8_tiles(const Q8Input& in, const Part& p, float* out, int64_t N, int64_t n0, int64_t n1) {
  constexpr int QK = kActBlock<KIND>;
  const int64_t nb = in.K / QK;
  for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
    const int64_t t1 = std::min(n1, t0 + kTile);
    for (int64_t m0 = 0; m0 < in.M; m0 += 8) {
      const int64_t g = std::min<int64_t>(8, in.M - m0);
      const Q8<QK>* y[8];
      for (int64_t m = 0; m < g; ++m) y[m] = in.rows<QK>(m0 + m);
      float sums[8];
      for (int64_t n = t0; n < t1; ++n) {
        const uint8_t* row = p.blocks + n * p.row_bytes;
        switch (g) {
#define ZL_CASE(G) \
  case G: q8_dot_row<KIND, G>(row, nb, y, sums); break;
          ZL_CASE(1) ZL_CASE(2) ZL_CASE(3) ZL_CASE(4) ZL_CASE(5) ZL_CASE(6) ZL_CASE(7) ZL_CASE(8)
#undef ZL_CASE
        }
        for (int64_t m = 0; m < g; ++m) out[(m0 + m) * N + p.first + n] = sums[m];
      }
    }
  }
}

at::Tensor q8matmul_parts(const at::Tensor& x, at::TensorList blocks, at::IntArrayRef kinds) {
  TORCH_CHECK(x.dim() == 2, "q8matmul: x [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "q8matmul: x float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  int64_t N = 0;
  const std::vector<Part> parts = parts_of(K, blocks, kinds, N);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  Q8Input in{M, K, {}, {}};
  bool super = false, small = false;
  for (const Part& p : parts) (p.kind >= kQ4_K ? super : small) = true;
  if (super) in.k.resize(M * (K / 256));
  if (small) in.b.resize(M * (K / 32));
  for (int64_t m = 0; m < M; ++m) {
    if (super) quantize_row_q8<256>(xp + m * K, K, in.k.data() + m * (K / 256));
    if (small) quantize_row_q8<32>(xp + m * K, K, in.b.data() + m * (K / 32));
  }
  at::Tensor out = at::empty({M, N}, xf.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (const Part& p : parts) {
      const int64_t a = std::max(n0, p.first), b = std::min(n1, p.first + p.rows);
      if (a >= b) continue;
      with_kind(p.kind, [&](auto k) { q8_tiles<decltype(k)::value>(in, p, op, N, a - p.first, b - p.first); });
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// The activations as q8matmul_parts quantizes them, blocks of `block` (32 or 256) values:
// d [M, K / block] float32, q [M, K] int8, bsum [M, K / 16] int16.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quantize_q8: x [M, K] float32");
  TORCH_CHECK((block == 32 || block == 256) && x.size(1) % block == 0,
              "quantize_q8: block 32 or 256 dividing K");
  const int64_t M = x.size(0), K = x.size(1), nb = K / block;
  const at::Tensor xc = x.contiguous();
  at::Tensor d = at::empty({M, nb}, xc.options());
  at::Tensor q = at::empty({M, K}, xc.options().dtype(at::kChar));
  at::Tensor s = at::empty({M, K / 16}, xc.options().dtype(at::kShort));
  auto copy_out = [&](auto* blocks, int qk) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        const auto& a = blocks[m * nb + b];
        d.data_ptr<float>()[m * nb + b] = a.d;
        std::memcpy(q.data_ptr<int8_t>() + m * K + b * qk, a.q, qk);
        std::memcpy(s.data_ptr<int16_t>() + m * (K / 16) + b * (qk / 16), a.bsum, 2 * (qk / 16));
      }
  };
  if (block == 256) {
    std::vector<Q8<256>> y(M * nb);
    for (int64_t m = 0; m < M; ++m) quantize_row_q8<256>(xc.data_ptr<float>() + m * K, K, y.data() + m * nb);
    copy_out(y.data(), 256);
  } else {
    std::vector<Q8<32>> y(M * nb);
    for (int64_t m = 0; m < M; ++m) quantize_row_q8<32>(xc.data_ptr<float>() + m * K, K, y.data() + m * nb);
    copy_out(y.data(), 32);
  }
  return {d, q, s};
}
