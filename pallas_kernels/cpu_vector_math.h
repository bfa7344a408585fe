// Vector math shared by the CPU kernels (GCC/Clang vector extensions).

#pragma once

#include <cstdint>
#include <cstring>

namespace jaxlongctx {

// The instruction-set tier of this build, chosen at compile time by the -march flags
// (`native_build`): the float vector type `vf` of kLanes lanes is one register of the widest
// vector unit, so GCC keeps it in registers. (A 64-byte vector on a CPU without AVX-512 is not a
// register type: GCC keeps it on the stack and moves it through memory on every operation, which
// took the kernels' AVX2 builds to about a third of the read bandwidth.)
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;  // AVX-512: one zmm register
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;  // AVX, AVX2: one ymm register
#else
constexpr int64_t kLanes = 4;  // the base tier: 128 bits (SSE2, NEON)
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vh __attribute__((vector_size(2 * kLanes)));

// The fixed-width types that lane sums split vectors into (vf is one of them on each tier).
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

// kLanes floats from p.
inline vf load(const float* p) {
  vf r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

// kLanes bf16 from p widened to float32 (a bf16 is its float's high half).
inline vf load(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return (vf)(__builtin_convertvector(h, vu) << 16);
}

inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof(x)); }

// 2 * kLanes consecutive bf16 as two float vectors in one load, without a lane permute: the even
// elements (a bf16 is the high half of its float32: shift left) and the odd ones (mask the low half).
inline void load_even_odd(const uint16_t* p, vf& even, vf& odd) {
  vu u;
  std::memcpy(&u, p, sizeof(u));
  even = (vf)(u << 16);
  odd = (vf)(u & 0xFFFF0000u);
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
#define JAXLONGCTX_SHUFFLE2(I, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define JAXLONGCTX_SHUFFLE2(I, a, b, ...) __builtin_shuffle(a, b, I{__VA_ARGS__})
#endif

// The low and high halves of a vector (in registers: an extract, not a trip through memory).
template <typename Half, typename V>
inline void halves(V v, Half& lo, Half& hi) {
  static_assert(2 * sizeof(Half) == sizeof(V));
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
}

// The sum of a vector's lanes: halves added down to four lanes, then two shuffle-and-add steps in
// registers (a lane loop or a split through memory would spill the caller's accumulators).
inline float sum(v4 v) {
  v += JAXLONGCTX_SHUFFLE2(v4i, v, v, 2, 3, 0, 1);
  v += JAXLONGCTX_SHUFFLE2(v4i, v, v, 1, 0, 3, 2);
  return v[0];
}

inline float sum(v8 v) {
  v4 lo, hi;
  halves(v, lo, hi);
  return sum(lo + hi);
}

inline float sum(v16 v) {  // four shuffle-and-add steps (AVX-512: in one register)
  typedef int32_t I __attribute__((vector_size(64)));
  v += JAXLONGCTX_SHUFFLE2(I, v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += JAXLONGCTX_SHUFFLE2(I, v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += JAXLONGCTX_SHUFFLE2(I, v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += JAXLONGCTX_SHUFFLE2(I, v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// The lane sums of four vectors at once: out[0..3] = sum(a), sum(b), sum(c), sum(d). Halves are added
// down to four lanes, then one 4x4 transpose-and-add (7 vector operations for the four, against 4 each
// alone).
inline void sums4(v4 a, v4 b, v4 c, v4 d, float* out) {
  const v4 ab = JAXLONGCTX_SHUFFLE2(v4i, a, b, 0, 4, 1, 5) + JAXLONGCTX_SHUFFLE2(v4i, a, b, 2, 6, 3, 7);
  const v4 cd = JAXLONGCTX_SHUFFLE2(v4i, c, d, 0, 4, 1, 5) + JAXLONGCTX_SHUFFLE2(v4i, c, d, 2, 6, 3, 7);
  // ab: a0+a2, b0+b2, a1+a3, b1+b3 (cd alike)
  const v4 v = JAXLONGCTX_SHUFFLE2(v4i, ab, cd, 0, 1, 4, 5) + JAXLONGCTX_SHUFFLE2(v4i, ab, cd, 2, 3, 6, 7);
  std::memcpy(out, &v, sizeof(v));
}

inline void sums4(v8 a, v8 b, v8 c, v8 d, float* out) {
  v4 lo[4], hi[4];
  halves(a, lo[0], hi[0]), halves(b, lo[1], hi[1]), halves(c, lo[2], hi[2]), halves(d, lo[3], hi[3]);
  sums4(lo[0] + hi[0], lo[1] + hi[1], lo[2] + hi[2], lo[3] + hi[3], out);
}

// 16 lanes: a transposing reduction, 13 vector operations for the four (AVX-512: in registers).
inline void sums4(v16 a, v16 b, v16 c, v16 d, float* out) {
  typedef int32_t I __attribute__((vector_size(64)));
  const v16 ab = JAXLONGCTX_SHUFFLE2(I, a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 JAXLONGCTX_SHUFFLE2(I, a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16 cd = JAXLONGCTX_SHUFFLE2(I, c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 JAXLONGCTX_SHUFFLE2(I, c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // lanes 0-3: a, 4-7: c, 8-11: b, 12-15: d (four partial sums each)
  v16 v = JAXLONGCTX_SHUFFLE2(I, ab, cd, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
          JAXLONGCTX_SHUFFLE2(I, ab, cd, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  v += JAXLONGCTX_SHUFFLE2(I, v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += JAXLONGCTX_SHUFFLE2(I, v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
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
