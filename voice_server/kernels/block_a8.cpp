// Block-quantised linears for CPU decode: int4 (GGUF Q4_1) or int8 (GGUF Q8_0) weights times int8
// activations quantised per row and per block of 32 (llama.cpp's Q8_1; blocks with an outlier get a
// second int8 plane, see Acts; quantised by quantize_a8.cpp), integer dot products per block. Loaded
// by voice_server/kernels/__init__.py as the torch custom op voice_server::block_a8_linear.
//
// Packed weights [N / 16, K / 32, block_bytes] uint8: 16 output channels interleaved per block so one
// 64-byte vector holds 4 consecutive K values of each of the 16 channels (the operand layout of
// VNNI's vpdpbusd). 4-bit: 256 bytes of nibbles (chunk c holds K groups c and c + 4, low and high
// nibble), then d and m as 16 fp16 each (w = d * q + m, q in 0..15): 320 bytes. 8-bit: 512 bytes
// of q + 128 (unsigned, so it can be vpdpbusd's unsigned operand), then d as 16 fp16
// (w = d * q): 544 bytes.
//
// Batch and thread invariance: a row's output depends only on that row (its own activation scales)
// and is computed by the same instruction sequence whatever the row count or the tile split across
// threads; the dot products are exact integers and the fp32 accumulation runs over blocks in a fixed
// order. The path (AVX512-VNNI, AVX2, scalar) is chosen once per process from cpuid.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels.h"

