// Fused decode/chunked-prefill attention over a block-table KV pool: the shard's R-part kernel.
//
// One call appends every new k, v into the pool and attends every query token of every sequence,
// whatever the lengths. Keys and values are read in place through each sequence's block table
// (slot = table[pos / block_size] * block_size + pos % block_size), once per KV head for all the
// query heads that share it (GQA/MQA), with an online softmax in fp32. Storage types: float32,
// float16 and bfloat16 (widened in registers) and int8 with one fp32 scale per (token, KV head).
//
// Work is split over (sequence, KV head, chunk of <= kQChunk query tokens) jobs, longest first,
// taken from an atomic counter by torch's intra-op threads (at::parallel_for, so the shard's
// torch.set_num_threads applies). Each job walks its keys in tiles (tile_of): scores for the whole
// tile first (8 keys per dot pass), one vectorized exp, then the weighted sum of V with the
// accumulator in registers (bfloat16 rows are read 16 at a time as even and odd halves: two bit
// operations instead of a widening shuffle per 8 values); while it sums V it prefetches the next
// tile's K and V rows, one key per key summed, into L2 (a tile of fp32 K and V is 16 KiB at D=64,
// so a tile ahead in L1 evicted the tile being read: T1 was 0.88x the time of T0 on Zen 4 and
// within noise on Zen 3). Denormals flush to zero while a job runs. The
// AVX2+FMA+F16C path is chosen at load time from CPUID; a portable
// scalar path serves other CPUs (and the tests, through set_isa).
//
// Two per-layer options (Mistral, Gemma 2/3): a sliding window W (a query at position p sees keys
// p - W + 1 .. p; first_key() is the one place that lower bound is computed, and a job starts its
// key walk there) and a logit soft-cap c (score = c * tanh(score / c), applied where each path
// scores, before the mask and the softmax).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FD_AVX2 1
#include <immintrin.h>
#endif

namespace fd {

enum Kind : int { kF32 = 0, kF16 = 1, kBF16 = 2, kI8 = 3 };

constexpr int kTile = 32;    // keys scored together before one softmax update (at most)
// The vector path's tile per storage type: half types walk 16 keys a tile (0.88x bf16's and 0.81x
// fp16's time against 32 on Zen 4, A/B medians of 4-5), float32 and int8 32 (16 was slower).
constexpr int tile_of(int kind) { return kind == kF16 || kind == kBF16 ? 16 : kTile; }
constexpr int kPrefetchTiles = 1;  // tiles ahead whose K and V rows are prefetched (2: slower)
constexpr int kQChunk = 16;  // query tokens of one sequence handled by one job (prefill chunks)

struct Job {
  int32_t seq, kvh, t0, t1;
  int64_t cost;
};

struct Args {
  const float* q;             // [T, H, D]
  float* out;                 // [T, H * D]
  const void* k;              // this layer's pools: [KVH, S, D]
  const void* v;
  const float* ks;            // int8 scales [KVH, S]; null for other kinds
  const float* vs;
  const int32_t* table;       // block tables of all sequences, concatenated
  const int64_t* table_off;   // [B + 1]
  const int64_t* start;       // [B] position of each sequence's first new token
  const int64_t* row0;        // [B + 1] first row of each sequence in q / out
  int64_t S, D, H, G, bs;
  float scale;
  int64_t window;             // keys a query sees, itself included (0: all before it)
  float softcap;              // 0: none
};

// The first key the query at position pos sees: the window's lower bound (0 without one).
inline int64_t first_key(const Args& a, int64_t pos) {
  return a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
}

// The first key any row of a job sees (its first query token's bound).
inline int64_t first_key(const Args& a, const Job& jb) { return first_key(a, a.start[jb.seq] + jb.t0); }

inline float softcap1(const Args& a, float x) { return a.softcap > 0.f ? a.softcap * std::tanh(x / a.softcap) : x; }

// Slot offsets (in tokens) of keys [p0, p0 + n) of one sequence, walking its block table.
inline void slots_of(const Args& a, const int32_t* tab, int64_t p0, int n, int64_t* slot) {
  int64_t b = p0 / a.bs, o = p0 % a.bs;
  int64_t base = static_cast<int64_t>(tab[b]) * a.bs;
  for (int j = 0; j < n; ++j) {
    slot[j] = base + o;
    if (++o == a.bs && j + 1 < n) {  // never read past the last block of the table
      o = 0;
      base = static_cast<int64_t>(tab[++b]) * a.bs;
    }
  }
}

// ---- portable scalar path ---------------------------------------------------------------------
template <int K>
inline float load1(const void* base, int64_t i) {
  if constexpr (K == kF32) return static_cast<const float*>(base)[i];
  if constexpr (K == kF16) return static_cast<float>(static_cast<const c10::Half*>(base)[i]);
  if constexpr (K == kBF16) return static_cast<float>(static_cast<const c10::BFloat16*>(base)[i]);
  if constexpr (K == kI8) return static_cast<float>(static_cast<const int8_t*>(base)[i]);
}

template <int K>
bool job_scalar(const Args& a, const Job& jb, const Job* /*next*/, bool /*warm*/, float* buf) {
  const int64_t D = a.D, G = a.G;
  const int rows = (jb.t1 - jb.t0) * static_cast<int>(G);
  float* acc = buf;
  float* m = acc + rows * D;
  float* l = m + rows;
  float* s = l + rows;
  std::fill(acc, acc + rows * D, 0.f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.f);
  const int32_t* tab = a.table + a.table_off[jb.seq];
  const int64_t start = a.start[jb.seq], nkeys = start + jb.t1, hbase = jb.kvh * a.S;
  int64_t slot[kTile];
  for (int64_t p0 = first_key(a, jb); p0 < nkeys; p0 += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, nkeys - p0));
    slots_of(a, tab, p0, n, slot);
    for (int r = 0; r < rows; ++r) {
      const int64_t t = jb.t0 + r / G, h = jb.kvh * G + r % G;
      const int nr = static_cast<int>(std::min<int64_t>(n, start + t + 1 - p0));
      const int j0 = static_cast<int>(std::max<int64_t>(0, first_key(a, start + t) - p0));
      if (nr <= j0) continue;
      const float* qr = a.q + ((a.row0[jb.seq] + t) * a.H + h) * D;
      float mt = -std::numeric_limits<float>::infinity();
      for (int j = j0; j < nr; ++j) {
        const int64_t off = (hbase + slot[j]) * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * load1<K>(a.k, off + d);
        if constexpr (K == kI8) dot *= a.ks[hbase + slot[j]];
        s[j] = softcap1(a, dot * a.scale);
        mt = std::max(mt, s[j]);
      }
      const float mn = std::max(m[r], mt);
      const float corr = std::exp(m[r] - mn);
      float* ar = acc + r * D;
      l[r] *= corr;
      for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
      for (int j = j0; j < nr; ++j) {
        const float p = std::exp(s[j] - mn);
        l[r] += p;
        float w = p;
        if constexpr (K == kI8) w *= a.vs[hbase + slot[j]];
        const int64_t off = (hbase + slot[j]) * D;
        for (int64_t d = 0; d < D; ++d) ar[d] += w * load1<K>(a.v, off + d);
      }
      m[r] = mn;
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t t = jb.t0 + r / G, h = jb.kvh * G + r % G;
    float* o = a.out + ((a.row0[jb.seq] + t) * a.H + h) * D;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
  }
  return false;
}

