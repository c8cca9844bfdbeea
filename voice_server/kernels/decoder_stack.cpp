// A dense decoder's layers (Llama / SmolLM2 / Qwen2 layout) with block-quantised weights, run for a
// whole step in one call: per layer RMSNorm, fused q/k/v, RoPE, the keys and values written to the
// paged cache, paged attention for every row, o_proj, residual, RMSNorm, fused gate/up, SiLU * up,
// down_proj, residual. In Python the same step was ~1,900 small torch ops whose dispatch cost more
// than their arithmetic (3-4 ms of a 9 ms single-row step, SmolLM2-135M, 1 thread).
//
// The paged cache is fp32 or fp16 (keys and values rounded to nearest on write, widened on read).
//
// Every operation is row by row (the matmuls quantise each row on its own, attention takes each
// row's own keys), so a row's result does not depend on the other rows of the step: batch
// invariant, prefill rows included (each prefill row attends its own causal prefix of the cache).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels.h"

namespace voice_server {
namespace {

struct Linear {
  const uint8_t* packed;
  int64_t num_tiles;
  int bits;
  const float* bias;  // nullptr: none
};

struct Layer {
  const float* input_norm;
  Linear qkv, o;
  const float* post_norm;
  Linear gate_up, down;
};

struct Stack {
  std::vector<at::Tensor> keep;  // the weights the pointers point into
  std::vector<Layer> layers;
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps, crest;
  std::mutex busy;  // one step at a time: the scratch below is shared
  std::vector<float> normed, qkv, attn, gate_up, act, proj;
  A8Acts acts;
};

std::mutex g_registry;
std::vector<std::unique_ptr<Stack>> g_stacks;

Stack& stack_at(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_registry);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(g_stacks.size()) && g_stacks[handle],
              "no decoder stack ", handle);
  return *g_stacks[handle];
}

// ------------------------------------------------------------------------------------------------
// Row operations (one fixed order per row, on the step's vector path: AVX512, AVX2 or scalar)
// ------------------------------------------------------------------------------------------------

VS_AVX512 void rms_norm_avx512(const float* x, const float* w, int64_t n, float eps, float* y) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float sum = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(sum / static_cast<float>(n) + eps));
  for (i = 0; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv), _mm512_loadu_ps(w + i)));
  }
  for (; i < n; ++i) y[i] = x[i] * inv[0] * w[i];
}

void rms_norm_scalar(const float* x, const float* w, int64_t n, float eps, float* y) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
}

// act[i] = silu(gate[i]) * up[i] = gate / (1 + exp(-gate)) * up.
VS_AVX512 void silu_mul_avx512(const float* gate, const float* up, int64_t n, float* act) {
  int64_t i = 0;
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_storeu_ps(act + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), _mm512_loadu_ps(up + i)));
  }
  for (; i < n; ++i) act[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

VS_AVX2 void rms_norm_avx2(const float* x, const float* w, int64_t n, float eps, float* y) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inv_f = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  const __m256 inv = _mm256_set1_ps(inv_f);
  for (i = 0; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv), _mm256_loadu_ps(w + i)));
  }
  for (; i < n; ++i) y[i] = x[i] * inv_f * w[i];
}

