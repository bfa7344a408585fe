// PQ lookup-table decode attention over the coded tokens, on CPU: an XLA FFI handler.
//
// One call covers one layer. For every (batch row b, kv head k, block of 4 query heads, token
// split s) a task walks its tokens once, in chunks that stay in L1:
//   scores  sc[t, g] = sum_m lut[b, k, nb, m, k_code[t, m], g]         (4 query heads per 16-byte load)
//   weights p[t, g]  = exp(sc[t, g] - running max)                      (online softmax over chunks)
//   bins[m, c, g]   += p[t, g] for c = v_code[t, m]                      (a weight histogram per centroid)
// and at the end out[g, m*ds + j] = sum_c bins[m, c, g] * v_cent[m, c, j] / sum_t p[t, g], with
// lse[g] = max + log(sum_t p[t, g]). No key or value is reconstructed; the splits and the exact
// window are merged by log-sum-exp by the caller. Tasks run on XLA's intra-op thread pool.
//
// Shapes: lut f32 [B K NB M C 4] (scale folded in; padded query heads are zero rows),
// k_codes/v_codes u8 [L B K T M] (every layer's codes: layer `layer`'s are read where they lie, so
// the step's layer loop copies no code slices), v_cent f32 [Kc M C ds] (Kc = 1 shared or K), lengths
// s32 [B], layer s32 []; out f32 [B K NB S 4 D], lse f32 [B K NB S 4] (D = M * ds). A split with no
// token gives (0, -inf).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_tasks.h"
#include "cpu_vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v4 __attribute__((vector_size(16)));
constexpr int64_t kLanes = 4;   // query heads per lookup-table entry
constexpr int64_t kChunk = 256;  // tokens scored before their weights go into the histogram
constexpr int64_t kGroup = 4;    // subspaces whose table rows (and histogram rows) are walked together
static_assert(kGroup == 4, "chunk_scores adds a group's four table entries as two pairs");
// A histogram row (one subspace, C x 4 floats) is padded by a cache line: unpadded rows are exactly
// 4 KiB apart for C = 256, and a store to one row stalls loads from the next (4K aliasing).
constexpr int64_t kRowPad = 16;

inline v4 load4(const float* p) {
  v4 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

inline void store4(float* p, v4 x) { std::memcpy(p, &x, sizeof(x)); }

inline v4 max4(v4 a, v4 b) { return a > b ? a : b; }

typedef int32_t v4i __attribute__((vector_size(16)));

inline v4 exp4(v4 x) { return jaxlongctx::exp_nonpositive<v4, v4i>(x); }

struct Problem {
  const float* lut;
  const uint8_t* k_codes;
  const uint8_t* v_codes;
  const float* v_cent;
  const int32_t* lengths;
  float* out;
  float* lse;
  int64_t batch, kv_heads, blocks, subspaces, centroids, capacity, cent_heads, sub_dim, splits;
};

// Scores of tokens [t0, t0 + n) against one block's lookup table, kGroup subspaces at a time: the
// table rows of a group (kGroup x C x 4 floats) stay in L1 while every token of the chunk adds its
// group's entries to its score. Tokens are independent, so their loads and adds overlap.
void chunk_scores(const float* lut, const uint8_t* codes, int64_t n, int64_t subspaces, int64_t centroids,
                  float* scores) {
  const int64_t row = centroids * kLanes;
  std::fill(scores, scores + n * kLanes, 0.0f);
  int64_t m = 0;
  for (; m + kGroup <= subspaces; m += kGroup) {
    const float* t = lut + m * row;
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* r = codes + i * subspaces + m;
      const v4 a = load4(t + r[0] * kLanes) + load4(t + row + r[1] * kLanes);
      const v4 c = load4(t + 2 * row + r[2] * kLanes) + load4(t + 3 * row + r[3] * kLanes);
      store4(scores + i * kLanes, load4(scores + i * kLanes) + (a + c));
    }
  }
  for (; m < subspaces; ++m)
    for (int64_t i = 0; i < n; ++i)
      store4(scores + i * kLanes, load4(scores + i * kLanes) + load4(lut + m * row + codes[i * subspaces + m] * kLanes));
}

// bins[m, v_code[t, m]] += weights[t] for tokens [t0, t0 + n), kGroup subspaces at a time (their
// histogram rows stay in L1 while the chunk's tokens are added).
void chunk_histogram(const float* weights, const uint8_t* codes, int64_t n, int64_t subspaces, int64_t row,
                     float* hist) {
  int64_t m = 0;
  for (; m + kGroup <= subspaces; m += kGroup) {
    float* h = hist + m * row;
    for (int64_t i = 0; i < n; ++i) {
      const v4 w = load4(weights + i * kLanes);
      const uint8_t* r = codes + i * subspaces + m;
      for (int64_t u = 0; u < kGroup; ++u) {
        float* bin = h + u * row + r[u] * kLanes;
        store4(bin, load4(bin) + w);
      }
    }
  }
  for (; m < subspaces; ++m)
    for (int64_t i = 0; i < n; ++i) {
      float* bin = hist + m * row + codes[i * subspaces + m] * kLanes;
      store4(bin, load4(bin) + load4(weights + i * kLanes));
    }
}

