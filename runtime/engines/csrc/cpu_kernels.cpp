// Kernels for the embedded engine on CPUs with AVX512-BF16 and no AMX, as torch ops: the lean runner's bf16 attention
// (prompt chunks, decode rows) and the RMSNorm and rotary passes around it, and the sampler's argmax and log-sum-exp.
//
// torch.ops.loopwise.prompt_attention(q, k, v, start, scale) -> out: a prompt chunk's causal attention
//   q (n, H, D) bf16, the chunk's queries at positions start .. start + n - 1 (rows may be strided; D contiguous)
//   k, v (K, L, D) bf16, the prompt's keys and values, L >= start + n; query i sees keys 0 .. start + i
//   out (n, H, D) bf16: softmax(q k^T * scale) v per head, query heads grouped per kv head (H = G K)
// Flash attention (Dao et al., 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness")
// over tiles of 4 queries x 64 keys: scores q k^T and the product P v both with vdpbf16ps (a pair of bf16 products
// per fp32 lane), the running softmax in fp32 (base 2), P rounded to bf16 before P v as GPU flash attention does.
// K and V are first repacked per kv head into the pair layouts the instruction reads (keys across lanes for the
// scores, dimensions across lanes for P v), zero-padded to whole 64-key blocks. Work items (head, 4-query tile)
// run on ATen's thread pool, ordered so that each thread's share has about as many causal key blocks as another's.
//
// torch.ops.loopwise.decode_attention(q, k, v, lengths, scale, k_new, v_new) -> out: one query token per row over a KV pool
//   q (n, H, D) bf16; k, v (rows, K, cap, D) bf16, a pool of runner/kv_pools.py; row r sees keys 0 .. lengths[r]
//   k_new, v_new (n, K, D) bf16 or None: this step's key and value of each row, written into column lengths[r] first
//   out (n, H, D) bf16
// Reads only each row's live keys (the batched-GEMM path reads all cap columns under a mask); per (row, kv head) the
// scores by pair dot products over D, an exact softmax in fp32, P v in fp32 with V widened from bf16.
//
// torch.ops.loopwise.argmax_lse(x) -> (ids, lse): each row's first maximum and log-sum-exp, x (B, V) fp32 -> (B,)
// int64 and (B,) fp32; a row holding NaN or +inf, or only -inf, has a non-finite lse (its id is then meaningless).
//
// torch.ops.loopwise.rms_norm(x, weight, eps) and torch.ops.loopwise.rope_(x, cos, sin, heads): transformers'
// LlamaRMSNorm and rotary embedding on bf16 rows, rounding where its bf16 ops round, one pass each.
//
// Not here: masks other than causal or a length, fp32 or fp16, head dims not a multiple of 64, AMX tiles.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int kRows = 4;    // queries per tile
constexpr int kBlock = 64;  // keys per block of scores in registers: 4 vectors of 16 lanes
constexpr int kSpan = 256;  // keys per running-softmax update
constexpr int kMaxDim = 256;

// 2^x for x <= 0 (and -inf -> 0): 2^floor(x) via scalef times a degree-6 polynomial of the fraction.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(x, n);  // [0, 1)
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

inline __m512 bf16x16_to_ps(const uint16_t* p) {
  return _mm512_cvtpbh_ps(reinterpret_cast<__m256bh>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
inline __m512 round_bf16(__m512 x) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x)); }
inline void store_bf16x16(uint16_t* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
}

// The lanes 0 .. n - 1 of a 16-lane vector (none for n <= 0, all for n >= 16).
inline __mmask16 first_lanes(int64_t n) {
  if (n >= 16) return static_cast<__mmask16>(0xFFFF);
  if (n <= 0) return static_cast<__mmask16>(0);
  return static_cast<__mmask16>((1u << n) - 1u);
}