VS_AVX2 void silu_mul_avx2(const float* gate, const float* up, int64_t n, float* act) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) act[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void silu_mul_scalar(const float* gate, const float* up, int64_t n, float* act) {
  for (int64_t i = 0; i < n; ++i) act[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// One head in place: y = x * cos + roll(x, D / 2) * sin_signed (sin with its first half negated),
// the model's `apply_rotary_signed`, same operations and rounding.
void rope_head(float* x, const float* cos, const float* sin_signed, int64_t d) {
  const int64_t half = d / 2;
  float tmp[512];
  std::memcpy(tmp, x, static_cast<size_t>(d) * sizeof(float));
  for (int64_t i = 0; i < half; ++i) x[i] = tmp[i] * cos[i] + tmp[i + half] * sin_signed[i];
  for (int64_t i = half; i < d; ++i) x[i] = tmp[i] * cos[i] + tmp[i - half] * sin_signed[i];
}

// One row's keys or values into the cache: copied, or rounded to fp16 (nearest even, F16C).
VS_AVX2 void to_half_f16c(const float* x, int64_t n, uint16_t* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) y[i] = c10::Half(x[i]).x;
}

void store_kv(const float* x, int64_t n, bool is_half, char* dst) {
  if (!is_half) {
    std::memcpy(dst, x, static_cast<size_t>(n) * sizeof(float));
  } else if (host_impl() >= kAvx2) {
    to_half_f16c(x, n, reinterpret_cast<uint16_t*>(dst));
  } else {
    uint16_t* y = reinterpret_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) y[i] = c10::Half(x[i]).x;
  }
}

void add_rows(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

// ------------------------------------------------------------------------------------------------
// The step
// ------------------------------------------------------------------------------------------------

struct Step {
  int64_t rows;
  const int64_t* slot_mapping;  // [rows]
  const float* cos;             // [rows, D]
  const float* sin;             // [rows, D], signed
  void* kv;                     // [L, 2, slots, H_kv, D], fp32 or (is_half) fp16
  bool is_half;
  int64_t slots_per_layer;      // (num_pages + 1) * page_size
  int64_t page_size;
  const int64_t* page_index;
  std::vector<AttnSeq> seqs;    // the rows that attend (padding rows do not)
};

void linear(Impl impl, Stack& st, const float* x, int64_t rows, int64_t k, const Linear& w, float* y) {
  block_a8_quantize(impl, x, rows, k, st.crest, st.acts);
  block_a8_matmul(impl, st.acts, w.packed, w.num_tiles, w.bits, w.bias, y, w.num_tiles * 16);
}

void run_layer(Impl impl, Stack& st, int64_t li, float* x, const Step& s) {
  const Layer& layer = st.layers[li];
  const int64_t m = s.rows, h = st.hidden, d = st.head_dim, nh = st.num_heads, nkv = st.num_kv_heads;
  const int64_t width = (nh + 2 * nkv) * d, inter = st.intermediate;
  auto norm = impl == kAvx512 ? rms_norm_avx512 : impl == kAvx2 ? rms_norm_avx2 : rms_norm_scalar;
  auto silu_mul = impl == kAvx512 ? silu_mul_avx512 : impl == kAvx2 ? silu_mul_avx2 : silu_mul_scalar;
  for (int64_t r = 0; r < m; ++r) norm(x + r * h, layer.input_norm, h, st.eps, st.normed.data() + r * h);
  float* qkv = st.qkv.data();
  linear(impl, st, st.normed.data(), m, h, layer.qkv, qkv);
  const int64_t plane = s.slots_per_layer * nkv * d;  // elements
  const int64_t elem = s.is_half ? 2 : 4;
  char* k_cache = static_cast<char*>(s.kv) + 2 * li * plane * elem;
  char* v_cache = k_cache + plane * elem;
  for (int64_t r = 0; r < m; ++r) {
    float* row = qkv + r * width;
    for (int64_t head = 0; head < nh + nkv; ++head) rope_head(row + head * d, s.cos + r * d, s.sin + r * d, d);
    const int64_t slot = s.slot_mapping[r];
    store_kv(row + nh * d, nkv * d, s.is_half, k_cache + slot * nkv * d * elem);
    store_kv(row + (nh + nkv) * d, nkv * d, s.is_half, v_cache + slot * nkv * d * elem);
  }
  float* attn = st.attn.data();
  std::memset(attn, 0, static_cast<size_t>(m * nh * d) * sizeof(float));
  const AttnProblem p{qkv, width, d, k_cache, v_cache, s.is_half, s.page_index, s.page_size, nh, nkv, d,
                      1.0f / std::sqrt(static_cast<float>(d)), attn};
  paged_attention(p, s.seqs.data(), static_cast<int64_t>(s.seqs.size()), impl);
  float* proj = st.proj.data();
  linear(impl, st, attn, m, nh * d, layer.o, proj);
  for (int64_t r = 0; r < m; ++r) add_rows(x + r * h, proj + r * h, h);
  for (int64_t r = 0; r < m; ++r) norm(x + r * h, layer.post_norm, h, st.eps, st.normed.data() + r * h);
  float* gate_up = st.gate_up.data();
  linear(impl, st, st.normed.data(), m, h, layer.gate_up, gate_up);
  float* act = st.act.data();
  for (int64_t r = 0; r < m; ++r) {
    const float* gu = gate_up + r * 2 * inter;
    silu_mul(gu, gu + inter, inter, act + r * inter);
  }
  linear(impl, st, act, m, inter, layer.down, proj);
  for (int64_t r = 0; r < m; ++r) add_rows(x + r * h, proj + r * h, h);
}

// ------------------------------------------------------------------------------------------------
// Ops
// ------------------------------------------------------------------------------------------------

Linear linear_of(const at::Tensor& packed, const at::Tensor& bias, int64_t in_features, int64_t out_features,
                 const char* name) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(), name,
              ": packed must be contiguous uint8 [N / 16, K / 32, block_bytes]");
  const int bits = packed.size(2) == block_a8_bytes(4) ? 4 : 8;
  TORCH_CHECK(packed.size(2) == block_a8_bytes(bits), name, ": blocks of ", packed.size(2), " bytes");
  TORCH_CHECK(packed.size(0) * 16 == out_features && packed.size(1) * 32 == in_features, name, ": packed ",
              packed.sizes(), " is not [", out_features, ", ", in_features, "]");
  const float* b = nullptr;
  if (bias.numel() > 0) {
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == out_features, name,
                ": bias must be fp32 [", out_features, "]");
    b = bias.data_ptr<float>();
  }
  return Linear{packed.data_ptr<uint8_t>(), packed.size(0), bits, b};
}

