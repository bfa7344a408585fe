// Causal prefill attention on CPU (flash-style, register-blocked): an XLA FFI handler.
//
// Query t of row b sees the keys s <= t that key_valid marks. Per (row b, kv head k) the keys are first
// packed into panels of kCols keys ([T / kCols, hd, kCols], so that the scores of a tile are a
// register-blocked product, `cpu_gemm.h`'s micro-tiles) and the values into panels of kCols dims
// ([hd / kCols, T, kCols]). A task is (b, k, block of kQueries queries): its G heads x kQueries rows walk
// the key tiles of their causal prefix (kKeys keys each, the diagonal tile masked):
//   scores  S[r, s] = q_r . k_s                                    (micro-tiles, depth hd)
//   weights P[r, s] = exp(S[r, s] - running max), summed per row   (online softmax)
//   acc[r]         = acc[r] * rescale + P[r] @ V                   (micro-tiles, depth kKeys)
// then out[r] = acc[r] / sum. With round_bf16 (a bf16 model) the weights are rounded to bf16 before the
// values are weighted, as the bf16 dot of XLA's path takes them; their sums stay unrounded.
//
// Shapes: q f32 [B T K G hd] (scale folded in); k, v f32 [B T K hd]; key_valid pred [B T]; out f32
// [B T K G hd] (a query that sees no key gets 0). Attribute: round_bf16.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_gemm.h"
#include "cpu_tasks.h"
#include "cpu_vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace gemm = jaxlongctx::gemm;
using jaxlongctx::kLanes, jaxlongctx::load, jaxlongctx::store, jaxlongctx::vf, jaxlongctx::vi;

namespace {

constexpr int64_t kQueries = 32;  // queries per task (x G heads: the rows of its tiles)
constexpr int64_t kKeys = 64;     // keys per tile (a multiple of kCols on every tier)
static_assert(kKeys % gemm::kCols == 0, "a key tile is whole panels");

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  const bool* key_valid;
  float* out;
  float* key_panels;    // [B K Tp/kCols hd kCols]
  float* value_panels;  // [B K ceil(hd/kCols) Tp kCols]
  int64_t batch, length, kv_heads, group, head_dim, padded;  // padded: T rounded up to kKeys
  bool round_bf16;

  int64_t value_panels_of() const { return gemm::panels(head_dim); }
  const float* keys_of(int64_t b, int64_t k) const { return key_panels + (b * kv_heads + k) * padded * head_dim; }
  const float* values_of(int64_t b, int64_t k) const {
    return value_panels + (b * kv_heads + k) * value_panels_of() * padded * gemm::kCols;
  }
};

// Packs (row b, kv head k)'s keys and values into their panels (zero past T).
void pack(const Problem& p, int64_t b, int64_t k) {
  const int64_t T = p.length, K = p.kv_heads, hd = p.head_dim, C = gemm::kCols;
  float* kp = const_cast<float*>(p.keys_of(b, k));
  float* vp = const_cast<float*>(p.values_of(b, k));
  std::fill(kp, kp + p.padded * hd, 0.0f);
  std::fill(vp, vp + p.value_panels_of() * p.padded * C, 0.0f);
  for (int64_t s = 0; s < T; ++s) {
    const float* key = p.k + ((b * T + s) * K + k) * hd;
    const float* value = p.v + ((b * T + s) * K + k) * hd;
    float* kcol = kp + (s / C) * hd * C + s % C;  // key s is column s % C of panel s / C
    for (int64_t d = 0; d < hd; ++d) kcol[d * C] = key[d];
    for (int64_t d = 0; d < hd; ++d) vp[((d / C) * p.padded + s) * C + d % C] = value[d];
  }
}

