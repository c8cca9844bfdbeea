// Decode attention straight from the paged KV cache: one query row per sequence, keys and values
// (fp32, or fp16 widened on load) read page by page through the page table (no gather), GQA, fp32
// arithmetic, softmax over the exact kv_len keys. Each (sequence, KV head) is computed alone and in a fixed order, so a sequence's output does
// not depend on the others in the step (batch invariant) nor on the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "kernels.h"

namespace voice_server {
namespace {

// offs[t]: where key t of KV head g starts in the k/v pages, walked page by page (a division per key
// cost more than the dot products).
void slot_offsets(const AttnProblem& p, const AttnSeq& s, int64_t g, std::vector<int64_t>& offs) {
  offs.resize(static_cast<size_t>(s.kv_len));
  const int64_t slot_stride = p.num_kv_heads * p.head_dim;
  for (int64_t pi = 0, t = 0; t < s.kv_len; ++pi) {
    const int64_t base = (p.page_index[s.page_start + pi] * p.page_size * p.num_kv_heads + g) * p.head_dim;
    const int64_t n = std::min(p.page_size, s.kv_len - t);
    for (int64_t i = 0; i < n; ++i, ++t) offs[static_cast<size_t>(t)] = base + i * slot_stride;
  }
}

inline float kv_at(const void* base, int64_t i, bool is_half) {
  if (!is_half) return static_cast<const float*>(base)[i];
  return static_cast<float>(c10::Half(static_cast<const uint16_t*>(base)[i], c10::Half::from_bits()));
}

struct Scratch {
  std::vector<float> scores;
  std::vector<int64_t> offs;
  std::vector<float> parts;  // not std::vector<__m512>: its allocation was not 64-byte aligned here
};

// The reference path (CPUs without AVX2, and the tests): plain loops, std::exp.
void attend_scalar(const AttnProblem& p, const AttnSeq& s, int64_t g, Scratch& scratch) {
  const int64_t group = p.num_heads / p.num_kv_heads, d = p.head_dim;
  std::vector<float>& scores = scratch.scores;
  const std::vector<int64_t>& offs = scratch.offs;
  slot_offsets(p, s, g, scratch.offs);
  scores.assign(group * s.kv_len, 0.0f);
  for (int64_t t = 0; t < s.kv_len; ++t) {
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = p.q + s.row * p.q_row + (g * group + h) * p.q_head;
      float acc = 0.0f;
      for (int64_t i = 0; i < d; ++i) acc += qh[i] * kv_at(p.k, offs[t] + i, p.is_half);
      scores[h * s.kv_len + t] = acc * p.scale;
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* sc = scores.data() + h * s.kv_len;
    const float mx = *std::max_element(sc, sc + s.kv_len);
    float sum = 0.0f;
    for (int64_t t = 0; t < s.kv_len; ++t) {
      sc[t] = std::exp(sc[t] - mx);
      sum += sc[t];
    }
    float* o = p.out + (s.row * p.num_heads + g * group + h) * d;
    std::fill(o, o + d, 0.0f);
    for (int64_t t = 0; t < s.kv_len; ++t) {
      for (int64_t i = 0; i < d; ++i) o[i] += sc[t] * kv_at(p.v, offs[t] + i, p.is_half);
    }
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < d; ++i) o[i] *= inv;
  }
}

// r[i] = the sum of v[i]'s 16 lanes, for 16 vectors: a transposing tree of 45 shuffles and adds
// where 16 horizontal reductions would take ~130 instructions.
VS_AVX512 inline __m512 reduce16(const float* vecs) {
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = _mm512_loadu_ps(vecs + 32 * i), b = _mm512_loadu_ps(vecs + 32 * i + 16);
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // NOTE: 128-bit lane L of w[i] now holds lane L's partial sums of v[4i .. 4i + 3].
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// NOTE: keys are 256-byte pieces 768 bytes apart, pages scattered: the hardware prefetcher missed
// most of them (30 layers of 8 sequences: 108 us per call from memory vs 39 us from cache).
constexpr int64_t kPrefetch = 16;  // keys ahead

// The cache lines of one key's D values (offset `off` elements into `base`).
template <int NV, bool Half>
inline void prefetch_row(const void* base, int64_t off) {
  const char* row = static_cast<const char*>(base) + off * (Half ? 2 : 4);
  for (int j = 0; j < (Half ? (NV + 1) / 2 : NV); ++j) _mm_prefetch(row + 64 * j, _MM_HINT_T0);
}

// 16 values of a key or value row from `off + 16 * j` elements into `base`, as fp32.
template <bool Half>
VS_AVX512 inline __m512 load16(const void* base, int64_t off) {
  if (Half) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + off)));
  }
  return _mm512_loadu_ps(static_cast<const float*>(base) + off);
}