// acc[r][c] += pairs[r] . vecs[c] for 4 rows x 4 vectors of 16 fp32 lanes: vecs are 4 x 32 bf16 (16 pairs each) at
// `vecs`, pairs[r] one bf16 pair broadcast to every lane. The register tile of both the scores and P v.
inline void pair_tile(__m512 (&acc)[kRows][4], const uint16_t* vecs, const uint32_t (&pairs)[kRows]) {
  __m512i v[4];
  for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_si512(vecs + c * 32);
  for (int r = 0; r < kRows; ++r) {
    const __m512i b = _mm512_set1_epi32(static_cast<int>(pairs[r]));
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(b), as_bh(v[c]));
  }
}

// K of one kv head (L, D) -> pairs of dimensions, keys across lanes: kp[d2][t][0..1] = k[t][2 d2 .. 2 d2 + 1].
void pack_k(const uint16_t* k, int64_t row_stride, int64_t T, int64_t Tpad, int64_t D, uint16_t* kp) {
  const int64_t D2 = D / 2;
  const uint32_t* k32 = reinterpret_cast<const uint32_t*>(k);
  uint32_t* kp32 = reinterpret_cast<uint32_t*>(kp);
  for (int64_t t = 0; t < Tpad; ++t) {
    const uint32_t* src = k32 + t * (row_stride / 2);
    for (int64_t d2 = 0; d2 < D2; ++d2) kp32[d2 * Tpad + t] = t < T ? src[d2] : 0u;
  }
}

// V of one kv head (L, D) -> pairs of keys, dimensions across lanes: vp[t2][d][0..1] = v[2 t2 .. 2 t2 + 1][d].
void pack_v(const uint16_t* v, int64_t row_stride, int64_t T, int64_t Tpad, int64_t D, uint16_t* vp) {
  for (int64_t t2 = 0; t2 < Tpad / 2; ++t2) {
    const int64_t a = 2 * t2, b = 2 * t2 + 1;
    uint16_t* dst = vp + t2 * D * 2;
    for (int64_t d = 0; d < D; ++d) {
      dst[2 * d] = a < T ? v[a * row_stride + d] : 0;
      dst[2 * d + 1] = b < T ? v[b * row_stride + d] : 0;
    }
  }
}

struct Args {
  const uint16_t* q;
  int64_t q_tok, q_head;  // strides in elements
  const uint16_t* kp;     // (K, D/2, Tpad, 2)
  const uint16_t* vp;     // (K, Tpad/2, D, 2)
  uint16_t* out;          // (n, H, D)
  int64_t n, start, H, G, D, Tpad;
  float scale2;  // scale * log2(e)
};

