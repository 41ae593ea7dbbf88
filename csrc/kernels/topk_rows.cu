// Top-k of fp32 score rows (the lightning indexer's selection), one CTA per row.
//
// Same contract as lowering/triton/indexer.py's topk_row_kernel (STAGE 0) and the reference:
// row r = (b, s) of scores [B, S, N] (last dim contiguous), entries i < visible[b, s] (clamped
// to [0, N]) are live; out[b, s, :] gets the min(topk, visible) best in descending score order,
// ties to the lower index, then -1. Scores compare as the order-preserving uint32 key of
// _ordered_key (-0.0 == +0.0).
//
// Why CUDA: a radix select wants a histogram per pass, and Triton's tl.histogram has no
// shared-memory atomics. Here a pass is a 256-bin histogram a warp in shared memory (no contention
// between warps), over only the entries at or above a floor that the k-th best key cannot be under
// (most of a random row is below it).
//
// Steps: (1) the row into registers, ITEMS consecutive entries a thread (thread t: entries
// [t * ITEMS, (t + 1) * ITEMS); loaded without waiting for the row's visible length, whose later
// stages skip the entries past it), and a floor under the k-th best; rows of more than 16 scores a
// thread (topk_rows_list_kernel) arrive by bulk copies through shared memory and then put the
// candidates (entries at or above the floor) in a shared list;
// (2) select: the threshold key, narrowed 8 bits at a time from the candidates' own key range (radix
// digits of the offset from the least candidate), stopping early when the threshold's bin is taken
// whole; (3) compaction: when the threshold's bin was taken whole, every candidate at or above it is a
// pick, slots claimed a warp at a time in no order; else (the bin is one key) one block prefix sum of
// two counts: the entries above the threshold, then the first k_rem equal to it by index; (4) the
// picks packed as key << 32 | ~index (descending: score, then lower index first) ordered by buckets of
// their keys (up to two picks a thread, no crowded bucket), else by a bitonic sort in registers,
// shuffles and shared memory; (5) the indices out, -1 past the picks.
//
// A CTA a row, each stage one pass over the block: the kernel is a chain of latencies, in which
// barriers and branches show, so every stage keeps its barriers few and its inner loops free of
// branches (the histogram atomics, the compaction's slots).
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "topk_rows.h"

namespace dsv4 {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;            // 8-bit digits: at most four passes fix a 32-bit key
constexpr int kMaxTopk = kTopkRowsMaxTopk;  // picks sorted in shared memory
constexpr int kMaxItems = 64;         // scores a thread: rows of up to kMaxItems * kThreads
constexpr int kCandidates = 8192;     // the shared candidate list (a random row's candidates fit it many times)
constexpr int kBucketMax = 64;        // the bucket sort's largest bucket; past it, the bitonic sort
static_assert(kMaxItems * kThreads == kTopkRowsMaxEntries, "the header's limit is the kernel's row");

// A pick as one number: larger is better (a higher key, then a lower index), and no two are equal.
__device__ __forceinline__ unsigned long long pack_pick(uint32_t key, int index) {
  return (static_cast<unsigned long long>(key) << 32) | uint32_t(~uint32_t(index));
}

__device__ __forceinline__ uint32_t ordered_key(float x) {
  uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Inclusive prefix sum of one value a lane, in lane order, within the warp.
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

// Exclusive prefix sum of one value a thread, in thread order; the block's total in *total.
template <typename T>
__device__ __forceinline__ T block_exclusive_scan(T v, T* warp_sums, T* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T x = warp_inclusive_scan(v);
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const T w = warp_inclusive_scan(lane < kWarps ? warp_sums[lane] : T(0));
    if (lane < kWarps) warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const T before = (warp ? warp_sums[warp - 1] : 0) + x - v;
  *total = warp_sums[kWarps - 1];
  __syncthreads();  // warp_sums may be reused by the next scan
  return before;
}

// Slots for this thread's n picks, in no particular order (the sort orders them): a scan within the warp
// and one shared atomic a warp, instead of block_exclusive_scan's three barriers. *counter starts at 0.
__device__ __forceinline__ int claim_slots(int n, int* counter) {
  const int incl = warp_inclusive_scan(n);
  int base = 0;
  if ((threadIdx.x & 31) == 31) base = atomicAdd(counter, incl);
  return __shfl_sync(0xffffffffu, base, 31) + incl - n;
}

// The sort: kpad picks over the block's threads, E a thread (pick i = e * kThreads + tid; slots past
// k_eff sort last as 0). Every thread takes part in every step, so that each exchange is a shuffle
// within a warp, or one store and load of shared memory between warps.
template <int E>
__device__ __forceinline__ void sort_and_store(unsigned long long* picks, int* out_row, int64_t so_k, int k_eff,
                                               int topk) {
  const int tid = threadIdx.x;
  unsigned long long v[E];
#pragma unroll
  for (int e = 0; e < E; ++e) v[e] = e * kThreads + tid < k_eff ? picks[e * kThreads + tid] : 0ull;
  constexpr int n = E * kThreads;
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      if (j >= kThreads) {  // partner in this thread's registers
#pragma unroll
        for (int m = 1; m < E; m <<= 1) {  // m and e compile-time: v stays in registers
          if (m != j / kThreads) continue;
#pragma unroll
          for (int e = 0; e < E; ++e) {
            if ((e ^ m) > e) {
              const bool descending = ((e * kThreads + tid) & k) == 0;
              const unsigned long long a = v[e], c = v[e ^ m];
              if (descending ? a < c : a > c) {
                v[e] = c;
                v[e ^ m] = a;
              }
            }
          }
        }
        continue;
      }
      unsigned long long other[E];
      if (j >= 32) {  // partner in another warp
        __syncthreads();  // every thread has read the last exchange
#pragma unroll
        for (int e = 0; e < E; ++e) picks[e * kThreads + tid] = v[e];
        __syncthreads();
#pragma unroll
        for (int e = 0; e < E; ++e) other[e] = picks[(e * kThreads + tid) ^ j];
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) other[e] = __shfl_xor_sync(0xffffffffu, v[e], j);
      }
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int i = e * kThreads + tid;
        // the lower of the pair keeps the larger in a descending run, the smaller otherwise
        const bool keep_max = ((i & j) == 0) == ((i & k) == 0);
        v[e] = keep_max ? max(v[e], other[e]) : min(v[e], other[e]);
      }
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int i = e * kThreads + tid;
    if (i < topk) out_row[i * so_k] = i < k_eff ? int(~uint32_t(v[e] & 0xFFFFFFFFull)) : -1;
  }
}

