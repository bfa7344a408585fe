// Decode attention over one layer of a stacked dense K/V cache, read in place, on CPU: an XLA FFI handler.
//
// One new token per row: its G query heads of kv head k attend over the cached slots of layer `layer`
// that `visible` marks, and over the token's own key and value (which the cache does not hold yet).
// XLA's CPU path copies each layer's cache slice out of the stacked cache before its dots; this handler
// reads the slots where they lie. A task is (row b, kv head k, token split s): it walks its share of the
// row's slots up to its last visible one (so the splits of a cache that is not yet full stay even) in
// chunks, scores G heads per slot (dot products of hd), takes the chunk's softmax weights with an
// online max, and adds the weighted values. The splits' outputs and log-sum-exps are then merged with
// the own key/value here, so the step's XLA graph has one operation for the whole attention.
//
// Shapes: q f32 [B K G hd] (scale folded in); k_cache, v_cache f32 or bf16 [L B K S hd]; visible pred
// [B S]; layer s32 []; k_new, v_new f32 [B K hd]; out f32 [B K G hd].

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
using jaxlongctx::kLanes, jaxlongctx::load, jaxlongctx::store, jaxlongctx::sum, jaxlongctx::vf, jaxlongctx::vi;

namespace {

constexpr int64_t kChunk = 64;     // slots scored before their weights are applied
constexpr int64_t kMaxGroup = 16;  // query heads per kv head (checked by the caller)
constexpr int64_t kSlotsPerPass = 4;  // values added to the sums per pass over them
constexpr int kHeadBlock = 3;  // query heads scored together (their 4-slot dot products fill the registers)

struct Problem {
  const float* q;
  const void* k;  // this layer's [B K S hd]
  const void* v;
  const bool* visible;
  const int64_t* ends;  // [B] one past each row's last visible slot
  float* out;  // [B K P G hd] each split's normalised output
  float* lse;  // [B K P G] and its log-sum-exp (-inf for a split that sees no slot)
  int64_t batch, kv_heads, group, head_dim, slots, splits;
};

// The attention of (row b, kv head k): the P splits' outputs joined with the token's own key and
// value, each weighted by its share of the total softmax mass. out [G hd].
void merge_splits(const Problem& p, const float* k_new, const float* v_new, int64_t b, int64_t k, float* out) {
  const int64_t G = p.group, hd = p.head_dim, P = p.splits, bk = b * p.kv_heads + k;
  const float* q = p.q + bk * G * hd;
  const float* key = k_new + bk * hd;
  const float* value = v_new + bk * hd;
  for (int64_t g = 0; g < G; ++g) {
    float own = 0.0f;
    for (int64_t j = 0; j < hd; ++j) own += q[g * hd + j] * key[j];
    const float* lse = p.lse + bk * P * G + g;  // split s at lse[s * G]
    float peak = own;
    for (int64_t s = 0; s < P; ++s) peak = std::max(peak, lse[s * G]);
    const float own_weight = std::exp(own - peak);
    float total = own_weight;
    float* o = out + g * hd;
    for (int64_t j = 0; j < hd; ++j) o[j] = own_weight * value[j];
    for (int64_t s = 0; s < P; ++s) {
      const float w = std::exp(lse[s * G] - peak);  // 0 for an empty split
      if (w == 0.0f) continue;
      total += w;
      const float* part = p.out + ((bk * P + s) * G + g) * hd;
      for (int64_t j = 0; j < hd; ++j) o[j] += w * part[j];
    }
    const float inv = 1.0f / total;
    for (int64_t j = 0; j < hd; ++j) o[j] *= inv;
  }
}

// A thread's buffers, reused by every task it runs in one call.
struct Scratch {
  std::vector<float> acc;      // [G hd] weighted values
  std::vector<float> weights;  // [G kChunk] scores, then weights
  std::vector<int32_t> slots;  // [kChunk] the visible slots of a chunk
};

// Scores of four slots' keys against H query heads q [H hd] (Vecs vectors each) into w[h * kChunk + u]:
// 4 H dot products kept in registers (12 for H = 3, with one key vector and a query operand: 16 AVX2
// registers), the key vectors loaded once per head block.
template <int H, int64_t Vecs, typename T>
inline void score4(const T* const key[4], const float* q, float* w) {
  vf dot[H][4] = {};
  for (int64_t j = 0; j < Vecs; ++j)
    for (int u = 0; u < 4; ++u) {
      const vf kj = load(key[u] + j * kLanes);
      for (int h = 0; h < H; ++h) dot[h][u] += kj * load(q + h * Vecs * kLanes + j * kLanes);
    }
  for (int h = 0; h < H; ++h) jaxlongctx::sums4(dot[h][0], dot[h][1], dot[h][2], dot[h][3], w + h * kChunk);
}

// Vecs = head_dim / kLanes, a compile-time count so that a key's vectors and the dot products stay in
// registers.
template <typename T, int64_t Vecs>
void run_task(const Problem& p, int64_t task, Scratch& scratch) {
  const int64_t s = task % p.splits, k = (task / p.splits) % p.kv_heads, b = task / (p.splits * p.kv_heads);
  const int64_t G = p.group, hd = Vecs * kLanes, vecs = Vecs;
  const int64_t end = p.ends[b], lo = s * end / p.splits, hi = (s + 1) * end / p.splits;
  const int64_t head = (b * p.kv_heads + k) * p.slots * hd;  // this (row, kv head)'s first slot
  const T* keys = static_cast<const T*>(p.k) + head;
  const T* values = static_cast<const T*>(p.v) + head;
  const bool* seen = p.visible + b * p.slots;
  const float* q = p.q + (b * p.kv_heads + k) * G * hd;

  scratch.acc.assign(G * hd, 0.0f);
  scratch.weights.resize(G * kChunk);
  scratch.slots.resize(kChunk);
  float* acc = scratch.acc.data();
  float* weights = scratch.weights.data();
  int32_t* slot = scratch.slots.data();
  float peak[kMaxGroup], total[kMaxGroup];
  std::fill(peak, peak + G, -std::numeric_limits<float>::infinity());
  std::fill(total, total + G, 0.0f);

  for (int64_t t0 = lo; t0 < hi; t0 += kChunk) {
    int64_t n = 0;
    for (int64_t t = t0; t < std::min(hi, t0 + kChunk); ++t)
      if (seen[t]) slot[n++] = static_cast<int32_t>(t);
    if (n == 0) continue;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {  // scores [G, n], four slots at a time (their lane sums reduced together)
      const T* key[4] = {keys + slot[i] * hd, keys + slot[i + 1] * hd, keys + slot[i + 2] * hd, keys + slot[i + 3] * hd};
      int64_t g = 0;
      for (; g + kHeadBlock <= G; g += kHeadBlock) score4<kHeadBlock, Vecs>(key, q + g * hd, weights + g * kChunk + i);
      for (; g < G; ++g) score4<1, Vecs>(key, q + g * hd, weights + g * kChunk + i);
    }
    for (; i < n; ++i) {
      const T* key = keys + slot[i] * hd;
      for (int64_t g = 0; g < G; ++g) {
        vf dot = load(key) * load(q + g * hd);
        for (int64_t j = 1; j < Vecs; ++j) dot += load(key + j * kLanes) * load(q + g * hd + j * kLanes);
        weights[g * kChunk + i] = sum(dot);
      }
    }
    for (int64_t g = 0; g < G; ++g) {  // online softmax: rescale what came before to the new peak
      float* w = weights + g * kChunk;
      const float chunk_peak = *std::max_element(w, w + n);
      const float next = std::max(peak[g], chunk_peak);
      const float factor = std::exp(peak[g] - next);  // 0 for the first chunk (peak -inf)
      for (int64_t j = 0; j < hd; ++j) acc[g * hd + j] *= factor;
      total[g] *= factor;
      peak[g] = next;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        const vf e = jaxlongctx::exp_nonpositive<vf, vi>(load(w + i) - next);
        store(w + i, e);
        total[g] += sum(e);
      }
      for (; i < n; ++i) total[g] += (w[i] = std::exp(w[i] - next));
    }
    i = 0;
    for (; i + kSlotsPerPass <= n; i += kSlotsPerPass) {  // acc[g] += sum_i w[g, i] * value[i], 4 slots a pass
      const T* v0 = values + slot[i] * hd;
      const T* v1 = values + slot[i + 1] * hd;
      const T* v2 = values + slot[i + 2] * hd;
      const T* v3 = values + slot[i + 3] * hd;
      for (int64_t j = 0; j < vecs; ++j) {
        const int64_t at = j * kLanes;
        const vf x0 = load(v0 + at), x1 = load(v1 + at), x2 = load(v2 + at), x3 = load(v3 + at);
        for (int64_t g = 0; g < G; ++g) {
          const float* w = weights + g * kChunk + i;
          vf a = load(acc + g * hd + at);
          a += w[0] * x0 + w[1] * x1 + w[2] * x2 + w[3] * x3;
          store(acc + g * hd + at, a);
        }
      }
    }
    for (; i < n; ++i) {
      const T* value = values + slot[i] * hd;
      for (int64_t j = 0; j < vecs; ++j) {
        const vf vj = load(value + j * kLanes);
        for (int64_t g = 0; g < G; ++g) {
          vf a = load(acc + g * hd + j * kLanes);
          a += weights[g * kChunk + i] * vj;
          store(acc + g * hd + j * kLanes, a);
        }
      }
    }
  }
  const int64_t part = ((b * p.kv_heads + k) * p.splits + s) * G;  // [B K P G] index of (b, k, s, 0)
  for (int64_t g = 0; g < G; ++g) {
    const float inv = total[g] > 0 ? 1.0f / total[g] : 0.0f;
    for (int64_t j = 0; j < hd; ++j) p.out[(part + g) * hd + j] = acc[g * hd + j] * inv;
    p.lse[part + g] = total[g] > 0 ? peak[g] + std::log(total[g]) : -std::numeric_limits<float>::infinity();
  }
}