constexpr int64_t kItemSize[4] = {4, 2, 2, 1};

// ---- AVX2 + FMA + F16C path -------------------------------------------------------------------
#ifdef FD_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

template <int K>
inline __m256 ld8(const void* base, int64_t i) {
  if constexpr (K == kF32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  if constexpr (K == kF16)
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
  if constexpr (K == kBF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i))),
        16));
  if constexpr (K == kI8)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + i))));
}

// bfloat16 is the top half of a float32, so 16 of them load as 8 lanes of two: a shift gives the
// even elements as floats, a mask the odd ones (no widening shuffle, which competes for one port).
// q and the accumulator are kept in the same even/odd order, and put back in order at the end.
inline void ld16_bf16(const void* base, int64_t i, __m256& even, __m256& odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Puts 16-element chunks of x into (or, with back, out of) the even/odd order of ld16_bf16.
inline void split_order(const float* x, float* y, int64_t D, bool back) {
  for (int64_t c = 0; c < D; c += 16)
    for (int i = 0; i < 8; ++i) {
      if (back)
        y[c + 2 * i] = x[c + i], y[c + 2 * i + 1] = x[c + 8 + i];
      else
        y[c + i] = x[c + 2 * i], y[c + 8 + i] = x[c + 2 * i + 1];
    }
}

// e^x for 8 lanes (Cephes polynomial, ~2 ulp on the range softmax uses: x <= 0).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654475f)), _mm256_set1_ps(88.37626266f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504089f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// c * tanh(x / c) for 8 lanes, as 1 - 2 / (e^(2x/c) + 1) (exp8 clamps, so large |x| gives +-c).
inline __m256 softcap8(__m256 x, float c) {
  const __m256 e = exp8(_mm256_mul_ps(x, _mm256_set1_ps(2.f / c)));
  const __m256 th = _mm256_sub_ps(_mm256_set1_ps(1.f), _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, _mm256_set1_ps(1.f))));
  return _mm256_mul_ps(th, _mm256_set1_ps(c));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Eight dot products q . k_j (j < 8) as one vector: eight accumulators, then a transposing sum.
