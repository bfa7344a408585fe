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
//    Packed 4-bit codes (at most 16 centroids, two codes a byte: subspace 2p in the low nibble of
//    byte p, 2p + 1 in the high; ds 1, 2 or 4) take the register path instead (coded_task_small): a
//    subspace's lookup table, per query head, is 16 floats and a tile of kTile tokens (one vector
//    register: 16 on AVX-512, 8 on AVX2, 4 on the base tier) is scored by one lookup of it with their
//    codes (a permute; two and a blend on AVX2); the values are the value centroids looked up the
//    same way, weighted and summed per lane. A tile's code bytes are first transposed from
//    [kTile tokens, M/2] to [M/2, kTile tokens] (CodeTranspose, in registers on AVX512-VBMI). With
//    bf16 queries (attr bf16_math, a bf16 model) at ds 1 and 2, on CPUs with AVX512-BF16, keys and
//    values are looked up as bf16 and multiplied in pairs by vdpbf16ps instead (scores_bf16,
//    values_bf16): q, the centroids and the weights at bf16, as the model's own attention rounds them,
//    with float32 sums.
//  - window (row b, kv head k): exact attention of the G heads over the first win_lengths[b] slots.
// The partials of each (b, k, g) are then merged by log-sum-exp into out, so the step's XLA graph has
// one operation for the layer's attention.
//
// Shapes: q f32 [B K G hd] (scale folded in); k_codes/v_codes u8 [L B K T M] (or [L B K T M/2] packed
// 4-bit codes); k_cent/v_cent f32
// [Kc M C ds] (Kc = 1 shared or K); lengths s32 [B]; k_win/v_win f32 or bf16 [B K R hd]; win_lengths
// s32 [B]; layer s32 []; out f32 [B K G hd] (0 for a head that sees no token); attrs splits, bf16_math.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_tasks.h"
#include "cpu_vector_math.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;
using jaxlongctx::vf;
using jaxlongctx::vi;
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

// ---- packed 4-bit codes: the register path ----

// Tokens per vector: one register of this build's tier (`cpu_vector_math.h`: 16 on AVX-512, 8 on AVX2, 4
// on the base tier), so a tile's scores, weights and sums stay in registers on every tier.
constexpr int64_t kTile = jaxlongctx::kLanes;
constexpr int64_t kCodes = 16;        // entries of a 4-bit code's table (C <= 16, zero-padded)
constexpr int64_t kSmallChunk = 128;  // tokens scored before their weights are applied to the values
constexpr int64_t kPrefetchTokens = 2 * 128;  // how far ahead of its transpose a tile's codes are fetched
constexpr int64_t kMaxCodeBytes = 256;  // packed code bytes per token the register path takes (M <= 512)

typedef uint8_t v64b __attribute__((vector_size(64)));
typedef uint8_t vb __attribute__((vector_size(kTile)));

// A 16-entry table (one subspace's values per code) in as many registers as the tier needs.
struct Table {
  vf part[kCodes / kTile];
};

inline vf load(const float* p) { return jaxlongctx::load(p); }

inline Table load_table(const float* p) {  // p: 16 floats
  Table t;
  for (int64_t i = 0; i < kCodes / kTile; ++i) t.part[i] = load(p + i * kTile);
  return t;
}

// table[idx[i] & 15] for every lane: one permute on AVX-512; two 8-lane permutes and a blend on bit 3
// of the index on AVX2; a lane loop on the base tier.
inline vf lookup(const Table& table, vi idx) {
#if defined(__AVX512F__)
  return (vf)_mm512_permutexvar_ps((__m512i)idx, (__m512)table.part[0]);
#elif defined(__AVX2__)
  const __m256 lo = _mm256_permutevar8x32_ps((__m256)table.part[0], (__m256i)idx);
  const __m256 hi = _mm256_permutevar8x32_ps((__m256)table.part[1], (__m256i)idx);
  return (vf)_mm256_blendv_ps(lo, hi, (__m256)(idx << 28));  // bit 3 of the index -> the sign bit
#else
  float entries[kCodes];
  std::memcpy(entries, table.part, sizeof(entries));
  vf r;
  for (int64_t i = 0; i < kTile; ++i) r[i] = entries[idx[i] & 15];
  return r;
#endif
}

