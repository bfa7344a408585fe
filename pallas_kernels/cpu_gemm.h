// Many-row products y[M, N] = x[M, K] @ w[K, N] on CPU, w float32 or bf16 (widened in registers): the
// prefill path of the layer products (`layer_matvec_cpu.cc`).
//
// A register-blocked kernel of the usual kind: w is first packed into panels of kCols columns
// ([N / kCols, K, kCols], a plain copy of each row's piece), then every micro-tile of kRows rows x
// kCols columns keeps its 2 * kRows accumulator vectors in registers over kDepth of K: per K step one
// panel row (two vectors: the two halves of float32, or the even and odd elements of bf16, put back in
// column order on store) and one broadcast of x per row, 2 * kRows fused multiply-adds. A panel's
// kDepth rows stay in L1 while the task's rows walk it; the task's block of x stays in L2.

#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu_vector_math.h"

namespace jaxlongctx::gemm {

constexpr int64_t kCols = 2 * kLanes;  // columns of a micro-tile: two vectors
// Rows of a micro-tile: 2 * kRows accumulators, two panel vectors and a broadcast in the tier's
// registers (32 on AVX-512, 16 otherwise).
constexpr int64_t kRows = kLanes == 16 ? 12 : 6;
constexpr int64_t kDepth = 16384 / (kCols * 4);  // K per pass: a float32 panel piece of 16 KiB (L1)
constexpr int64_t kBlockRows = 16 * kRows;       // rows per task: their x block (kDepth wide) in L2
constexpr int64_t kPackPanels = 8;               // panels packed per task

inline int64_t panels(int64_t n) { return (n + kCols - 1) / kCols; }

// Panels [p0, p1) of w [K, N] into packed [panels(N), K, kCols] (columns past N zero).
template <typename W>
void pack(const W* w, int64_t k, int64_t n, int64_t p0, int64_t p1, W* packed) {
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t c0 = p * kCols, width = std::min(kCols, n - c0);
    W* out = packed + p * k * kCols;
    for (int64_t kk = 0; kk < k; ++kk, out += kCols) {
      std::memcpy(out, w + kk * n + c0, width * sizeof(W));
      std::fill(out + width, out + kCols, W{0});
    }
  }
}

inline void load_pair(const float* p, vf& a, vf& b) {
  a = load(p);
  b = load(p + kLanes);
}

inline void load_pair(const uint16_t* p, vf& even, vf& odd) { load_even_odd(p, even, odd); }

// y[R, cols] (+)= x[R, depth] @ panel[depth, kCols] (x rows ldx apart, y rows ldy apart; add: accumulate
// onto y, else overwrite).
template <typename W, int R>
void micro_tile(const float* x, int64_t ldx, const W* panel, int64_t depth, float* y, int64_t ldy, int64_t cols,
                bool add) {
  vf lo[R] = {}, hi[R] = {};
  for (int64_t kk = 0; kk < depth; ++kk) {
    vf b0, b1;
    load_pair(panel + kk * kCols, b0, b1);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const float a = x[i * ldx + kk];
      lo[i] += a * b0;
      hi[i] += a * b1;
    }
  }
  for (int i = 0; i < R; ++i) {
    float* o = y + i * ldy;
    if (sizeof(W) == 4 && cols == kCols) {  // a whole float32 tile: in column order already
      store(o, add ? load(o) + lo[i] : lo[i]);
      store(o + kLanes, add ? load(o + kLanes) + hi[i] : hi[i]);
      continue;
    }
    float t[kCols];
    if constexpr (sizeof(W) == 2) {  // even/odd back to column order
      for (int64_t l = 0; l < kLanes; ++l) t[2 * l] = lo[i][l], t[2 * l + 1] = hi[i][l];
    } else {
      store(t, lo[i]);
      store(t + kLanes, hi[i]);
    }
    if (add) {
      for (int64_t j = 0; j < cols; ++j) o[j] += t[j];
    } else {
      std::memcpy(o, t, cols * sizeof(float));
    }
  }
}

template <typename W>
using MicroTile = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t, int64_t, bool);

// micro_tile<W, r> for r = 1..kRows, indexed by r - 1.
template <typename W, size_t... I>
constexpr auto micro_tiles(std::index_sequence<I...>) {
  return std::array<MicroTile<W>, sizeof...(I)>{micro_tile<W, I + 1>...};
}

// Rows [r0, r1) and panels [p0, p1) of y[M, N] = x[M, K] @ w, w packed by `pack`.
template <typename W>
void block(const float* x, const W* packed, int64_t k, int64_t n, int64_t r0, int64_t r1, int64_t p0, int64_t p1,
           float* y) {
  static constexpr auto tiles = micro_tiles<W>(std::make_index_sequence<kRows>());
  for (int64_t d0 = 0; d0 < k; d0 += kDepth) {
    const int64_t depth = std::min(kDepth, k - d0);
    for (int64_t p = p0; p < p1; ++p) {
      const W* panel = packed + (p * k + d0) * kCols;
      const int64_t c0 = p * kCols, cols = std::min(kCols, n - c0);
      for (int64_t r = r0; r < r1; r += kRows) {
        const int64_t count = std::min(kRows, r1 - r);
        tiles[count - 1](x + r * k + d0, k, panel, depth, y + r * n + c0, n, cols, d0 > 0);
      }
    }
  }
}

}  // namespace jaxlongctx::gemm