constexpr int kHeadsPerPass = 4;  // query heads of a KV head scored together (K and V read once each)

// NV = head_dim / 16 (1..16).
template <int NV, bool Half>
VS_AVX512 void attend_avx512(const AttnProblem& p, const AttnSeq& s, int64_t g, Scratch& scratch) {
  const int64_t group = p.num_heads / p.num_kv_heads, d = p.head_dim;
  const int64_t padded = (s.kv_len + 15) / 16 * 16;
  slot_offsets(p, s, g, scratch.offs);
  const int64_t* offs = scratch.offs.data();
  scratch.scores.resize(group * padded);
  float* scores = scratch.scores.data();
  scratch.parts.resize(kHeadsPerPass * 16 * 16);
  float* parts = scratch.parts.data();
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t t = 0; t < std::min(kPrefetch, s.kv_len); ++t) {
    prefetch_row<NV, Half>(p.k, offs[t]);
    prefetch_row<NV, Half>(p.v, offs[t]);
  }
  for (int64_t h0 = 0; h0 < group; h0 += kHeadsPerPass) {
    const int hn = static_cast<int>(std::min<int64_t>(kHeadsPerPass, group - h0));
    const float* q0 = p.q + s.row * p.q_row + (g * group + h0) * p.q_head;
    // Scores: per key, one partial vector per head; every 16 keys, one transposing reduction.
    for (int64_t t = 0; t < s.kv_len; ++t) {
      if (t + kPrefetch < s.kv_len) prefetch_row<NV, Half>(p.k, offs[t + kPrefetch]);
      // NOTE: the values too, for the pass after the softmax (a sequence's are ~30 KB: they stay in L1/L2).
      if (h0 == 0 && t + kPrefetch < s.kv_len) prefetch_row<NV, Half>(p.v, offs[t + kPrefetch]);
      __m512 kv[NV];
      for (int j = 0; j < NV; ++j) kv[j] = load16<Half>(p.k, offs[t] + 16 * j);
      const int64_t lane = t % 16;
      for (int h = 0; h < hn; ++h) {
        const float* qh = q0 + h * p.q_head;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), kv[0]);
        for (int j = 1; j < NV; ++j) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * j), kv[j], acc);
        _mm512_storeu_ps(parts + (h * 16 + lane) * 16, acc);
      }
      if (lane == 15 || t == s.kv_len - 1) {
        for (int h = 0; h < hn; ++h) {
          for (int64_t i = lane + 1; i < 16; ++i) _mm512_storeu_ps(parts + (h * 16 + i) * 16, _mm512_setzero_ps());
          _mm512_storeu_ps(scores + (h0 + h) * padded + t - lane, _mm512_mul_ps(reduce16(parts + h * 256), scale));
        }
      }
    }
    // Softmax over the exact kv_len keys (the padding is set to zero weight).
    float inv[kHeadsPerPass];
    for (int h = 0; h < hn; ++h) {
      float* sc = scores + (h0 + h) * padded;
      std::fill(sc + s.kv_len, sc + padded, -INFINITY);
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int64_t t = 0; t < padded; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + t));
      const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
      for (int64_t t = 0; t < padded; t += 16) _mm512_storeu_ps(sc + t, exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + t), m)));
      // NOTE: exp512 clamps, so the padding came out ~1e-38, not 0: zeroed before the sum.
      std::fill(sc + s.kv_len, sc + padded, 0.0f);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < padded; t += 16) sum = _mm512_add_ps(sum, _mm512_loadu_ps(sc + t));
      inv[h] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    // Values: each V row read once for the heads of this pass.
    __m512 acc[kHeadsPerPass][NV];
    for (int h = 0; h < kHeadsPerPass; ++h) {
      for (int j = 0; j < NV; ++j) acc[h][j] = _mm512_setzero_ps();
    }
    for (int64_t t = 0; t < s.kv_len; ++t) {
      if (t + kPrefetch < s.kv_len) prefetch_row<NV, Half>(p.v, offs[t + kPrefetch]);
      __m512 vv[NV];
      for (int j = 0; j < NV; ++j) vv[j] = load16<Half>(p.v, offs[t] + 16 * j);
      for (int h = 0; h < hn; ++h) {
        const __m512 w = _mm512_set1_ps(scores[(h0 + h) * padded + t]);
        for (int j = 0; j < NV; ++j) acc[h][j] = _mm512_fmadd_ps(w, vv[j], acc[h][j]);
      }
    }
    for (int h = 0; h < hn; ++h) {
      float* o = p.out + (s.row * p.num_heads + g * group + h0 + h) * d;
      const __m512 iv = _mm512_set1_ps(inv[h]);
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(acc[h][j], iv));
    }
  }
}