inline vi widen_codes(const uint8_t* p) {  // kTile codes -> kTile int32 indices
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vb b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, vi);
#endif
}

inline void store(float* p, vf x) { jaxlongctx::store(p, x); }

// Transposes the code bytes of kTile tokens, [kTile, N] row-major, into [N, kTile] (a tile of the register path).
// For N = 4 << R (R = 1..4) on CPUs with byte permutes, in R rounds of two-source byte permutes over
// the 16N / 64 = 2^R vectors: round r swaps bit 6 + r of a byte's position (its vector's bit r) with
// bit 2 + r (bit 2 + r of its column, which is where it starts), so after the last round vector o
// holds columns 4o..4o+3; the last round's masks also put each byte at its lane (n % 4) * 16 + t.
// Other N (or no byte permutes) take the scalar loop.
struct CodeTranspose {
  int64_t columns = 0, rounds = 0;
  std::vector<v64b> masks;  // [rounds, 2^rounds]: lane i of output vector o takes byte masks[.][o][i]
                            // of the pair (o without bit r, o with bit r), 64.. naming the second

  explicit CodeTranspose(int64_t n) : columns(n) {
#if defined(__AVX512VBMI__)
    static_assert(kTile == 16, "the byte permutes move 16 tokens' codes");
    int64_t r = 0;
    while ((int64_t{4} << r) < n) ++r;
    if (r < 1 || r > 4 || (int64_t{4} << r) != n) return;  // scalar path
    rounds = r;
    const int64_t vectors = int64_t{1} << r;
    masks.assign(rounds * vectors, v64b{});
    for (int64_t e = 0; e < kTile * n; ++e) {  // e = t * N + s: token t's byte of column s
      const int64_t t = e / n, s = e % n;
      int64_t pos = e;
      for (int64_t round = 0; round < rounds; ++round) {
        const int64_t lo = 2 + round, hi = 6 + round;
        int64_t next = pos & ~((int64_t{1} << lo) | (int64_t{1} << hi));
        next |= ((pos >> hi) & 1) << lo | ((pos >> lo) & 1) << hi;
        if (round == rounds - 1) next = (s / 4) * 64 + (s % 4) * kTile + t;
        const int64_t out = next / 64, from = pos / 64;
        masks[round * vectors + out][next % 64] = static_cast<uint8_t>((pos % 64) + ((from >> round) & 1) * 64);
        pos = next;
      }
    }
#endif
  }

  // src: kTile tokens' code bytes [kTile, N] -> dst [N, kTile].
  void operator()(const uint8_t* src, uint8_t* dst) const {
#if defined(__AVX512VBMI__)
    switch (rounds) {
      case 1: return permute<1>(src, dst);
      case 2: return permute<2>(src, dst);
      case 3: return permute<3>(src, dst);
      case 4: return permute<4>(src, dst);
    }
#endif
    for (int64_t t = 0; t < kTile; ++t)
      for (int64_t s = 0; s < columns; ++s) dst[s * kTile + t] = src[t * columns + s];
  }

#if defined(__AVX512VBMI__)
  template <int R>  // the rounds, unrolled so that the 2^R vectors stay in registers
  void permute(const uint8_t* src, uint8_t* dst) const {
    constexpr int vectors = 1 << R;
    __m512i v[vectors], next[vectors];
    for (int i = 0; i < vectors; ++i) v[i] = _mm512_loadu_si512(src + 64 * i);
    const v64b* mask = masks.data();
    for (int round = 0; round < R; ++round) {
      const int bit = 1 << round;
      for (int o = 0; o < vectors; ++o)
        next[o] = _mm512_permutex2var_epi8(v[o & ~bit], (__m512i)mask[round * vectors + o], v[o | bit]);
      for (int o = 0; o < vectors; ++o) v[o] = next[o];
    }
    for (int i = 0; i < vectors; ++i) _mm512_storeu_si512(dst + 64 * i, v[i]);
  }
#endif
};

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
  int64_t code_bytes;  // per token and kv head: M, or M / 2 packed
  bool packed;  // packed 4-bit codes: the register path
  bool bf16_math;  // bf16 queries: the register path at ds 1 and 2 computes in bf16 where the CPU can
  const CodeTranspose* transpose;  // of code_bytes columns, for the register path

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
  std::vector<float> lut, bins, scores, vtab;
  std::vector<v4> q_lanes;
  std::vector<uint8_t> k_tiles, v_tiles;  // the register path's transposed codes of one chunk
  std::vector<uint16_t> ktab16, vtab16;  // the bf16 register path's tables (bf16_tables)
  std::vector<uint32_t> qpair;
};