template <int K, bool SPLIT>
inline __m256 dot8(const float* q, const void* kb, const int64_t* off, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  if constexpr (SPLIT) {
    __m256 e, o;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256 qe = _mm256_loadu_ps(q + d), qo = _mm256_loadu_ps(q + d + 8);
#define FD_DOT(j) ld16_bf16(kb, off[j] + d, e, o), a##j = _mm256_fmadd_ps(qo, o, _mm256_fmadd_ps(qe, e, a##j))
      FD_DOT(0); FD_DOT(1); FD_DOT(2); FD_DOT(3); FD_DOT(4); FD_DOT(5); FD_DOT(6); FD_DOT(7);
#undef FD_DOT
    }
  } else
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, ld8<K>(kb, off[0] + d), a0);
    a1 = _mm256_fmadd_ps(qv, ld8<K>(kb, off[1] + d), a1);
    a2 = _mm256_fmadd_ps(qv, ld8<K>(kb, off[2] + d), a2);
    a3 = _mm256_fmadd_ps(qv, ld8<K>(kb, off[3] + d), a3);
    a4 = _mm256_fmadd_ps(qv, ld8<K>(kb, off[4] + d), a4);
    a5 = _mm256_fmadd_ps(qv, ld8<K>(kb, off[5] + d), a5);
    a6 = _mm256_fmadd_ps(qv, ld8<K>(kb, off[6] + d), a6);
    a7 = _mm256_fmadd_ps(qv, ld8<K>(kb, off[7] + d), a7);
  }
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// int8 keys: q . k_j for 8 keys on integers. q comes quantized to int16 per row (error ~1.5e-5 of
// the row's max |q|, far below int8 K's own 1/254), so 16 values cost one widening of k and one
// vpmaddwd instead of two widenings, two conversions and two FMAs. |q . k| <= D * 127 * 32767 fits
// int32 for D <= 512; attend() sends larger head dims to the scalar path.
inline __m256 dot8_i8(const int16_t* q, const void* kb, const int64_t* off, int64_t D) {
  const int8_t* k = static_cast<const int8_t*>(kb);
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < D; d += 16) {
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + d));
#define FD_DOT(j)                                                     \
  a##j = _mm256_add_epi32(a##j, _mm256_madd_epi16(qv, _mm256_cvtepi8_epi16(_mm_loadu_si128( \
                                                     reinterpret_cast<const __m128i*>(k + off[j] + d)))))
    FD_DOT(0); FD_DOT(1); FD_DOT(2); FD_DOT(3); FD_DOT(4); FD_DOT(5); FD_DOT(6); FD_DOT(7);
#undef FD_DOT
  }
  const __m256i t0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
  const __m256i t1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a4, a5), _mm256_hadd_epi32(a6, a7));
  return _mm256_cvtepi32_ps(
      _mm256_add_epi32(_mm256_permute2x128_si256(t0, t1, 0x20), _mm256_permute2x128_si256(t0, t1, 0x31)));
}

// acc[d0 .. d0 + 8*NC) += sum_j w[j] * v_j[d0 ..], the accumulator held in registers over the tile.
template <int K, int NC, bool SPLIT = false>
inline void vacc(float* acc, const float* w, const void* vb, const int64_t* off, int n, int64_t d0,
                 const char* pk, const int64_t* poff, int pn, int64_t prow) {
  __m256 r[NC];
  for (int c = 0; c < NC; ++c) r[c] = _mm256_loadu_ps(acc + d0 + 8 * c);
  const intptr_t dv = static_cast<const char*>(vb) - pk;
  for (int j = 0; j < n; ++j) {
    if (j < pn) {  // one future key's K and V rows per key summed: prefetches spread over the work
      const char* kr = pk + poff[j] * kItemSize[K];
      for (int64_t c = 0; c < prow; c += 64) _mm_prefetch(kr + c, _MM_HINT_T1), _mm_prefetch(kr + dv + c, _MM_HINT_T1);
    }
    const __m256 wj = _mm256_set1_ps(w[j]);
    const int64_t o = off[j] + d0;
    if constexpr (SPLIT) {
      static_assert(NC % 2 == 0);
      __m256 e, od;
      for (int c = 0; c < NC; c += 2) {
        ld16_bf16(vb, o + 8 * c, e, od);
        r[c] = _mm256_fmadd_ps(wj, e, r[c]);
        r[c + 1] = _mm256_fmadd_ps(wj, od, r[c + 1]);
      }
    } else {
      for (int c = 0; c < NC; ++c) r[c] = _mm256_fmadd_ps(wj, ld8<K>(vb, o + 8 * c), r[c]);
    }
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + d0 + 8 * c, r[c]);
}

