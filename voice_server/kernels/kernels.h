// What the kernel files share: the vector path choice, the block-quantised linear and the paged
// attention as plain functions over raw pointers (block_a8.cpp and paged_attention.cpp wrap them as
// torch ops; decoder_stack.cpp calls them layer after layer without going back to Python).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

#define VS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define VS_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace voice_server {

enum Impl : int64_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };

constexpr int64_t kBlock = 32;  // K values per weight block and per activation block

// The best path this CPU runs (cpuid, once per process).
Impl host_impl();
// `requested` (an Impl value; 0 = the host's best), checked against what the CPU has.
Impl resolve_impl(int64_t requested);

// Activations quantised per row and block of 32 for `block_a8_matmul` (quantize_a8.cpp; the layout is
// block_a8.cpp's Acts): buffers sized by `resize`, reused from step to step.
struct A8Acts {
  std::vector<int8_t> q;
  std::vector<float> scale, scaled_sum;
  std::vector<int32_t> sum, sum2;
  std::vector<uint8_t> is_two_plane;
  int64_t m = 0, k = 0;
  void resize(int64_t rows, int64_t cols);
};

// x fp32 [m, k] (row stride k) -> acts (resized here).
void block_a8_quantize(Impl impl, const float* x, int64_t m, int64_t k, float crest, A8Acts& acts);
// y [m, num_tiles * 16] (row stride y_stride) = acts x packed blocks (+ bias); bits 4 (Q4_1) or 8 (Q8_0).
void block_a8_matmul(Impl impl, const A8Acts& acts, const uint8_t* packed, int64_t num_tiles, int bits,
                     const float* bias, float* y, int64_t y_stride);
inline int64_t block_a8_bytes(int bits) { return bits == 4 ? 320 : 544; }

// One query row attending its own keys: row of q/out, first entry of its pages in page_index, kv_len.
struct AttnSeq {
  int64_t row, page_start, kv_len;
};

struct AttnProblem {
  const float* q;  // [rows, H, D] with strides q_row, q_head (D contiguous)
  int64_t q_row, q_head;
  const void* k;  // [pages, page_size, H_kv, D] contiguous, fp32 or (is_half) fp16
  const void* v;
  bool is_half;
  const int64_t* page_index;
  int64_t page_size, num_heads, num_kv_heads, head_dim;
  float scale;
  float* out;  // [rows, H, D] contiguous
};

// Every (sequence, KV head) of `seqs` (parallel over them), on `impl`'s vector path (a resolved Impl;
// head_dim must be a multiple of 16 and at most 256 for a vector path, else the scalar loops run).
void paged_attention(const AttnProblem& p, const AttnSeq* seqs, int64_t num_seqs, Impl impl);

// exp for x <= ~88: Cephes' polynomial on x - n ln2, then scalef by 2^n (~2 ulp); -inf gives ~0.
VS_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// exp256: exp512's polynomial on 8 lanes; 2^n built in the exponent bits (AVX2 has no scalef), so
// x is also clamped above (88.0: 2^127 still fits).
VS_AVX2 inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
  // NOTE: n in [-126, 127] after the clamps: (n + 127) << 23 is 2^n as a normal float.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

}  // namespace voice_server