int64_t decoder_stack_create(at::TensorList input_norm, at::TensorList qkv, at::TensorList qkv_bias,
                             at::TensorList o, at::TensorList o_bias, at::TensorList post_norm,
                             at::TensorList gate_up, at::TensorList gate_up_bias, at::TensorList down,
                             at::TensorList down_bias, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             double eps, double crest) {
  const size_t n = input_norm.size();
  for (const auto list : {qkv, qkv_bias, o, o_bias, post_norm, gate_up, gate_up_bias, down, down_bias}) {
    TORCH_CHECK(list.size() == n, "every weight list needs one tensor per layer (", n, ")");
  }
  TORCH_CHECK(n > 0 && num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0, "bad head counts");
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= 512, "head_dim must be even and at most 512");
  auto st = std::make_unique<Stack>();
  st->hidden = input_norm[0].numel();
  st->num_heads = num_heads;
  st->num_kv_heads = num_kv_heads;
  st->head_dim = head_dim;
  st->intermediate = down[0].size(1) * 32;
  st->eps = static_cast<float>(eps);
  st->crest = static_cast<float>(crest);
  const int64_t h = st->hidden, width = (num_heads + 2 * num_kv_heads) * head_dim;
  for (size_t i = 0; i < n; ++i) {
    for (const auto& norm : {input_norm[i], post_norm[i]}) {
      TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.numel() == h,
                  "norm weights must be fp32 [", h, "]");
    }
    st->layers.push_back(Layer{input_norm[i].data_ptr<float>(),
                               linear_of(qkv[i], qkv_bias[i], h, width, "qkv"),
                               linear_of(o[i], o_bias[i], num_heads * head_dim, h, "o_proj"),
                               post_norm[i].data_ptr<float>(),
                               linear_of(gate_up[i], gate_up_bias[i], h, 2 * st->intermediate, "gate_up"),
                               linear_of(down[i], down_bias[i], st->intermediate, h, "down_proj")});
    for (const auto list : {input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, gate_up_bias, down, down_bias}) {
      st->keep.push_back(list[i]);
    }
  }
  std::lock_guard<std::mutex> lock(g_registry);
  g_stacks.push_back(std::move(st));
  return static_cast<int64_t>(g_stacks.size()) - 1;
}

void decoder_stack_free(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_registry);
  if (handle >= 0 && handle < static_cast<int64_t>(g_stacks.size())) g_stacks[handle].reset();
}

