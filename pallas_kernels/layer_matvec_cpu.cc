// Products against one layer of stacked weights, read in place, on CPU: an XLA FFI handler.
//
//   y[m, n] = sum_k x[m, k] * w[layer, k, n]      (w stored [L, K, N], "in, out": the layers' matrices)
//   y[m, n] = sum_k x[m, k] * w[layer, n, k]      (transposed: w [L, N, K], a tied embedding as head)
//
// More than kMatvecRows rows of the (in, out) layout (a prompt's tokens) are a GEMM: `cpu_gemm.h`'s
// register-blocked kernel, the layer's weights packed once per call. The rest of this file is the
// few-row path of decode steps:
// A decode step multiplies one row per sequence by every weight matrix of the model once, so it is
// bound by reading the weights. XLA's CPU dot takes each layer's slice of the stacked weights as a
// copy and widens bf16 weights to float32 through memory first; this handler reads the layer's
// weights where they lie, once, widening bf16 in registers. Rows are processed up to kRows at a time
// against a tile of columns whose accumulators stay in registers; tiles run on XLA's intra-op pool.
//
// With a norm weight g (f32 or bf16 [K], not empty) x is first RMS-normalised, as the model's norm does:
// x * rsqrt(mean(x^2) + eps) rounded to bf16 with `round_bf16` (x was bf16), times g, rounded again
// where g is bf16 too; the layer's norm then costs no operations of its own in the step.
//
// Shapes: x f32 [M K]; layer s32 []; norm weight f32 or bf16 [K] or [0]; then any number of weight
// stacks w_i f32 or bf16 [L K N_i] ([L N_i K] transposed), one dtype for all, and as many results
// y_i f32 [M N_i]. Attributes: transposed, eps (f32), round_bf16.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_gemm.h"
#include "cpu_tasks.h"
#include "cpu_vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxlongctx::kLanes, jaxlongctx::load, jaxlongctx::round_to_bf16, jaxlongctx::store, jaxlongctx::sum,
    jaxlongctx::sums4, jaxlongctx::vf, jaxlongctx::widen;