// Scores within this many nats under the running reference keep their weights: the reference moves
// (and the sums so far are rescaled) only when a score passes it, and then to that score plus this
// headroom, so a slowly rising maximum rescales the histogram a few times instead of every chunk.
constexpr float kHeadroom = 8.0f;

// ---- packed 4-bit codes at ds 1 and 2 with AVX512-BF16: the bf16 register path ----
//
// Keys and values are looked up as bf16 (a 32-entry word permute) and multiplied in pairs by
// vdpbf16ps, which sums two bf16 products into each fp32 lane: keys pair a token's two dims with the
// query's, values pair two tokens' values of one dim with their weights. Half the instructions of the
// fp32 path per token, at bf16 precision for q, the centroids and the weights (the model's own K/V
// cache is bf16); accumulation stays fp32.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define JAXLONGCTX_BF16_PATH 1
template <int DS>
constexpr bool kBf16Path = DS == 1 || DS == 2;

inline uint16_t bf16_bits(float v) {
  const float r = jaxlongctx::round_to_bf16(v);
  uint32_t bits;
  std::memcpy(&bits, &r, sizeof(bits));
  return static_cast<uint16_t>(bits >> 16);
}

inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// The bf16 tables of one task (scratch.ktab16 / vtab16 / qpair):
//   keys [M/2, 32] words at ds 1 (a code byte's two dims: entries 0-15 the low nibble's dim, 16-31 the
//     high nibble's) or [M, 16] dwords at ds 2 (a centroid's two dims as one dword);
//   values [D, 32] words (entry c of dim d: v_cent[d / DS, c, d % DS]; 16-31 zero);
//   q pairs [H, hd/2] dwords: the head's dims 2i (low half) and 2i + 1, scale included.
template <int H, int DS>
void bf16_tables(const Problem& p, int64_t b, int64_t k, int64_t nb, int64_t cent_base, Scratch& scratch) {
  const int64_t M = p.subspaces, C = p.centroids, D = M * DS, hd = p.head_dim;
  scratch.ktab16.assign(M * DS * 16, 0);
  scratch.vtab16.assign(D * 32, 0);
  scratch.qpair.resize(H * hd / 2);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c)
      for (int j = 0; j < DS; ++j) {
        const float key = p.k_cent[cent_base + (m * C + c) * DS + j];
        const int64_t slot = DS == 1 ? (m / 2) * 32 + (m % 2) * 16 + c : m * 32 + 2 * c + j;
        scratch.ktab16[slot] = bf16_bits(key);
        scratch.vtab16[(m * DS + j) * 32 + c] = bf16_bits(p.v_cent[cent_base + (m * C + c) * DS + j]);
      }
  for (int h = 0; h < H; ++h) {
    const float* q = p.q + ((b * p.kv_heads + k) * p.group + nb * kLanes + h) * hd;
    for (int64_t i = 0; i < hd / 2; ++i)
      scratch.qpair[h * hd / 2 + i] = bf16_bits(q[2 * i]) | static_cast<uint32_t>(bf16_bits(q[2 * i + 1])) << 16;
  }
}

// Scores of a chunk's tiles: w[h, 16 i + t] = sum_d q_h[d] k[t, d] with k from the bf16 key tables.
// kScoreTiles tiles at a time share the query broadcasts and keep that many independent sums per head
// in flight (one tile's sums alone wait on the latency of vdpbf16ps); past the chunk's last tile the
// scratch holds stale codes, whose scores land in w slots the softmax never reads.
constexpr int64_t kScoreTiles = 4;
static_assert(kSmallChunk % (kScoreTiles * kTile) == 0, "a chunk is whole groups of score tiles");