template <int K, bool SPLIT>
inline void vacc_all(float* acc, const float* w, const void* vb, const int64_t* off, int n, int64_t D,
                     const char* pk, const int64_t* poff, int pn) {
  const int64_t prow = D * kItemSize[K];
  int64_t d0 = 0;
  if constexpr (SPLIT) {  // D % 16 == 0
    for (; d0 + 64 <= D; d0 += 64, pn = 0) vacc<K, 8, true>(acc, w, vb, off, n, d0, pk, poff, pn, prow);
    switch ((D - d0) / 16) {
      case 1: vacc<K, 2, true>(acc, w, vb, off, n, d0, pk, poff, pn, prow); break;
      case 2: vacc<K, 4, true>(acc, w, vb, off, n, d0, pk, poff, pn, prow); break;
      case 3: vacc<K, 6, true>(acc, w, vb, off, n, d0, pk, poff, pn, prow); break;
      default: break;
    }
    return;
  }
  for (; d0 + 64 <= D; d0 += 64, pn = 0) vacc<K, 8>(acc, w, vb, off, n, d0, pk, poff, pn, prow);
  switch ((D - d0) / 8) {
    case 1: vacc<K, 1>(acc, w, vb, off, n, d0, pk, poff, pn, prow); break;
    case 2: vacc<K, 2>(acc, w, vb, off, n, d0, pk, poff, pn, prow); break;
    case 3: vacc<K, 3>(acc, w, vb, off, n, d0, pk, poff, pn, prow); break;
    case 4: vacc<K, 4>(acc, w, vb, off, n, d0, pk, poff, pn, prow); break;
    case 5: vacc<K, 5>(acc, w, vb, off, n, d0, pk, poff, pn, prow); break;
    case 6: vacc<K, 6>(acc, w, vb, off, n, d0, pk, poff, pn, prow); break;
    case 7: vacc<K, 7>(acc, w, vb, off, n, d0, pk, poff, pn, prow); break;
    default: break;
  }
}

// Asks for rows off[0..n) of a pool at once: a job's first tile, and what a short row (fewer keys
// than the tile ahead) left unrequested. Later tiles go out one key at a time from vacc.
template <int K>
inline void prefetch_rows(const void* base, const int64_t* off, int n, int64_t row_bytes) {
  const char* b = static_cast<const char*>(base);
  for (int j = 0; j < n; ++j) {
    const char* p = b + off[j] * kItemSize[K];
    for (int64_t c = 0; c < row_bytes; c += 64) _mm_prefetch(p + c, _MM_HINT_T1);
  }
}

std::atomic<bool> g_prefetch{true};

// Offsets of keys [p0, p0 + tile) of one job (as many as it has), padded to a multiple of 8 with
// the first row (padding lanes read a valid row, then are masked); returns how many keys.
inline int tile_offsets(const Args& a, const Job& jb, int64_t p0, int tile, int64_t* off, int64_t* slot) {
  const int64_t nkeys = a.start[jb.seq] + jb.t1, hbase = jb.kvh * a.S;
  const int n = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(tile, nkeys - p0)));
  if (n == 0) return 0;
  slots_of(a, a.table + a.table_off[jb.seq], p0, n, slot);
  for (int j = 0; j < n; ++j) off[j] = (hbase + slot[j]) * a.D;
  const int n8 = (n + 7) & ~7;
  for (int j = n; j < n8; ++j) off[j] = off[0];
  return n;
}