// (4) + (5): sort the picks and write them out, one to four picks a thread
__device__ __forceinline__ void sort_picks(unsigned long long* picks, int* out_row, int64_t so_k, int k_eff, int topk,
                                           int kpad) {
  if (kpad <= kThreads) sort_and_store<1>(picks, out_row, so_k, k_eff, topk);
  else if (kpad <= 2 * kThreads) sort_and_store<2>(picks, out_row, so_k, k_eff, topk);
  else sort_and_store<4>(picks, out_row, so_k, k_eff, topk);
}

// One row's task: the CTA's row of scores, its output row, how much of it is live.
struct RowTask {
  const float* row;
  int* out_row;
  int vis, k_eff;
  __device__ __forceinline__ RowTask(const float* scores, int64_t ss_b, int64_t ss_s, const int* visible, int64_t sv_b,
                                     int64_t sv_s, int* out, int64_t so_b, int64_t so_s, int S, int N, int topk) {
    const int64_t b = blockIdx.x / S, s = blockIdx.x % S;
    row = scores + b * ss_b + s * ss_s;
    out_row = out + b * so_b + s * so_s;
    vis = min(max(visible[b * sv_b + s * sv_s], 0), N);
    k_eff = min(vis, topk);
  }
};

// (1) the row: ITEMS consecutive entries a thread from `first`, every one < n. The register kernel
// passes the row's length, not its live length (vis), so that the loads need not wait for vis (one
// memory latency before them); every later stage tests first + i < vis before it reads a key.
template <int ITEMS>
__device__ __forceinline__ void load_row(const float* row, int first, int n, uint32_t (&key)[ITEMS]) {
  if ((ITEMS % 4) == 0 && first + ITEMS <= n && (reinterpret_cast<uintptr_t>(row + first) & 15) == 0) {
#pragma unroll
    for (int i = 0; i < ITEMS; i += 4) {
      float4 v = __ldg(reinterpret_cast<const float4*>(row + first + i));
      key[i] = ordered_key(v.x);
      key[i + 1] = ordered_key(v.y);
      key[i + 2] = ordered_key(v.z);
      key[i + 3] = ordered_key(v.w);
    }
  } else {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) key[i] = first + i < n ? ordered_key(__ldg(row + first + i)) : 0u;
  }
}

