// Fused decode/chunked-prefill attention over a block-table KV pool: the shard's R-part kernel.
//
// One call appends every new k, v into the pool and attends every query token of every sequence,
// whatever the lengths. Keys and values are read in place through each sequence's block table
// (slot = table[pos / block_size] * block_size + pos % block_size), once per KV head for all the
// query heads that share it (GQA/MQA), with an online softmax in fp32. Storage types: float32,
// float16 and bfloat16 (widened in registers), and int8 and float8 e4m3 with one fp32 scale per
// (token, KV head).
//
// Work is split over (sequence, KV head, chunk of <= kQChunk query tokens) jobs, longest first,
// so a job's K and V are read once for all its query rows: the query heads of its KV head at each
// of its new positions (a decode's one, a speculative verification's k + 1, a prefill chunk's),
// each seeing the cache and the new positions up to its own. Jobs are taken from an atomic
// counter by torch's intra-op threads (at::parallel_for, so the shard's torch.set_num_threads
// applies). Each vector job walks its keys in tiles (tile_of): scores for the whole tile first (8
// keys per dot pass), one vectorized exp, then the weighted sum of V with the accumulator in
// registers (bfloat16 rows are read 16 at a time as even and odd halves: two bit operations
// instead of a widening shuffle per 8 values), one query row after another over the tile while it
// is in L1 (so its arithmetic grows with the rows: 4 positions at GQA 4 took 2.5-2.7x one's time);
// while it sums V it prefetches the next tile's K and V rows, one key per key summed, into L2 (a
// tile of fp32 K and V is 16 KiB at D=64, so a tile ahead in L1 evicted the tile being read: T1 was
// 0.88x the time of T0 on Zen 4 and within noise on Zen 3). Denormals flush to zero while a job
// runs.
//
// Paths (isa levels, each needing the CPU features of the ones below it): scalar, avx2
// (AVX2+FMA+F16C), avx512 (F/BW/VL/DQ: 512-bit loads, FMAs and widenings), avx512_vnni (int8 keys
// dotted with vpdpwssd), avx512_bf16 (bf16 keys dotted with vdpbf16ps against q split in three bf16
// parts), amx (AMX-TILE + AMX-BF16, granted by the OS: bf16, fp16, int8 and fp8 rows widened to
// bf16 exactly, keys scored and values summed for up to 16 query rows per tile multiply,
// amx_job.inc; fp32 as avx512_bf16). The vector job (vec_job.inc) is compiled once per path under
// that path's target pragma, so no -march is needed; the highest level the CPU has is picked at
// load time from CPUID, and each dtype then uses the highest path at or below it that measured
// faster than the one below (kKeep, figures in docs/kernel.md; on amx only jobs with enough query
// rows, amx_min_rows). set_isa forces a level (tests, A/B benches).
//
// Two per-layer options (Mistral, Gemma 2/3): a sliding window W (a query at position p sees keys
// p - W + 1 .. p; first_key() is the one place that lower bound is computed, and a job starts its
// key walk there) and a logit soft-cap c (score = c * tanh(score / c), applied where each path
// scores, before the mask and the softmax).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
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
#define FD_X86 1
#include <immintrin.h>
#endif
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace fd {

enum Kind : int { kF32 = 0, kF16 = 1, kBF16 = 2, kI8 = 3, kF8 = 4 };
constexpr int kKinds = 5;
// int8 and float8 rows carry one fp32 scale per (token, KV head): x ~= code * scale.
constexpr bool scaled(int kind) { return kind == kI8 || kind == kF8; }
// The dtypes the amx level's job reads: rows that widen to bfloat16 exactly, in one part (bf16;
// int8 codes, |c| <= 127; float8 codes, 3 mantissa bits, as value * 2^-120) or two (float16: 11
// bits = 8 + 3). float32 (three parts, 9 products to keep its precision) stays on the vector path.
constexpr bool amx_kind(int kind) { return kind == kBF16 || kind == kF16 || kind == kI8 || kind == kF8; }
constexpr int parts_of(int kind) { return kind == kF16 ? 2 : 1; }
constexpr float kF8Max = 448.f;  // e4m3's largest finite value: scale = absmax / 448
// e4m3's smallest normal. Codes are stored without subnormals (below it a value rounds to 0 or
// +-2^-6, at most 2^-7 * scale off, as fastdecode/kv/memory.py's quantize_float8): the vector paths
// widen a code to fp32 bits by shifts, where a subnormal code becomes an fp32 denormal, which the
// kernel's denormals-are-zero mode reads as 0 (and without that mode each costs a ~30x assist).
constexpr float kF8MinNormal = 0x1p-6f;

constexpr int kTile = 32;    // keys scored together before one softmax update (at most)
// The vector path's tile per storage type: half types walk 16 keys a tile (0.88x bf16's and 0.81x
// fp16's time against 32 on Zen 4, A/B medians of 4-5), float32 and int8 32 (16 was slower).
constexpr int tile_of(int kind) { return kind == kF16 || kind == kBF16 ? 16 : kTile; }
// Tiles ahead whose K and V rows are prefetched (2-6 measured no faster on the Xeon of 2026-12-03,
// nor 2 on Zen 4).
constexpr int kPrefetchTiles = 1;
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
  if constexpr (K == kF8) return static_cast<float>(static_cast<const c10::Float8_e4m3fn*>(base)[i]);
}