// One job; `next` is the job this worker runs after it (null when none). While the last tile is
// summed, next's first tile is prefetched the way later tiles are, so a job no longer starts on a
// burst of misses; returns whether it did (next's `warm`: its first tile is already asked for).
template <int K>
bool job_avx2(const Args& a, const Job& jb, const Job* next, bool warm, float* buf) {
  const int64_t D = a.D, G = a.G;
  constexpr bool SPLIT = K == kBF16;  // attend() sends D % 16 != 0 bfloat16 and int8 to the scalar path
  const int rows = (jb.t1 - jb.t0) * static_cast<int>(G);
  float* acc = buf;
  float* m = acc + rows * D;
  float* l = m + rows;
  float* s = l + rows;  // kTile scores, then weights
  float* qs = s + kTile + 8;  // SPLIT: the rows' queries in even/odd order (int8: see qi)
  if constexpr (SPLIT)
    for (int r = 0; r < rows; ++r) {
      const int64_t t = jb.t0 + r / G, h = jb.kvh * G + r % G;
      split_order(a.q + ((a.row0[jb.seq] + t) * a.H + h) * D, qs + r * D, D, false);
    }
  int16_t* qi = reinterpret_cast<int16_t*>(qs);  // int8: the rows' queries as int16, then scales
  float* qscale = qs + rows * D;
  if constexpr (K == kI8)
    for (int r = 0; r < rows; ++r) {
      const int64_t t = jb.t0 + r / G, h = jb.kvh * G + r % G;
      const float* qr = a.q + ((a.row0[jb.seq] + t) * a.H + h) * D;
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(qr[d]));
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      for (int64_t d = 0; d < D; ++d) qi[r * D + d] = static_cast<int16_t>(std::lrintf(qr[d] * inv));
      qscale[r] = amax / 32767.f;
    }
  std::fill(acc, acc + rows * D, 0.f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.f);
  const int64_t start = a.start[jb.seq], nkeys = start + jb.t1, hbase = jb.kvh * a.S;
  constexpr int kRing = kPrefetchTiles + 1;
  constexpr int T = tile_of(K);
  int64_t slots[kRing][kTile], offs[kRing][kTile];
  int cnt[kRing];
  alignas(32) float ksc[kTile], vsc[kTile];
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t row_bytes = D * kItemSize[K];
  const bool pf = g_prefetch.load(std::memory_order_relaxed);
  bool next_warm = false;
  // Software prefetch, kPrefetchTiles tiles ahead: the first tiles are asked for at once (unless
  // the previous job did), later ones one key's K and V rows per key summed (vacc), so the requests
  // trickle out with the work instead of in bursts that fill the line-fill buffers (bursts were
  // 0.9-1.1x slower here).
  const int64_t k0 = first_key(a, jb);
  for (int i = 0; i < kPrefetchTiles; ++i) {
    cnt[i] = tile_offsets(a, jb, k0 + i * T, T, offs[i], slots[i]);
    if (pf && !(warm && i == 0)) {
      prefetch_rows<K>(a.k, offs[i], cnt[i], row_bytes);
      prefetch_rows<K>(a.v, offs[i], cnt[i], row_bytes);
    }
  }
  for (int64_t p0 = k0, ti = 0; p0 < nkeys; p0 += T, ti = (ti + 1) % kRing) {
    const int64_t* off = offs[ti];
    const int n = cnt[ti];
    const int ahead = (ti + kPrefetchTiles) % kRing;
    cnt[ahead] = tile_offsets(a, jb, p0 + kPrefetchTiles * T, T, offs[ahead], slots[ahead]);
    if (cnt[ahead] == 0 && next != nullptr && pf && kPrefetchTiles == 1) {  // the last tile
      cnt[ahead] = tile_offsets(a, *next, first_key(a, *next), T, offs[ahead], slots[ahead]);
      next_warm = true;
    }
    int pn = pf ? cnt[ahead] : 0;
    if constexpr (K == kI8) {
      const int n8 = (n + 7) & ~7;
      const int64_t* slot = slots[ti];
      for (int j = 0; j < n; ++j) ksc[j] = a.ks[hbase + slot[j]], vsc[j] = a.vs[hbase + slot[j]];
      for (int j = n; j < n8; ++j) ksc[j] = 0.f, vsc[j] = 0.f;
    }
    for (int r = 0; r < rows; ++r) {
      const int64_t t = jb.t0 + r / G, h = jb.kvh * G + r % G;
      const int nr = static_cast<int>(std::min<int64_t>(n, start + t + 1 - p0));
      const int j0 = static_cast<int>(std::max<int64_t>(0, first_key(a, start + t) - p0));
      if (nr <= j0) continue;
      const float* qr = SPLIT ? qs + r * D : a.q + ((a.row0[jb.seq] + t) * a.H + h) * D;
      const int g8 = (nr + 7) / 8, g0 = j0 / 8;  // key groups of 8 this row reads: [g0, g8)
      const __m256 lim = _mm256_set1_ps(static_cast<float>(nr)), lo = _mm256_set1_ps(static_cast<float>(j0));
      __m256 mt = ninf;
      for (int g = g0; g < g8; ++g) {
        __m256 sc;
        if constexpr (K == kI8)
          sc = _mm256_mul_ps(_mm256_mul_ps(dot8_i8(qi + r * D, a.k, off + 8 * g, D), _mm256_set1_ps(a.scale * qscale[r])),
                             _mm256_load_ps(ksc + 8 * g));
        else
          sc = _mm256_mul_ps(dot8<K, SPLIT>(qr, a.k, off + 8 * g, D), _mm256_set1_ps(a.scale));
        if (a.softcap > 0.f) sc = softcap8(sc, a.softcap);
        const __m256 idx = _mm256_add_ps(iota, _mm256_set1_ps(static_cast<float>(8 * g)));
        sc = _mm256_blendv_ps(
            ninf, sc, _mm256_and_ps(_mm256_cmp_ps(idx, lim, _CMP_LT_OQ), _mm256_cmp_ps(idx, lo, _CMP_GE_OQ)));
        _mm256_storeu_ps(s + 8 * g, sc);
        mt = _mm256_max_ps(mt, sc);
      }
      const float mn = std::max(m[r], hmax(mt));
      float* ar = acc + r * D;
      if (m[r] != mn) {
        const float corr = std::exp(m[r] - mn);
        l[r] *= corr;
        const __m256 cv = _mm256_set1_ps(corr);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(ar + d, _mm256_mul_ps(cv, _mm256_loadu_ps(ar + d)));
      }
      const __m256 mv = _mm256_set1_ps(mn);
      __m256 lsum = _mm256_setzero_ps();
      for (int g = g0; g < g8; ++g) {
        const __m256 sc = _mm256_loadu_ps(s + 8 * g);
        // masked lanes hold -inf: exp8 clamps to ~1e-38, so zero them exactly
        __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(sc, mv)), _mm256_cmp_ps(sc, ninf, _CMP_NEQ_OQ));
        lsum = _mm256_add_ps(lsum, p);
        if constexpr (K == kI8) p = _mm256_mul_ps(p, _mm256_load_ps(vsc + 8 * g));
        _mm256_storeu_ps(s + 8 * g, p);
      }
      l[r] += hsum(lsum);
      m[r] = mn;
      const int nsum = nr - 8 * g0;
      vacc_all<K, SPLIT>(ar, s + 8 * g0, a.v, off + 8 * g0, nsum, D, static_cast<const char*>(a.k), offs[ahead], pn);
      if (nsum < pn) {  // a short row: the rest of the tile ahead goes out here
        prefetch_rows<K>(a.k, offs[ahead] + nsum, pn - nsum, row_bytes);
        prefetch_rows<K>(a.v, offs[ahead] + nsum, pn - nsum, row_bytes);
      }
      pn = 0;
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t t = jb.t0 + r / G, h = jb.kvh * G + r % G;
    float* o = a.out + ((a.row0[jb.seq] + t) * a.H + h) * D;
    const __m256 inv = _mm256_set1_ps(1.f / l[r]);
    float* ar = acc + r * D;
    float* dst = SPLIT ? ar : o;  // bfloat16: scaled in place, then put back in order into o
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(inv, _mm256_loadu_ps(ar + d)));
    if constexpr (SPLIT) split_order(ar, o, D, true);
  }
  return next_warm;
}