// The floor and the candidates' key range [lo_key, hi_key]. Entries below the floor are never
// candidates: when k_eff <= the threads holding live entries, the smallest of those threads' maxima is
// <= the k-th best key (at least that many entries, one a thread, are >= it). Dropping them leaves the
// threshold, and every entry >= it, as they were, and spares the select the bulk of the row (random
// scores crowd into a few bins). Else there is no floor (0), and lo_key is the row's least.
template <int ITEMS>
__device__ __forceinline__ void find_floor(const uint32_t (&key)[ITEMS], int first, int vis, int k_eff,
                                           uint32_t* warp_min, uint32_t* warp_max, int* warp_live,
                                           uint32_t& floor_key, uint32_t& lo_key, uint32_t& hi_key) {
  const int tid = threadIdx.x;
  floor_key = 0;
  lo_key = 0xFFFFFFFFu;
  hi_key = 0;
  uint32_t my_max = 0;
  bool any = false;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (first + i < vis) {
      my_max = max(my_max, key[i]);
      any = true;
    }
  }
  // over threads with live entries: the min of their maxima, the max; their count
  uint32_t m = any ? my_max : 0xFFFFFFFFu, hi = my_max;
  int n_live = any ? 1 : 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    m = min(m, __shfl_xor_sync(0xffffffffu, m, o));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    n_live += __shfl_xor_sync(0xffffffffu, n_live, o);
  }
  if ((tid & 31) == 0) {
    warp_min[tid >> 5] = m;
    warp_max[tid >> 5] = hi;
    warp_live[tid >> 5] = n_live;
  }
  __syncthreads();
  int live_threads = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    lo_key = min(lo_key, warp_min[w]);
    hi_key = max(hi_key, warp_max[w]);
    live_threads += warp_live[w];
  }
  if (k_eff <= live_threads) {
    floor_key = lo_key;
  } else {
    __syncthreads();  // every thread has read warp_min, reused here (find_floor's own arrays: no one
                      // else writes them, so the common case needs no second barrier)
    uint32_t lo = 0xFFFFFFFFu;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
      if (first + i < vis) lo = min(lo, key[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    if ((tid & 31) == 0) warp_min[tid >> 5] = lo;
    __syncthreads();
    lo_key = 0xFFFFFFFFu;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) lo_key = min(lo_key, warp_min[w]);
  }
}

// Select state, in shared memory so that every thread reads what one published.
struct Published {
  int digit, above, count;
  int claimed;  // picks given slots so far (claim_slots; 0 from before find_floor's barriers)
};

// (2) select, one pass's end: the warps' histograms of the interval [lo, lo + span] in bins of
// 2^shift keys counted from lo are complete (the caller's barrier). The threshold bin d*:
// count(bins above d*) < k_rem <= count(bins from d* up); the interval narrows to it, k_rem drops by
// the entries above it, and done says the whole bin is picked (nothing in it needs telling apart).
// The histograms are cleared for the next pass.
__device__ __forceinline__ void take_threshold_bin(int shift, uint32_t& lo, uint32_t& span, int& k_rem, bool& done,
                                                   int* hist, int* warp_sums, Published& pub) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // threads 0-255 own bin 255 - t, so a prefix sum in thread order counts the entries in the bins above
  int own = 0, incl = 0;
  if (tid < kBins) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) own += hist[w * kBins + (kBins - 1 - tid)];
    incl = warp_inclusive_scan(own);
    if (lane == 31) warp_sums[warp] = incl;
  }
  __syncthreads();  // (b) the bin warps' totals; every histogram read
  for (int i = tid; i < kWarps * kBins; i += kThreads) hist[i] = 0;  // the next pass's
  if (tid < kBins) {
    int above = incl - own;
    for (int w = 0; w < warp; ++w) above += warp_sums[w];
    if (above < k_rem && above + own >= k_rem) {
      pub.digit = kBins - 1 - tid;
      pub.above = above;
      pub.count = own;
    }
  }
  __syncthreads();  // (c) the threshold bin published, the histograms cleared
  k_rem -= pub.above;
  done = k_rem == pub.count;
  lo += uint32_t(pub.digit) << shift;
  span = min(span - (uint32_t(pub.digit) << shift), (1u << shift) - 1u);
}

// The select's interval starts as [lo_key, hi_key], where every candidate lies, and each pass splits
// it into at most 256 bins of 2^shift keys counted from lo (a radix of the offset key - lo, not of the
// key: bins aligned to lo spread the candidates over the whole histogram, where digits of the key itself
// put a row that crosses a power of two, e.g. scores from 0.4 to 3.9, into a few bins and the warps'
// atomics onto a few addresses).
__device__ __forceinline__ int pass_shift(uint32_t span) { return max(32 - __clz(span) - 8, 0); }  // span >> shift <= 255