inline vf round_to_bf16(vf x) {  // every lane to the nearest bf16 (ties to even), as float
  vi bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & static_cast<int32_t>(0xFFFF0000u);
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// A thread's buffers.
struct Scratch {
  std::vector<float> q, scores, acc, peak, total;
};

void run_task(const Problem& p, int64_t task, Scratch& scratch) {
  static constexpr auto tiles = gemm::micro_tiles<float>(std::make_index_sequence<gemm::kRows>());
  const int64_t T = p.length, K = p.kv_heads, G = p.group, hd = p.head_dim, C = gemm::kCols;
  const int64_t blocks = (T + kQueries - 1) / kQueries;
  const int64_t qb = blocks - 1 - task / (p.batch * K);  // the longest prefixes first: even tails
  const int64_t b = (task % (p.batch * K)) / K, k = task % K;
  const int64_t t0 = qb * kQueries, t1 = std::min(T, t0 + kQueries), rows = (t1 - t0) * G;
  const float inf = std::numeric_limits<float>::infinity();
  scratch.q.resize(rows * hd);
  scratch.scores.resize(rows * kKeys);
  scratch.acc.assign(rows * hd, 0.0f);
  scratch.peak.assign(rows, -inf);
  scratch.total.assign(rows, 0.0f);
  float* q = scratch.q.data();  // [rows hd], row r = (query t0 + r / G, head r % G)
  float* scores = scratch.scores.data();
  float* acc = scratch.acc.data();
  for (int64_t t = t0; t < t1; ++t)
    std::memcpy(q + (t - t0) * G * hd, p.q + ((b * T + t) * K + k) * G * hd, G * hd * sizeof(float));
  const float* key_panels = p.keys_of(b, k);
  const float* value_panels = p.values_of(b, k);
  const bool* valid = p.key_valid + b * T;
  for (int64_t s0 = 0; s0 < t1; s0 += kKeys) {
    const int64_t n = std::min(kKeys, T - s0);  // keys of this tile
    for (int64_t c = 0; c < kKeys; c += C)  // scores [rows kKeys]
      for (int64_t r = 0; r < rows; r += gemm::kRows)
        tiles[std::min(gemm::kRows, rows - r) - 1](q + r * hd, hd, key_panels + (s0 + c) * hd, hd,
                                                   scores + r * kKeys + c, kKeys, C, false);
    bool all_valid = n == kKeys;
    for (int64_t j = 0; j < n && all_valid; ++j) all_valid = valid[s0 + j];
    for (int64_t r = 0; r < rows; ++r) {
      float* w = scores + r * kKeys;
      const int64_t seen = std::clamp<int64_t>(t0 + r / G + 1 - s0, 0, n);  // keys up to the query
      float top = -inf;
      if (all_valid && seen == kKeys) {  // a whole visible tile: the vector max
        vf m = load(w);
        for (int64_t j = kLanes; j < kKeys; j += kLanes) {
          const vf x = load(w + j);
          m = x > m ? x : m;
        }
        for (int64_t j = 0; j < kLanes; ++j) top = std::max(top, m[j]);
      } else {
        for (int64_t j = 0; j < seen; ++j)
          if (valid[s0 + j]) top = std::max(top, w[j]);
      }
      if (top == -inf) {  // sees no key of this tile
        std::fill(w, w + kKeys, 0.0f);
        continue;
      }
      const float next = std::max(scratch.peak[r], top);
      if (next > scratch.peak[r]) {
        const float factor = std::exp(scratch.peak[r] - next);  // 0 for the first seen tile
        for (int64_t d = 0; d < hd; ++d) acc[r * hd + d] *= factor;
        scratch.total[r] *= factor;
        scratch.peak[r] = next;
      }
      vf sum = {};
      for (int64_t j = 0; j < kKeys; j += kLanes) {
        const vf e = jaxlongctx::exp_nonpositive<vf, vi>(load(w + j) - next);
        store(w + j, e);
      }
      if (!all_valid || seen < kKeys)
        for (int64_t j = 0; j < kKeys; ++j)
          if (j >= seen || !valid[s0 + j]) w[j] = 0.0f;
      for (int64_t j = 0; j < kKeys; j += kLanes) {
        const vf e = load(w + j);
        sum += e;
        if (p.round_bf16) store(w + j, round_to_bf16(e));
      }
      scratch.total[r] += jaxlongctx::sum(sum);
    }
    for (int64_t c = 0; c < hd; c += C)  // acc [rows hd] += weights @ values
      for (int64_t r = 0; r < rows; r += gemm::kRows)
        tiles[std::min(gemm::kRows, rows - r) - 1](scores + r * kKeys, kKeys,
                                                   value_panels + ((c / C) * p.padded + s0) * C, kKeys,
                                                   acc + r * hd + c, hd, std::min(C, hd - c), true);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / G, g = r % G;
    float* o = p.out + (((b * T + t) * K + k) * G + g) * hd;
    const float inv = scratch.total[r] > 0.0f ? 1.0f / scratch.total[r] : 0.0f;
    for (int64_t d = 0; d < hd; ++d) o[d] = acc[r * hd + d] * inv;
  }
}

ffi::Error PrefillAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> key_valid,
                                ffi::ResultBuffer<ffi::F32> out, bool round_bf16) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 5 || kd.size() != 4) return ffi::Error::InvalidArgument("prefill_attention: unexpected ranks");
  const int64_t B = qd[0], T = qd[1], K = qd[2], G = qd[3], hd = qd[4];
  if (kd[0] != B || kd[1] != T || kd[2] != K || kd[3] != hd || v.element_count() != k.element_count() ||
      key_valid.element_count() != B * T || out->element_count() != q.element_count()) {
    return ffi::Error::InvalidArgument("prefill_attention: operand shapes do not agree");
  }
  const int64_t padded = (T + kKeys - 1) / kKeys * kKeys;
  std::vector<float> key_panels(B * K * padded * hd), value_panels(B * K * gemm::panels(hd) * padded * gemm::kCols);
  const Problem p{q.typed_data(), k.typed_data(), v.typed_data(), key_valid.typed_data(), out->typed_data(),
                  key_panels.data(), value_panels.data(), B, T, K, G, hd, padded, round_bf16};
  const int64_t threads = pool.num_threads();
  jaxlongctx::run_tasks<int>(pool, threads, B * K, [&p](int64_t t, int&) { pack(p, t / p.kv_heads, t % p.kv_heads); });
  jaxlongctx::run_tasks<Scratch>(pool, threads, B * K * ((T + kQueries - 1) / kQueries),
                                 [&p](int64_t t, Scratch& s) { run_task(p, t, s); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PrefillAttention, PrefillAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("round_bf16"));