// Sum of n floats with four independent accumulators: the memory-bandwidth yardstick's inner loop.
float stream_sum_avx2(const float* x, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_add_ps(s0, _mm256_loadu_ps(x + i));
    s1 = _mm256_add_ps(s1, _mm256_loadu_ps(x + i + 8));
    s2 = _mm256_add_ps(s2, _mm256_loadu_ps(x + i + 16));
    s3 = _mm256_add_ps(s3, _mm256_loadu_ps(x + i + 24));
  }
  float r = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  for (; i < n; ++i) r += x[i];
  return r;
}

#pragma GCC pop_options
#endif  // FD_AVX2

float stream_sum_scalar(const float* x, int64_t n) {
  float r0 = 0.f, r1 = 0.f, r2 = 0.f, r3 = 0.f;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) r0 += x[i], r1 += x[i + 1], r2 += x[i + 2], r3 += x[i + 3];
  for (; i < n; ++i) r0 += x[i];
  return r0 + r1 + r2 + r3;
}

// ---- dispatch ---------------------------------------------------------------------------------
bool cpu_has_avx2() {
#ifdef FD_AVX2
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

std::atomic<bool> g_avx2{cpu_has_avx2()};

std::string isa() { return g_avx2.load() ? "avx2" : "scalar"; }

void set_prefetch(bool on) { g_prefetch = on; }

void set_isa(const std::string& name) {
  if (name == "avx2") {
    TORCH_CHECK(cpu_has_avx2(), "this CPU lacks AVX2/FMA/F16C");
    g_avx2 = true;
  } else if (name == "scalar") {
    g_avx2 = false;
  } else {
    TORCH_CHECK(false, "isa must be 'avx2' or 'scalar', got '", name, "'");
  }
}

using JobFn = bool (*)(const Args&, const Job&, const Job*, bool, float*);

template <int K>
JobFn job_fn(bool vec) {
#ifdef FD_AVX2
  if (vec) return job_avx2<K>;
#endif
  (void)vec;
  return job_scalar<K>;
}

Kind kind_of(const at::Tensor& pool) {
  switch (pool.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    case at::kChar: return kI8;
    default: TORCH_CHECK(false, "KV pool dtype must be float32, float16, bfloat16 or int8, got ", pool.scalar_type());
  }
}

// Writes rows [r0, r1) of new k (or v) [T, KVH, D] into the pool at their slots (quantizing for int8).
void append_rows(const Args& a, Kind kind, const float* src, void* pool, float* scales, int64_t KVH,
                 int64_t B, int64_t r0, int64_t r1) {
  const int64_t D = a.D;
  int64_t b = std::upper_bound(a.row0, a.row0 + B + 1, r0) - a.row0 - 1;
  for (int64_t r = r0; r < r1; ++r) {
    while (r >= a.row0[b + 1]) ++b;
    const int64_t pos = a.start[b] + (r - a.row0[b]);
    const int32_t* tab = a.table + a.table_off[b];
    const int64_t slot = static_cast<int64_t>(tab[pos / a.bs]) * a.bs + pos % a.bs;
    for (int64_t h = 0; h < KVH; ++h) {
      const float* x = src + (r * KVH + h) * D;
      const int64_t dst = (h * a.S + slot) * D;
      switch (kind) {
        case kF32: std::memcpy(static_cast<float*>(pool) + dst, x, D * sizeof(float)); break;
        case kF16: {
          auto* p = static_cast<c10::Half*>(pool) + dst;
          for (int64_t d = 0; d < D; ++d) p[d] = c10::Half(x[d]);
          break;
        }
        case kBF16: {
          auto* p = static_cast<c10::BFloat16*>(pool) + dst;
          for (int64_t d = 0; d < D; ++d) p[d] = c10::BFloat16(x[d]);
          break;
        }
        case kI8: {
          float amax = 0.f;
          for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
          const float sc = amax / 127.f;
          auto* p = static_cast<int8_t*>(pool) + dst;
          for (int64_t d = 0; d < D; ++d) {
            const float qv = sc > 0.f ? std::nearbyint(x[d] / sc) : 0.f;
            p[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, qv)));
          }
          scales[h * a.S + slot] = sc;
          break;
        }
      }
    }
  }
}

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

