// Activations for the block-quantised linears (block_a8.cpp): each row quantised per block of 32 to
// int8 (llama.cpp's Q8_1), with a second int8 plane for blocks that hold an outlier. The same q bits
// on every vector path, and a block's choice depends on its own values only, so rows stay
// independent of each other and of the thread count.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"

namespace voice_server {
namespace {

// ------------------------------------------------------------------------------------------------
// Activation quantisation (same q bits on every path: x * (127 / amax) rounded half to even)
// ------------------------------------------------------------------------------------------------

// NOTE: one scalar sum order on every path, so every path makes the same choice.
bool wants_second_plane(const float* x, float amax, float crest) {
  if (crest < 0.0f) return false;
  float sum_abs = 0.0f;
  for (int j = 0; j < kBlock; ++j) sum_abs += std::fabs(x[j]);
  return amax * static_cast<float>(kBlock) > crest * sum_abs;
}

// q1 (and q2) of a block from its rounded values q1 and remainders frac = x * id - q1.
void finish_block(const int32_t* q1, const float* frac, float amax, bool is_two_plane, int64_t k, int8_t* q,
                  float* scale, float* scaled_sum, int32_t* sum, int32_t* sum2) {
  int32_t s = 0, s2 = 0;
  for (int j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(q1[j]);
    s += q1[j];
  }
  if (is_two_plane) {
    for (int j = 0; j < kBlock; ++j) {
      // NOTE: a remainder of exactly +-0.5 would be +-128: clamped (an error of 1/256 of a step).
      const int32_t v = std::min(127, std::max(-127, static_cast<int32_t>(std::nearbyint(frac[j] * 256.0f))));
      q[k + j] = static_cast<int8_t>(v);
      s2 += v;
    }
  }
  const float d = amax / 127.0f;
  *scale = d;
  *sum = s;
  *sum2 = s2;
  *scaled_sum = d * static_cast<float>(s) + d / 256.0f * static_cast<float>(s2);
}

void quantize_block_scalar(const float* x, float crest, int64_t k, int8_t* q, float* scale, float* scaled_sum,
                           int32_t* sum, int32_t* sum2, uint8_t* is_two_plane) {
  float amax = 0.0f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t q1[kBlock];
  float frac[kBlock];
  for (int j = 0; j < kBlock; ++j) {
    const float v = x[j] * id;
    q1[j] = static_cast<int32_t>(std::nearbyint(v));
    frac[j] = v - static_cast<float>(q1[j]);
  }
  *is_two_plane = wants_second_plane(x, amax, crest);
  finish_block(q1, frac, amax, *is_two_plane, k, q, scale, scaled_sum, sum, sum2);
}

VS_AVX2 void quantize_block_avx2(const float* x, float crest, int64_t k, int8_t* q, float* scale, float* scaled_sum,
                                 int32_t* sum, int32_t* sum2, uint8_t* is_two_plane) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i]));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, amax8);
  float amax = 0.0f;
  for (float l : lanes) amax = std::max(amax, l);
  const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  int32_t q1[kBlock];
  float frac[kBlock];
  for (int i = 0; i < 4; ++i) {
    const __m256 scaled = _mm256_mul_ps(v[i], id);
    const __m256i r = _mm256_cvtps_epi32(scaled);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q1 + 8 * i), r);
    _mm256_storeu_ps(frac + 8 * i, _mm256_sub_ps(scaled, _mm256_cvtepi32_ps(r)));
  }
  *is_two_plane = wants_second_plane(x, amax, crest);
  finish_block(q1, frac, amax, *is_two_plane, k, q, scale, scaled_sum, sum, sum2);
}

VS_AVX512 void quantize_block_avx512(const float* x, float crest, int64_t k, int8_t* q, float* scale,
                                    float* scaled_sum, int32_t* sum, int32_t* sum2, uint8_t* is_two_plane) {
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512 vlo = _mm512_mul_ps(lo, id), vhi = _mm512_mul_ps(hi, id);
  const __m512i qlo = _mm512_cvtps_epi32(vlo), qhi = _mm512_cvtps_epi32(vhi);
  *is_two_plane = wants_second_plane(x, amax, crest);
  if (*is_two_plane) {
    int32_t q1[kBlock];
    float frac[kBlock];
    _mm512_storeu_si512(q1, qlo);
    _mm512_storeu_si512(q1 + 16, qhi);
    _mm512_storeu_ps(frac, _mm512_sub_ps(vlo, _mm512_cvtepi32_ps(qlo)));
    _mm512_storeu_ps(frac + 16, _mm512_sub_ps(vhi, _mm512_cvtepi32_ps(qhi)));
    return finish_block(q1, frac, amax, true, k, q, scale, scaled_sum, sum, sum2);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
  const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  const float d = amax / 127.0f;
  *scale = d;
  *sum = s;
  *sum2 = 0;
  *scaled_sum = d * static_cast<float>(s);
}

}  // namespace

void A8Acts::resize(int64_t rows, int64_t cols) {
  const size_t num_blocks = static_cast<size_t>(rows * (cols / kBlock));
  q.resize(static_cast<size_t>(2 * rows * cols));
  scale.resize(num_blocks);
  scaled_sum.resize(num_blocks);
  sum.resize(num_blocks);
  sum2.resize(num_blocks);
  is_two_plane.resize(num_blocks);
  m = rows;
  k = cols;
}

void block_a8_quantize(Impl impl, const float* x, int64_t m, int64_t k, float crest, A8Acts& acts) {
  acts.resize(m, k);
  const int64_t num_blocks = k / kBlock;
  int8_t* qp = acts.q.data();
  float *sp = acts.scale.data(), *ssp = acts.scaled_sum.data();
  int32_t *sump = acts.sum.data(), *sum2p = acts.sum2.data();
  uint8_t* tp = acts.is_two_plane.data();
  at::parallel_for(0, m * num_blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / num_blocks, b = i % num_blocks;
      const float* xb = x + row * k + b * kBlock;
      int8_t* qb = qp + 2 * row * k + b * kBlock;
      if (impl == kAvx512) quantize_block_avx512(xb, crest, k, qb, sp + i, ssp + i, sump + i, sum2p + i, tp + i);
      else if (impl == kAvx2) quantize_block_avx2(xb, crest, k, qb, sp + i, ssp + i, sump + i, sum2p + i, tp + i);
      else quantize_block_scalar(xb, crest, k, qb, sp + i, ssp + i, sump + i, sum2p + i, tp + i);
    }
  });
}

}  // namespace voice_server