template <int K>
int job_scalar(const Args& a, const Job& jb, const Job* /*next*/, int /*warm*/, float* buf) {
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
        if constexpr (scaled(K)) dot *= a.ks[hbase + slot[j]];
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
        if constexpr (scaled(K)) w *= a.vs[hbase + slot[j]];
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
  return 0;
}

constexpr int64_t kItemSize[kKinds] = {4, 2, 2, 1, 1};

std::atomic<bool> g_prefetch{true};

// Walks one job's keys in order through its block table, a tile at a time: the element offset of
// each key's row in a pool ((hbase + slot) * D) and its row index (hbase + slot, the scales'
// index), with no division per key (one when the walk starts) and one table read per block
// (tile_offsets, before: a 64-bit division per tile and 64-bit vector multiplies per key, 16% of
// bf16's time with the rows in L2), padded to a multiple of 8 with the tile's first row (padding lanes read a valid row,
// then are masked). The table is read only for blocks holding keys the walk gives out, so never
// past the last one.
struct KeyWalk {
  const int32_t* tab = nullptr;
  int64_t pos = 0, end = 0;  // next key, one past the last
  int64_t b = 0, o = 0;      // its block index and offset in the block
  int64_t row = -1;          // hbase + slot of the block's first key (-1: not read yet)
  int64_t hbase = 0;

  void start(const Args& a, const Job& jb, int64_t p0) {
    tab = a.table + a.table_off[jb.seq];
    pos = p0;
    end = a.start[jb.seq] + jb.t1;
    b = p0 / a.bs;
    o = p0 % a.bs;
    row = -1;
    hbase = jb.kvh * a.S;
  }

  // The next min(tile, keys left) keys' offsets and rows; returns how many.
  int take(const Args& a, int tile, int64_t* off, int64_t* rows) {
    const int n = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(tile, end - pos)));
    if (n == 0) return 0;
    const int64_t bs = a.bs, D = a.D;
    if (row < 0) row = hbase + static_cast<int64_t>(tab[b]) * bs;
    for (int j = 0; j < n;) {
      if (o == bs) {  // the next block (a key follows, so the table holds it)
        o = 0;
        row = hbase + static_cast<int64_t>(tab[++b]) * bs;
      }
      const int seg = static_cast<int>(std::min<int64_t>(n - j, bs - o));  // keys left in this block
      const int64_t r0 = row + o;
      int64_t of = r0 * D;
      for (int i = 0; i < seg; ++i, of += D) rows[j + i] = r0 + i, off[j + i] = of;
      j += seg;
      o += seg;
    }
    pos += n;
    const int n8 = (n + 7) & ~7;
    for (int j = n; j < n8; ++j) off[j] = off[0], rows[j] = rows[0];
    return n;
  }
};

// ---- AVX2 + FMA + F16C path (v2) ----------------------------------------------------------------
#ifdef FD_X86
namespace v2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// float8 e4m3 codes sign-extended to 32 bits -> the fp32 bits of value * 2^-120: shifted left 20,
// the 7 magnitude bits land in the exponent's low 4 bits and the mantissa's top 3 and a copy of the
// sign in bit 31; the mask clears the other copies. Two integer operations and no conversion
// (before: to float16 bits and vcvtph2ps, 1.13x the time with the rows in cache). e4m3's normals
// become fp32 normals (its smallest, 2^-6, lands on fp32's, 2^-126); its subnormals would become
// fp32 denormals, which the kernel's denormals-are-zero mode reads as 0, so the store keeps none
// (kF8MinNormal). The 2^120 rides on q's factor and the scales (scale_q_f8, kF8UnitV, kF8Out).
inline __m256i f8_to_f32_bits(__m256i sext32) {
  return _mm256_and_si256(_mm256_slli_epi32(sext32, 20), _mm256_set1_epi32(static_cast<int>(0x87F00000u)));
}

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
  if constexpr (K == kF8) {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + i));
    return _mm256_castsi256_ps(f8_to_f32_bits(_mm256_cvtepi8_epi32(c)));
  }
}

// bfloat16 is the top half of a float32, so 16 of them load as 8 lanes of two: a shift gives the
// even elements as floats, a mask the odd ones (no widening shuffle, which competes for one port).
// q and the accumulator are kept in the same even/odd order, and put back in order at the end.
inline void ld16_bf16(const void* base, int64_t i, __m256& even, __m256& odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Puts C-element chunks of x into (or, with back, out of) the even/odd order of a C-element
// bfloat16 load (C = 16 on 256-bit registers, 32 on 512-bit ones).
template <int C>
inline void split_order(const float* x, float* y, int64_t D, bool back) {
  for (int64_t c = 0; c < D; c += C)
    for (int i = 0; i < C / 2; ++i) {
      if (back)
        y[c + 2 * i] = x[c + i], y[c + 2 * i + 1] = x[c + C / 2 + i];
      else
        y[c + i] = x[c + 2 * i], y[c + C / 2 + i] = x[c + 2 * i + 1];
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

// The sums of eight accumulators as one vector (lane j: the sum of a_j): a transposing sum.
inline __m256 tree8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

inline __m256i tree8i(__m256i a0, __m256i a1, __m256i a2, __m256i a3, __m256i a4, __m256i a5, __m256i a6,
                      __m256i a7) {
  const __m256i t0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
  const __m256i t1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a4, a5), _mm256_hadd_epi32(a6, a7));
  return _mm256_add_epi32(_mm256_permute2x128_si256(t0, t1, 0x20), _mm256_permute2x128_si256(t0, t1, 0x31));
}

// int8 keys meet q quantized to int16 per row (error ~1.5e-5 of the row's max |q|, far below int8
// K's own 1/254): 16 values cost one widening of k and one vpmaddwd instead of two widenings, two
// conversions and two FMAs. |q . k| <= D * 127 * 32767 fits int32 for D <= 512; attend() sends
// larger head dims to the scalar path. Returns the scale of the row's int16 codes.
inline float quantize_q16(const float* q, int16_t* qi, int64_t D) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(q[d]));
  const float inv = amax > 0.f ? 32767.f / amax : 0.f;
  for (int64_t d = 0; d < D; ++d) qi[d] = static_cast<int16_t>(std::lrintf(q[d] * inv));
  return amax / 32767.f;
}