// x [rows, hidden] fp32, updated in place to the last layer's output; kv [L, 2, P + 1, page_size,
// H_kv, D] fp32; slot_mapping [rows]; cos/sin [rows, D] (sin signed); page_index [pages read];
// row_seqs [S, 3] (row, first page in page_index, kv_len): the rows that attend, each over its own
// kv_len keys (its own position + 1); rows not named (padding) attend to nothing.
void decoder_stack_run(int64_t handle, at::Tensor x, at::Tensor kv, const at::Tensor& slot_mapping,
                       const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& page_index,
                       const at::Tensor& row_seqs, int64_t impl_id) {
  Stack& st = stack_at(handle);
  std::lock_guard<std::mutex> lock(st.busy);
  const int64_t m = x.size(0), d = st.head_dim, nkv = st.num_kv_heads, num_layers = st.layers.size();
  TORCH_CHECK(x.dim() == 2 && x.size(1) == st.hidden && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous fp32 [rows, ", st.hidden, "]");
  TORCH_CHECK(kv.dim() == 6 && kv.size(0) == num_layers && kv.size(1) == 2 && kv.size(4) == nkv && kv.size(5) == d &&
                  (kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kHalf) && kv.is_contiguous(),
              "kv must be contiguous fp32 or fp16 [", num_layers, ", 2, pages, page_size, ", nkv, ", ", d, "]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == m,
              "slot_mapping must be int64 [rows]");
  for (const auto& t : {cos, sin}) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == m && t.size(1) == d,
                "cos/sin must be contiguous fp32 [rows, ", d, "]");
  }
  TORCH_CHECK(page_index.scalar_type() == at::kLong && page_index.is_contiguous(), "page_index must be int64");
  TORCH_CHECK(row_seqs.dim() == 2 && row_seqs.size(1) == 3 && row_seqs.scalar_type() == at::kLong &&
                  row_seqs.is_contiguous(), "row_seqs must be int64 [S, 3]");
  Step s{m, slot_mapping.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), kv.data_ptr(),
         kv.scalar_type() == at::kHalf, kv.size(2) * kv.size(3), kv.size(3), page_index.data_ptr<int64_t>(), {}};
  for (int64_t r = 0; r < m; ++r) {
    TORCH_CHECK(s.slot_mapping[r] >= 0 && s.slot_mapping[r] < s.slots_per_layer, "slot_mapping row ", r, " out of range");
  }
  const int64_t* rs = row_seqs.data_ptr<int64_t>();
  for (int64_t i = 0; i < row_seqs.size(0); ++i) {
    const AttnSeq q{rs[3 * i], rs[3 * i + 1], rs[3 * i + 2]};
    TORCH_CHECK(q.row >= 0 && q.row < m && q.kv_len >= 1 && q.page_start >= 0 &&
                    q.page_start + (q.kv_len + s.page_size - 1) / s.page_size <= page_index.numel(),
                "row_seqs row ", i, " is out of range");
    s.seqs.push_back(q);
  }
  const Impl impl = resolve_impl(impl_id);
  const int64_t width = (st.num_heads + 2 * nkv) * d;
  st.normed.resize(m * st.hidden);
  st.qkv.resize(m * width);
  st.attn.resize(m * st.num_heads * d);
  st.gate_up.resize(m * 2 * st.intermediate);
  st.act.resize(m * st.intermediate);
  st.proj.resize(m * st.hidden);
  if (m == 0) return;
  for (int64_t li = 0; li < num_layers; ++li) run_layer(impl, st, li, x.data_ptr<float>(), s);
}

}  // namespace
}  // namespace voice_server

TORCH_LIBRARY_FRAGMENT(voice_server, m) {
  m.def("decoder_stack_create(Tensor[] input_norm, Tensor[] qkv, Tensor[] qkv_bias, Tensor[] o, Tensor[] o_bias, "
        "Tensor[] post_norm, Tensor[] gate_up, Tensor[] gate_up_bias, Tensor[] down, Tensor[] down_bias, "
        "int num_heads, int num_kv_heads, int head_dim, float eps, float crest) -> int",
        &voice_server::decoder_stack_create);
  m.def("decoder_stack_free(int stack) -> ()", &voice_server::decoder_stack_free);
  m.def("decoder_stack_run(int stack, Tensor(a!) x, Tensor(b!) kv, Tensor slot_mapping, Tensor cos, Tensor sin, "
        "Tensor page_index, Tensor row_seqs, int impl=0) -> ()");
}

TORCH_LIBRARY_IMPL(voice_server, CPU, m) { m.impl("decoder_stack_run", &voice_server::decoder_stack_run); }
