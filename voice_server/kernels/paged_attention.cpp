// Decode attention straight from the paged KV cache: one query row per sequence, keys and values
// read page by page through the page table (no gather), GQA, fp32, softmax over the exact kv_len
// keys. Each (sequence, KV head) is computed alone and in a fixed order, so a sequence's output does
// not depend on the others in the step (batch invariant) nor on the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#define VS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

namespace {

struct Seq {
  int64_t row;
  int64_t page_start;
  int64_t kv_len;
};

struct Problem {
  const float* q;  // [rows, H, D] with strides q_row, q_head (D contiguous)
  int64_t q_row, q_head;
  const float* k;  // [pages, page_size, H_kv, D] contiguous
  const float* v;
  const int64_t* page_index;
  int64_t page_size, num_heads, num_kv_heads, head_dim;
  float scale;
  float* out;  // [rows, H, D] contiguous
};

inline int64_t slot_offset(const Problem& p, const Seq& s, int64_t t, int64_t g) {
  const int64_t page = p.page_index[s.page_start + t / p.page_size];
  return ((page * p.page_size + t % p.page_size) * p.num_kv_heads + g) * p.head_dim;
}

// The reference path (CPUs without AVX512, and the tests): the same order, std::exp.
void attend_scalar(const Problem& p, const Seq& s, int64_t g, std::vector<float>& scores) {
  const int64_t group = p.num_heads / p.num_kv_heads, d = p.head_dim;
  scores.assign(group * s.kv_len, 0.0f);
  for (int64_t t = 0; t < s.kv_len; ++t) {
    const float* kp = p.k + slot_offset(p, s, t, g);
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = p.q + s.row * p.q_row + (g * group + h) * p.q_head;
      float acc = 0.0f;
      for (int64_t i = 0; i < d; ++i) acc += qh[i] * kp[i];
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
      const float* vp = p.v + slot_offset(p, s, t, g);
      for (int64_t i = 0; i < d; ++i) o[i] += sc[t] * vp[i];
    }
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < d; ++i) o[i] *= inv;
  }
}

// exp for x <= 0: Cephes' polynomial on x - n ln2, then scalef by 2^n (~2 ulp).
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

// head_dim a multiple of 16, at most 256; the group of query heads sharing a KV head at most 16.
VS_AVX512 void attend_avx512(const Problem& p, const Seq& s, int64_t g, std::vector<float>& scores) {
  const int64_t group = p.num_heads / p.num_kv_heads, d = p.head_dim, nv = d / 16;
  const int64_t padded = (s.kv_len + 15) / 16 * 16;
  scores.resize(group * padded);
  for (int64_t t = 0; t < s.kv_len; ++t) {
    const float* kp = p.k + slot_offset(p, s, t, g);
    __m512 kv[16];
    for (int64_t j = 0; j < nv; ++j) kv[j] = _mm512_loadu_ps(kp + 16 * j);
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = p.q + s.row * p.q_row + (g * group + h) * p.q_head;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), kv[0]);
      for (int64_t j = 1; j < nv; ++j) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * j), kv[j], acc);
      scores[h * padded + t] = _mm512_reduce_add_ps(acc) * p.scale;
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* sc = scores.data() + h * padded;
    std::fill(sc + s.kv_len, sc + padded, -INFINITY);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < padded; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + t));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (int64_t t = 0; t < padded; t += 16) _mm512_storeu_ps(sc + t, exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + t), m)));
    // NOTE: exp512 clamps, so the padding came out ~1e-38, not 0: zeroed before the sum.
    std::fill(sc + s.kv_len, sc + padded, 0.0f);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += 16) sum = _mm512_add_ps(sum, _mm512_loadu_ps(sc + t));
    const float inv = 1.0f / _mm512_reduce_add_ps(sum);
    __m512 acc[16];
    for (int64_t j = 0; j < nv; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < s.kv_len; ++t) {
      const float* vp = p.v + slot_offset(p, s, t, g);
      const __m512 w = _mm512_set1_ps(sc[t]);
      for (int64_t j = 0; j < nv; ++j) acc[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vp + 16 * j), acc[j]);
    }
    float* o = p.out + (s.row * p.num_heads + g * group + h) * d;
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t j = 0; j < nv; ++j) _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(acc[j], iv));
  }
}

bool host_has_avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  }();
  return has;
}

// q [rows, H, D] (D contiguous), k/v pages [P, page_size, H_kv, D], page_index [pages read] int64,
// seqs [S, 3] int64 (row, first page in page_index, kv_len), out [rows, H, D]: rows of seqs written.
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                            const at::Tensor& page_index, const at::Tensor& seqs, double scale, at::Tensor out,
                            int64_t impl) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1, "q must be fp32 [rows, H, D]");
  TORCH_CHECK(k_pages.dim() == 4 && k_pages.scalar_type() == at::kFloat && k_pages.is_contiguous() &&
                  v_pages.sizes() == k_pages.sizes() && v_pages.scalar_type() == at::kFloat && v_pages.is_contiguous(),
              "k_pages/v_pages must be contiguous fp32 [pages, page_size, H_kv, D]");
  TORCH_CHECK(page_index.scalar_type() == at::kLong && page_index.is_contiguous(), "page_index must be int64");
  TORCH_CHECK(seqs.dim() == 2 && seqs.size(1) == 3 && seqs.scalar_type() == at::kLong && seqs.is_contiguous(),
              "seqs must be int64 [S, 3]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat,
              "out must be contiguous fp32 like q");
  const int64_t heads = q.size(1), d = q.size(2), kv_heads = k_pages.size(2);
  TORCH_CHECK(k_pages.size(3) == d && heads % kv_heads == 0, "head_dim or head counts do not match");
  const bool vector = impl != 1 && host_has_avx512() && d % 16 == 0 && d <= 256;
  const Problem p{q.data_ptr<float>(), q.stride(0), q.stride(1), k_pages.data_ptr<float>(), v_pages.data_ptr<float>(),
                  page_index.data_ptr<int64_t>(), k_pages.size(1), heads, kv_heads, d, static_cast<float>(scale),
                  out.data_ptr<float>()};
  const int64_t* sp = seqs.data_ptr<int64_t>();
  const int64_t num_seqs = seqs.size(0), num_pages = page_index.numel();
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t row = sp[3 * i], start = sp[3 * i + 1], kv_len = sp[3 * i + 2];
    TORCH_CHECK(row >= 0 && row < q.size(0) && kv_len >= 1 && start >= 0 &&
                    start + (kv_len + p.page_size - 1) / p.page_size <= num_pages,
                "seqs row ", i, " is out of range");
  }
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const Seq s{sp[3 * (i / kv_heads)], sp[3 * (i / kv_heads) + 1], sp[3 * (i / kv_heads) + 2]};
      if (vector) attend_avx512(p, s, i % kv_heads, scores);
      else attend_scalar(p, s, i % kv_heads, scores);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(voice_server, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor page_index, Tensor seqs, "
        "float scale, Tensor(a!) out, int impl=0) -> ()");
}

TORCH_LIBRARY_IMPL(voice_server, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