// float8 keys widened by f8_to_f32_bits carry 2^-120: q is scaled by a power of two (exact) so
// its largest element is ~2^64, which keeps every product q_d * k_d and their sums normal in fp32
// (the kernel flushes denormals); the returned factor undoes both.
inline float scale_q_f8(const float* q, float* dst, int64_t D) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(q[d]));
  // at least -7: the returned 2^(120 - e) must stay finite (|q| up to fp32's largest)
  const int e = amax > 0.f && std::isfinite(amax) ? std::max(-7, 64 - std::ilogb(amax)) : 0;
  for (int64_t d = 0; d < D; ++d) dst[d] = std::ldexp(q[d], e);
  return std::ldexp(1.f, 120 - e);
}

// The 2^120 that float8 rows widened by f8_to_f32_bits lack: the keys' goes into q's factor
// (scale_q_f8, so the K scale is taken as is), the values' is split between their weights (2^64,
// which keeps the accumulator far from fp32's denormals) and the output (2^56).
constexpr float kF8UnitK = 1.f;
constexpr float kF8UnitV = 0x1p64f;
constexpr float kF8Out = 0x1p56f;

// ---- this path's tile scoring: prep_q once per query row, score8 per 8 keys ----
constexpr int kSplitChunk = 16;

// Writes the row's query in the form score8 reads (<= 2D floats); returns the factor its dot
// products carry (1 but for int8's int16 codes).
template <int K>
inline float prep_q(const float* q, float* dst, int64_t D) {
  if constexpr (K == kI8) return quantize_q16(q, reinterpret_cast<int16_t*>(dst), D);
  if constexpr (K == kF8) return scale_q_f8(q, dst, D);
  if constexpr (K == kBF16)
    split_order<kSplitChunk>(q, dst, D, false);
  else
    std::memcpy(dst, q, D * sizeof(float));
  return 1.f;
}

// Eight raw dot products q . k_j (j < 8) as one vector: eight accumulators, then a transposing sum.
template <int K>
inline __m256 score8(const float* q, const void* kb, const int64_t* off, int64_t D) {
  if constexpr (K == kI8) {
    const int8_t* k = static_cast<const int8_t*>(kb);
    const int16_t* qi = reinterpret_cast<const int16_t*>(q);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qi + d));
#define FD_DOT(j)                                                     \
  a##j = _mm256_add_epi32(a##j, _mm256_madd_epi16(qv, _mm256_cvtepi8_epi16(_mm_loadu_si128( \
                                                     reinterpret_cast<const __m128i*>(k + off[j] + d)))))
      FD_DOT(0); FD_DOT(1); FD_DOT(2); FD_DOT(3); FD_DOT(4); FD_DOT(5); FD_DOT(6); FD_DOT(7);
#undef FD_DOT
    }
    return _mm256_cvtepi32_ps(tree8i(a0, a1, a2, a3, a4, a5, a6, a7));
  } else {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    if constexpr (K == kBF16) {
      __m256 e, o;
      for (int64_t d = 0; d < D; d += 16) {
        const __m256 qe = _mm256_loadu_ps(q + d), qo = _mm256_loadu_ps(q + d + 8);
#define FD_DOT(j) ld16_bf16(kb, off[j] + d, e, o), a##j = _mm256_fmadd_ps(qo, o, _mm256_fmadd_ps(qe, e, a##j))
        FD_DOT(0); FD_DOT(1); FD_DOT(2); FD_DOT(3); FD_DOT(4); FD_DOT(5); FD_DOT(6); FD_DOT(7);
#undef FD_DOT
      }
    } else {
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
    }
    return tree8(a0, a1, a2, a3, a4, a5, a6, a7);
  }
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

#include "vec_job.inc"

// Sum of n floats with four independent accumulators: the memory-bandwidth yardstick's inner loop.
float stream_sum(const float* x, int64_t n) {
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
}  // namespace v2

// ---- AVX-512 paths (v5: F/BW/VL/DQ; v5n: + VNNI; v5b: + BF16) ---------------------------------
// 512-bit loads, widenings and FMAs for the dot products and the V sum; the per-tile softmax
// stays on 8 lanes (v2's helpers, inlined: their target is a subset of these).
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_* (a known
// false positive); off for these paths only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace v5 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
using v2::exp8;
using v2::hmax;
using v2::hsum;
using v2::softcap8;
using v2::prefetch_rows;
using v2::quantize_q16;
using v2::scale_q_f8;
using v2::kF8UnitK;
using v2::kF8UnitV;
using v2::kF8Out;
using v2::split_order;
using v2::tree8;
using v2::tree8i;

template <int K>
inline __m512 ld16(const void* base, int64_t i) {
  if constexpr (K == kF32) return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  if constexpr (K == kF16)
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i)));
  if constexpr (K == kI8)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + i))));
  static_assert(K != kBF16 && K != kF8, "bfloat16 and float8 loads go through ld32_bf16 and ld32_f8");
}

