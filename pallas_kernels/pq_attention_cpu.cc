// PQ lookup-table decode attention of one layer on CPU (MILLION): an XLA FFI handler.
//
// One new token per row: its G query heads of kv head k attend over the coded tokens of layer `layer`
// (every layer's codes are passed and read where they lie) and over the exact window (the recent
// tokens in full precision, the new token's own key and value among them). Tasks on XLA's intra-op
// threads:
//  - coded (row b, kv head k, block nb of 4 query heads, token split s): builds the block's lookup
//    table lut[m, c, lane] = q[4 nb + lane, m*ds : (m+1)*ds] . k_cent[m, c] (4 query heads per
//    16-byte entry; missing heads are zero lanes), then walks its tokens once, in chunks that stay in L1:
//      scores  sc[t, g] = sum_m lut[m, k_code[t, m], g]
//      weights p[t, g]  = exp(sc[t, g] - running reference)        (online softmax over chunks)
//      bins[m, c, g]   += p[t, g] for c = v_code[t, m]              (a weight histogram per centroid)
//    and ends with out[g, m*ds + j] = sum_c bins[m, c, g] * v_cent[m, c, j] / sum_t p[t, g] and its
//    log-sum-exp. No key or value is reconstructed.
//  - window (row b, kv head k): exact attention of the G heads over the first win_lengths[b] slots.
// The partials of each (b, k, g) are then merged by log-sum-exp into out, so the step's XLA graph has
// one operation for the layer's attention.
//
// Shapes: q f32 [B K G hd] (scale folded in); k_codes/v_codes u8 [L B K T M]; k_cent/v_cent f32
// [Kc M C ds] (Kc = 1 shared or K); lengths s32 [B]; k_win/v_win f32 or bf16 [B K R hd]; win_lengths
// s32 [B]; layer s32 []; out f32 [B K G hd] (0 for a head that sees no token); attr splits.

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
using jaxlongctx::widen;

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
  const float* q;  // [B K G hd]
  const uint8_t* k_codes;  // layer `layer`'s [B K T M]
  const uint8_t* v_codes;
  const float* k_cent;  // [Kc M C ds]
  const float* v_cent;
  const int32_t* lengths;
  const void* k_win;  // [B K R hd], float or bf16
  const void* v_win;
  const int32_t* win_lengths;
  float* coded_out;  // [B K NB S 4 hd] each coded task's normalised output
  float* coded_lse;  // [B K NB S 4] and its log-sum-exp (-inf where no token was seen)
  float* window_out;  // [B K G hd]
  float* window_lse;  // [B K G]
  int64_t batch, kv_heads, group, head_dim, blocks, subspaces, centroids, capacity, cent_heads, sub_dim,
      splits, window;
  bool bf16_window;

  int64_t coded_tasks() const { return batch * kv_heads * blocks * splits; }
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

// The lookup table of query heads [4 nb, 4 nb + 4) of (row b, kv head k): lut [M, C, 4] (row stride
// C * 4), scale already in q; heads past G are zero lanes.
void build_lut(const Problem& p, int64_t b, int64_t k, int64_t nb, std::vector<v4>& q_lanes, float* lut) {
  const int64_t hd = p.head_dim, M = p.subspaces, C = p.centroids, ds = p.sub_dim;
  q_lanes.assign(hd, v4{0, 0, 0, 0});  // q_lanes[d] = the block's 4 heads at dim d
  for (int64_t lane = 0; lane < kLanes && nb * kLanes + lane < p.group; ++lane) {
    const float* q = p.q + ((b * p.kv_heads + k) * p.group + nb * kLanes + lane) * hd;
    for (int64_t d = 0; d < hd; ++d) q_lanes[d][lane] = q[d];
  }
  const float* cent = p.k_cent + (p.cent_heads > 1 ? k : 0) * M * C * ds;
  for (int64_t m = 0; m < M; ++m) {
    const v4* qm = q_lanes.data() + m * ds;
    for (int64_t c = 0; c < C; ++c) {
      const float* centroid = cent + (m * C + c) * ds;
      v4 acc = qm[0] * centroid[0];
      for (int64_t j = 1; j < ds; ++j) acc += qm[j] * centroid[j];
      store4(lut + (m * C + c) * kLanes, acc);
    }
  }
}

// A thread's buffers, reused by every task it runs in one call (thread_local ones kept between calls
// measured 2x slower here).
struct Scratch {
  std::vector<float> lut, bins, scores;
  std::vector<v4> q_lanes;
};

// Scores within this many nats under the running reference keep their weights: the reference moves
// (and the sums so far are rescaled) only when a score passes it, and then to that score plus this
// headroom, so a slowly rising maximum rescales the histogram a few times instead of every chunk.
constexpr float kHeadroom = 8.0f;