template <int H, int DS>
void scores_bf16(const Scratch& scratch, const uint8_t* k_tiles, int64_t tiles, int64_t N, int64_t hd, float* w) {
  constexpr int T = kScoreTiles;
  const uint16_t* ktab = scratch.ktab16.data();
  const uint32_t* qpair = scratch.qpair.data();
  const __m512i low_nibbles = _mm512_set1_epi32(0x000F000F), high_table = _mm512_set1_epi32(0x00100000);
  for (int64_t i0 = 0; i0 < tiles; i0 += T) {
    __m512 sc[T][H];
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) sc[t][h] = _mm512_setzero_ps();
    const uint8_t* codes = k_tiles + i0 * kTile * N;
    for (int64_t col = 0; col < N; ++col) {
      __m512i x[T];  // 16 tokens' code bytes a tile
      for (int t = 0; t < T; ++t) x[t] = _mm512_cvtepu8_epi32(load128(codes + (t * N + col) * kTile));
      if constexpr (DS == 1) {  // word 2t: the low nibble; word 2t + 1: the high nibble + 16
        const __m512i table = load512(ktab + col * 32);
        __m512bh keys[T];
        for (int t = 0; t < T; ++t) {
          const __m512i idx = _mm512_or_si512(
              _mm512_and_si512(_mm512_or_si512(x[t], _mm512_slli_epi32(x[t], 12)), low_nibbles), high_table);
          keys[t] = (__m512bh)_mm512_permutexvar_epi16(idx, table);
        }
        for (int h = 0; h < H; ++h) {
          const __m512bh qh = (__m512bh)_mm512_set1_epi32(qpair[h * hd / 2 + col]);
          for (int t = 0; t < T; ++t) sc[t][h] = _mm512_dpbf16_ps(sc[t][h], keys[t], qh);
        }
      } else {  // two subspaces a byte; the dword permute reads the low 4 bits
        for (int u = 0; u < 2; ++u) {
          const __m512i table = load512(ktab + (2 * col + u) * 32);
          __m512bh keys[T];
          for (int t = 0; t < T; ++t)
            keys[t] = (__m512bh)_mm512_permutexvar_epi32(u ? _mm512_srli_epi32(x[t], 4) : x[t], table);
          for (int h = 0; h < H; ++h) {
            const __m512bh qh = (__m512bh)_mm512_set1_epi32(qpair[h * hd / 2 + 2 * col + u]);
            for (int t = 0; t < T; ++t) sc[t][h] = _mm512_dpbf16_ps(sc[t][h], keys[t], qh);
          }
        }
      }
    }
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) _mm512_storeu_ps(w + h * kSmallChunk + (i0 + t) * kTile, sc[t][h]);
  }
}

// acc[h, d, lane] += weighted values of a chunk: two tiles (32 tokens) per step, the bf16 weights of
// tokens 2l and 2l + 1 in lane l; an odd last tile is paired with zero weights.
template <int H, int DS>
void values_bf16(const Scratch& scratch, const uint8_t* v_tiles, int64_t tiles, int64_t N, float* w, float* acc) {
  const int64_t D = 2 * N * DS, pairs = (tiles + 1) / 2;
  if (tiles % 2)
    for (int h = 0; h < H; ++h) std::fill_n(w + h * kSmallChunk + tiles * kTile, kTile, 0.0f);
  __m512bh weights[H][kSmallChunk / 32];
  for (int h = 0; h < H; ++h)
    for (int64_t l = 0; l < pairs; ++l) {
      const float* wh = w + h * kSmallChunk + 2 * l * kTile;
      weights[h][l] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(wh + kTile), _mm512_loadu_ps(wh));
    }
  const __m512i nibble = _mm512_set1_epi16(15);
  for (int64_t col = 0; col < N; ++col) {  // dims [2 DS col, 2 DS col + 2 DS): the byte's two subspaces
    __m512i table[2 * DS];
    __m512 part[H][2 * DS];
    for (int e = 0; e < 2 * DS; ++e) {
      table[e] = load512(scratch.vtab16.data() + (2 * DS * col + e) * 32);
      for (int h = 0; h < H; ++h) part[h][e] = _mm512_setzero_ps();
    }
    for (int64_t l = 0; l < pairs; ++l) {
      const uint8_t* first = v_tiles + 2 * l * kTile * N + col * kTile;
      const __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(load128(first)), load128(first + kTile * N), 1);
      const __m512i words = _mm512_cvtepu8_epi16(bytes);  // 32 tokens' code bytes
      const __m512i codes[2] = {_mm512_and_si512(words, nibble), _mm512_srli_epi16(words, 4)};
      for (int e = 0; e < 2 * DS; ++e) {
        const __m512bh vals = (__m512bh)_mm512_permutexvar_epi16(codes[e / DS], table[e]);
        for (int h = 0; h < H; ++h) part[h][e] = _mm512_dpbf16_ps(part[h][e], vals, weights[h][l]);
      }
    }
    for (int h = 0; h < H; ++h)
      for (int e = 0; e < 2 * DS; ++e) {
        float* a = acc + (h * D + 2 * DS * col + e) * kTile;
        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), part[h][e]));
      }
  }
}