// 32 bfloat16 as 16 lanes of two: even elements by a shift, odd ones by a mask (as v2::ld16_bf16).
inline void ld32_bf16(const void* base, int64_t i, __m512& even, __m512& odd) {
  const __m512i x = _mm512_loadu_si512(static_cast<const uint16_t*>(base) + i);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 32 float8 codes as two 16-lane fp32 vectors (v2::f8_to_f32_bits on 512-bit registers).
inline void ld32_f8(const void* base, int64_t i, __m512& lo, __m512& hi) {
  const int8_t* c = static_cast<const int8_t*>(base) + i;
  const __m512i m = _mm512_set1_epi32(static_cast<int>(0x87F00000u));
  lo = _mm512_castsi512_ps(_mm512_and_si512(
      _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))), 20), m));
  hi = _mm512_castsi512_ps(_mm512_and_si512(
      _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16))), 20), m));
}

inline __m256 half_sum(__m512 x) {
  return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
}
inline __m256i half_sum(__m512i x) {
  return _mm256_add_epi32(_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64(x, 1));
}
inline __m256 tree8(__m512 a0, __m512 a1, __m512 a2, __m512 a3, __m512 a4, __m512 a5, __m512 a6, __m512 a7) {
  return tree8(half_sum(a0), half_sum(a1), half_sum(a2), half_sum(a3), half_sum(a4), half_sum(a5), half_sum(a6),
               half_sum(a7));
}
inline __m256 tree8(__m512i a0, __m512i a1, __m512i a2, __m512i a3, __m512i a4, __m512i a5, __m512i a6,
                    __m512i a7) {
  return _mm256_cvtepi32_ps(tree8i(half_sum(a0), half_sum(a1), half_sum(a2), half_sum(a3), half_sum(a4),
                                   half_sum(a5), half_sum(a6), half_sum(a7)));
}

// ---- this path's tile scoring ----
constexpr int kSplitChunk = 32;

template <int K>
inline float prep_q(const float* q, float* dst, int64_t D) {
  if constexpr (K == kI8) return quantize_q16(q, reinterpret_cast<int16_t*>(dst), D);
  if constexpr (K == kF8) return scale_q_f8(q, dst, D);
  if constexpr (K == kBF16)
    split_order<kSplitChunk>(q, dst, D, false);
  else
    std::memcpy(dst, q, D * sizeof(float));
  return 1.f;
}

template <int K>
inline __m256 score8(const float* q, const void* kb, const int64_t* off, int64_t D) {
  if constexpr (K == kI8) {  // D % 32 == 0: 32 int16 products summed in pairs (vpmaddwd)
    const int8_t* k = static_cast<const int8_t*>(kb);
    const int16_t* qi = reinterpret_cast<const int16_t*>(q);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i qv = _mm512_loadu_si512(qi + d);
#define FD_DOT(j)                                                                                     \
  a##j = _mm512_add_epi32(                                                                            \
      a##j, _mm512_madd_epi16(qv, _mm512_cvtepi8_epi16(_mm256_loadu_si256(                           \
                                      reinterpret_cast<const __m256i*>(k + off[j] + d)))))
      FD_DOT(0); FD_DOT(1); FD_DOT(2); FD_DOT(3); FD_DOT(4); FD_DOT(5); FD_DOT(6); FD_DOT(7);
#undef FD_DOT
    }
    return tree8(a0, a1, a2, a3, a4, a5, a6, a7);
  } else {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    if constexpr (K == kBF16) {  // D % 32 == 0, q in the even/odd order of ld32_bf16
      __m512 e, o;
      for (int64_t d = 0; d < D; d += 32) {
        const __m512 qe = _mm512_loadu_ps(q + d), qo = _mm512_loadu_ps(q + d + 16);
#define FD_DOT(j) ld32_bf16(kb, off[j] + d, e, o), a##j = _mm512_fmadd_ps(qo, o, _mm512_fmadd_ps(qe, e, a##j))
        FD_DOT(0); FD_DOT(1); FD_DOT(2); FD_DOT(3); FD_DOT(4); FD_DOT(5); FD_DOT(6); FD_DOT(7);
#undef FD_DOT
      }
    } else if constexpr (K == kF8) {  // D % 32 == 0
      __m512 lo, hi;
      for (int64_t d = 0; d < D; d += 32) {
        const __m512 ql = _mm512_loadu_ps(q + d), qh = _mm512_loadu_ps(q + d + 16);
#define FD_DOT(j) ld32_f8(kb, off[j] + d, lo, hi), a##j = _mm512_fmadd_ps(qh, hi, _mm512_fmadd_ps(ql, lo, a##j))
        FD_DOT(0); FD_DOT(1); FD_DOT(2); FD_DOT(3); FD_DOT(4); FD_DOT(5); FD_DOT(6); FD_DOT(7);
#undef FD_DOT
      }
    } else {  // D % 16 == 0
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qv = _mm512_loadu_ps(q + d);
        a0 = _mm512_fmadd_ps(qv, ld16<K>(kb, off[0] + d), a0);
        a1 = _mm512_fmadd_ps(qv, ld16<K>(kb, off[1] + d), a1);
        a2 = _mm512_fmadd_ps(qv, ld16<K>(kb, off[2] + d), a2);
        a3 = _mm512_fmadd_ps(qv, ld16<K>(kb, off[3] + d), a3);
        a4 = _mm512_fmadd_ps(qv, ld16<K>(kb, off[4] + d), a4);
        a5 = _mm512_fmadd_ps(qv, ld16<K>(kb, off[5] + d), a5);
        a6 = _mm512_fmadd_ps(qv, ld16<K>(kb, off[6] + d), a6);
        a7 = _mm512_fmadd_ps(qv, ld16<K>(kb, off[7] + d), a7);
      }
    }
    return tree8(a0, a1, a2, a3, a4, a5, a6, a7);
  }
}