// ------------------------------------------------------------------------------------------------
// AVX2 (8 lanes, FMA, F16C): the same passes as attend_avx512, each 16 values of a row as two vectors
// ------------------------------------------------------------------------------------------------

// r[i] = the sum of v[i]'s 8 lanes, for 8 vectors 8 floats apart (three rounds of hadd and a lane swap).
VS_AVX2 inline __m256 reduce8(const float* vecs) {
  __m256 v[8];
  for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(vecs + 8 * i);
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // NOTE: a's low 128 bits hold v[0..3]'s low-half sums, its high 128 their high-half sums (b: v[4..7]).
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

template <bool Half>
VS_AVX2 inline __m256 load8(const void* base, int64_t off) {
  if (Half) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + off)));
  }
  return _mm256_loadu_ps(static_cast<const float*>(base) + off);
}

VS_AVX2 inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

VS_AVX2 inline float hmax8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// NV = head_dim / 16 (1..16), as attend_avx512; a row is 2 * NV vectors of 8.
template <int NV, bool Half>
VS_AVX2 void attend_avx2(const AttnProblem& p, const AttnSeq& s, int64_t g, Scratch& scratch) {
  constexpr int kV = 2 * NV;
  const int64_t group = p.num_heads / p.num_kv_heads, d = p.head_dim;
  const int64_t padded = (s.kv_len + 7) / 8 * 8;
  slot_offsets(p, s, g, scratch.offs);
  const int64_t* offs = scratch.offs.data();
  scratch.scores.resize(group * padded);
  float* scores = scratch.scores.data();
  scratch.parts.resize(kHeadsPerPass * 8 * 8);
  float* parts = scratch.parts.data();
  const __m256 scale = _mm256_set1_ps(p.scale);
  for (int64_t t = 0; t < std::min(kPrefetch, s.kv_len); ++t) {
    prefetch_row<NV, Half>(p.k, offs[t]);
    prefetch_row<NV, Half>(p.v, offs[t]);
  }
  for (int64_t h0 = 0; h0 < group; h0 += kHeadsPerPass) {
    const int hn = static_cast<int>(std::min<int64_t>(kHeadsPerPass, group - h0));
    const float* q0 = p.q + s.row * p.q_row + (g * group + h0) * p.q_head;
    // Scores: per key, one partial vector per head; every 8 keys, one transposing reduction.
    for (int64_t t = 0; t < s.kv_len; ++t) {
      if (t + kPrefetch < s.kv_len) prefetch_row<NV, Half>(p.k, offs[t + kPrefetch]);
      if (h0 == 0 && t + kPrefetch < s.kv_len) prefetch_row<NV, Half>(p.v, offs[t + kPrefetch]);
      __m256 kv[kV];
      for (int j = 0; j < kV; ++j) kv[j] = load8<Half>(p.k, offs[t] + 8 * j);
      const int64_t lane = t % 8;
      for (int h = 0; h < hn; ++h) {
        const float* qh = q0 + h * p.q_head;
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qh), kv[0]);
        for (int j = 1; j < kV; ++j) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * j), kv[j], acc);
        _mm256_storeu_ps(parts + (h * 8 + lane) * 8, acc);
      }
      if (lane == 7 || t == s.kv_len - 1) {
        for (int h = 0; h < hn; ++h) {
          for (int64_t i = lane + 1; i < 8; ++i) _mm256_storeu_ps(parts + (h * 8 + i) * 8, _mm256_setzero_ps());
          _mm256_storeu_ps(scores + (h0 + h) * padded + t - lane, _mm256_mul_ps(reduce8(parts + h * 64), scale));
        }
      }
    }
    float inv[kHeadsPerPass];
    for (int h = 0; h < hn; ++h) {
      float* sc = scores + (h0 + h) * padded;
      std::fill(sc + s.kv_len, sc + padded, -INFINITY);
      __m256 mx = _mm256_set1_ps(-INFINITY);
      for (int64_t t = 0; t < padded; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + t));
      const __m256 m = _mm256_set1_ps(hmax8(mx));
      for (int64_t t = 0; t < padded; t += 8) _mm256_storeu_ps(sc + t, exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + t), m)));
      std::fill(sc + s.kv_len, sc + padded, 0.0f);  // NOTE: exp256 clamps, as exp512 does
      __m256 sum = _mm256_setzero_ps();
      for (int64_t t = 0; t < padded; t += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(sc + t));
      inv[h] = 1.0f / hsum8(sum);
    }
    // Values: each V row read once for the heads of this pass; the accumulators live in `out` (16
    // registers cannot hold 4 heads x head_dim floats), one head's row at a time.
    for (int h = 0; h < hn; ++h) {
      float* o = p.out + (s.row * p.num_heads + g * group + h0 + h) * d;
      for (int j = 0; j < kV; ++j) _mm256_storeu_ps(o + 8 * j, _mm256_setzero_ps());
    }
    for (int64_t t = 0; t < s.kv_len; ++t) {
      if (t + kPrefetch < s.kv_len) prefetch_row<NV, Half>(p.v, offs[t + kPrefetch]);
      __m256 vv[kV];
      for (int j = 0; j < kV; ++j) vv[j] = load8<Half>(p.v, offs[t] + 8 * j);
      for (int h = 0; h < hn; ++h) {
        float* o = p.out + (s.row * p.num_heads + g * group + h0 + h) * d;
        const __m256 w = _mm256_set1_ps(scores[(h0 + h) * padded + t]);
        for (int j = 0; j < kV; ++j) _mm256_storeu_ps(o + 8 * j, _mm256_fmadd_ps(w, vv[j], _mm256_loadu_ps(o + 8 * j)));
      }
    }
    for (int h = 0; h < hn; ++h) {
      float* o = p.out + (s.row * p.num_heads + g * group + h0 + h) * d;
      const __m256 iv = _mm256_set1_ps(inv[h]);
      for (int j = 0; j < kV; ++j) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(o + 8 * j), iv));
    }
  }
}

