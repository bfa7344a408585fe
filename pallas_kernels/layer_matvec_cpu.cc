// Few-row products against one layer of stacked weights, read in place, on CPU: an XLA FFI handler.
//
//   y[m, n] = sum_k x[m, k] * w[layer, k, n]      (w stored [L, K, N], "in, out": the layers' matrices)
//   y[m, n] = sum_k x[m, k] * w[layer, n, k]      (transposed: w [L, N, K], a tied embedding as head)
//
// A decode step multiplies one row per sequence by every weight matrix of the model once, so it is
// bound by reading the weights. XLA's CPU dot takes each layer's slice of the stacked weights as a
// copy and widens bf16 weights to float32 through memory first; this handler reads the layer's
// weights where they lie, once, widening bf16 in registers. Rows are processed up to kRows at a time
// against a tile of columns whose accumulators stay in registers; tiles run on XLA's intra-op pool.
//
// Shapes: x f32 [M K]; w f32 or bf16 [L K N] ([L N K] transposed); layer s32 []; y f32 [M N].

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_tasks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

constexpr int64_t kLanes = 16;
constexpr int64_t kStep = 2 * kLanes;  // columns per step of the (in, out) layout
constexpr int64_t kColumns = 2048;  // output columns per task of the (in, out) layout (sums in L1)
constexpr int64_t kUnroll = 4;      // weight rows added per pass over the sums
constexpr int64_t kTransposedTile = 256;   // output columns (weight rows) per task of the transposed layout
constexpr int64_t kMinBytesPerTask = 1 << 17;  // below this a task is not worth a pool thread

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