inline vf bf16_round(vf x) { return (vf)_mm512_cvtpbh_ps(_mm512_cvtneps_pbh((__m512)x)); }
#else
#define JAXLONGCTX_BF16_PATH 0
template <int DS>
constexpr bool kBf16Path = false;
#endif

// A coded task on the register path (packed 4-bit codes, ds = DS, H query heads of the lane block):
// the same result as coded_task. Per chunk of kSmallChunk tokens: their codes transposed per tile, scores
// sc[h, t] = sum_m lut[h, m][k_code[t, m]] (16 tokens per permute), the online softmax of
// coded_task, then per subspace m and dim j the value centroids permuted by the tile's codes and
// summed with the weights into acc[h, m*DS + j] (16 lanes each, summed across lanes at the end).
template <int H, int DS, bool BF16>
void coded_task_small(const Problem& p, int64_t b, int64_t k, int64_t nb, int64_t lo, int64_t hi, Scratch& scratch,
                      float* out, float* lse) {
  constexpr bool kBf16 = BF16 && kBf16Path<DS>;  // the bf16 register path
  const int64_t M = p.subspaces, C = p.centroids, D = M * DS, hd = p.head_dim, N = p.code_bytes;
  const int64_t code_base = (b * p.kv_heads + k) * p.capacity * N;
  const int64_t cent_base = (p.cent_heads > 1 ? k : 0) * M * C * DS;
  const float inf = std::numeric_limits<float>::infinity();
  auto& lut = scratch.lut;      // [H, M, 16]: lut[h, m, c] = q_h[m] . k_cent[m, c] (0 for c >= C)
  auto& vtab = scratch.vtab;    // [M, DS, 16]: v_cent[m, c, j] at [m, j, c]
  auto& acc = scratch.bins;     // [H, D, 16] weighted values, 16 lanes per entry
  auto& w = scratch.scores;     // [H, kSmallChunk] scores, then weights
  lut.assign(H * M * kCodes, 0.0f);
  vtab.assign(M * DS * kCodes, 0.0f);
  acc.assign(H * D * kTile, 0.0f);
  w.resize(H * kSmallChunk);
  scratch.k_tiles.resize(kSmallChunk * N);
  scratch.v_tiles.resize(kSmallChunk * N);
#if JAXLONGCTX_BF16_PATH
  if constexpr (kBf16) bf16_tables<H, DS>(p, b, k, nb, cent_base, scratch);
#endif
  for (int h = 0; h < H && !kBf16; ++h) {
    const float* q = p.q + ((b * p.kv_heads + k) * p.group + nb * kLanes + h) * hd;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < C; ++c) {
        const float* centroid = p.k_cent + cent_base + (m * C + c) * DS;
        float dot = 0.0f;
        for (int j = 0; j < DS; ++j) dot += q[m * DS + j] * centroid[j];
        lut[(h * M + m) * kCodes + c] = dot;
      }
  }
  for (int64_t m = 0; m < M && !kBf16; ++m)
    for (int64_t c = 0; c < C; ++c)
      for (int j = 0; j < DS; ++j) vtab[(m * DS + j) * kCodes + c] = p.v_cent[cent_base + (m * C + c) * DS + j];

  const CodeTranspose& transpose = *p.transpose;
  uint8_t* k_tiles = scratch.k_tiles.data();  // [tiles, M/2, 16]
  uint8_t* v_tiles = scratch.v_tiles.data();
  float ref[H], total[H];
  for (int h = 0; h < H; ++h) ref[h] = -inf, total[h] = 0.0f;
  vf lane;  // 0, 1, ..., kTile - 1
  for (int64_t i = 0; i < kTile; ++i) lane[i] = static_cast<float>(i);
  for (int64_t t0 = lo; t0 < hi; t0 += kSmallChunk) {
    const int64_t n = std::min(kSmallChunk, hi - t0), tiles = (n + kTile - 1) / kTile;
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t first = t0 + i * kTile, count = std::min(kTile, hi - first);
      const uint8_t* kc = p.k_codes + code_base + first * N;
      const uint8_t* vc = p.v_codes + code_base + first * N;
      if (first + kPrefetchTokens + kTile <= hi)  // this tile of a later chunk, on its way from memory
        for (int64_t line = 0; line < kTile * N; line += 64) {
          __builtin_prefetch(kc + kPrefetchTokens * N + line);
          __builtin_prefetch(vc + kPrefetchTokens * N + line);
        }
      if (count < kTile) {  // the row's last tokens: pad the tile with code 0 (weight 0 below)
        uint8_t kpad[kTile * kMaxCodeBytes] = {}, vpad[kTile * kMaxCodeBytes] = {};
        std::memcpy(kpad, kc, count * N);
        std::memcpy(vpad, vc, count * N);
        transpose(kpad, k_tiles + i * kTile * N);
        transpose(vpad, v_tiles + i * kTile * N);
      } else {
        transpose(kc, k_tiles + i * kTile * N);
        transpose(vc, v_tiles + i * kTile * N);
      }
    }
