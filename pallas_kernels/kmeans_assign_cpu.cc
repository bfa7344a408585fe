// The assignment step of batched Lloyd k-means on CPU: an XLA FFI handler.
//
// P independent problems, each n points of ds coordinates and k centroids. One task per problem:
//  - every point's nearest centroid (squared L2, ties to the lowest index) and that distance,
//    kLanes points per vector (the build tier's width) and kBlock points per pass over the
//    centroids, so each centroid is read once per pass and the running minima stay in registers;
//  - then the problem's cluster sizes and coordinate sums (summed in double, in point order), and
//    for k-means' split of a cluster into an empty one, each cluster's
//      gain[c] = sum over its points i of |<x_i - mean_c, delta_c>|,
//      delta_c[j] = split_eps * (|mean_c[j]| + rms) * (+1 for even j, -1 for odd j)
//    (mean_c = sums / counts in float32; the centroid itself for an empty cluster).
// Distances are (x_j - c_j)^2 summed over j in order, as the XLA path computes them.
//
// Shapes: x f32 [P n ds]; cent f32 [P k ds]; rms f32 [P] -> assign s32 [P n], dist f32 [P n],
// counts f32 [P k], sums f32 [P k ds], gain f32 [P k]; attr split_eps.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_tasks.h"
#include "cpu_vector_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxlongctx::kLanes;
using jaxlongctx::vf;
using jaxlongctx::vi;

namespace {

constexpr int64_t kVectors = 8;  // independent running minima per pass (hides the add-compare latency)
constexpr int64_t kBlock = kVectors * kLanes;

struct Problem {
  const float* x;
  const float* cent;
  const float* rms;
  int32_t* assign;
  float* dist;
  float* counts;
  float* sums;
  float* gain;
  int64_t n, k, ds;
  float split_eps;
};

// A thread's buffers: one block's coordinates, coordinate-major ([ds][kBlock]).
struct Scratch {
  std::vector<float> coords;
};

// Nearest centroid of points [i0, i0 + count) (count <= kBlock) of one problem. DS > 0 fixes the
// subspace size at compile time; DS == 0 reads it from the problem.
template <int DS>
void nearest_block(const Problem& p, const float* x, const float* cent, int64_t i0, int64_t count,
                   Scratch& scratch, int32_t* assign, float* dist) {
  const int64_t ds = DS > 0 ? DS : p.ds;
  scratch.coords.assign(ds * kBlock, 0.0f);
  float* coords = scratch.coords.data();
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < ds; ++j) coords[j * kBlock + i] = x[(i0 + i) * ds + j];
  vf best[kVectors];
  vi index[kVectors];
  for (int64_t v = 0; v < kVectors; ++v) {
    best[v] = vf{} + std::numeric_limits<float>::infinity();
    index[v] = vi{};
  }
  for (int64_t c = 0; c < p.k; ++c) {
    const float* centroid = cent + c * ds;
    for (int64_t v = 0; v < kVectors; ++v) {
      const vf diff0 = jaxlongctx::load(coords + v * kLanes) - centroid[0];
      vf d = diff0 * diff0;
      for (int64_t j = 1; j < ds; ++j) {
        const vf diff = jaxlongctx::load(coords + j * kBlock + v * kLanes) - centroid[j];
        d = d + diff * diff;
      }
      const vi closer = d < best[v];
      best[v] = closer ? d : best[v];
      index[v] = closer ? vi{} + static_cast<int32_t>(c) : index[v];
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    assign[i0 + i] = index[i / kLanes][i % kLanes];
    dist[i0 + i] = best[i / kLanes][i % kLanes];
  }
}

template <int DS>
void problem_task(const Problem& p, int64_t task, Scratch& scratch) {
  const int64_t n = p.n, k = p.k, ds = p.ds;
  const float* x = p.x + task * n * ds;
  const float* cent = p.cent + task * k * ds;
  int32_t* assign = p.assign + task * n;
  float* dist = p.dist + task * n;
  for (int64_t i0 = 0; i0 < n; i0 += kBlock)
    nearest_block<DS>(p, x, cent, i0, std::min(kBlock, n - i0), scratch, assign, dist);
  std::vector<double> counts(k, 0.0), sums(k * ds, 0.0), gain(k, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = assign[i];
    counts[c] += 1.0;
    for (int64_t j = 0; j < ds; ++j) sums[c * ds + j] += x[i * ds + j];
  }
  float* counts_out = p.counts + task * k;
  float* sums_out = p.sums + task * k * ds;
  std::copy(counts.begin(), counts.end(), counts_out);
  std::copy(sums.begin(), sums.end(), sums_out);
  std::vector<float> mean(k * ds), delta(k * ds);
  for (int64_t c = 0; c < k; ++c)
    for (int64_t j = 0; j < ds; ++j) {
      const int64_t e = c * ds + j;
      mean[e] = counts_out[c] > 0.0f ? sums_out[e] / counts_out[c] : cent[e];
      delta[e] = p.split_eps * (std::fabs(mean[e]) + p.rms[task]) * (j % 2 == 0 ? 1.0f : -1.0f);
    }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = assign[i];
    float dot = 0.0f;
    for (int64_t j = 0; j < ds; ++j) dot += (x[i * ds + j] - mean[c * ds + j]) * delta[c * ds + j];
    gain[c] += std::fabs(dot);
  }
  std::copy(gain.begin(), gain.end(), p.gain + task * k);
}

void run_problem(const Problem& p, int64_t task, Scratch& scratch) {
  switch (p.ds) {
    case 1: return problem_task<1>(p, task, scratch);
    case 2: return problem_task<2>(p, task, scratch);
    case 4: return problem_task<4>(p, task, scratch);
    case 8: return problem_task<8>(p, task, scratch);
    default: return problem_task<0>(p, task, scratch);
  }
}

ffi::Error KmeansAssignImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cent,
                            ffi::Buffer<ffi::F32> rms, ffi::ResultBuffer<ffi::S32> assign,
                            ffi::ResultBuffer<ffi::F32> dist, ffi::ResultBuffer<ffi::F32> counts,
                            ffi::ResultBuffer<ffi::F32> sums, ffi::ResultBuffer<ffi::F32> gain, float split_eps) {
  const auto xd = x.dimensions(), cd = cent.dimensions();
  if (xd.size() != 3 || cd.size() != 3) return ffi::Error::InvalidArgument("kmeans_assign: x and cent must be rank 3");
  const int64_t P = xd[0], n = xd[1], ds = xd[2], k = cd[1];
  if (cd[0] != P || cd[2] != ds || ds < 1 || k < 1 || k > std::numeric_limits<int32_t>::max() ||
      assign->element_count() != P * n || dist->element_count() != P * n || counts->element_count() != P * k ||
      sums->element_count() != P * k * ds || rms.element_count() != P || gain->element_count() != P * k) {
    return ffi::Error::InvalidArgument("kmeans_assign: operand shapes do not agree");
  }
  const Problem p{x.typed_data(),      cent.typed_data(),   rms.typed_data(),
                  assign->typed_data(), dist->typed_data(),  counts->typed_data(),
                  sums->typed_data(),   gain->typed_data(),  n, k, ds, split_eps};
  jaxlongctx::run_tasks<Scratch>(pool, pool.num_threads(), P,
                                 [p](int64_t t, Scratch& s) { run_problem(p, t, s); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KmeansAssign, KmeansAssignImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("split_eps"));