inline float widen(uint16_t v) {
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

struct Problem {
  const float* x;
  const void* w;  // this layer's [K N] or [N K] block
  float* y;
  int64_t m, k, n;
  bool transposed;
  int64_t k_chunks = 1, column_blocks = 1;  // the (in, out) layout's tasks: K chunks x column blocks
  float* partials = nullptr;                // [k_chunks, M, N] partial sums of the (in, out) layout
};

// 32 consecutive weights as two float vectors. float32: the two halves. bf16: the even and the odd
// elements (one 64-byte load; a bf16 is the high half of its float32), so the sums of a 32-column
// step are kept in that even/odd order and put back in column order when written out.
inline void load_pair(const float* p, v16& a, v16& b) {
  std::memcpy(&a, p, sizeof(a));
  std::memcpy(&b, p + kLanes, sizeof(b));
}

inline void load_pair(const uint16_t* p, v16& even, v16& odd) {
  v16u u;
  std::memcpy(&u, p, sizeof(u));
  even = (v16)(u << 16);
  odd = (v16)(u & 0xFFFF0000u);
}

// Sums of a 32-column step in column order (see load_pair).
inline void store_pair(float* out, const float* acc, bool interleaved) {
  if (!interleaved) return (void)std::memcpy(out, acc, kStep * sizeof(float));
  for (int64_t i = 0; i < kLanes; ++i) out[2 * i] = acc[i], out[2 * i + 1] = acc[kLanes + i];
}

// Weight rows [k0, k1) and output columns [c0, c1) of the (in, out) layout, every row of x: the
// weights are read as contiguous row pieces, the partial sums acc [M, c1 - c0] stay in L1.
template <typename W>
void run_block(const Problem& p, int64_t t, float* acc) {
  const W* w = static_cast<const W*>(p.w);
  const int64_t kc = t / p.column_blocks, cb = t % p.column_blocks;
  const int64_t k0 = kc * p.k / p.k_chunks, k1 = (kc + 1) * p.k / p.k_chunks;
  const int64_t c0 = cb * kColumns, c1 = std::min(p.n, c0 + kColumns), width = c1 - c0;
  const int64_t vw = width / kStep * kStep;  // columns done in 32-column steps; the rest scalar
  std::fill(acc, acc + p.m * width, 0.0f);
  int64_t kk = k0;
  for (; kk + kUnroll <= k1; kk += kUnroll) {  // kUnroll weight rows per pass over the sums
    const W* row = w + kk * p.n + c0;
    for (int64_t r = 0; r < p.m; ++r) {
      float xr[kUnroll];
      for (int64_t u = 0; u < kUnroll; ++u) xr[u] = p.x[r * p.k + kk + u];
      float* a = acc + r * width;
      for (int64_t j = 0; j < vw; j += kStep) {
        v16 s0, s1, w0, w1;
        load_pair(a + j, s0, s1);
        for (int64_t u = 0; u < kUnroll; ++u) {
          load_pair(row + u * p.n + j, w0, w1);
          s0 += xr[u] * w0;
          s1 += xr[u] * w1;
        }
        std::memcpy(a + j, &s0, sizeof(s0));
        std::memcpy(a + j + kLanes, &s1, sizeof(s1));
      }
      for (int64_t j = vw; j < width; ++j)
        for (int64_t u = 0; u < kUnroll; ++u) a[j] += xr[u] * widen(row[u * p.n + j]);
    }
  }
  for (; kk < k1; ++kk) {
    const W* row = w + kk * p.n + c0;
    for (int64_t r = 0; r < p.m; ++r) {
      const float xr = p.x[r * p.k + kk];
      float* a = acc + r * width;
      for (int64_t j = 0; j < vw; j += kStep) {
        v16 s0, s1, w0, w1;
        load_pair(a + j, s0, s1);
        load_pair(row + j, w0, w1);
        s0 += xr * w0;
        s1 += xr * w1;
        std::memcpy(a + j, &s0, sizeof(s0));
        std::memcpy(a + j + kLanes, &s1, sizeof(s1));
      }
      for (int64_t j = vw; j < width; ++j) a[j] += xr * widen(row[j]);
    }
  }
  float* out = p.partials + kc * p.m * p.n;  // this k chunk's partial sums [M, N]
  constexpr bool interleaved = sizeof(W) == 2;
  for (int64_t r = 0; r < p.m; ++r) {
    const float* a = acc + r * width;
    float* o = out + r * p.n + c0;
    for (int64_t j = 0; j < vw; j += kStep) store_pair(o + j, a + j, interleaved);
    std::memcpy(o + vw, a + vw, (width - vw) * sizeof(float));
  }
}

// Weight rows [n0, n1) in the transposed layout: each output is a dot of x's row with a weight row.
template <typename W>
void run_tile_transposed(const Problem& p, int64_t t) {
  const W* w = static_cast<const W*>(p.w);
  const int64_t n0 = t * kTransposedTile, n1 = std::min(p.n, n0 + kTransposedTile);
  const int64_t kv = p.k / kLanes * kLanes;
  for (int64_t c = n0; c < n1; ++c) {
    const W* row = w + c * p.k;
    for (int64_t r = 0; r < p.m; ++r) {
      const float* xr = p.x + r * p.k;
      v16 acc = {};
      for (int64_t kk = 0; kk < kv; kk += kLanes) acc += load(xr + kk) * load(row + kk);
      float s = sum(acc);
      for (int64_t kk = kv; kk < p.k; ++kk) s += xr[kk] * widen(row[kk]);
      p.y[r * p.n + c] = s;
    }
  }
}

using Runner = void (*)(const Problem&, int64_t, float*);

template <typename W>
Runner runner(bool transposed) {
  if (transposed) return [](const Problem& p, int64_t t, float*) { run_tile_transposed<W>(p, t); };
  return run_block<W>;
}

ffi::Error LayerMatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                           ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, bool transposed) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("layer_matvec: x [M K], w [L K N] and y [M N] expected");
  }
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  if ((transposed ? wd[2] != k || wd[1] != n : wd[1] != k || wd[2] != n) || yd[0] != m) {
    return ffi::Error::InvalidArgument("layer_matvec: operand shapes do not agree");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("layer_matvec: layer index out of range");
  int64_t item;
  Runner run;
  if (w.element_type() == ffi::DataType::F32) {
    item = 4;
    run = runner<float>(transposed);
  } else if (w.element_type() == ffi::DataType::BF16) {
    item = 2;
    run = runner<uint16_t>(transposed);
  } else {
    return ffi::Error::InvalidArgument("layer_matvec: weights must be float32 or bfloat16");
  }
  const char* base = static_cast<const char*>(w.untyped_data()) + l * k * n * item;
  Problem p{x.typed_data(), base, y->typed_data(), m, k, n, transposed};
  const int64_t worth = std::max<int64_t>(1, k * n * item / kMinBytesPerTask);
  const int64_t threads = std::min<int64_t>(pool.num_threads(), worth);
  std::vector<float> partials;
  int64_t tasks;
  if (transposed) {
    tasks = (n + kTransposedTile - 1) / kTransposedTile;
  } else {  // split K so that each thread streams its own contiguous rows; one partial [M, N] per chunk
    p.column_blocks = (n + kColumns - 1) / kColumns;
    p.k_chunks = std::max<int64_t>(1, std::min(k / kUnroll, threads));
    partials.resize(p.k_chunks == 1 ? 0 : p.k_chunks * m * n);
    p.partials = p.k_chunks == 1 ? p.y : partials.data();
    tasks = p.k_chunks * p.column_blocks;
  }
  const int64_t acc_size = transposed ? 0 : m * kColumns;  // each thread's partial sums (in, out layout)
  jaxlongctx::run_tasks<std::vector<float>>(pool, threads, tasks,
                                            [p, run, acc_size](int64_t t, std::vector<float>& acc) {
                                              acc.resize(acc_size);
                                              run(p, t, acc.data());
                                            });
  if (!partials.empty()) {
    float* out = p.y;
    std::copy(partials.begin(), partials.begin() + m * n, out);
    for (int64_t c = 1; c < p.k_chunks; ++c) {
      const float* part = partials.data() + c * m * n;
      for (int64_t i = 0; i < m * n; ++i) out[i] += part[i];
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerMatvec, LayerMatvecImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transposed"));