#if JAXLONGCTX_BF16_PATH
    if constexpr (kBf16) scores_bf16<H, DS>(scratch, k_tiles, tiles, N, hd, w.data());
#endif
    for (int64_t i = 0; i < tiles && !kBf16; ++i) {  // scores
      vf sc[H] = {};
      const uint8_t* codes = k_tiles + i * kTile * N;
      for (int64_t pair = 0; pair < N; ++pair) {  // subspaces 2 pair (low nibbles) and 2 pair + 1 (high)
        const vi low = widen_codes(codes + pair * kTile), high = low >> 4;  // the lookup reads 4 bits
        const float* tables = lut.data() + 2 * pair * kCodes;
        for (int h = 0; h < H; ++h)
          sc[h] += lookup(load_table(tables + h * M * kCodes), low) +
                   lookup(load_table(tables + (h * M + 1) * kCodes), high);
      }
      for (int h = 0; h < H; ++h) store(w.data() + h * kSmallChunk + i * kTile, sc[h]);
    }
    const float valid = static_cast<float>(n - (tiles - 1) * kTile);  // lanes of the last tile in the row
    for (int h = 0; h < H; ++h) {
      float* wh = w.data() + h * kSmallChunk;
      vf top = vf{} - inf;
      for (int64_t i = 0; i < tiles; ++i) {
        vf si = load(wh + i * kTile);
        if (i == tiles - 1) si = lane < valid ? si : vf{} - inf;  // padded lanes
        top = si > top ? si : top;
      }
      float peak = ref[h];
      for (int64_t i = 0; i < kTile; ++i) peak = std::max(peak, top[i]);
      if (peak > ref[h]) {  // move the reference (headroom as in coded_task) and rescale the sums
        const float next = peak + kHeadroom;
        const float factor = ref[h] == -inf ? 0.0f : std::exp(ref[h] - next);
        if (t0 > lo) {
          total[h] *= factor;
          float* a = acc.data() + h * D * kTile;
          for (int64_t e = 0; e < D * kTile; e += kTile) store(a + e, load(a + e) * factor);
        }
        ref[h] = next;
      }
      vf sum = {};
      for (int64_t i = 0; i < tiles; ++i) {
        vf wi = jaxlongctx::exp_nonpositive<vf, vi>(load(wh + i * kTile) - ref[h]);
        if (i == tiles - 1) wi = lane < valid ? wi : vf{};
#if JAXLONGCTX_BF16_PATH
        if constexpr (kBf16) wi = bf16_round(wi);  // the weights values_bf16 multiplies
#endif
        store(wh + i * kTile, wi);
        sum += wi;
      }
      total[h] += jaxlongctx::sum(sum);
    }
    // values, S = 2 subspaces (a byte's two codes) at a time where their sums fit the registers
    constexpr int S = H * DS <= 8 ? 2 : 1;