namespace voice_server {
namespace {

constexpr int64_t kTile = 16;
constexpr int64_t kRowsPerPass = 4;   // activation rows sharing one unpacked weight block
constexpr int64_t kRowsPerChunk = 64; // activation rows kept in L1 while the weights stream

int64_t block_bytes(int64_t bits) { return block_a8_bytes(static_cast<int>(bits)); }

// Quantised activations: per row m and block b, q (int8, two planes of K values per row), the
// block's scale s, the block sums of q1 and q2, the Q4_1 min term's factor s * sum1 + s / 256 * sum2
// and whether it has a second plane. One plane: x ~ s * q1 with s = max|x| / 127 (llama.cpp's Q8_1).
// Two planes, for blocks with an outlier (max|x| > crest * mean|x|), ~16-bit activations for int8 dot
// products: x ~ s * q1 + s / 256 * q2, q2 the rounded remainder. A block's choice depends on its own
// values only, so rows stay independent of each other.
struct Acts {
  const int8_t* q;
  const float* scale;
  const float* scaled_sum;
  const int32_t* sum;
  const int32_t* sum2;
  const uint8_t* is_two_plane;
  int64_t k;
  int64_t num_blocks;
};

struct Out {
  float* y;
  int64_t n;  // row stride of y
  const float* bias;
};

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ------------------------------------------------------------------------------------------------
// Scalar: the reference order every vector path follows (per block: exact int dots, then
// acc_d += dot1 * (d * s), for a second plane acc_d += dot2 * (d * (s / 256)), acc_m += m * scaled_sum;
// output acc_d + acc_m (+ bias))
// ------------------------------------------------------------------------------------------------

template <int Bits>
void tile_scalar(const uint8_t* w, const Acts& a, int64_t row0, int rows, const Out& o, int64_t tile) {
  const int64_t bb = block_bytes(Bits);
  for (int r = 0; r < rows; ++r) {
    const int64_t m = row0 + r;
    float acc_d[kTile] = {}, acc_m[kTile] = {};
    for (int64_t b = 0; b < a.num_blocks; ++b) {
      const uint8_t* blk = w + b * bb;
      const int8_t* qa = a.q + 2 * m * a.k + b * kBlock;
      const float sx = a.scale[m * a.num_blocks + b];
      const bool is_two_plane = a.is_two_plane[m * a.num_blocks + b];
      for (int c = 0; c < kTile; ++c) {
        int32_t dot = 0, dot2 = 0;
        for (int g = 0; g < 8; ++g) {
          for (int j = 0; j < 4; ++j) {
            int32_t wq;
            if (Bits == 4) {
              const uint8_t byte = blk[64 * (g % 4) + 4 * c + j];
              wq = g < 4 ? (byte & 0x0F) : (byte >> 4);
            } else {
              wq = static_cast<int32_t>(blk[64 * g + 4 * c + j]) - 128;
            }
            dot += wq * qa[4 * g + j];
            dot2 += wq * qa[a.k + 4 * g + j];
          }
        }

        const float d = half_to_float(blk + (Bits == 4 ? 256 : 512) + 2 * c);
        acc_d[c] = std::fma(static_cast<float>(dot), d * sx, acc_d[c]);
        if (is_two_plane) acc_d[c] = std::fma(static_cast<float>(dot2), d * (sx * (1.0f / 256.0f)), acc_d[c]);
        if (Bits == 4) {
          const float mn = half_to_float(blk + 288 + 2 * c);
          acc_m[c] = std::fma(mn, a.scaled_sum[m * a.num_blocks + b], acc_m[c]);
        }
      }
    }
    float* y = o.y + m * o.n + tile * kTile;
    for (int c = 0; c < kTile; ++c) {
      const float v = acc_d[c] + acc_m[c];
      y[c] = o.bias ? v + o.bias[tile * kTile + c] : v;
    }
  }
}

inline void prefetch_block(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// ------------------------------------------------------------------------------------------------
// AVX512-VNNI: one zmm = 16 channels x 4 K values; vpdpbusd(u8 weights, s8 activations)
// ------------------------------------------------------------------------------------------------

// One block's exact dot of 16 channels with 32 activations of one plane (8-bit weights are stored
// + 128: minus 128 * the plane's sum). Four independent chains summed in a fixed tree: one chain of
// 8 vpdpbusd would bound a single row's speed by their latency.
template <int Bits>
VS_AVX512 inline __m512i dot_avx512(const __m512i* wv, const int8_t* qa, int32_t sum) {
  __m512i p[4];
  for (int i = 0; i < 4; ++i) {
    p[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[i], _mm512_set1_epi32(load_i32(qa + 4 * i)));
    p[i] = _mm512_dpbusd_epi32(p[i], wv[i + 4], _mm512_set1_epi32(load_i32(qa + 4 * (i + 4))));
  }
  const __m512i dot = _mm512_add_epi32(_mm512_add_epi32(p[0], p[1]), _mm512_add_epi32(p[2], p[3]));
  return Bits == 8 ? _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * sum)) : dot;
}

template <int Bits, int Rows>
VS_AVX512 void tile_avx512(const uint8_t* w, const Acts& a, int64_t row0, const Out& o, int64_t tile,
                           const uint8_t* next) {
  const int64_t bb = block_bytes(Bits);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc_d[Rows], acc_m[Rows];
  for (int r = 0; r < Rows; ++r) acc_d[r] = acc_m[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.num_blocks; ++b) {
    const uint8_t* blk = w + b * bb;
    if (next != nullptr) prefetch_block(next + b * bb, bb);
    __m512i wv[8];
    if (Bits == 4) {
      for (int c = 0; c < 4; ++c) {
        const __m512i raw = _mm512_loadu_si512(blk + 64 * c);
        wv[c] = _mm512_and_si512(raw, nibble);
        wv[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
      }
    } else {
      for (int g = 0; g < 8; ++g) wv[g] = _mm512_loadu_si512(blk + 64 * g);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (Bits == 4 ? 256 : 512))));
    __m512 mn = _mm512_setzero_ps();
    if (Bits == 4) mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
    for (int r = 0; r < Rows; ++r) {
      const int64_t m = row0 + r;
      const int64_t i_mb = m * a.num_blocks + b;
      const __m512i dot = dot_avx512<Bits>(wv, a.q + 2 * m * a.k + b * kBlock, a.sum[i_mb]);
      acc_d[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(a.scale[i_mb])), acc_d[r]);
      if (Bits == 4) acc_m[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.scaled_sum[i_mb]), acc_m[r]);
    }
    // NOTE: second planes in their own loop: a branch inside the loop above cost ~40% of its speed
    // at 4 rows even when never taken (the rows' work no longer interleaved).
    for (int r = 0; r < Rows; ++r) {
      const int64_t m = row0 + r, i_mb = m * a.num_blocks + b;
      if (!a.is_two_plane[i_mb]) continue;
      const __m512i dot = dot_avx512<Bits>(wv, a.q + (2 * m + 1) * a.k + b * kBlock, a.sum2[i_mb]);
      const __m512 d2 = _mm512_mul_ps(d, _mm512_set1_ps(a.scale[i_mb] * (1.0f / 256.0f)));
      acc_d[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d2, acc_d[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    __m512 v = _mm512_add_ps(acc_d[r], acc_m[r]);
    if (o.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(o.bias + tile * kTile));
    _mm512_storeu_ps(o.y + (row0 + r) * o.n + tile * kTile, v);
  }
}

// ------------------------------------------------------------------------------------------------
// AVX2: each tile as two halves of 8 channels; vpmaddubsw + vpmaddwd. 8-bit weights go through
// abs/sign (llama.cpp's trick) since (q + 128) * q8 pairs would saturate int16.
// ------------------------------------------------------------------------------------------------

template <int Bits>
VS_AVX2 inline __m256i dot4_avx2(__m256i w, const int8_t* qa, __m256i ones) {
  const __m256i act = _mm256_set1_epi32(load_i32(qa));
  if (Bits == 4) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, act), ones);
  const __m256i ws = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(act, ws)), ones);
}