void check_i64(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 1 &&
                  t.size(0) == n,
              name, " must be a contiguous int64 CPU tensor of ", n, " elements");
}

// q [T, H, D], k/v [T, KVH, D] float32; pools [KVH, S, D] of one layer; scales [KVH, S] (int8 only);
// table int32 (concatenated block tables), table_off [B+1], start [B], ntok [B] int64.
// window: keys a query sees (0: all); softcap: logit soft-cap (0: none). Returns o [T, H * D] float32.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor kpool,
                  at::Tensor vpool, const c10::optional<at::Tensor>& kscale_opt,
                  const c10::optional<at::Tensor>& vscale_opt, const at::Tensor& table,
                  const at::Tensor& table_off, const at::Tensor& start, const at::Tensor& ntok,
                  int64_t block_size, double scale, int64_t window, double softcap) {
  check_f32(q, "q");
  check_f32(k, "k");
  check_f32(v, "v");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-d");
  TORCH_CHECK(kpool.dim() == 3 && kpool.is_contiguous() && vpool.is_contiguous() &&
                  kpool.sizes() == vpool.sizes() && kpool.scalar_type() == vpool.scalar_type(),
              "pools must be contiguous [KVH, S, D] of one dtype");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = kpool.size(0), S = kpool.size(1);
  TORCH_CHECK(kpool.size(2) == D && k.size(0) == T && k.size(1) == KVH && k.size(2) == D &&
                  v.sizes() == k.sizes(),
              "k/v must be [T, KVH, D] matching q and the pool");
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_size >= 1 && S % block_size == 0, "bad block size");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0");
  const Kind kind = kind_of(kpool);
  at::Tensor kscale, vscale;
  if (kind == kI8) {
    TORCH_CHECK(kscale_opt.has_value() && vscale_opt.has_value(), "int8 pools need scales");
    kscale = *kscale_opt;
    vscale = *vscale_opt;
    check_f32(kscale, "kscale");
    check_f32(vscale, "vscale");
    TORCH_CHECK(kscale.dim() == 2 && kscale.size(0) == KVH && kscale.size(1) == S &&
                    vscale.sizes() == kscale.sizes(),
                "scales must be [KVH, S]");
  }
  const int64_t B = start.numel();
  check_i64(start, "start", B);
  check_i64(ntok, "ntok", B);
  check_i64(table_off, "table_off", B + 1);
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kInt && table.is_contiguous() &&
                  table.dim() == 1,
              "table must be a contiguous int32 CPU tensor");
  const int64_t nblocks = S / block_size;
  const int32_t* tab = table.data_ptr<int32_t>();
  const int64_t* toff = table_off.data_ptr<int64_t>();
  const int64_t* st = start.data_ptr<int64_t>();
  const int64_t* nt = ntok.data_ptr<int64_t>();
  std::vector<int64_t> row0(B + 1, 0);
  TORCH_CHECK(toff[0] == 0 && toff[B] == table.numel(), "table_off does not cover the table");
  // -1 marks a block a windowed layer gave back: allowed only where no query of the call looks
  for (int64_t i = 0; i < table.numel(); ++i)
    TORCH_CHECK(tab[i] >= -1 && tab[i] < nblocks, "block id ", tab[i], " outside the pool");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(nt[b] >= 1 && st[b] >= 0, "sequence ", b, ": needs >= 1 new token at a position >= 0");
    TORCH_CHECK(toff[b + 1] >= toff[b] && st[b] + nt[b] <= (toff[b + 1] - toff[b]) * block_size,
                "sequence ", b, ": tokens beyond its block table");
    const int64_t lo = (window > 0 ? std::max<int64_t>(0, st[b] - window + 1) : 0) / block_size;
    for (int64_t i = toff[b] + lo; i < toff[b] + (st[b] + nt[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tab[i] >= 0, "sequence ", b, ": block ", i - toff[b], " is gone but inside the window");
    row0[b + 1] = row0[b] + nt[b];
  }
  TORCH_CHECK(row0[B] == T, "ntok sums to ", row0[B], " but q has ", T, " rows");

  at::Tensor out = at::empty({T, H * D}, q.options());
  Args a{q.data_ptr<float>(), out.data_ptr<float>(), kpool.data_ptr(), vpool.data_ptr(),
         kind == kI8 ? kscale.data_ptr<float>() : nullptr, kind == kI8 ? vscale.data_ptr<float>() : nullptr,
         tab, toff, st, row0.data(), S, D, H, H / KVH, block_size, static_cast<float>(scale),
         window, static_cast<float>(softcap)};

  // 1. append the new k, v (rows in parallel: a prefill chunk brings thousands)
  at::parallel_for(0, T, 64, [&](int64_t r0, int64_t r1) {
    append_rows(a, kind, k.data_ptr<float>(), kpool.data_ptr(), kind == kI8 ? kscale.data_ptr<float>() : nullptr,
                KVH, B, r0, r1);
    append_rows(a, kind, v.data_ptr<float>(), vpool.data_ptr(), kind == kI8 ? vscale.data_ptr<float>() : nullptr,
                KVH, B, r0, r1);
  });

  // 2. jobs: (sequence, KV head, chunk of query tokens), longest first
  std::vector<Job> jobs;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t0 = 0; t0 < nt[b]; t0 += kQChunk) {
      const int64_t t1 = std::min<int64_t>(nt[b], t0 + kQChunk);
      const int64_t keys = st[b] + t1 - first_key(a, st[b] + t0);
      const int64_t cost = keys * (t1 - t0) + 64;
      for (int64_t h = 0; h < KVH; ++h)
        jobs.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h), static_cast<int32_t>(t0),
                        static_cast<int32_t>(t1), cost});
    }
  std::stable_sort(jobs.begin(), jobs.end(), [](const Job& x, const Job& y) { return x.cost > y.cost; });

  const bool vec = g_avx2.load() && D % (kind == kBF16 || kind == kI8 ? 16 : 8) == 0 && (kind != kI8 || D <= 512);
  JobFn fn = nullptr;
  switch (kind) {
    case kF32: fn = job_fn<kF32>(vec); break;
    case kF16: fn = job_fn<kF16>(vec); break;
    case kBF16: fn = job_fn<kBF16>(vec); break;
    case kI8: fn = job_fn<kI8>(vec); break;
  }
  const int64_t scratch = kQChunk * (H / KVH) * (2 * D + 3) + kTile + 8;
  std::atomic<int64_t> next{0};
  const int64_t njobs = static_cast<int64_t>(jobs.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), njobs);
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> buf(scratch);
#ifdef FD_AVX2
    // Flush denormals to zero while attending: weights of keys far below the row's max reach the
    // denormal range, and each multiply by one costs a microcode assist (~100 cycles).
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
#endif
    for (int64_t w = w0; w < w1; ++w) {
      // Each worker claims its next job before running the current one, so the current job can
      // prefetch the next one's first tile.
      bool warm = false;
      for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < njobs;) {
        const int64_t j = next.fetch_add(1, std::memory_order_relaxed);
        warm = fn(a, jobs[i], j < njobs ? &jobs[j] : nullptr, warm, buf.data());
        i = j;
      }
    }