namespace {

constexpr int64_t kStep = 2 * kLanes;  // columns per step of the (in, out) layout
constexpr int64_t kColumns = 2048;  // output columns per task of the (in, out) layout (sums in L1)
constexpr int64_t kUnroll = 4;      // weight rows added per pass over the sums
constexpr int64_t kTransposedTile = 256;   // output columns (weight rows) per task of the transposed layout
constexpr int64_t kMinBytesPerTask = 1 << 17;  // below this a task is not worth a helper thread
constexpr int64_t kMatvecRows = 16;  // more rows of the (in, out) layout take the GEMM path

struct Problem {
  const float* x;
  const float* x_even_odd;  // transposed bf16: x with each kStep block split into its even, then odd elements
  const void* w;  // this layer's [K N] or [N K] block
  float* y;
  int64_t m, k, n;
  bool transposed;
  int64_t k_chunks = 1, column_blocks = 1;  // the (in, out) layout's tasks: K chunks x column blocks
  float* partials = nullptr;                // [k_chunks, M, N] partial sums of the (in, out) layout
};

// kStep consecutive weights as two float vectors. float32: the two halves. bf16: the even and the odd
// elements (one load, widened in registers by a shift and a mask), so the sums of a kStep-column step
// are kept in that even/odd order and put back in column order when written out.
inline void load_pair(const float* p, vf& a, vf& b) {
  a = load(p);
  b = load(p + kLanes);
}

inline void load_pair(const uint16_t* p, vf& even, vf& odd) { jaxlongctx::load_even_odd(p, even, odd); }

// Asks for the cache lines of kStep consecutive weights ahead of their use. A layer's matrix is read once
// per step from memory; with hardware prefetchers alone the bf16 stream stayed latency-bound (about
// 30 GB/s against 45 GB/s for float32 weights on 2 cores; float32 gained nothing from it).
template <typename W>
inline void prefetch_pair(const W* p) {
  for (size_t line = 0; line < kStep * sizeof(W); line += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + line, 0, 3);
}

// Sums of a kStep-column step in column order (see load_pair).
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
  const int64_t vw = width / kStep * kStep;  // columns done in kStep-column steps; the rest scalar
  std::fill(acc, acc + p.m * width, 0.0f);
  int64_t kk = k0;
  for (; kk + kUnroll <= k1; kk += kUnroll) {  // kUnroll weight rows per pass over the sums
    const W* row = w + kk * p.n + c0;
    for (int64_t r = 0; r < p.m; ++r) {
      float xr[kUnroll];
      for (int64_t u = 0; u < kUnroll; ++u) xr[u] = p.x[r * p.k + kk + u];
      float* a = acc + r * width;
      for (int64_t j = 0; j < vw; j += kStep) {
        vf s0, s1, w0, w1;
        load_pair(a + j, s0, s1);
        for (int64_t u = 0; u < kUnroll; ++u) {
          if constexpr (sizeof(W) == 2) prefetch_pair(row + (kUnroll + u) * p.n + j);  // the next pass
          load_pair(row + u * p.n + j, w0, w1);
          s0 += xr[u] * w0;
          s1 += xr[u] * w1;
        }
        store(a + j, s0);
        store(a + j + kLanes, s1);
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
        vf s0, s1, w0, w1;
        load_pair(a + j, s0, s1);
        load_pair(row + j, w0, w1);
        s0 += xr * w0;
        s1 += xr * w1;
        store(a + j, s0);
        store(a + j + kLanes, s1);
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
// Four weight rows at a time, each with an even and an odd accumulator (eight independent chains of
// fused multiply-adds), their lane sums reduced together; every row of x reuses the four weight rows
// from L1. bf16 rows are widened in registers (`load_pair`) against x split the same way (x_even_odd).
template <typename W>
void run_tile_transposed(const Problem& p, int64_t t) {
  const W* w = static_cast<const W*>(p.w);
  const float* xs = sizeof(W) == 2 ? p.x_even_odd : p.x;  // [M K], in load_pair's element order
  const int64_t n0 = t * kTransposedTile, n1 = std::min(p.n, n0 + kTransposedTile);
  const int64_t kv = p.k / kStep * kStep;  // the rest scalar
  int64_t c = n0;
  for (; c + 4 <= n1; c += 4) {
    const W* rows[4] = {w + c * p.k, w + (c + 1) * p.k, w + (c + 2) * p.k, w + (c + 3) * p.k};
    for (int64_t r = 0; r < p.m; ++r) {
      const float* xr = xs + r * p.k;
      vf even[4] = {}, odd[4] = {};
      for (int64_t kk = 0; kk < kv; kk += kStep) {
        const vf x0 = load(xr + kk), x1 = load(xr + kk + kLanes);
        for (int64_t u = 0; u < 4; ++u) {
          vf a, b;
          load_pair(rows[u] + kk, a, b);
          even[u] += x0 * a;
          odd[u] += x1 * b;
        }
      }
      float s[4];
      sums4(even[0] + odd[0], even[1] + odd[1], even[2] + odd[2], even[3] + odd[3], s);
      for (int64_t u = 0; u < 4; ++u) {
        for (int64_t kk = kv; kk < p.k; ++kk) s[u] += p.x[r * p.k + kk] * widen(rows[u][kk]);
        p.y[r * p.n + c + u] = s[u];
      }
    }
  }
  for (; c < n1; ++c) {
    const W* row = w + c * p.k;
    for (int64_t r = 0; r < p.m; ++r) {
      const float* xr = xs + r * p.k;
      vf even = {}, odd = {};
      for (int64_t kk = 0; kk < kv; kk += kStep) {
        vf a, b;
        load_pair(row + kk, a, b);
        even += load(xr + kk) * a;
        odd += load(xr + kk + kLanes) * b;
      }
      float s = sum(even + odd);
      for (int64_t kk = kv; kk < p.k; ++kk) s += p.x[r * p.k + kk] * widen(row[kk]);
      p.y[r * p.n + c] = s;
    }
  }
}

// x [M K] with each full kStep block split into its even elements, then its odd ones (the order in which
// `load_pair` widens a bf16 block); the tail past the last full block is left out (read from x).
std::vector<float> split_even_odd(const float* x, int64_t m, int64_t k) {
  std::vector<float> out(m * k, 0.0f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b + kStep <= k; b += kStep)
      for (int64_t i = 0; i < kLanes; ++i) {
        out[r * k + b + i] = x[r * k + b + 2 * i];
        out[r * k + b + kLanes + i] = x[r * k + b + 2 * i + 1];
      }
  return out;
}

using Runner = void (*)(const Problem&, int64_t, float*);

template <typename W>
Runner runner(bool transposed) {
  if (transposed) return [](const Problem& p, int64_t t, float*) { run_tile_transposed<W>(p, t); };
  return run_block<W>;
}

// One weight matrix's problem and its tasks: x times layer `l` of the stack `w`, into y.
ffi::ErrorOr<Problem> plan(const float* x, const float* x_even_odd, int64_t m, int64_t k, int64_t l, ffi::AnyBuffer w,
                           ffi::Result<ffi::AnyBuffer> y, bool transposed, int64_t threads, int64_t& tasks,
                           std::vector<float>& partials) {
  const auto wd = w.dimensions(), yd = y->dimensions();
  if (wd.size() != 3 || yd.size() != 2 || y->element_type() != ffi::DataType::F32) {
    return ffi::Unexpected(ffi::Error::InvalidArgument("layer_matvec: w [L K N] and float32 y [M N] expected"));
  }
  const int64_t n = yd[1];
  if ((transposed ? wd[2] != k || wd[1] != n : wd[1] != k || wd[2] != n) || yd[0] != m) {
    return ffi::Unexpected(ffi::Error::InvalidArgument("layer_matvec: operand shapes do not agree"));
  }
  if (l < 0 || l >= wd[0]) return ffi::Unexpected(ffi::Error::InvalidArgument("layer_matvec: layer out of range"));
  const int64_t item = w.element_type() == ffi::DataType::BF16 ? 2 : 4;
  const char* base = static_cast<const char*>(w.untyped_data()) + l * k * n * item;
  Problem p{x, x_even_odd, base, static_cast<float*>(y->untyped_data()), m, k, n, transposed};
  if (transposed) {
    tasks = (n + kTransposedTile - 1) / kTransposedTile;
  } else if (m > kMatvecRows) {
    tasks = 0;  // the GEMM path plans its own
  } else {  // split K so that each thread streams its own contiguous rows; one partial [M, N] per chunk
    p.column_blocks = (n + kColumns - 1) / kColumns;
    p.k_chunks = std::max<int64_t>(1, std::min(k / kUnroll, threads));
    partials.resize(p.k_chunks == 1 ? 0 : p.k_chunks * m * n);
    p.partials = p.k_chunks == 1 ? p.y : partials.data();
    tasks = p.k_chunks * p.column_blocks;
  }
  return p;
}

// x [M K] RMS-normalised with gain g [K] into out [M K] (see the header).
template <typename G>
void rms_norm(const float* x, const G* g, int64_t m, int64_t k, float eps, bool round_bf16, float* out) {
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    float squares = 0.0f;
    for (int64_t j = 0; j < k; ++j) squares += xr[j] * xr[j];
    const float scale = 1.0f / std::sqrt(squares / static_cast<float>(k) + eps);
    for (int64_t j = 0; j < k; ++j) {
      const float normed = round_bf16 ? round_to_bf16(xr[j] * scale) : xr[j] * scale;  // in x's dtype
      const float scaled = normed * widen(g[j]);
      out[r * k + j] = round_bf16 && sizeof(G) == 2 ? round_to_bf16(scaled) : scaled;  // bf16 x bf16 is bf16
    }
  }
}

// The GEMM path: every stack's layer packed (one set of tasks), then its products by blocks of rows and
// panels (another), on XLA's intra-op threads. x [M K] is float32; the weights float32 or bf16.
template <typename W>
void gemm_products(ffi::ThreadPool& pool, const float* x, const std::vector<Problem>& problems) {
  namespace gemm = jaxlongctx::gemm;
  const int64_t threads = pool.num_threads(), m = problems[0].m, k = problems[0].k;
  thread_local std::vector<W> packed;  // the calling thread's, reused between calls
  std::vector<int64_t> offset{0}, first_pack{0}, first_block{0}, groups;
  const int64_t row_blocks = (m + gemm::kBlockRows - 1) / gemm::kBlockRows;
  for (const Problem& p : problems) {
    const int64_t panels = gemm::panels(p.n);
    offset.push_back(offset.back() + panels * k * gemm::kCols);
    first_pack.push_back(first_pack.back() + (panels + gemm::kPackPanels - 1) / gemm::kPackPanels);
    // panel groups per row block: enough tasks for every thread where the rows alone are few
    groups.push_back(std::clamp<int64_t>((4 * threads + row_blocks - 1) / row_blocks, 1, panels));
    first_block.push_back(first_block.back() + row_blocks * groups.back());
  }
  if (static_cast<int64_t>(packed.size()) < offset.back()) packed.resize(offset.back());
  W* const panels_of = packed.data();  // (a lambda running on a helper would name that thread's `packed`)
  auto problem_of = [&problems](const std::vector<int64_t>& first, int64_t& t) {
    size_t i = 0;
    while (t >= first[i + 1]) ++i;
    t -= first[i];
    return i;
  };
  jaxlongctx::run_tasks<int>(pool, threads, first_pack.back(), [&](int64_t t, int&) {
    const size_t i = problem_of(first_pack, t);
    const Problem& p = problems[i];
    const int64_t p0 = t * gemm::kPackPanels, p1 = std::min(gemm::panels(p.n), p0 + gemm::kPackPanels);
    gemm::pack(static_cast<const W*>(p.w), k, p.n, p0, p1, panels_of + offset[i]);
  });
  jaxlongctx::run_tasks<int>(pool, threads, first_block.back(), [&](int64_t t, int&) {
    const size_t i = problem_of(first_block, t);
    const Problem& p = problems[i];
    const int64_t panels = gemm::panels(p.n), g = t % groups[i], rb = t / groups[i];
    const int64_t r0 = rb * gemm::kBlockRows, r1 = std::min(m, r0 + gemm::kBlockRows);
    gemm::block(x, panels_of + offset[i], k, p.n, r0, r1, panels * g / groups[i], panels * (g + 1) / groups[i],
                p.y);
  });
}

// y_i = x @ w_i[layer] for every weight stack w_i (the remaining arguments) and result y_i, as one set of
// tasks: several matrices sharing an input (q, k, v; gate, up) cost one dispatch to the pool.
ffi::Error LayerMatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                           ffi::AnyBuffer norm_weight, ffi::RemainingArgs weights, ffi::RemainingRets results,
                           bool transposed, float eps, bool round_bf16) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || weights.size() == 0 || weights.size() != results.size()) {
    return ffi::Error::InvalidArgument("layer_matvec: x [M K] and one result per weight stack expected");
  }
  const int64_t m = xd[0], k = xd[1], l = layer.typed_data()[0], count = weights.size();
  const float* input = x.typed_data();
  std::vector<float> normed;
  if (norm_weight.element_count() != 0) {
    const auto type = norm_weight.element_type();
    if (norm_weight.element_count() != k || (type != ffi::DataType::F32 && type != ffi::DataType::BF16)) {
      return ffi::Error::InvalidArgument("layer_matvec: the norm weight must be float32/bfloat16 [K]");
    }
    normed.resize(m * k);
    if (type == ffi::DataType::BF16) {
      rms_norm(input, static_cast<const uint16_t*>(norm_weight.untyped_data()), m, k, eps, round_bf16, normed.data());
    } else {
      rms_norm(input, static_cast<const float*>(norm_weight.untyped_data()), m, k, eps, round_bf16, normed.data());
    }
    input = normed.data();
  }
  std::vector<ffi::AnyBuffer> stacks;
  int64_t bytes = 0;
  for (int64_t i = 0; i < count; ++i) {
    auto w = weights.get<ffi::AnyBuffer>(i);
    if (!w.has_value()) return w.error();
    const auto type = w->element_type();
    if (type != ffi::DataType::F32 && type != ffi::DataType::BF16) {
      return ffi::Error::InvalidArgument("layer_matvec: weights must be float32 or bfloat16");
    }
    if (type != (i ? stacks[0].element_type() : type)) {
      return ffi::Error::InvalidArgument("layer_matvec: all weight stacks must have one dtype");
    }
    stacks.push_back(*w);
    bytes += w->size_bytes() / std::max<int64_t>(1, w->dimensions()[0]);
  }
  const int64_t threads = std::min<int64_t>(pool.num_threads(), std::max<int64_t>(1, bytes / kMinBytesPerTask));
  const bool bf16 = stacks[0].element_type() == ffi::DataType::BF16;
  const std::vector<float> x_even_odd = transposed && bf16 ? split_even_odd(input, m, k) : std::vector<float>();
  std::vector<Problem> problems;
  std::vector<int64_t> first_task{0};  // problem i runs global tasks [first_task[i], first_task[i + 1])
  std::vector<std::vector<float>> partials(count);
  for (int64_t i = 0; i < count; ++i) {
    auto y = results.get<ffi::AnyBuffer>(i);
    if (!y.has_value()) return y.error();
    int64_t tasks = 0;
    auto p = plan(input, x_even_odd.data(), m, k, l, stacks[i], *y, transposed, threads, tasks, partials[i]);
    if (!p.has_value()) return p.error();
    problems.push_back(*p);
    first_task.push_back(first_task.back() + tasks);
  }
  if (!transposed && m > kMatvecRows) {
    if (bf16) {
      gemm_products<uint16_t>(pool, input, problems);
    } else {
      gemm_products<float>(pool, input, problems);
    }
    return ffi::Error::Success();
  }
  const Runner run = bf16 ? runner<uint16_t>(transposed) : runner<float>(transposed);
  const int64_t acc_size = transposed ? 0 : m * kColumns;  // each thread's partial sums (in, out layout)
  jaxlongctx::run_tasks<std::vector<float>>(
      pool, threads, first_task.back(), [&problems, &first_task, run, acc_size](int64_t t, std::vector<float>& acc) {
        int64_t i = 0;
        while (t >= first_task[i + 1]) ++i;
        acc.resize(acc_size);
        run(problems[i], t - first_task[i], acc.data());
      });
  for (int64_t i = 0; i < count; ++i) {  // sum the K chunks' partials
    const Problem& p = problems[i];
    if (partials[i].empty()) continue;
    const int64_t size = p.m * p.n;
    std::copy(partials[i].begin(), partials[i].begin() + size, p.y);
    for (int64_t c = 1; c < p.k_chunks; ++c) {
      const float* part = partials[i].data() + c * size;
      for (int64_t j = 0; j < size; ++j) p.y[j] += part[j];
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerMatvec, LayerMatvecImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<bool>("transposed")
                                  .Attr<float>("eps")
                                  .Attr<bool>("round_bf16"));