using Runner = void (*)(const Problem&, int64_t, Scratch&);

template <typename T>
Runner runner(int64_t head_dim) {
  switch (head_dim) {
    case 16: return run_task<T, 16 / kLanes>;
    case 32: return run_task<T, 32 / kLanes>;
    case 64: return run_task<T, 64 / kLanes>;
    case 96: return run_task<T, 96 / kLanes>;
    case 128: return run_task<T, 128 / kLanes>;
    default: return nullptr;
  }
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                               ffi::AnyBuffer v_cache, ffi::Buffer<ffi::PRED> visible, ffi::Buffer<ffi::S32> layer,
                               ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                               ffi::ResultBuffer<ffi::F32> out, int64_t splits) {
  const auto qd = q.dimensions(), cd = k_cache.dimensions(), od = out->dimensions();
  if (qd.size() != 4 || cd.size() != 5 || od.size() != 4 || v_cache.dimensions().size() != 5) {
    return ffi::Error::InvalidArgument("decode_attention: unexpected operand ranks");
  }
  const int64_t B = qd[0], K = qd[1], G = qd[2], hd = qd[3], S = cd[3], P = splits;
  if (cd[1] != B || cd[2] != K || cd[4] != hd || hd % kLanes || G > kMaxGroup || P < 1 ||
      k_cache.element_type() != v_cache.element_type() || k_new.element_count() != B * K * hd ||
      v_new.element_count() != B * K * hd || out->element_count() != B * K * G * hd) {
    return ffi::Error::InvalidArgument("decode_attention: operand shapes or dtypes do not agree");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= cd[0]) return ffi::Error::InvalidArgument("decode_attention: layer index out of range");
  const bool bf16 = k_cache.element_type() == ffi::DataType::BF16;
  if (!bf16 && k_cache.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("decode_attention: the cache must be float32 or bfloat16");
  }
  const int64_t offset = l * B * K * S * hd * (bf16 ? 2 : 4);
  std::vector<float> split_out(B * K * P * G * hd), split_lse(B * K * P * G);
  std::vector<int64_t> ends(B, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = S - 1; t >= 0; --t)
      if (visible.typed_data()[b * S + t]) {
        ends[b] = t + 1;
        break;
      }
  const Problem p{q.typed_data(),
                  static_cast<const char*>(k_cache.untyped_data()) + offset,
                  static_cast<const char*>(v_cache.untyped_data()) + offset,
                  visible.typed_data(),
                  ends.data(),
                  split_out.data(),
                  split_lse.data(),
                  B, K, G, hd, S, P};
  const Runner run = bf16 ? runner<uint16_t>(hd) : runner<float>(hd);
  if (run == nullptr) return ffi::Error::InvalidArgument("decode_attention: head_dim must be 16, 32, 64, 96 or 128");
  jaxlongctx::run_tasks<Scratch>(pool, pool.num_threads(), B * K * P,
                                 [p, run](int64_t t, Scratch& s) { run(p, t, s); });
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < K; ++k)
      merge_splits(p, k_new.typed_data(), v_new.typed_data(), b, k, out->typed_data() + (b * K + k) * G * hd);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("splits"));