#ifdef FD_AVX2
    _mm_setcsr(csr);
#endif
  });
  return out;
}

// Reads x once with the same threads as attend (torch's intra-op pool): the bandwidth yardstick.
double stream_read(const at::Tensor& x) {
  check_f32(x, "x");
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel(), chunk = 1 << 16;
  const int64_t nchunks = (n + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nchunks));
  std::vector<double> part(workers, 0.0);
  const bool vec = g_avx2.load();
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w)
      for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < nchunks;) {
        const int64_t len = std::min(chunk, n - c * chunk);
#ifdef FD_AVX2
        part[w] += vec ? stream_sum_avx2(p + c * chunk, len) : stream_sum_scalar(p + c * chunk, len);
#else
        (void)vec;
        part[w] += stream_sum_scalar(p + c * chunk, len);
#endif
      }
  });
  double s = 0.0;
  for (double v : part) s += v;
  return s;
}

}  // namespace fd

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FastDecode shard kernel: fused decode/chunked-prefill attention over a block-table KV pool";
  m.def("attend", &fd::attend, "append new k, v and attend every query token (see attention.cpp)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("kpool"), py::arg("vpool"), py::arg("kscale"),
        py::arg("vscale"), py::arg("table"), py::arg("table_off"), py::arg("start"), py::arg("ntok"),
        py::arg("block_size"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("stream_read", &fd::stream_read, "sum a float32 tensor with attend's threads (bandwidth yardstick)");
  m.def("isa", &fd::isa, "vector path in use: 'avx2' or 'scalar'");
  m.def("set_isa", &fd::set_isa, "force 'avx2' or 'scalar' (tests)");
  m.def("set_prefetch", &fd::set_prefetch, "software prefetch of the next tile on/off (A/B measurements)");
}