#if JAXLONGCTX_BF16_PATH
    if constexpr (kBf16) values_bf16<H, DS>(scratch, v_tiles, tiles, N, w.data(), acc.data());
#endif
    for (int64_t m0 = 0; m0 < M && !kBf16; m0 += S) {
      Table table[S][DS];
      vf part[H][S][DS] = {};
      for (int u = 0; u < S; ++u)
        for (int j = 0; j < DS; ++j) table[u][j] = load_table(vtab.data() + ((m0 + u) * DS + j) * kCodes);
      for (int64_t i = 0; i < tiles; ++i) {
        const vi byte = widen_codes(v_tiles + i * kTile * N + m0 / 2 * kTile);
        vf wi[H];
        for (int h = 0; h < H; ++h) wi[h] = load(w.data() + h * kSmallChunk + i * kTile);
        for (int u = 0; u < S; ++u) {
          const vi idx = byte >> (4 * ((m0 + u) % 2));  // the lookup reads the low 4 bits
          for (int j = 0; j < DS; ++j) {
            const vf vals = lookup(table[u][j], idx);
            for (int h = 0; h < H; ++h) part[h][u][j] += wi[h] * vals;
          }
        }
      }
      for (int h = 0; h < H; ++h)
        for (int u = 0; u < S; ++u)
          for (int j = 0; j < DS; ++j) {
            float* a = acc.data() + (h * D + (m0 + u) * DS + j) * kTile;
            store(a, load(a) + part[h][u][j]);
          }
    }
  }
  for (int64_t g = 0; g < kLanes; ++g) {
    float* o = out + g * D;
    if (g >= H || total[g] <= 0.0f) {
      std::fill(o, o + D, 0.0f);
      lse[g] = -inf;
      continue;
    }
    lse[g] = ref[g] + std::log(total[g]);
    const float inv = 1.0f / total[g];
    for (int64_t d = 0; d < D; ++d) o[d] = jaxlongctx::sum(load(acc.data() + (g * D + d) * kTile)) * inv;
  }
}

template <int DS, bool BF16>
void coded_task_small_heads(const Problem& p, int64_t b, int64_t k, int64_t nb, int64_t lo, int64_t hi,
                            Scratch& scratch, float* out, float* lse) {
  switch (std::min<int64_t>(kLanes, p.group - nb * kLanes)) {
    case 1: return coded_task_small<1, DS, BF16>(p, b, k, nb, lo, hi, scratch, out, lse);
    case 2: return coded_task_small<2, DS, BF16>(p, b, k, nb, lo, hi, scratch, out, lse);
    case 3: return coded_task_small<3, DS, BF16>(p, b, k, nb, lo, hi, scratch, out, lse);
    default: return coded_task_small<4, DS, BF16>(p, b, k, nb, lo, hi, scratch, out, lse);
  }
}

