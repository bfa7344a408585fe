// Vector math shared by the CPU kernels (GCC/Clang vector extensions).

#pragma once

#include <cstdint>
#include <cstring>

namespace jaxlongctx {

// 16 float lanes (one AVX-512 register where the CPU has them), and the types to widen bf16 into them.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline v16 load(const float* p) {
  v16 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

inline v16 load(const uint16_t* p) {  // bf16 -> f32: the 16 bits are the float's high half
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  return (v16)(__builtin_convertvector(h, v16u) << 16);
}

inline float widen(float v) { return v; }

inline float widen(uint16_t v) {  // one bf16 -> f32
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float sum(v16 v) {
  float s = 0;
  for (int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// exp of every lane for x <= 0 (softmax weights below their running max): 2^n * e^r with
// |r| <= ln2 / 2 and a degree-6 Taylor polynomial (relative error about 1e-7); x below -87 gives
// e^-87, not 0. V is a float vector type, VI the int32 vector type of the same lane count.
template <typename V, typename VI>
inline V exp_nonpositive(V x) {
  x = x > -87.0f ? x : V{} - 87.0f;
  const V t = x * 1.44269504f;
  const VI n = __builtin_convertvector(t - 0.5f, VI);  // round to nearest for t <= 0
  const V nf = __builtin_convertvector(n, V);
  const V r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
  V poly = 1.0f / 720 + r * (1.0f / 5040);
  poly = 1.0f / 120 + r * poly;
  poly = 1.0f / 24 + r * poly;
  poly = 1.0f / 6 + r * poly;
  poly = 0.5f + r * poly;
  poly = 1.0f + r * poly;
  poly = 1.0f + r * poly;
  const VI bits = (n + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return poly * scale;
}

}  // namespace jaxlongctx