// One task: tokens [lo, hi) of row b, kv head k, query-head block nb -> out [4 D], lse [4].
void run_task(const Problem& p, int64_t task, std::vector<float>& bins, std::vector<float>& scratch) {
  const int64_t s = task % p.splits;
  const int64_t nb = (task / p.splits) % p.blocks;
  const int64_t k = (task / (p.splits * p.blocks)) % p.kv_heads;
  const int64_t b = task / (p.splits * p.blocks * p.kv_heads);
  const int64_t length = std::clamp<int64_t>(p.lengths[b], 0, p.capacity);
  const int64_t lo = length * s / p.splits, hi = length * (s + 1) / p.splits;
  const int64_t M = p.subspaces, C = p.centroids, ds = p.sub_dim, D = M * ds, row = C * kLanes + kRowPad;
  const float* lut = p.lut + (((b * p.kv_heads + k) * p.blocks + nb) * M * C * kLanes);
  const int64_t code_base = (b * p.kv_heads + k) * p.capacity * M;
  const float* cent = p.v_cent + (p.cent_heads > 1 ? k : 0) * M * C * ds;
  float* out = p.out + task * kLanes * D;
  float* lse = p.lse + task * kLanes;

  const float inf = std::numeric_limits<float>::infinity();
  std::fill(bins.begin(), bins.end(), 0.0f);
  v4 run_max = {-inf, -inf, -inf, -inf}, run_sum = {0, 0, 0, 0};
  float* scores = scratch.data();
  for (int64_t t0 = lo; t0 < hi; t0 += kChunk) {
    const int64_t n = std::min(kChunk, hi - t0);
    chunk_scores(lut, p.k_codes + code_base + t0 * M, n, M, C, scores);
    v4 peak = run_max;
    for (int64_t i = 0; i < n; ++i) peak = max4(peak, load4(scores + i * kLanes));
    bool grew = false;  // a lane's running max moved: rescale what was summed so far
    for (int64_t g = 0; g < kLanes; ++g) grew |= peak[g] > run_max[g];
    if (grew && t0 > lo) {
      v4 factor;
      for (int64_t g = 0; g < kLanes; ++g) factor[g] = std::exp(run_max[g] - peak[g]);
      run_sum *= factor;
      for (size_t e = 0; e < bins.size(); e += kLanes) store4(bins.data() + e, load4(bins.data() + e) * factor);
    }
    run_max = peak;
    for (int64_t i = 0; i < n; ++i) {  // scores -> weights, summed
      const v4 w = exp4(load4(scores + i * kLanes) - peak);
      store4(scores + i * kLanes, w);
      run_sum += w;
    }
    chunk_histogram(scores, p.v_codes + code_base + t0 * M, n, M, row, bins.data());
  }
  for (int64_t g = 0; g < kLanes; ++g) {
    const bool seen = run_sum[g] > 0.0f;
    lse[g] = seen ? run_max[g] + std::log(run_sum[g]) : -inf;
  }
  const v4 inv = run_sum > 0.0f ? 1.0f / run_sum : v4{0, 0, 0, 0};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < ds; ++j) {
      v4 acc = {0, 0, 0, 0};
      const float* bin = bins.data() + m * row;
      const float* c = cent + m * C * ds + j;
      for (int64_t e = 0; e < C; ++e) acc += load4(bin + e * kLanes) * c[e * ds];
      acc *= inv;
      for (int64_t g = 0; g < kLanes; ++g) out[g * D + m * ds + j] = acc[g];
    }
  }
}

// A thread's buffers, reused by every task it runs in one call (thread_local ones kept between calls
// measured 2x slower here).
struct Scratch {
  std::vector<float> bins, scores;
};

ffi::Error PqCodedPartialsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> lut, ffi::Buffer<ffi::U8> k_codes,
                               ffi::Buffer<ffi::U8> v_codes, ffi::Buffer<ffi::F32> v_cent,
                               ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> layer,
                               ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  const auto ld = lut.dimensions(), cd = k_codes.dimensions(), vd = v_cent.dimensions(), od = out->dimensions();
  if (ld.size() != 6 || cd.size() != 5 || vd.size() != 4 || od.size() != 6 || ld[5] != kLanes) {
    return ffi::Error::InvalidArgument("pq_coded_partials: unexpected operand ranks");
  }
  if (cd[1] != ld[0] || cd[2] != ld[1] || cd[4] != ld[3] || v_codes.element_count() != k_codes.element_count()) {
    return ffi::Error::InvalidArgument("pq_coded_partials: code and table shapes do not agree");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= cd[0]) return ffi::Error::InvalidArgument("pq_coded_partials: layer index out of range");
  const int64_t offset = l * cd[1] * cd[2] * cd[3] * cd[4];  // layer l's codes [B K T M]
  const Problem p{lut.typed_data(), k_codes.typed_data() + offset, v_codes.typed_data() + offset,
                  v_cent.typed_data(), lengths.typed_data(), out->typed_data(), lse->typed_data(),
                  ld[0], ld[1], ld[2], ld[3], ld[4], cd[3], vd[0], vd[3], od[3]};
  jaxlongctx::run_tasks<Scratch>(pool, pool.num_threads(), ld[0] * ld[1] * ld[2] * od[3],
                                 [p](int64_t t, Scratch& s) {
                                   s.bins.resize(p.subspaces * (p.centroids * kLanes + kRowPad));
                                   s.scores.resize(kChunk * kLanes);
                                   run_task(p, t, s.bins, s.scores);
                                 });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PqCodedPartials, PqCodedPartialsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