// acc[d0 .. d0 + 16*NC) += sum_j w[j] * v_j[d0 ..], the accumulator in 512-bit registers.
template <int K, int NC, bool SPLIT = false>
inline void vacc(float* acc, const float* w, const void* vb, const int64_t* off, int n, int64_t d0,
                 const char* pk, const int64_t* poff, int pn, int64_t prow) {
  __m512 r[NC];
  for (int c = 0; c < NC; ++c) r[c] = _mm512_loadu_ps(acc + d0 + 16 * c);
  const intptr_t dv = static_cast<const char*>(vb) - pk;
  for (int j = 0; j < n; ++j) {
    if (j < pn) {  // one future key's K and V rows per key summed (as v2::vacc)
      const char* kr = pk + poff[j] * kItemSize[K];
      for (int64_t c = 0; c < prow; c += 64) _mm_prefetch(kr + c, _MM_HINT_T1), _mm_prefetch(kr + dv + c, _MM_HINT_T1);
    }
    const __m512 wj = _mm512_set1_ps(w[j]);
    const int64_t o = off[j] + d0;
    if constexpr (SPLIT || K == kF8) {
      static_assert(NC % 2 == 0);
      __m512 e, od;
      for (int c = 0; c < NC; c += 2) {
        if constexpr (SPLIT)
          ld32_bf16(vb, o + 16 * c, e, od);
        else
          ld32_f8(vb, o + 16 * c, e, od);
        r[c] = _mm512_fmadd_ps(wj, e, r[c]);
        r[c + 1] = _mm512_fmadd_ps(wj, od, r[c + 1]);
      }
    } else {
      for (int c = 0; c < NC; ++c) r[c] = _mm512_fmadd_ps(wj, ld16<K>(vb, o + 16 * c), r[c]);
    }
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + d0 + 16 * c, r[c]);
}

template <int K, bool SPLIT>
inline void vacc_all(float* acc, const float* w, const void* vb, const int64_t* off, int n, int64_t D,
                     const char* pk, const int64_t* poff, int pn) {
  const int64_t prow = D * kItemSize[K];
  int64_t d0 = 0;
  for (; d0 + 128 <= D; d0 += 128, pn = 0) vacc<K, 8, SPLIT>(acc, w, vb, off, n, d0, pk, poff, pn, prow);
  if constexpr (SPLIT || K == kF8) {  // D % 32 == 0
    switch ((D - d0) / 32) {
      case 1: vacc<K, 2, SPLIT>(acc, w, vb, off, n, d0, pk, poff, pn, prow); break;
      case 2: vacc<K, 4, SPLIT>(acc, w, vb, off, n, d0, pk, poff, pn, prow); break;
      case 3: vacc<K, 6, SPLIT>(acc, w, vb, off, n, d0, pk, poff, pn, prow); break;
      default: break;
    }
  } else {
    switch ((D - d0) / 16) {  // D % 16 == 0
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
}

#include "vec_job.inc"

#pragma GCC pop_options
}  // namespace v5

// AVX-512 VNNI: int8 keys against q's int16 codes with vpdpwssd (multiply, pair-sum and
// accumulate in one); everything else as v5.
namespace v5n {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
using v2::kF8UnitK;
using v2::kF8UnitV;
using v2::kF8Out;
using v2::exp8;
using v2::hmax;
using v2::hsum;
using v2::softcap8;
using v2::prefetch_rows;
using v2::split_order;
using v5::kSplitChunk;
using v5::prep_q;
using v5::tree8;
using v5::vacc_all;

template <int K>
inline __m256 score8(const float* q, const void* kb, const int64_t* off, int64_t D) {
  if constexpr (K == kI8) {  // D % 32 == 0
    const int8_t* k = static_cast<const int8_t*>(kb);
    const int16_t* qi = reinterpret_cast<const int16_t*>(q);
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i qv = _mm512_loadu_si512(qi + d);
#define FD_DOT(j) \
  a##j = _mm512_dpwssd_epi32(a##j, qv, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + off[j] + d))))
      FD_DOT(0); FD_DOT(1); FD_DOT(2); FD_DOT(3); FD_DOT(4); FD_DOT(5); FD_DOT(6); FD_DOT(7);
#undef FD_DOT
    }
    return tree8(a0, a1, a2, a3, a4, a5, a6, a7);
  } else {
    return v5::score8<K>(q, kb, off, D);
  }
}

#include "vec_job.inc"

#pragma GCC pop_options
}  // namespace v5n