using AttendFn = void (*)(const AttnProblem&, const AttnSeq&, int64_t, Scratch&);

template <int... NV>
AttendFn pick_attend(Impl impl, int64_t nv, bool is_half, std::integer_sequence<int, NV...>) {
  AttendFn fn = nullptr;
  if (impl == kAvx512) {
    ((nv == NV + 1 ? (fn = is_half ? &attend_avx512<NV + 1, true> : &attend_avx512<NV + 1, false>, 0) : 0), ...);
  } else if (impl == kAvx2) {
    ((nv == NV + 1 ? (fn = is_half ? &attend_avx2<NV + 1, true> : &attend_avx2<NV + 1, false>, 0) : 0), ...);
  }
  return fn;
}

}  // namespace

void paged_attention(const AttnProblem& p, const AttnSeq* seqs, int64_t num_seqs, Impl impl) {
  // NOTE: nullptr (the scalar loops) for the scalar impl or a head_dim the vector paths do not take.
  const AttendFn attend = p.head_dim % 16 == 0 && p.head_dim <= 256
      ? pick_attend(impl, p.head_dim / 16, p.is_half, std::make_integer_sequence<int, 16>()) : nullptr;
  const int64_t kv_heads = p.num_kv_heads;
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      if (attend != nullptr) attend(p, seqs[i / kv_heads], i % kv_heads, scratch);
      else attend_scalar(p, seqs[i / kv_heads], i % kv_heads, scratch);
    }
  });
}