// One tile: queries i0 .. i0 + 3 (clamped to n) of head h, over key spans of up to kSpan keys: the scores of a span
// go to a buffer (blocks of 64 keys, 4 x 4 vectors in registers), then one running-softmax update per row and span,
// then P v for the span with the output's 4 x 64 dims in registers.
void tile(const Args& a, int64_t h, int64_t i0) {
  const int64_t D = a.D, D2 = D / 2, kh = h / a.G;
  const uint16_t* kp = a.kp + kh * D2 * a.Tpad * 2;
  const uint16_t* vp = a.vp + kh * (a.Tpad / 2) * D * 2;
  const uint32_t* qrow[kRows];
  int64_t last[kRows];  // the last key each query sees
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = std::min(i0 + r, a.n - 1);
    qrow[r] = reinterpret_cast<const uint32_t*>(a.q + i * a.q_tok + h * a.q_head);
    last[r] = a.start + i;
  }
  const int64_t keys = last[kRows - 1] + 1;
  alignas(64) float o[kRows][kMaxDim];
  alignas(64) float s[kRows][kSpan];
  alignas(64) uint16_t p[kRows][kSpan];
  alignas(64) float m[kRows], l[kRows], alpha[kRows];
  for (int r = 0; r < kRows; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
    std::memset(o[r], 0, sizeof(float) * D);
  }
  const __m512 scale = _mm512_set1_ps(a.scale2);
  for (int64_t t0 = 0; t0 < keys; t0 += kSpan) {
    const int64_t nb = std::min<int64_t>(kSpan, keys - t0 + kBlock - 1) / kBlock;  // 64-key blocks in this span
    for (int64_t b = 0; b < nb; ++b) {
      __m512 acc[kRows][4];
      for (int r = 0; r < kRows; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
      const uint16_t* kb = kp + (t0 + b * kBlock) * 2;
      for (int64_t d2 = 0; d2 < D2; ++d2) {
        const uint32_t q2[kRows] = {qrow[0][d2], qrow[1][d2], qrow[2][d2], qrow[3][d2]};
        pair_tile(acc, kb + d2 * a.Tpad * 2, q2);
      }
      for (int r = 0; r < kRows; ++r)
        for (int c = 0; c < 4; ++c) _mm512_store_ps(&s[r][b * kBlock + 16 * c], _mm512_mul_ps(acc[r][c], scale));
    }
    const int nv = static_cast<int>(nb * 4);  // vectors of 16 keys
    for (int r = 0; r < kRows; ++r) {
      const int64_t room = last[r] - t0;  // keys t0 .. t0 + room are visible to this row
      __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int c = 0; c < nv; ++c) {
        const __mmask16 ok = first_lanes(room - 16 * c + 1);
        mx = _mm512_mask_max_ps(mx, ok, mx, _mm512_load_ps(&s[r][16 * c]));
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));  // finite: key 0 is visible to every row
      alpha[r] = m[r] - m_new;
      m[r] = m_new;
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < nv; ++c) {
        const __mmask16 ok = first_lanes(room - 16 * c + 1);
        const __m512 pe = _mm512_maskz_mov_ps(ok, exp2_ps(_mm512_sub_ps(_mm512_load_ps(&s[r][16 * c]), mv)));
        const __m256bh pb = _mm512_cvtneps_pbh(pe);
        sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(pb));  // what P v uses: the rounded probabilities
        _mm256_store_si256(reinterpret_cast<__m256i*>(&p[r][16 * c]), reinterpret_cast<__m256i>(pb));
      }
      l[r] = _mm512_reduce_add_ps(sum) + l[r] * exp2_ps(_mm512_set1_ps(alpha[r]))[0];
    }
    __m512 al[kRows];
    for (int r = 0; r < kRows; ++r) al[r] = exp2_ps(_mm512_set1_ps(alpha[r]));  // exp2(-inf) = 0 on the first span
    const uint16_t* vb = vp + (t0 / 2) * D * 2;
    const uint32_t* p32[kRows];
    for (int r = 0; r < kRows; ++r) p32[r] = reinterpret_cast<const uint32_t*>(p[r]);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      __m512 acc[kRows][4];
      for (int r = 0; r < kRows; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_mul_ps(_mm512_load_ps(&o[r][d0 + 16 * c]), al[r]);
      for (int t2 = 0; t2 < nv * 8; ++t2) {
        const uint32_t p2[kRows] = {p32[0][t2], p32[1][t2], p32[2][t2], p32[3][t2]};
        pair_tile(acc, vb + t2 * D * 2 + d0 * 2, p2);
      }
      for (int r = 0; r < kRows; ++r)
        for (int c = 0; c < 4; ++c) _mm512_store_ps(&o[r][d0 + 16 * c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows && i0 + r < a.n; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    uint16_t* dst = a.out + ((i0 + r) * a.H + h) * D;
    for (int64_t d = 0; d < D; d += 16) store_bf16x16(dst + d, _mm512_mul_ps(_mm512_load_ps(&o[r][d]), inv));
  }
}

torch::Tensor prompt_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q (n, H, D), k and v (K, L, D)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), K = k.size(0);
  TORCH_CHECK(D % 64 == 0 && D <= kMaxDim, "head dim must be a multiple of 64, at most ", kMaxDim);
  TORCH_CHECK(k.size(2) == D && v.size(2) == D && v.size(0) == K && H % K == 0, "shapes disagree");
  TORCH_CHECK(start >= 0 && k.size(1) >= start + n && v.size(1) >= start + n, "k and v must hold keys 0 .. start + n - 1");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "the head dim must be contiguous");
  TORCH_CHECK(q.stride(0) % 2 == 0 && q.stride(1) % 2 == 0 && k.stride(1) % 2 == 0, "strides must be even");
  auto out = torch::empty({n, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (n == 0) return out;
  const int64_t T = start + n, Tpad = (T + kBlock - 1) / kBlock * kBlock;
  auto kp = torch::empty({K, D / 2, Tpad, 2}, k.options());
  auto vp = torch::empty({K, Tpad / 2, D, 2}, v.options());
  const auto* kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* kpd = reinterpret_cast<uint16_t*>(kp.data_ptr<at::BFloat16>());
  auto* vpd = reinterpret_cast<uint16_t*>(vp.data_ptr<at::BFloat16>());
  at::parallel_for(0, 2 * K, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      const int64_t kh = j / 2;
      if (j % 2 == 0)
        pack_k(kd + kh * k.stride(0), k.stride(1), T, Tpad, D, kpd + kh * (D / 2) * Tpad * 2);
      else
        pack_v(vd + kh * v.stride(0), v.stride(1), T, Tpad, D, vpd + kh * (Tpad / 2) * D * 2);
    }
  });
  Args a{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
         q.stride(0),
         q.stride(1),
         kpd,
         vpd,
         reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
         n,
         start,
         H,
         H / K,
         D,
         Tpad,
         static_cast<float>(scale * M_LOG2E)};
  const int64_t tiles = (n + kRows - 1) / kRows;
  // item z -> (head, tile); tiles alternate from both ends (0, last, 1, last - 1, ...) so that any contiguous range of
  // items, which is what parallel_for hands a thread, holds about as many causal key blocks as any other
  at::parallel_for(0, H * tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t z = lo; z < hi; ++z) {
      const int64_t h = z % H, w = z / H;
      const int64_t t = (w % 2 == 0) ? w / 2 : tiles - 1 - w / 2;
      tile(a, h, t * kRows);
    }
  });
  return out;
}