// AVX-512 BF16: bf16 keys dotted with vdpbf16ps. q is split into three bf16 parts (hi = q rounded,
// mid = q - hi rounded, lo = the rest rounded: q's 24 significant bits, so the scores are fp32's;
// bf16 k times a bf16 part is exact in fp32). Two parts (16 bits) missed the fp32 tolerance by 4x
// on sharp scores (keys x30), and q rounded to one bf16 would cost 2^-9 of |q|, as much as bf16
// storage itself. Each 32 elements cost one load of k and three vdpbf16ps instead of a shift, a
// mask and two FMAs per 16. The V sum stays as v5's.
namespace v5b {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16")
using v2::kF8UnitK;
using v2::kF8UnitV;
using v2::kF8Out;
using v2::exp8;
using v2::hmax;
using v2::hsum;
using v2::softcap8;
using v2::prefetch_rows;
using v2::split_order;
using v5::kSplitChunk;
using v5::tree8;
using v5::vacc_all;

template <int K>
inline float prep_q(const float* q, float* dst, int64_t D) {
  if constexpr (K == kBF16) {  // D % 32 == 0: [hi][mid][lo], D bf16 each, in dst's 2D floats
    auto* part = reinterpret_cast<uint16_t*>(dst);
    for (int64_t d = 0; d < D; d += 16) {
      __m512 x = _mm512_loadu_ps(q + d);
      for (int i = 0; i < 3; ++i) {  // x - (its bf16 rounding) is exact in fp32
        const __m256bh h = _mm512_cvtneps_pbh(x);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(part + i * D + d), (__m256i)h);
        x = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16)));
      }
    }
    return 1.f;
  } else {
    return v5n::prep_q<K>(q, dst, D);
  }
}

template <int K>
inline __m256 score8(const float* q, const void* kb, const int64_t* off, int64_t D) {
  if constexpr (K == kBF16) {
    const auto* part = reinterpret_cast<const uint16_t*>(q);
    const auto* k = static_cast<const uint16_t*>(kb);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh qh = (__m512bh)_mm512_loadu_si512(part + d), qm = (__m512bh)_mm512_loadu_si512(part + D + d),
                     ql = (__m512bh)_mm512_loadu_si512(part + 2 * D + d);
#define FD_DOT(j)                                                                       \
  do {                                                                                  \
    const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + off[j] + d);                   \
    a##j = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_dpbf16_ps(a##j, ql, kv), qm, kv), qh, kv); \
  } while (0)
      FD_DOT(0); FD_DOT(1); FD_DOT(2); FD_DOT(3); FD_DOT(4); FD_DOT(5); FD_DOT(6); FD_DOT(7);
#undef FD_DOT
    }
    return tree8(a0, a1, a2, a3, a4, a5, a6, a7);
  } else {
    return v5n::score8<K>(q, kb, off, D);
  }
}

#include "vec_job.inc"

#pragma GCC pop_options
}  // namespace v5b

// AMX (tiles of bf16 products): KV that widens to bfloat16 exactly (amx_kind) scored and summed for
// up to 16 query rows per tile multiply (amx_job.inc); float32 runs v5b's job on this level.
namespace amx {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-bf16")

#include "amx_job.inc"

#pragma GCC pop_options
}  // namespace amx
#pragma GCC diagnostic pop
#endif  // FD_X86


float stream_sum_scalar(const float* x, int64_t n) {
  float r0 = 0.f, r1 = 0.f, r2 = 0.f, r3 = 0.f;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) r0 += x[i], r1 += x[i + 1], r2 += x[i + 2], r3 += x[i + 3];
  for (; i < n; ++i) r0 += x[i];
  return r0 + r1 + r2 + r3;
}