// (4) + (5) by buckets, for up to 2 * kThreads picks (kpad <= 1024: the picks and their buckets' copy
// fit the scratch). The picks' keys lie in [lo, hi_key]: 256 buckets of 2^shift keys, counted from the
// top; one histogram of the picks, one scan of the buckets, each pick copied into its bucket's segment
// (in no order), then each pick's place is its segment's start + the picks of its segment better than
// it. Four barriers, where the bitonic sort of kThreads picks takes dozens of dependent steps and
// barriers. Returns false,
// having written nothing, when a bucket holds more than kBucketMax picks (many equal or crowded
// scores): the caller then sorts by the bitonic sort. count[] (kBins) is zero on entry: the caller
// clears it before a barrier; start[] (kBins) and most[] (kBins / 32) are scratch; seg holds 2 *
// kThreads picks apart from picks'. Not inlined: inlined, it made the 8- and 64-a-thread kernels spill.
template <int E>
__device__ __noinline__ bool bucket_sort_and_store(const unsigned long long* picks, unsigned long long* seg,
                                                      int* count, int* start, int* most, int k_eff, int topk,
                                                      uint32_t lo, uint32_t hi_key, int* out_row, int64_t so_k,
                                                      int* warp_sums) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int shift = pass_shift(hi_key - lo);
  unsigned long long v[E];
  int bucket[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int i = e * kThreads + tid;
    v[e] = i < k_eff ? picks[i] : 0ull;
    bucket[e] = kBins - 1 - int((uint32_t(v[e] >> 32) - lo) >> shift);  // bucket 0: the best keys
    if (i < k_eff) atomicAdd(&count[bucket[e]], 1);
  }
  __syncthreads();  // (a) the histogram
  // the buckets' starts: an exclusive scan over threads 0-255, a bucket each; the largest bucket
  int c = 0, incl = 0;
  if (tid < kBins) {
    int m = c = incl = count[tid];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
      m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    }
    if (lane == 31) warp_sums[warp] = incl;
    if (lane == 0) most[warp] = m;
  }
  __syncthreads();  // (b) the bucket warps' totals and maxima
  int largest = 0;
#pragma unroll
  for (int w = 0; w < kBins / 32; ++w) largest = max(largest, most[w]);
  if (largest > kBucketMax) return false;  // (the same for every thread)
  if (tid < kBins) {
    int before = incl - c;
    for (int w = 0; w < warp; ++w) before += warp_sums[w];
    start[tid] = before;  // a cursor: it ends at the segment's end
  }
  __syncthreads();  // (c) the segments' starts
#pragma unroll
  for (int e = 0; e < E; ++e)
    if (e * kThreads + tid < k_eff) seg[atomicAdd(&start[bucket[e]], 1)] = v[e];
  __syncthreads();  // (d) the segments
#pragma unroll
  for (int e = 0; e < E; ++e) {
    if (e * kThreads + tid < k_eff) {
      const int end = start[bucket[e]], base = end - count[bucket[e]];
      int place = base;
      for (int j = base; j < end; ++j) place += seg[j] > v[e];
      out_row[place * so_k] = int(~uint32_t(v[e] & 0xFFFFFFFFull));
    }
  }
  for (int i = k_eff + tid; i < topk; i += kThreads) out_row[i * so_k] = -1;
  return true;
}

// The bitonic sort as a call, for the register kernel: inlined there, it made the 4- and 8-a-thread
// kernels spill.
__device__ __noinline__ void sort_picks_call(unsigned long long* picks, int* out_row, int64_t so_k, int k_eff,
                                             int topk, int kpad) {
  sort_picks(picks, out_row, so_k, k_eff, topk, kpad);
}

// (4) + (5): the bucket sort where it serves (kpad <= 2 * kThreads, no bucket past kBucketMax), else
// the bitonic sort (kSortCall: by sort_picks_call). `sort` holds the bucket sort's scratch (count[]
// zero on entry).
struct SortScratch {
  int count[kBins], start[kBins], most[kBins / 32];
};
template <bool kSortCall>
__device__ __forceinline__ void order_picks(unsigned long long* picks, int* out_row, int64_t so_k, int k_eff, int topk,
                                            int kpad, uint32_t lo, uint32_t hi_key, SortScratch& sort,
                                            int* warp_sums) {
  if (k_eff > 0 && kpad <= 2 * kThreads) {
    unsigned long long* seg = picks + 2 * kThreads;
    if (kpad <= kThreads ? bucket_sort_and_store<1>(picks, seg, sort.count, sort.start, sort.most, k_eff, topk, lo,
                                                    hi_key, out_row, so_k, warp_sums)
                         : bucket_sort_and_store<2>(picks, seg, sort.count, sort.start, sort.most, k_eff, topk, lo,
                                                    hi_key, out_row, so_k, warp_sums))
      return;
  }
  if constexpr (kSortCall) sort_picks_call(picks, out_row, so_k, k_eff, topk, kpad);
  else sort_picks(picks, out_row, so_k, k_eff, topk, kpad);
}

// The select's histograms, the slot counter, the bucket counts: zeroed (before find_floor, whose barrier publishes)
__device__ __forceinline__ void clear_counters(int* hist, Published& pub, SortScratch& sort) {
  if (threadIdx.x == 0) pub.claimed = 0;
  if (threadIdx.x < kBins) sort.count[threadIdx.x] = 0;
  for (int i = threadIdx.x; i < kWarps * kBins; i += kThreads) hist[i] = 0;
}