template <int Bits>
VS_AVX2 inline __m256i dot_avx2(const __m256i* wv, const int8_t* qa, __m256i ones) {
  if (Bits == 4) {
    // NOTE: a vpmaddubsw pair sum of two 4-bit weights and two int8 activations lies in [-3840, 3810],
    // so the block's eight of them sum in int16 ([-30720, 30480], every partial sum too) and widen
    // once: the same exact integers as widening each (one vpmaddwd per block instead of eight: ~1.25x
    // the speed of 4-bit rows on an AVX2-only EPYC).
    __m256i t[8];
    for (int i = 0; i < 8; ++i) t[i] = _mm256_maddubs_epi16(wv[i], _mm256_set1_epi32(load_i32(qa + 4 * i)));
    const __m256i lo = _mm256_add_epi16(_mm256_add_epi16(t[0], t[1]), _mm256_add_epi16(t[2], t[3]));
    const __m256i hi = _mm256_add_epi16(_mm256_add_epi16(t[4], t[5]), _mm256_add_epi16(t[6], t[7]));
    return _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones);
  }
  __m256i p[4];
  for (int i = 0; i < 4; ++i) {
    p[i] = _mm256_add_epi32(dot4_avx2<Bits>(wv[i], qa + 4 * i, ones), dot4_avx2<Bits>(wv[i + 4], qa + 4 * (i + 4), ones));
  }
  return _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3]));
}

template <int Bits, int Rows>
VS_AVX2 void tile_avx2(const uint8_t* w, const Acts& a, int64_t row0, const Out& o, int64_t tile,
                       const uint8_t* next) {
  const int64_t bb = block_bytes(Bits);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc_d[Rows], acc_m[Rows];
    for (int r = 0; r < Rows; ++r) acc_d[r] = acc_m[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.num_blocks; ++b) {
      const uint8_t* blk = w + b * bb;
      if (next != nullptr && h == 0) prefetch_block(next + b * bb, bb);
      __m256i wv[8];
      if (Bits == 4) {
        for (int c = 0; c < 4; ++c) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * c + 32 * h));
          wv[c] = _mm256_and_si256(raw, nibble);
          wv[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        }
      } else {
        for (int g = 0; g < 8; ++g) wv[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g + 32 * h));
      }
      const int64_t scales = (Bits == 4 ? 256 : 512) + 16 * h;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + scales)));
      __m256 mn = _mm256_setzero_ps();
      if (Bits == 4) mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288 + 16 * h)));
      for (int r = 0; r < Rows; ++r) {
        const int64_t m = row0 + r;
        const int64_t i_mb = m * a.num_blocks + b;
        const __m256i dot = dot_avx2<Bits>(wv, a.q + 2 * m * a.k + b * kBlock, ones);
        acc_d[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(a.scale[i_mb])), acc_d[r]);
        if (Bits == 4) acc_m[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.scaled_sum[i_mb]), acc_m[r]);
      }
      for (int r = 0; r < Rows; ++r) {
        const int64_t m = row0 + r, i_mb = m * a.num_blocks + b;
        if (!a.is_two_plane[i_mb]) continue;
        const __m256i dot = dot_avx2<Bits>(wv, a.q + (2 * m + 1) * a.k + b * kBlock, ones);
        const __m256 d2 = _mm256_mul_ps(d, _mm256_set1_ps(a.scale[i_mb] * (1.0f / 256.0f)));
        acc_d[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d2, acc_d[r]);
      }
    }
    for (int r = 0; r < Rows; ++r) {
      __m256 v = _mm256_add_ps(acc_d[r], acc_m[r]);
      if (o.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(o.bias + tile * kTile + 8 * h));
      _mm256_storeu_ps(o.y + (row0 + r) * o.n + tile * kTile + 8 * h, v);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Dispatch
// ------------------------------------------------------------------------------------------------

template <int Bits, int Rows>
void run_tile(Impl impl, const uint8_t* w, const Acts& a, int64_t row0, const Out& o, int64_t tile,
              const uint8_t* next) {
  if (impl == kAvx512) return tile_avx512<Bits, Rows>(w, a, row0, o, tile, next);
  if (impl == kAvx2) return tile_avx2<Bits, Rows>(w, a, row0, o, tile, next);
  tile_scalar<Bits>(w, a, row0, Rows, o, tile);
}

template <int Bits>
void run_rows(Impl impl, const uint8_t* w, const Acts& a, int64_t row0, int rows, const Out& o, int64_t tile,
              const uint8_t* next) {
  switch (rows) {
    case 1: return run_tile<Bits, 1>(impl, w, a, row0, o, tile, next);
    case 2: return run_tile<Bits, 2>(impl, w, a, row0, o, tile, next);
    case 3: return run_tile<Bits, 3>(impl, w, a, row0, o, tile, next);
    default: return run_tile<Bits, 4>(impl, w, a, row0, o, tile, next);
  }
}

}  // namespace