namespace {

// q [rows, H, D] (D contiguous), k/v pages [P, page_size, H_kv, D], page_index [pages read] int64,
// seqs [S, 3] int64 (row, first page in page_index, kv_len), out [rows, H, D]: rows of seqs written.
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                            const at::Tensor& page_index, const at::Tensor& seqs, double scale, at::Tensor out,
                            int64_t impl) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1, "q must be fp32 [rows, H, D]");
  const bool is_half = k_pages.scalar_type() == at::kHalf;
  TORCH_CHECK(k_pages.dim() == 4 && (is_half || k_pages.scalar_type() == at::kFloat) && k_pages.is_contiguous() &&
                  v_pages.sizes() == k_pages.sizes() && v_pages.scalar_type() == k_pages.scalar_type() &&
                  v_pages.is_contiguous(),
              "k_pages/v_pages must be contiguous fp32 or fp16 [pages, page_size, H_kv, D]");
  TORCH_CHECK(page_index.scalar_type() == at::kLong && page_index.is_contiguous(), "page_index must be int64");
  TORCH_CHECK(seqs.dim() == 2 && seqs.size(1) == 3 && seqs.scalar_type() == at::kLong && seqs.is_contiguous(),
              "seqs must be int64 [S, 3]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat,
              "out must be contiguous fp32 like q");
  const int64_t heads = q.size(1), d = q.size(2), kv_heads = k_pages.size(2);
  TORCH_CHECK(k_pages.size(3) == d && heads % kv_heads == 0, "head_dim or head counts do not match");
  const AttnProblem p{q.data_ptr<float>(), q.stride(0), q.stride(1), k_pages.data_ptr(), v_pages.data_ptr(),
                      is_half, page_index.data_ptr<int64_t>(), k_pages.size(1), heads, kv_heads, d,
                      static_cast<float>(scale), out.data_ptr<float>()};
  const int64_t* sp = seqs.data_ptr<int64_t>();
  const int64_t num_seqs = seqs.size(0), num_pages = page_index.numel();
  std::vector<AttnSeq> rows(static_cast<size_t>(num_seqs));
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t row = sp[3 * i], start = sp[3 * i + 1], kv_len = sp[3 * i + 2];
    TORCH_CHECK(row >= 0 && row < q.size(0) && kv_len >= 1 && start >= 0 &&
                    start + (kv_len + p.page_size - 1) / p.page_size <= num_pages,
                "seqs row ", i, " is out of range");
    rows[static_cast<size_t>(i)] = AttnSeq{row, start, kv_len};
  }
  paged_attention(p, rows.data(), num_seqs, resolve_impl(impl));
}

}  // namespace
}  // namespace voice_server

TORCH_LIBRARY_FRAGMENT(voice_server, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor page_index, Tensor seqs, "
        "float scale, Tensor(a!) out, int impl=0) -> ()");
}

TORCH_LIBRARY_IMPL(voice_server, CPU, m) {
  m.impl("paged_decode_attention", &voice_server::paged_decode_attention);
}