// Rows of at most 16 scores a thread (8192: V4 at 32K context): the candidates stay in registers.
template <int ITEMS>
__global__ void __launch_bounds__(kThreads, ITEMS <= 8 ? 2 : 1) topk_rows_kernel(
    const float* __restrict__ scores, int64_t ss_b, int64_t ss_s,
    const int* __restrict__ visible, int64_t sv_b, int64_t sv_s,
    int* __restrict__ out, int64_t so_b, int64_t so_s, int64_t so_k,
    int S, int N, int topk, int kpad) {
  // the select's histograms (one a warp), then the picks: the same bytes
  __shared__ __align__(16) unsigned char scratch[kMaxTopk * sizeof(unsigned long long)];
  static_assert(kWarps * kBins * sizeof(int) <= sizeof(scratch), "the histograms fit the picks' bytes");
  int* hist = reinterpret_cast<int*>(scratch);
  unsigned long long* picks = reinterpret_cast<unsigned long long*>(scratch);
  __shared__ uint32_t warp_min[kWarps], warp_max[kWarps];  // find_floor's, with warp_live
  __shared__ int warp_sums[kWarps], warp_live[kWarps];
  __shared__ Published pub;
  __shared__ int sink[kThreads];  // where a thread's histogram count goes when its entry is not counted
  __shared__ SortScratch sort;

  const RowTask task(scores, ss_b, ss_s, visible, sv_b, sv_s, out, so_b, so_s, S, N, topk);
  const int vis = task.vis, k_eff = task.k_eff, first = threadIdx.x * ITEMS;
  uint32_t key[ITEMS];
  load_row(task.row, first, N, key);
  uint32_t floor_key, lo_key, hi_key;
  clear_counters(hist, pub, sort);  // (find_floor's barrier publishes the three)
  find_floor(key, first, vis, k_eff, warp_min, warp_max, warp_live, floor_key, lo_key, hi_key);

  // (2) select: k_rem = picks still needed from the interval [lo, lo + span]
  uint32_t lo = lo_key, span = hi_key - lo_key;
  int k_rem = k_eff;
  bool done = k_eff == 0;
  int* my_hist = hist + (threadIdx.x >> 5) * kBins;  // this warp's own histogram: no contention between warps
#pragma unroll 1
  while (span != 0 && !done) {
    const int shift = pass_shift(span);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const uint32_t off = key[i] - lo;  // keys below lo wrap past span
      const bool counted = first + i < vis && key[i] >= floor_key && off <= span;
      // every entry an atomic, to its bin or to the thread's own sink: no branch, no reconvergence (at
      // 8 entries a thread, 64 registers for two CTAs an SM, that form spilled: the branch there)
      if constexpr (ITEMS != 8) atomicAdd(counted ? &my_hist[off >> shift] : &sink[threadIdx.x], 1);
      else if (counted) atomicAdd(&my_hist[off >> shift], 1);
    }
    __syncthreads();  // (a) the histograms are complete
    take_threshold_bin(shift, lo, span, k_rem, done, hist, warp_sums, pub);
  }
  // the picks: every candidate above lo + span, and k_rem of those in [lo, lo + span] (all of them
  // when done; else the interval is one key, and ties go to the lower index)
  const uint32_t hi = lo + span;

  // (3) compaction: every candidate (live, >= floor) above hi, then the first k_rem by index in
  // [lo, hi] (all of them when done: then slots in any order, claim_slots). Else one scan counts both
  // (above in the low half-word, in the interval in the high: each total <= N <= 32768); the picks'
  // order is the sort's business, so above go to [0, n_above) and the interval's after them.
  // this thread's entries of each kind, a bit each
  unsigned above_bits = 0, eq_bits = 0;
  static_assert(ITEMS <= 32, "a bit an entry in one word");
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const bool live = first + i < vis && key[i] >= floor_key;
    if (live && key[i] > hi) above_bits |= 1u << i;
    if (live && key[i] >= lo && key[i] <= hi) eq_bits |= 1u << i;
  }
  // (picks alias the histograms, last read before the select's final barriers; the sort reads
  // only [0, k_eff), so nothing is cleared)
  if (done && k_eff > 0) {
    const unsigned mine = above_bits | eq_bits;
    int slot = claim_slots(__popc(mine), &pub.claimed);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
      if ((mine >> i) & 1u) picks[slot++] = pack_pick(key[i], first + i);
  } else {
    unsigned packed_total;
    const unsigned packed_before = block_exclusive_scan(
        unsigned(__popc(above_bits)) | unsigned(__popc(eq_bits)) << 16, reinterpret_cast<unsigned*>(warp_sums),
        &packed_total);
    int above_slot = int(packed_before & 0xFFFFu);
    int eq_slot = int(packed_total & 0xFFFFu) + int(packed_before >> 16);  // the equal ones after every above
    const int eq_end = int(packed_total & 0xFFFFu) + k_rem;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const unsigned long long pick = pack_pick(key[i], first + i);
      if ((above_bits >> i) & 1u) picks[above_slot++] = pick;
      if ((eq_bits >> i) & 1u) {
        if (eq_slot < eq_end) picks[eq_slot] = pick;
        ++eq_slot;
      }
    }
  }
  __syncthreads();
  // (4) + (5): sort the picks and write them out
  order_picks</*kSortCall=*/true>(picks, task.out_row, so_k, k_eff, topk, kpad, lo, hi_key, sort, warp_sums);
}