// ---- decode rows over the runner's pools ------------------------------------------------------------------------------

// v[0..15], 16 vectors of partial sums -> one vector whose lane j is the sum of v[j]'s 16 lanes (a transposing tree of
// unpacks and 128-bit shuffles: 45 operations for 16 sums).
inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int w = 0; w < 8; ++w)  // per 128-bit lane: [v2w (0+2), v2w+1 (0+2), v2w (1+3), v2w+1 (1+3)]
    t[w] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * w], v[2 * w + 1]), _mm512_unpackhi_ps(v[2 * w], v[2 * w + 1]));
  for (int w = 0; w < 4; ++w) {  // per 128-bit lane: that lane's sums of v4w .. v4w+3
    const __m512d x = _mm512_castps_pd(t[2 * w]), y = _mm512_castps_pd(t[2 * w + 1]);
    u[w] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // across the four 128-bit lanes: lane group w of the result holds u[w]'s totals, so lane j is v[j]'s
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

// P v for NG query heads of one kv head: out[g] = sum over keys t of p[g][t] v[t], dims d0 .. d0 + 63, in fp32.
template <int NG>
void pv(const float* p, int64_t p_stride, const uint16_t* v, int64_t D, int64_t keys, int64_t d0, float* out, int64_t out_stride) {
  __m512 acc[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < keys; ++t) {
    const uint16_t* vt = v + t * D + d0;
    __m512 vv[4];
    for (int c = 0; c < 4; ++c) vv[c] = bf16x16_to_ps(vt + 16 * c);
    for (int g = 0; g < NG; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * p_stride + t]);
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(pg, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + g * out_stride + d0 + 16 * c, acc[g][c]);
}

struct DecodeArgs {
  const uint16_t* q;
  int64_t q_tok, q_head;  // strides in elements
  uint16_t* k;            // (rows, K, cap, D)
  uint16_t* v;
  const uint16_t* k_new;  // (n, K, D) with strides new_tok, new_head, 1; nullptr: the pools hold this step's keys already
  const uint16_t* v_new;
  int64_t k_new_tok, k_new_head, v_new_tok, v_new_head;
  const int64_t* lengths;
  uint16_t* out;  // (n, H, D)
  int64_t K, G, D, cap;
  float scale2;  // scale * log2(e)
};

// One (row, kv head): its G query heads over keys 0 .. lengths[row] (the column this step wrote included). Scores by
// pair dot products over D (16 keys' partial sums reduced at once), an exact two-pass softmax in fp32, P v in fp32.
void decode_item(const DecodeArgs& a, int64_t row, int64_t kh, std::vector<float>& buf) {
  const int64_t G = a.G, D = a.D, keys = a.lengths[row] + 1, kpad = (keys + 15) / 16 * 16;
  buf.resize(static_cast<size_t>(G * kpad + G * D + G));
  float* s = buf.data();    // (G, kpad): scores, then unnormalised probabilities
  float* o = s + G * kpad;  // (G, D): unnormalised outputs
  float* inv = o + G * D;   // (G,): 1 / the probabilities' sum
  uint16_t* kb = a.k + (row * a.K + kh) * a.cap * D;
  uint16_t* vb = a.v + (row * a.K + kh) * a.cap * D;
  if (a.k_new != nullptr) {  // this (row, kv head) owns the column: no other work item writes or reads it
    std::memcpy(kb + (keys - 1) * D, a.k_new + row * a.k_new_tok + kh * a.k_new_head, D * sizeof(uint16_t));
    std::memcpy(vb + (keys - 1) * D, a.v_new + row * a.v_new_tok + kh * a.v_new_head, D * sizeof(uint16_t));
  }
  const __m512 scale = _mm512_set1_ps(a.scale2);
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* qg = a.q + row * a.q_tok + (kh * G + g) * a.q_head;
    __m512i qv[kMaxDim / 32];
    for (int64_t c = 0; c < D / 32; ++c) qv[c] = _mm512_loadu_si512(qg + 32 * c);
    for (int64_t t0 = 0; t0 < keys; t0 += 16) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        const uint16_t* kt = kb + std::min(t0 + j, keys - 1) * D;  // past the last key: a repeat, masked below
        __m512 x = _mm512_setzero_ps();
        for (int64_t c = 0; c < D / 32; ++c) x = _mm512_dpbf16_ps(x, as_bh(qv[c]), as_bh(_mm512_loadu_si512(kt + 32 * c)));
        acc[j] = x;
      }
      _mm512_storeu_ps(s + g * kpad + t0, _mm512_mul_ps(sum16(acc), scale));
    }
    float* sg = s + g * kpad;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t0 = 0; t0 < kpad; t0 += 16) {
      const __mmask16 ok = first_lanes(keys - t0);
      mx = _mm512_mask_max_ps(mx, ok, mx, _mm512_loadu_ps(sg + t0));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < kpad; t0 += 16) {
      const __mmask16 ok = first_lanes(keys - t0);
      const __m512 e = _mm512_maskz_mov_ps(ok, exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(sg + t0), m)));
      _mm512_storeu_ps(sg + t0, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const float* p = s + g0 * kpad;
      float* og = o + g0 * D;
      switch (std::min<int64_t>(4, G - g0)) {
        case 1: pv<1>(p, kpad, vb, D, keys, d0, og, D); break;
        case 2: pv<2>(p, kpad, vb, D, keys, d0, og, D); break;
        case 3: pv<3>(p, kpad, vb, D, keys, d0, og, D); break;
        default: pv<4>(p, kpad, vb, D, keys, d0, og, D); break;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    uint16_t* dst = a.out + (row * a.K * G + kh * G + g) * D;
    const __m512 iv = _mm512_set1_ps(inv[g]);
    for (int64_t d = 0; d < D; d += 16) store_bf16x16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + g * D + d), iv));
  }
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& lengths, double scale,
                               const std::optional<torch::Tensor>& k_new, const std::optional<torch::Tensor>& v_new) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4 && lengths.dim() == 1, "q (n, H, D), k and v (rows, K, cap, D), lengths (n,)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous(), "lengths: contiguous int64");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && lengths.device().is_cpu(), "CPU tensors only");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), K = k.size(1), cap = k.size(2);
  TORCH_CHECK(D % 64 == 0 && D <= kMaxDim, "head dim must be a multiple of 64, at most ", kMaxDim);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(3) == D && H % K == 0 && k.size(0) >= n && lengths.size(0) == n, "shapes disagree");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && q.stride(2) == 1, "k and v contiguous, q's head dim contiguous");
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(len[r] >= 0 && len[r] < cap, "row ", r, ": length ", len[r], " outside the pool's ", cap, " columns");
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "k_new and v_new: both or neither");
  const uint16_t* kn = nullptr;
  const uint16_t* vn = nullptr;
  if (k_new.has_value()) {
    for (const torch::Tensor* t : {&*k_new, &*v_new}) {
      TORCH_CHECK(t->dim() == 3 && t->size(0) == n && t->size(1) == K && t->size(2) == D && t->stride(2) == 1, "k_new and v_new (n, K, D), D contiguous");
      TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->device().is_cpu(), "k_new and v_new: bf16 CPU tensors");
    }
    kn = reinterpret_cast<const uint16_t*>(k_new->data_ptr<at::BFloat16>());
    vn = reinterpret_cast<const uint16_t*>(v_new->data_ptr<at::BFloat16>());
  }
  auto out = torch::empty({n, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  DecodeArgs a{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
               q.stride(0),
               q.stride(1),
               reinterpret_cast<uint16_t*>(k.data_ptr<at::BFloat16>()),
               reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>()),
               kn,
               vn,
               kn ? k_new->stride(0) : 0,
               kn ? k_new->stride(1) : 0,
               vn ? v_new->stride(0) : 0,
               vn ? v_new->stride(1) : 0,
               len,
               reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
               K,
               H / K,
               D,
               cap,
               static_cast<float>(scale * M_LOG2E)};
  at::parallel_for(0, n * K, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    for (int64_t z = lo; z < hi; ++z) decode_item(a, z / K, z % K, buf);
  });
  return out;
}

