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

inline float round_to_bf16(float v) {  // the nearest bf16 (ties to even), as a float; finite inputs
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

#if defined(__clang__)
#define JAXLONGCTX_SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define JAXLONGCTX_SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, v16i{__VA_ARGS__})
#endif

// The sum of a vector's lanes: four shuffle-and-add steps in registers (a lane loop or a split
// through memory would spill the accumulator of the caller's dot product to the stack).
inline float sum(v16 v) {
  v += JAXLONGCTX_SHUFFLE2(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += JAXLONGCTX_SHUFFLE2(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += JAXLONGCTX_SHUFFLE2(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += JAXLONGCTX_SHUFFLE2(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// The lane sums of four vectors at once (a transposing reduction: 13 vector operations for the four,
// against 8 for each alone): out[0..3] = sum(a), sum(b), sum(c), sum(d).
inline void sums4(v16 a, v16 b, v16 c, v16 d, float* out) {
  const v16 ab = JAXLONGCTX_SHUFFLE2(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 JAXLONGCTX_SHUFFLE2(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16 cd = JAXLONGCTX_SHUFFLE2(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 JAXLONGCTX_SHUFFLE2(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // lanes 0-3: a, 4-7: c, 8-11: b, 12-15: d (four partial sums each)
  v16 v = JAXLONGCTX_SHUFFLE2(ab, cd, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
          JAXLONGCTX_SHUFFLE2(ab, cd, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  v += JAXLONGCTX_SHUFFLE2(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += JAXLONGCTX_SHUFFLE2(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  out[0] = v[0], out[1] = v[8], out[2] = v[4], out[3] = v[12];
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