// Rows of more than 16 scores a thread (up to kTopkRowsMaxEntries: V4 at 128K context). Were the
// candidates kept in the row's registers, every select pass and the compaction would walk all of a
// thread's entries for the few that are candidates, and that many registers live through the select
// would spill. So the candidates go to a shared list in index order (up to kCandidates), which the
// passes and the compaction read, a few entries a thread; a row with more candidates (rising scores,
// where thread 0's maximum is the floor) reads them from the row again (in L2: the scores pass wrote
// it just before). Either way the row's registers die after the list.
// The row arrives by bulk asynchronous copies (sm_90), one a thread into its own slice of shared memory
// (ITEMS floats + 16 B of padding, so that the threads' float4 reads of their slices hit distinct
// banks), then into registers: a CTA's plain loads keep too few bytes in flight to cover a long row's
// memory latency. Rows not 16-byte aligned take plain loads.
template <int ITEMS>
struct ListSmem {
  static constexpr size_t kScratch = kMaxTopk * sizeof(unsigned long long);  // histograms, then the picks
  static constexpr size_t kKeys = kCandidates * sizeof(uint32_t);
  static constexpr size_t kSlice = ITEMS * sizeof(float) + 16;  // a thread's slice of the staged row
  static constexpr size_t kStaged = kScratch + kKeys + kCandidates * sizeof(uint16_t);
  static constexpr size_t kBytes = kStaged + kThreads * kSlice;
  static_assert(kWarps * kBins * sizeof(int) <= kScratch, "the histograms fit the picks' bytes");
  static_assert(ITEMS * kThreads <= 65536, "a list index fits 16 bits");
};

// (2) select over for_each(f), which calls f(key) on this thread's candidates.
template <class ForEach>
__device__ __forceinline__ void select_threshold(const ForEach& for_each, uint32_t& lo, uint32_t& span, int& k_rem,
                                                 bool& done, int* hist, int* sink, int* warp_sums, Published& pub) {
  int* my_hist = hist + (threadIdx.x >> 5) * kBins;
#pragma unroll 1
  while (span != 0 && !done) {
    const int shift = pass_shift(span);
    const uint32_t lo_now = lo, span_now = span;
    for_each([&](uint32_t key, int) {
      const uint32_t off = key - lo_now;  // keys below lo wrap past span
      atomicAdd(off <= span_now ? &my_hist[off >> shift] : &sink[threadIdx.x], 1);  // (no branch)
    });
    __syncthreads();  // (a) the histograms are complete
    take_threshold_bin(shift, lo, span, k_rem, done, hist, warp_sums, pub);
  }
}