// ---- the elementwise passes around attention ----------------------------------------------------------------------

// transformers' LlamaRMSNorm on bf16 rows: y = bf16(x / sqrt(mean(x^2) + eps)) * weight, the product rounded to bf16
// (the mean in fp32, summed in another order than PyTorch's: the two agree to fp32 rounding before the bf16 cast).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "x (N, d) and weight (d,) bf16");
  const int64_t N = x.size(0), d = x.size(1);
  TORCH_CHECK(weight.numel() == d && weight.is_contiguous() && x.stride(1) == 1 && d % 16 == 0, "shapes disagree");
  auto out = torch::empty({N, d}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const auto* xd = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wd = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t xs = x.stride(0);
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const uint16_t* xi = xd + i * xs;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < d; j += 16) {
        const __m512 v = bf16x16_to_ps(xi + j);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(d) + static_cast<float>(eps));
      const __m512 rv = _mm512_set1_ps(r);
      for (int64_t j = 0; j < d; j += 16)
        store_bf16x16(od + i * d + j, _mm512_mul_ps(round_bf16(_mm512_mul_ps(bf16x16_to_ps(xi + j), rv)), bf16x16_to_ps(wd + j)));
    }
  });
  return out;
}

// transformers' rotary embedding in bf16, in place on the first `heads` heads of each row of x (N, >= heads, D):
// x = bf16(bf16(x cos) + bf16(rotate_half(x) sin)), cos and sin (N, D) bf16 for the rows' positions.
void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16, "bf16");
  const int64_t N = x.size(0), D = x.size(2), half = D / 2;
  TORCH_CHECK(x.size(1) >= heads && x.stride(2) == 1 && x.stride(1) == D && half % 16 == 0, "x (N, heads, D) with D contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == N * D && sin.numel() == N * D, "cos and sin (N, D)");
  auto* xd = reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* cd = reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>());
  const auto* sd = reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>());
  const int64_t xs = x.stride(0);
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const uint16_t* c = cd + i * D;
      const uint16_t* s = sd + i * D;
      for (int64_t h = 0; h < heads; ++h) {
        uint16_t* row = xd + i * xs + h * D;
        for (int64_t j = 0; j < half; j += 16) {
          const __m512 a = bf16x16_to_ps(row + j), b = bf16x16_to_ps(row + half + j);
          // first half: a cos - b sin; second half: b cos + a sin (rotate_half = [-b, a])
          const __m512 lo_ = _mm512_add_ps(round_bf16(_mm512_mul_ps(a, bf16x16_to_ps(c + j))),
                                           round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b), bf16x16_to_ps(s + j))));
          const __m512 hi_ = _mm512_add_ps(round_bf16(_mm512_mul_ps(b, bf16x16_to_ps(c + half + j))),
                                           round_bf16(_mm512_mul_ps(a, bf16x16_to_ps(s + half + j))));
          store_bf16x16(row + j, lo_);
          store_bf16x16(row + half + j, hi_);
        }
      }
    }
  });
}