// A coded task: tokens [lo, hi) of row b, kv head k, query-head block nb -> coded_out [4 hd], coded_lse [4].
void coded_task(const Problem& p, int64_t task, Scratch& scratch) {
  const int64_t s = task % p.splits;
  const int64_t nb = (task / p.splits) % p.blocks;
  const int64_t k = (task / (p.splits * p.blocks)) % p.kv_heads;
  const int64_t b = task / (p.splits * p.blocks * p.kv_heads);
  const int64_t length = std::clamp<int64_t>(p.lengths[b], 0, p.capacity);
  const int64_t lo = length * s / p.splits, hi = length * (s + 1) / p.splits;
  const int64_t M = p.subspaces, C = p.centroids, ds = p.sub_dim, D = M * ds, row = C * kLanes + kRowPad;
  const int64_t code_base = (b * p.kv_heads + k) * p.capacity * M;
  const float* cent = p.v_cent + (p.cent_heads > 1 ? k : 0) * M * C * ds;
  float* out = p.coded_out + task * kLanes * D;
  float* lse = p.coded_lse + task * kLanes;
  const float inf = std::numeric_limits<float>::infinity();
  if (lo == hi) {
    std::fill(out, out + kLanes * D, 0.0f);
    std::fill(lse, lse + kLanes, -inf);
    return;
  }
  scratch.lut.resize(M * C * kLanes);
  scratch.bins.assign(M * row, 0.0f);
  scratch.scores.resize(kChunk * kLanes);
  float* lut = scratch.lut.data();
  float* bins = scratch.bins.data();
  float* scores = scratch.scores.data();
  build_lut(p, b, k, nb, scratch.q_lanes, lut);

  v4 ref = {-inf, -inf, -inf, -inf}, run_sum = {0, 0, 0, 0};
  for (int64_t t0 = lo; t0 < hi; t0 += kChunk) {
    const int64_t n = std::min(kChunk, hi - t0);
    chunk_scores(lut, p.k_codes + code_base + t0 * M, n, M, C, scores);
    v4 peak = ref;
    for (int64_t i = 0; i < n; ++i) peak = max4(peak, load4(scores + i * kLanes));
    bool passed = false;  // a lane's score passed its reference: move it (and rescale what was summed)
    for (int64_t g = 0; g < kLanes; ++g) passed |= peak[g] > ref[g];
    if (passed) {
      v4 next = ref, factor;
      for (int64_t g = 0; g < kLanes; ++g) {
        if (peak[g] > ref[g]) next[g] = peak[g] + kHeadroom;
        factor[g] = ref[g] == -inf ? 0.0f : std::exp(ref[g] - next[g]);
      }
      if (t0 > lo) {
        run_sum *= factor;
        for (int64_t e = 0; e < M * row; e += kLanes) store4(bins + e, load4(bins + e) * factor);
      }
      ref = next;
    }
    for (int64_t i = 0; i < n; ++i) {  // scores -> weights, summed
      const v4 w = exp4(load4(scores + i * kLanes) - ref);
      store4(scores + i * kLanes, w);
      run_sum += w;
    }
    chunk_histogram(scores, p.v_codes + code_base + t0 * M, n, M, row, bins);
  }
  for (int64_t g = 0; g < kLanes; ++g) lse[g] = run_sum[g] > 0.0f ? ref[g] + std::log(run_sum[g]) : -inf;
  const v4 inv = run_sum > 0.0f ? 1.0f / run_sum : v4{0, 0, 0, 0};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < ds; ++j) {
      v4 acc = {0, 0, 0, 0};
      const float* bin = bins + m * row;
      const float* c = cent + m * C * ds + j;
      for (int64_t e = 0; e < C; ++e) acc += load4(bin + e * kLanes) * c[e * ds];
      acc *= inv;
      for (int64_t g = 0; g < kLanes; ++g) out[g * D + m * ds + j] = acc[g];
    }
  }
}

// A window task: exact attention of the G heads of (row b, kv head k) over the window's first
// win_lengths[b] slots -> window_out [G hd], window_lse [G].
template <typename T>
void window_task(const Problem& p, int64_t b, int64_t k, Scratch& scratch) {
  const int64_t G = p.group, hd = p.head_dim, R = p.window, bk = b * p.kv_heads + k;
  const int64_t n = std::clamp<int64_t>(p.win_lengths[b], 0, R);
  const T* keys = static_cast<const T*>(p.k_win) + bk * R * hd;
  const T* values = static_cast<const T*>(p.v_win) + bk * R * hd;
  scratch.scores.resize(std::max<int64_t>(n, 1));
  float* w = scratch.scores.data();
  for (int64_t g = 0; g < G; ++g) {
    const float* q = p.q + (bk * G + g) * hd;
    float* out = p.window_out + (bk * G + g) * hd;
    std::fill(out, out + hd, 0.0f);
    if (n == 0) {
      p.window_lse[bk * G + g] = -std::numeric_limits<float>::infinity();
      continue;
    }
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < n; ++r) {
      const T* key = keys + r * hd;
      float dot = 0.0f;
      for (int64_t d = 0; d < hd; ++d) dot += q[d] * widen(key[d]);
      w[r] = dot;
      peak = std::max(peak, dot);
    }
    float total = 0.0f;
    for (int64_t r = 0; r < n; ++r) total += (w[r] = std::exp(w[r] - peak));
    for (int64_t r = 0; r < n; ++r) {
      const T* value = values + r * hd;
      for (int64_t d = 0; d < hd; ++d) out[d] += w[r] * widen(value[d]);
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < hd; ++d) out[d] *= inv;
    p.window_lse[bk * G + g] = peak + std::log(total);
  }
}