// ---- dispatch ---------------------------------------------------------------------------------
// Levels in the order CPUs gain them (every AVX-512 BF16 CPU so far has VNNI; every VNNI one has
// F/BW/VL/DQ): a level needs its features and those of the levels below it.
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kAvx512Bf16 = 4, kAmx = 5, kIsas = 6 };
const char* const kIsaNames[kIsas] = {"scalar", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"};

// The highest level each dtype uses when the level is picked from CPUID (float32, float16, bfloat16,
// int8, float8): a level is kept for a dtype only where `bench attention --isa L --baseline-isa
// avx2` measured it faster than avx2 on the same run by more than the run-to-run noise (3%;
// docs/kernel.md has the figures). set_isa forces a level for every dtype (tests, A/B benches).
// On the Sapphire Rapids class host of 2026-12-03 (a 2-vCPU VM shared with other work, one thread,
// B=32, mixed lengths), against avx2: fp32 avx512 1.02x; bf16 avx512 0.99x, avx512_bf16 1.05-1.06x
// (three vdpbf16ps per 32 elements cost more than the shift, mask and two FMAs they replace); int8
// avx512 1.02x, avx512_vnni 0.98x; at load ~1.5 (21 repeats) bf16 avx512 0.97x, int8 avx512_vnni
// 0.97x: within the noise (avx2 against itself read 0.995-1.06x). float8 avx512 0.96x and 0.93x
// while its codes went through float16 and vcvtph2ps (a conversion 32 at a time instead of 16);
// widened by a shift and a mask (f8_to_f32_bits), avx512 0.986x and 0.995x: back to avx2.
// amx (2026-12-05, same host class, one thread, uniform lengths): its tile multiplies cost the
// same for 1 to 16 query rows of a job (GQA group x new positions), so it wins with rows and loses
// on a lone row. Against avx2, Llama-3-8B's 32:8 x 128, B=32 at 4096: bf16 decode (4 rows) 0.74-0.77x
// and 4 positions 0.30-0.32x; float16 1.21x, 0.48x; int8 1.03x, 0.38x; float8 0.73x, 0.26x. B=16
// at 2048, by rows: bf16 D=128 1: 1.27x, 2: 1.08-1.16x, 3: 0.97x, 4: 0.82-0.84x; D=64 1: 2.1x,
// 2: 1.5-1.7x, 4: 0.99-1.06x, 6: 0.78x, 8: 0.45-0.51x; float16 (two bf16 parts) D=128 2: 1.63-1.68x,
// 4: 1.22x, 8: 0.79x, D=64 4: 1.55x, 8: 0.76x; int8 2: 1.74-1.88x, 4: 1.10x, 8: 0.55-0.58x;
// float8 2: 1.27x, 4: 0.72-0.74x, 8: 0.37-0.40x. Picked from CPUID, a job with fewer rows than
// amx_min_rows runs on avx2 (kBelowAmx), as does every dtype on a CPU without amx; forced, every
// job on amx. float32 keeps avx2 (no amx job).
constexpr int kKeep[kKinds] = {kAvx2, kAmx, kAmx, kAmx, kAmx};
constexpr int kBelowAmx = kAvx2;  // the level each dtype keeps below amx (the table above)

// The fewest query rows of a job that amx attends when picked from CPUID: the crossovers above
// (bf16 rows x D >= 384: 3 rows at D = 128, 6 at 64).
constexpr int64_t amx_min_rows(int kind, int64_t D) {
  switch (kind) {
    case kBF16: return (384 + D - 1) / D;
    case kF8: return 3;
    case kI8: return 5;
    default: return 7;  // float16
  }
}

// AMX's tile state is off for a Linux process until it asks for it (arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without that, a tile instruction faults.
bool amx_permitted() {
  static const bool ok = [] {
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

bool cpu_has(int level) {
#ifdef FD_X86
  __builtin_cpu_init();
  switch (level) {
    case kAmx:
      if (!(__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && amx_permitted())) return false;
      [[fallthrough]];
    case kAvx512Bf16:
      if (!__builtin_cpu_supports("avx512bf16")) return false;
      [[fallthrough]];
    case kAvx512Vnni:
      if (!__builtin_cpu_supports("avx512vnni")) return false;
      [[fallthrough]];
    case kAvx512:
      if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")))
        return false;
      [[fallthrough]];
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    default:
      return true;
  }
#else
  return level == kScalar;
#endif
}

int best_level() {
  int level = kIsas - 1;
  while (level > kScalar && !cpu_has(level)) --level;
  return level;
}

std::atomic<int> g_isa{best_level()};
std::atomic<bool> g_forced{false};  // set_isa chose the level: every dtype runs on it (kKeep aside)

std::string isa() { return kIsaNames[g_isa.load()]; }
bool forced() { return g_forced.load(); }

void set_prefetch(bool on) { g_prefetch = on; }

void set_isa(const std::string& name) {
  if (name == "auto") {  // back to the CPUID pick, kKeep applying
    g_isa = best_level();
    g_forced = false;
    return;
  }
  for (int level = 0; level < kIsas; ++level)
    if (name == kIsaNames[level]) {
      TORCH_CHECK(cpu_has(level), "this CPU lacks the features of isa '", name, "' (it has up to '",
                  kIsaNames[best_level()], "')");
      g_isa = level;
      g_forced = true;
      return;
    }
  TORCH_CHECK(false, "isa must be one of auto, scalar, avx2, avx512, avx512_vnni, avx512_bf16, amx; got '",
              name, "'");
}

// Whether a level's vector job serves a dtype at head dim D (its loads step by 8, 16 or 32
// elements; int8's int32 dot overflows past D = 512).
bool fits(int level, int kind, int64_t D) {
  if (level == kScalar) return true;
  if (level == kAmx) {
    if (amx_kind(kind)) return D % 32 == 0;  // tiles take 32 elements of D
    level = kAvx512Bf16;
  }
  const int64_t step = level == kAvx2 ? (kind == kBF16 || kind == kI8 ? 16 : 8)
                                      : (kind == kBF16 || kind == kI8 || kind == kF8 ? 32 : 16);
  return D % step == 0 && (kind != kI8 || D <= 512);
}

// The level that serves a dtype at head dim D under the current isa.
int path_of(int kind, int64_t D) {
  const int cpu = g_isa.load(), keep = kKeep[kind] == kAmx && cpu < kAmx ? kBelowAmx : kKeep[kind];
  int level = g_forced.load() ? cpu : std::min(cpu, keep);
  while (level > kScalar && !fits(level, kind, D)) --level;
  return level;
}

std::string path(const std::string& dtype, int64_t head_dim) {
  const char* const names[kKinds] = {"float32", "float16", "bfloat16", "int8", "float8_e4m3"};
  for (int k = 0; k < kKinds; ++k)
    if (dtype == names[k]) return kIsaNames[path_of(k, head_dim)];
  TORCH_CHECK(false, "unknown KV dtype '", dtype, "'");
}

using JobFn = int (*)(const Args&, const Job&, const Job*, int, float*);

template <int K>
JobFn job_fn(int level) {
#ifdef FD_X86
  switch (level) {
    case kAmx: if constexpr (amx_kind(K)) return amx::job<K>; [[fallthrough]];
    case kAvx512Bf16: if constexpr (K == kBF16) return v5b::job<K>; [[fallthrough]];
    case kAvx512Vnni: if constexpr (K == kI8) return v5n::job<K>; [[fallthrough]];
    case kAvx512: return v5::job<K>;
    case kAvx2: return v2::job<K>;
    default: break;
  }
#endif
  (void)level;
  return job_scalar<K>;
}

JobFn job_for(int kind, int level) {
  switch (kind) {
    case kF32: return job_fn<kF32>(level);
    case kF16: return job_fn<kF16>(level);
    case kBF16: return job_fn<kBF16>(level);
    case kI8: return job_fn<kI8>(level);
    default: return job_fn<kF8>(level);
  }
}

Kind kind_of(const at::Tensor& pool) {
  switch (pool.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    case at::kChar: return kI8;
    case at::kFloat8_e4m3fn: return kF8;
    default:
      TORCH_CHECK(false, "KV pool dtype must be float32, float16, bfloat16, int8 or float8_e4m3fn, got ",
                  pool.scalar_type());
  }
}

// Writes rows [r0, r1) of new k (or v) [T, KVH, D] into the pool at their slots (quantizing int8 and
// float8 per row: scale = absmax / 127 or / 448; float8 codes round to nearest even, as torch's cast).
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
        case kF8: {
          float amax = 0.f;
          for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
          const float sc = amax / kF8Max;
          auto* p = static_cast<c10::Float8_e4m3fn*>(pool) + dst;
          for (int64_t d = 0; d < D; ++d) {
            float y = sc > 0.f ? std::min(kF8Max, std::max(-kF8Max, x[d] / sc)) : 0.f;
            if (std::fabs(y) < kF8MinNormal)  // no subnormal codes (kF8MinNormal)
              y = std::fabs(y) > 0.5f * kF8MinNormal ? std::copysign(kF8MinNormal, y) : 0.f;
            p[d] = c10::Float8_e4m3fn(y);
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
  if (scaled(kind)) {
    TORCH_CHECK(kscale_opt.has_value() && vscale_opt.has_value(), "int8 and float8 pools need scales");
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
         scaled(kind) ? kscale.data_ptr<float>() : nullptr, scaled(kind) ? vscale.data_ptr<float>() : nullptr,
         tab, toff, st, row0.data(), S, D, H, H / KVH, block_size, static_cast<float>(scale),
         window, static_cast<float>(softcap)};

  // 1. append the new k, v (rows in parallel: a prefill chunk brings thousands)
  at::parallel_for(0, T, 64, [&](int64_t r0, int64_t r1) {
    append_rows(a, kind, k.data_ptr<float>(), kpool.data_ptr(), scaled(kind) ? kscale.data_ptr<float>() : nullptr,
                KVH, B, r0, r1);
    append_rows(a, kind, v.data_ptr<float>(), vpool.data_ptr(), scaled(kind) ? vscale.data_ptr<float>() : nullptr,
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

  const int level = path_of(kind, D);
  const JobFn fn = job_for(kind, level);
  // amx: jobs with few query rows on the vector path instead, unless amx was forced
  const bool tiles = level == kAmx && amx_kind(kind);
  JobFn few = fn;
  int64_t min_rows = 0;
  if (tiles && !g_forced.load()) {
    int below = kBelowAmx;
    while (below > kScalar && !fits(below, kind, D)) --below;
    few = job_for(kind, below);
    min_rows = amx_min_rows(kind, D);
  }
  // vec_job.inc's layout and amx_job.inc's (blocks of 16 rows of a job's <= kQChunk * G)
  int64_t scratch = kQChunk * (H / KVH) * (3 * D + 3) + kTile + 8;
#ifdef FD_X86
  if (tiles) scratch = std::max(scratch, amx::scratch_floats((kQChunk * (H / KVH) + 15) / 16, D));
#endif
  std::atomic<int64_t> next{0};
  const int64_t njobs = static_cast<int64_t>(jobs.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), njobs);
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> buf(scratch);
#ifdef FD_X86
    // Flush denormals to zero while attending: weights of keys far below the row's max reach the
    // denormal range, and each multiply by one costs a microcode assist (~100 cycles).
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    if (tiles) amx::begin();
#endif
    for (int64_t w = w0; w < w1; ++w) {
      // Each worker claims its next job before running the current one, so the current job can
      // prefetch the next one's first tile.
      int warm = 0;
      for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < njobs;) {
        const int64_t j = next.fetch_add(1, std::memory_order_relaxed);
        const Job& jb = jobs[i];
        warm = ((jb.t1 - jb.t0) * a.G >= min_rows ? fn : few)(a, jb, j < njobs ? &jobs[j] : nullptr, warm, buf.data());
        i = j;
      }
    }
#ifdef FD_X86
    if (tiles) amx::end();
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
  const bool vec = g_isa.load() >= kAvx2;  // one yardstick for every vector path: AVX2 loads
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w)
      for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < nchunks;) {
        const int64_t len = std::min(chunk, n - c * chunk);
#ifdef FD_X86
        part[w] += vec ? v2::stream_sum(p + c * chunk, len) : stream_sum_scalar(p + c * chunk, len);
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
  m.def("isa", &fd::isa, "isa level in use: scalar, avx2, avx512, avx512_vnni, avx512_bf16 or amx");
  m.def("set_isa", &fd::set_isa,
        "force an isa level the CPU has for every dtype (tests, A/B benches; an error if it lacks it), "
        "or 'auto': the CPUID pick with each dtype on its kept level");
  m.def("forced", &fd::forced, "whether set_isa forced the level (else the CPUID pick)");
  m.def("path", &fd::path, "the level that serves a KV dtype at a head dim under the current isa");
  m.def("isas", []() {
    std::vector<std::string> out;
    for (int level = 0; level < fd::kIsas; ++level)
      if (fd::cpu_has(level)) out.push_back(fd::kIsaNames[level]);
    return out;
  }, "the isa levels this CPU can run, lowest first");
  m.def("set_prefetch", &fd::set_prefetch, "software prefetch of the next tile on/off (A/B measurements)");
}