// ---- sampling ---------------------------------------------------------------------------------------------------

// Each row's first maximum (torch.argmax's tie rule) and log-sum-exp, in two passes over the row (it stays in L2):
// the maximum with, per lane, the first index that reached it; then the sum of exp(x - max).
std::tuple<torch::Tensor, torch::Tensor> argmax_lse(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1, "x (B, V) fp32, rows contiguous");
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0 && V <= std::numeric_limits<int32_t>::max() - 16, "V outside 1 .. 2^31 - 17");
  auto ids = torch::empty({B}, x.options().dtype(at::kLong));
  auto lse = torch::empty({B}, x.options());
  const float* xd = x.data_ptr<float>();
  const int64_t xs = x.stride(0);
  int64_t* id = ids.data_ptr<int64_t>();
  float* ld = lse.data_ptr<float>();
  constexpr float inf = std::numeric_limits<float>::infinity();
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* r = xd + i * xs;
      __m512 mx = _mm512_set1_ps(-inf);
      __m512i at = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i step = _mm512_set1_epi32(16);
      __mmask16 nan = 0;
      for (int64_t j = 0; j < V; j += 16) {
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-inf), first_lanes(V - j), r + j);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, mx, _CMP_GT_OQ);  // strict: a lane keeps its first index of a tie
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_mask_mov_ps(mx, gt, v);
        at = _mm512_mask_mov_epi32(at, gt, idx);
        idx = _mm512_add_epi32(idx, step);
      }
      const float m = _mm512_reduce_max_ps(mx);
      id[i] = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(mx, _mm512_set1_ps(m), _CMP_EQ_OQ), at);
      if (nan) {
        ld[i] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      if (std::isinf(m)) {  // +inf: an infinite sum; only -inf: nothing allowed
        ld[i] = m;
        continue;
      }
      const __m512 mm = _mm512_set1_ps(m), l2e = _mm512_set1_ps(static_cast<float>(M_LOG2E));
      __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t j = 0; j < V; j += 16) {  // four partial sums: shorter dependency chains, smaller rounding error
        const __mmask16 ok = first_lanes(V - j);
        const __m512 v = _mm512_maskz_loadu_ps(ok, r + j);
        sum[(j >> 4) & 3] = _mm512_add_ps(sum[(j >> 4) & 3], _mm512_maskz_mov_ps(ok, exp2_ps(_mm512_mul_ps(_mm512_sub_ps(v, mm), l2e))));
      }
      ld[i] = m + std::log(_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3]))));
    }
  });
  return {ids, lse};
}

}  // namespace

TORCH_LIBRARY(loopwise, m) {
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, int start, float scale) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor(a!) k, Tensor(b!) v, Tensor lengths, float scale, Tensor? k_new=None, Tensor? v_new=None) -> Tensor");
  m.def("argmax_lse(Tensor x) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> ()");
}

TORCH_LIBRARY_IMPL(loopwise, CPU, m) {
  m.impl("prompt_attention", &prompt_attention);
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_", &rope_);
  m.impl("argmax_lse", &argmax_lse);
}