void run_task(const Problem& p, int64_t task, Scratch& scratch) {
  if (task < p.coded_tasks()) return coded_task(p, task, scratch);
  const int64_t bk = task - p.coded_tasks();
  if (p.bf16_window) return window_task<uint16_t>(p, bk / p.kv_heads, bk % p.kv_heads, scratch);
  window_task<float>(p, bk / p.kv_heads, bk % p.kv_heads, scratch);
}

// out[b, k, g] = the partials of head g (every split of its block's lane, and the window), each
// weighted by its share of the softmax mass; 0 where no partial saw a token.
void merge(const Problem& p, float* out) {
  const int64_t G = p.group, hd = p.head_dim, S = p.splits;
  for (int64_t bk = 0; bk < p.batch * p.kv_heads; ++bk) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t nb = g / kLanes, lane = g % kLanes;
      const int64_t first = (bk * p.blocks + nb) * S;  // coded task of split 0
      float peak = p.window_lse[bk * G + g];
      for (int64_t s = 0; s < S; ++s) peak = std::max(peak, p.coded_lse[(first + s) * kLanes + lane]);
      float* o = out + (bk * G + g) * hd;
      std::fill(o, o + hd, 0.0f);
      if (peak == -std::numeric_limits<float>::infinity()) continue;
      float total = 0.0f;
      auto add = [&](float part_lse, const float* part) {
        const float w = std::exp(part_lse - peak);  // 0 for an empty partial
        if (w == 0.0f) return;
        total += w;
        for (int64_t d = 0; d < hd; ++d) o[d] += w * part[d];
      };
      add(p.window_lse[bk * G + g], p.window_out + (bk * G + g) * hd);
      for (int64_t s = 0; s < S; ++s)
        add(p.coded_lse[(first + s) * kLanes + lane], p.coded_out + ((first + s) * kLanes + lane) * hd);
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < hd; ++d) o[d] *= inv;
    }
  }
}

ffi::Error PqDecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> k_codes,
                                 ffi::Buffer<ffi::U8> v_codes, ffi::Buffer<ffi::F32> k_cent,
                                 ffi::Buffer<ffi::F32> v_cent, ffi::Buffer<ffi::S32> lengths,
                                 ffi::AnyBuffer k_win, ffi::AnyBuffer v_win, ffi::Buffer<ffi::S32> win_lengths,
                                 ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int64_t splits) {
  const auto qd = q.dimensions(), cd = k_codes.dimensions(), kd = k_cent.dimensions(), wd = k_win.dimensions();
  if (qd.size() != 4 || cd.size() != 5 || kd.size() != 4 || wd.size() != 4) {
    return ffi::Error::InvalidArgument("pq_decode_attention: unexpected operand ranks");
  }
  const int64_t B = qd[0], K = qd[1], G = qd[2], hd = qd[3], M = cd[4], C = kd[2], ds = kd[3];
  const bool bf16 = k_win.element_type() == ffi::DataType::BF16;
  if (cd[1] != B || cd[2] != K || kd[1] != M || M * ds != hd || (kd[0] != 1 && kd[0] != K) ||
      v_codes.element_count() != k_codes.element_count() || v_cent.element_count() != k_cent.element_count() ||
      wd[0] != B || wd[1] != K || wd[3] != hd || v_win.element_count() != k_win.element_count() ||
      k_win.element_type() != v_win.element_type() || (!bf16 && k_win.element_type() != ffi::DataType::F32) ||
      lengths.element_count() != B || win_lengths.element_count() != B || C < 1 || C > 256 || splits < 1 ||
      out->element_count() != B * K * G * hd) {
    return ffi::Error::InvalidArgument("pq_decode_attention: operand shapes or dtypes do not agree");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= cd[0]) return ffi::Error::InvalidArgument("pq_decode_attention: layer index out of range");
  const int64_t offset = l * B * K * cd[3] * M;  // layer l's codes [B K T M]
  const int64_t blocks = (G + kLanes - 1) / kLanes;
  std::vector<float> coded_out(B * K * blocks * splits * kLanes * hd), coded_lse(B * K * blocks * splits * kLanes);
  std::vector<float> window_out(B * K * G * hd), window_lse(B * K * G);
  const Problem p{q.typed_data(), k_codes.typed_data() + offset, v_codes.typed_data() + offset, k_cent.typed_data(),
                  v_cent.typed_data(), lengths.typed_data(), k_win.untyped_data(), v_win.untyped_data(),
                  win_lengths.typed_data(), coded_out.data(), coded_lse.data(), window_out.data(),
                  window_lse.data(), B, K, G, hd, blocks, M, C, cd[3], kd[0], ds, splits, wd[2], bf16};
  jaxlongctx::run_tasks<Scratch>(pool, pool.num_threads(), p.coded_tasks() + B * K,
                                 [p](int64_t t, Scratch& s) { run_task(p, t, s); });
  merge(p, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PqDecodeAttention, PqDecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("splits"));