template <int DS>
void coded_task_small_math(const Problem& p, int64_t b, int64_t k, int64_t nb, int64_t lo, int64_t hi,
                           Scratch& scratch, float* out, float* lse) {
  if (p.bf16_math) return coded_task_small_heads<DS, true>(p, b, k, nb, lo, hi, scratch, out, lse);
  coded_task_small_heads<DS, false>(p, b, k, nb, lo, hi, scratch, out, lse);
}

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
  if (p.packed) {
    if (ds == 1) return coded_task_small_math<1>(p, b, k, nb, lo, hi, scratch, out, lse);
    if (ds == 2) return coded_task_small_math<2>(p, b, k, nb, lo, hi, scratch, out, lse);
    return coded_task_small_heads<4, false>(p, b, k, nb, lo, hi, scratch, out, lse);
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

// The transpose plan of N code bytes a token: built once per process for the usual N, per call otherwise.
const CodeTranspose& code_transpose(int64_t n) {
  static const CodeTranspose usual[] = {CodeTranspose(8), CodeTranspose(16), CodeTranspose(32), CodeTranspose(64)};
  for (const CodeTranspose& plan : usual)
    if (plan.columns == n) return plan;
  thread_local CodeTranspose other(0);
  if (other.columns != n) other = CodeTranspose(n);
  return other;
}

ffi::Error PqDecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> k_codes,
                                 ffi::Buffer<ffi::U8> v_codes, ffi::Buffer<ffi::F32> k_cent,
                                 ffi::Buffer<ffi::F32> v_cent, ffi::Buffer<ffi::S32> lengths,
                                 ffi::AnyBuffer k_win, ffi::AnyBuffer v_win, ffi::Buffer<ffi::S32> win_lengths,
                                 ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int64_t splits,
                                 int64_t bf16_math) {
  const auto qd = q.dimensions(), cd = k_codes.dimensions(), kd = k_cent.dimensions(), wd = k_win.dimensions();
  if (qd.size() != 4 || cd.size() != 5 || kd.size() != 4 || wd.size() != 4) {
    return ffi::Error::InvalidArgument("pq_decode_attention: unexpected operand ranks");
  }
  const int64_t B = qd[0], K = qd[1], G = qd[2], hd = qd[3], M = kd[1], C = kd[2], ds = kd[3], N = cd[4];
  const bool packed = N != M;  // packed 4-bit codes: two a byte
  const bool bf16 = k_win.element_type() == ffi::DataType::BF16;
  if (packed && (2 * N != M || C > 16 || (ds != 1 && ds != 2 && ds != 4) || N > kMaxCodeBytes)) {
    return ffi::Error::InvalidArgument("pq_decode_attention: packed codes need M/2 bytes, C <= 16 and ds 1, 2 or 4");
  }
  if (cd[1] != B || cd[2] != K || M * ds != hd || (kd[0] != 1 && kd[0] != K) ||
      v_codes.element_count() != k_codes.element_count() || v_cent.element_count() != k_cent.element_count() ||
      wd[0] != B || wd[1] != K || wd[3] != hd || v_win.element_count() != k_win.element_count() ||
      k_win.element_type() != v_win.element_type() || (!bf16 && k_win.element_type() != ffi::DataType::F32) ||
      lengths.element_count() != B || win_lengths.element_count() != B || C < 1 || C > 256 || splits < 1 ||
      out->element_count() != B * K * G * hd) {
    return ffi::Error::InvalidArgument("pq_decode_attention: operand shapes or dtypes do not agree");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= cd[0]) return ffi::Error::InvalidArgument("pq_decode_attention: layer index out of range");
  const int64_t offset = l * B * K * cd[3] * N;  // layer l's codes [B K T N]
  const int64_t blocks = (G + kLanes - 1) / kLanes;
  std::vector<float> coded_out(B * K * blocks * splits * kLanes * hd), coded_lse(B * K * blocks * splits * kLanes);
  std::vector<float> window_out(B * K * G * hd), window_lse(B * K * G);
  const Problem p{q.typed_data(), k_codes.typed_data() + offset, v_codes.typed_data() + offset, k_cent.typed_data(),
                  v_cent.typed_data(), lengths.typed_data(), k_win.untyped_data(), v_win.untyped_data(),
                  win_lengths.typed_data(), coded_out.data(), coded_lse.data(), window_out.data(),
                  window_lse.data(), B, K, G, hd, blocks, M, C, cd[3], kd[0], ds, splits, wd[2], bf16,
                  N, packed, bf16_math != 0, packed ? &code_transpose(N) : nullptr};
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
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("bf16_math"));