// (3) compaction over for_each(f), which calls f(key, index) on this thread's candidates in index
// order (and the threads' in thread order): as topk_rows_kernel's, counting twice instead of bits
// (`every`: the select was done, each candidate at or above lo is a pick, slots in no order).
template <class ForEach>
__device__ __forceinline__ void compact_picks(const ForEach& for_each, uint32_t lo, uint32_t hi, int k_rem,
                                              bool every, unsigned long long* picks, int* warp_sums, int* claimed) {
  if (every) {
    int n = 0;
    for_each([&](uint32_t key, int) { n += key >= lo; });
    int slot = claim_slots(n, claimed);
    for_each([&](uint32_t key, int index) {
      if (key >= lo) picks[slot++] = pack_pick(key, index);
    });
    __syncthreads();
    return;
  }
  unsigned n_above = 0, n_eq = 0;
  for_each([&](uint32_t key, int) {
    n_above += key > hi;
    n_eq += key >= lo && key <= hi;
  });
  unsigned packed_total;
  const unsigned packed_before = block_exclusive_scan(n_above | n_eq << 16, reinterpret_cast<unsigned*>(warp_sums),
                                                      &packed_total);
  int above_slot = int(packed_before & 0xFFFFu);
  int eq_slot = int(packed_total & 0xFFFFu) + int(packed_before >> 16);
  const int eq_end = int(packed_total & 0xFFFFu) + k_rem;
  for_each([&](uint32_t key, int index) {
    const unsigned long long pick = pack_pick(key, index);
    if (key > hi) picks[above_slot++] = pick;
    if (key >= lo && key <= hi) {
      if (eq_slot < eq_end) picks[eq_slot] = pick;
      ++eq_slot;
    }
  });
  __syncthreads();
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DSV4_BULK_COPY 1
#else
#define DSV4_BULK_COPY 0
#endif

// (1) the row into registers by way of shared memory: thread t's ITEMS consecutive entries are one bulk
// asynchronous copy into its slice (the live ones, in 16-byte units: the row's length is a multiple of 4),
// all completing on the mbarrier *bar, which every thread waits for; then the slice into registers.
// The caller checks that the copies may run (sm_90, a 16-byte aligned row, N % 4 == 0).
template <int ITEMS>
__device__ __forceinline__ void load_row_staged(const float* row, int first, int vis, float* slice, uint64_t* bar,
                                                uint32_t (&key)[ITEMS]) {
#if DSV4_BULK_COPY
  const uint32_t bar_addr = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  const uint32_t total = uint32_t((vis + 3) / 4) * 16u;  // every thread's copy, together
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_addr) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the copy engine
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_addr), "r"(total) : "memory");
  }
  __syncthreads();  // the barrier initialised, its bytes expected, before any copy completes on it
  const int live = min(max(vis - first, 0), ITEMS);
  if (live > 0) {
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(slice));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(row + first), "r"(uint32_t((live + 3) / 4) * 16u), "r"(bar_addr)
                 : "memory");
  }
  uint32_t ready = total == 0;
  while (!ready) {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(ready) : "r"(bar_addr) : "memory");
  }
  const float4* slice4 = reinterpret_cast<const float4*>(slice);
#pragma unroll
  for (int i = 0; i < ITEMS; i += 4) {
    const float4 v = slice4[i / 4];
    key[i] = first + i < vis ? ordered_key(v.x) : 0u;
    key[i + 1] = first + i + 1 < vis ? ordered_key(v.y) : 0u;
    key[i + 2] = first + i + 2 < vis ? ordered_key(v.z) : 0u;
    key[i + 3] = first + i + 3 < vis ? ordered_key(v.w) : 0u;
  }
#endif
}

template <int ITEMS>
__global__ void __launch_bounds__(kThreads, 1) topk_rows_list_kernel(
    const float* __restrict__ scores, int64_t ss_b, int64_t ss_s,
    const int* __restrict__ visible, int64_t sv_b, int64_t sv_s,
    int* __restrict__ out, int64_t so_b, int64_t so_s, int64_t so_k,
    int S, int N, int topk, int kpad) {
  using Layout = ListSmem<ITEMS>;
  extern __shared__ __align__(128) unsigned char smem[];
  int* hist = reinterpret_cast<int*>(smem);
  unsigned long long* picks = reinterpret_cast<unsigned long long*>(smem);
  uint32_t* list_key = reinterpret_cast<uint32_t*>(smem + Layout::kScratch);
  uint16_t* list_index = reinterpret_cast<uint16_t*>(smem + Layout::kScratch + Layout::kKeys);
  float* slice = reinterpret_cast<float*>(smem + Layout::kStaged + threadIdx.x * Layout::kSlice);
  __shared__ uint32_t warp_min[kWarps], warp_max[kWarps];  // find_floor's, with warp_live
  __shared__ int warp_sums[kWarps], warp_live[kWarps];
  __shared__ Published pub;
  __shared__ int sink[kThreads];  // as topk_rows_kernel's
  __shared__ SortScratch sort;
  __shared__ __align__(8) uint64_t bar;

  const RowTask task(scores, ss_b, ss_s, visible, sv_b, sv_s, out, so_b, so_s, S, N, topk);
  const int vis = task.vis, k_eff = task.k_eff, first = threadIdx.x * ITEMS;
  const bool staged = DSV4_BULK_COPY && (reinterpret_cast<uintptr_t>(task.row) & 15) == 0 && N % 4 == 0;
  uint32_t floor_key, lo_key, hi_key;
  int n_list, list_before;
  bool listed;
  {
    uint32_t key[ITEMS];
    if (staged) load_row_staged(task.row, first, vis, slice, &bar, key);
    else load_row(task.row, first, vis, key);
    clear_counters(hist, pub, sort);  // (find_floor's barrier publishes the three)
    find_floor(key, first, vis, k_eff, warp_min, warp_max, warp_live, floor_key, lo_key, hi_key);
    int n_mine = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) n_mine += first + i < vis && key[i] >= floor_key;
    list_before = block_exclusive_scan(n_mine, warp_sums, &n_list);
    listed = n_list <= kCandidates;
    if (listed) {
      int slot = list_before;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        if (first + i < vis && key[i] >= floor_key) {
          list_key[slot] = key[i];
          list_index[slot] = uint16_t(first + i);
          ++slot;
        }
      }
      __syncthreads();
    }
  }
  // this thread's share of the list: a contiguous range, so that threads in order visit it in order
  const int per_thread = (n_list + kThreads - 1) / kThreads;
  const int list_lo = min(int(threadIdx.x) * per_thread, n_list), list_hi = min(list_lo + per_thread, n_list);
  const auto in_list = [&](auto&& f) {
    for (int c = list_lo; c < list_hi; ++c) f(list_key[c], int(list_index[c]));
  };
  const auto in_row = [&](auto&& f) {
#pragma unroll 4  // (unrolled further, the row loop spills)
    for (int i = 0; i < ITEMS; ++i) {
      if (first + i < vis) {
        const uint32_t k = ordered_key(__ldg(task.row + first + i));
        if (k >= floor_key) f(k, first + i);
      }
    }
  };

  uint32_t lo = lo_key, span = hi_key - lo_key;
  int k_rem = k_eff;
  bool done = k_eff == 0;
  if (listed) select_threshold(in_list, lo, span, k_rem, done, hist, sink, warp_sums, pub);
  else select_threshold(in_row, lo, span, k_rem, done, hist, sink, warp_sums, pub);
  const uint32_t hi = lo + span;
  // (rows off the list keep the ordered compaction: a second unordered one, inlined, made this kernel spill)
  if (listed) compact_picks(in_list, lo, hi, k_rem, done && k_eff > 0, picks, warp_sums, &pub.claimed);
  else compact_picks(in_row, lo, hi, k_rem, false, picks, warp_sums, &pub.claimed);
  order_picks</*kSortCall=*/false>(picks, task.out_row, so_k, k_eff, topk, kpad, lo, hi_key, sort, warp_sums);
}