Impl host_impl() {
  static const Impl impl = [] {
    __builtin_cpu_init();
    Impl best = kScalar;
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
      best = kAvx512;
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      best = kAvx2;
    }
    // NOTE: VOICE_SERVER_KERNEL_ISA=avx2|scalar caps the path, like torch's ATEN_CPU_CAPABILITY: an
    // AVX-512 machine then runs what an AVX2-only or a plain x86-64 CPU would (tests, benchmarks).
    const char* cap = std::getenv("VOICE_SERVER_KERNEL_ISA");
    if (cap != nullptr && std::strcmp(cap, "avx2") == 0 && best > kAvx2) best = kAvx2;
    if (cap != nullptr && std::strcmp(cap, "scalar") == 0) best = kScalar;
    return best;
  }();
  return impl;
}

Impl resolve_impl(int64_t requested) {
  const Impl host = host_impl();
  if (requested == kAuto) return host;
  TORCH_CHECK(requested >= kScalar && requested <= kAvx512, "impl must be 0 (auto), 1, 2 or 3, got ", requested);
  TORCH_CHECK(requested <= host, "impl ", requested, " is not supported by this CPU (best: ", static_cast<int64_t>(host), ")");
  return static_cast<Impl>(requested);
}

void block_a8_matmul(Impl impl, const A8Acts& acts, const uint8_t* packed, int64_t num_tiles, int bits,
                     const float* bias, float* y, int64_t y_stride) {
  const int64_t m = acts.m, num_blocks = acts.k / kBlock;
  const Acts a{acts.q.data(), acts.scale.data(), acts.scaled_sum.data(), acts.sum.data(), acts.sum2.data(),
               acts.is_two_plane.data(), acts.k, num_blocks};
  const Out out{y, y_stride, bias};
  const int64_t tile_bytes = num_blocks * block_bytes(bits);
  // NOTE: the split over threads only decides who computes a tile, never how.
  at::parallel_for(0, num_tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t row0 = 0; row0 < m; row0 += kRowsPerChunk) {
      const int64_t row_end = std::min(m, row0 + kRowsPerChunk);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t r = row0; r < row_end; r += kRowsPerPass) {
          const int rows = static_cast<int>(std::min<int64_t>(kRowsPerPass, row_end - r));
          // NOTE: the first pass over a tile fetches the next tile's blocks: with several passes
          // per tile the hardware prefetcher lost the stream (8 rows, weights from memory: 98 us
          // for a 3072x576 layer, twice the 4-row time).
          const uint8_t* next = r == 0 && t + 1 < end ? packed + (t + 1) * tile_bytes : nullptr;
          if (bits == 4) run_rows<4>(impl, packed + t * tile_bytes, a, r, rows, out, t, next);
          else run_rows<8>(impl, packed + t * tile_bytes, a, r, rows, out, t, next);
        }
      }
    }
  });
}

namespace {

at::Tensor block_a8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t weight_bits,
                           const std::optional<at::Tensor>& bias, double crest, int64_t impl_id) {
  TORCH_CHECK(weight_bits == 4 || weight_bits == 8, "weight_bits must be 4 or 8, got ", weight_bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed must be contiguous uint8 [N / 16, K / 32, block_bytes]");
  TORCH_CHECK(packed.size(2) == block_bytes(weight_bits), "packed blocks of ", packed.size(2), " bytes, expected ",
              block_bytes(weight_bits), " for ", weight_bits, "-bit weights");
  const int64_t m = x.size(0), k = x.size(1), num_tiles = packed.size(0), num_blocks = packed.size(1);
  const int64_t n = num_tiles * kTile;
  TORCH_CHECK(k == num_blocks * kBlock, "x has K=", k, ", the weights ", num_blocks * kBlock);
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, "bias must be fp32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  const Impl impl = resolve_impl(impl_id);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  // NOTE: per thread, reused: the op may run from several Python threads at once.
  thread_local A8Acts acts;
  block_a8_quantize(impl, x.data_ptr<float>(), m, k, static_cast<float>(crest), acts);
  block_a8_matmul(impl, acts, packed.data_ptr<uint8_t>(), num_tiles, static_cast<int>(weight_bits), bias_ptr,
                  y.data_ptr<float>(), n);
  return y;
}

int64_t best_impl() { return host_impl(); }

}  // namespace
}  // namespace voice_server

TORCH_LIBRARY(voice_server, m) {
  m.def("block_a8_linear(Tensor x, Tensor packed, int weight_bits, Tensor? bias=None, float crest=-1.0, "
        "int impl=0) -> Tensor");
  m.def("best_impl() -> int", &voice_server::best_impl);
}

TORCH_LIBRARY_IMPL(voice_server, CPU, m) { m.impl("block_a8_linear", &voice_server::block_a8_linear); }