template <int ITEMS>
cudaError_t launch(const float* scores, int64_t ss_b, int64_t ss_s, const int* visible, int64_t sv_b,
                   int64_t sv_s, int* out, int64_t so_b, int64_t so_s, int64_t so_k, int rows, int S, int N,
                   int topk, int kpad, cudaStream_t stream) {
  if constexpr (ITEMS <= 16) {
    topk_rows_kernel<ITEMS><<<rows, kThreads, 0, stream>>>(scores, ss_b, ss_s, visible, sv_b, sv_s, out, so_b, so_s,
                                                           so_k, S, N, topk, kpad);
  } else {
    // the list's shared memory is past the 48 KB a launch gets by default: opt in, once a device (eager
    // calls come before any CUDA-graph capture)
    constexpr int bytes = int(ListSmem<ITEMS>::kBytes);
    static std::atomic<uint64_t> opted{0};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    const uint64_t bit = 1ull << (device & 63);
    if (!(opted.load() & bit)) {
      err = cudaFuncSetAttribute(topk_rows_list_kernel<ITEMS>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      if (err != cudaSuccess) return err;
      opted.fetch_or(bit);
    }
    topk_rows_list_kernel<ITEMS><<<rows, kThreads, bytes, stream>>>(scores, ss_b, ss_s, visible, sv_b, sv_s, out,
                                                                    so_b, so_s, so_k, S, N, topk, kpad);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t topk_rows(const float* scores, int64_t ss_b, int64_t ss_s, const int* visible, int64_t sv_b,
                      int64_t sv_s, int* out, int64_t so_b, int64_t so_s, int64_t so_k, int64_t B, int64_t S,
                      int N, int topk, cudaStream_t stream) {
  if (B <= 0 || S <= 0) return cudaSuccess;
  if (N < 1 || N > kTopkRowsMaxEntries || topk < 1 || topk > kMaxTopk) return cudaErrorInvalidValue;
  if (B * S > int64_t(0x7FFFFFFF)) return cudaErrorInvalidValue;  // one CTA a row, one grid
  const int rows = int(B * S);
  int kpad = kThreads;  // the sort's size: a power of two, at least one pick a thread
  while (kpad < topk) kpad <<= 1;
  const int per_thread = (N + kThreads - 1) / kThreads;
#define DSV4_LAUNCH(I) launch<I>(scores, ss_b, ss_s, visible, sv_b, sv_s, out, so_b, so_s, so_k, rows, int(S), N, topk, \
                                 kpad, stream)
  if (per_thread <= 4) return DSV4_LAUNCH(4);
  if (per_thread <= 8) return DSV4_LAUNCH(8);
  if (per_thread <= 16) return DSV4_LAUNCH(16);
  if (per_thread <= 32) return DSV4_LAUNCH(32);
  return DSV4_LAUNCH(kMaxItems);
#undef DSV4_LAUNCH
}

}  // namespace dsv4
