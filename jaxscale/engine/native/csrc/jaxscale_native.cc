// jaxscale native CPU kernels: embedding gathers and fused sparse optimizers, called through XLA's FFI.
//
// Routing: each request's rank among the earlier requests bound for the same owner, and the bag of each
// received pair slot from the senders' per-bag counts: one sequential pass each (O(n), where XLA on CPU
// needs a running sum over a one-hot [n, owners] and a scatter + running sum).
// Forward: gather rows (zeros for invalid rows) and gather + pool bags (sum / mean over the valid ids),
// parallel over the batch with software prefetch of the rows a few ids ahead.
// Backward: (row, source) pairs are sorted by row with a stable LSD radix sort, grouped into unique rows,
// and each unique row's gradient is summed in the original order and applied once, in place. Blocks of
// unique rows are disjoint, so threads never write the same row: no atomics, and the result does not
// depend on the number of threads (the sort is stable, each row is summed by one thread in a fixed order).
//
// Threads come from XLA's own intra-op pool (Ctx<ThreadPool>); the calling thread takes part and never
// waits for a task that has not started, so a busy pool cannot deadlock a call.
//
// Build: see jaxscale/native/build.py (g++ -O3 -std=c++17 -shared -fPIC -ffp-contract=off, cached).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxscale_native {
namespace {

constexpr int kAbiVersion = 4;
constexpr int64_t kPrefetchIds = 8;     // ids ahead whose rows are prefetched in the gathers
constexpr int64_t kPrefetchUniques = 8;  // unique rows ahead prefetched in the update
constexpr int kMaxDigitBits = 11;       // radix sort digit: two passes up to 4M rows (2048 buckets)

enum Pooling : int32_t { kSum = 1, kMean = 2 };
enum Optimizer : int32_t { kSgd = 0, kRowwiseAdagrad = 1 };

// ------------------------------------------------------------------------------------------ threads

int64_t HardwareThreads() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int64_t>(n) : 1;
}

struct TaskQueue {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  int64_t count = 0;
  const std::function<void(int64_t)>* fn = nullptr;

  // Claims and runs tasks until none is left. A late helper finds none and touches nothing but *this.
  void Drain() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) {
      (*fn)(i);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs fn(i) for every i in [0, count) on XLA's pool and the calling thread. Which thread runs which i
// never changes a result: every kernel below gives each output element to exactly one task.
void ParallelFor(ffi::ThreadPool* pool, int64_t count, const std::function<void(int64_t)>& fn) {
  if (count <= 0) return;
  static const int64_t hw = HardwareThreads();
  int64_t workers = pool != nullptr ? std::min<int64_t>(pool->num_threads(), hw) : 1;
  int64_t helpers = std::min<int64_t>(workers, count) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < count; ++i) fn(i);
    return;
  }
  auto queue = std::make_shared<TaskQueue>();
  queue->count = count;
  queue->fn = &fn;
  for (int64_t h = 0; h < helpers; ++h) pool->Schedule([queue] { queue->Drain(); });
  queue->Drain();
  while (queue->finished.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

// --------------------------------------------------------------------------------------- row helpers

inline void PrefetchRow(const float* row, int64_t w, bool for_write) {
  const char* p = reinterpret_cast<const char*>(row);
  const int64_t bytes = w * static_cast<int64_t>(sizeof(float));
  for (int64_t off = 0; off < bytes; off += 64) {
    if (for_write) {
      __builtin_prefetch(p + off, 1, 3);
    } else {
      __builtin_prefetch(p + off, 0, 3);
    }
  }
}

// Width W > 0 is a compile-time row width (fully unrolled, vectorized); W == 0 reads the runtime width.
template <int W>
struct Width {
  int64_t dynamic;
  inline int64_t get() const { return W > 0 ? W : dynamic; }
};

template <int W>
inline void Copy(float* __restrict dst, const float* __restrict src, Width<W> width) {
  const int64_t w = width.get();
  for (int64_t j = 0; j < w; ++j) dst[j] = src[j];
}

template <int W>
inline void AddTo(float* __restrict dst, const float* __restrict src, Width<W> width) {
  const int64_t w = width.get();
  for (int64_t j = 0; j < w; ++j) dst[j] += src[j];
}

template <int W>
inline float SumOfSquares(const float* __restrict g, Width<W> width) {
  const int64_t w = width.get();
  // Eight independent partial sums: vectorizes without -ffast-math; order is fixed for a given width.
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= w; j += 8) {
    for (int k = 0; k < 8; ++k) part[k] += g[j + k] * g[j + k];
  }
  for (; j < w; ++j) part[0] += g[j] * g[j];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// Calls body.template operator()<W>() with a compile-time width for the common widths.
template <typename Body>
void DispatchWidth(int64_t w, Body&& body) {
  switch (w) {
    case 4: body(Width<4>{4}); break;
    case 8: body(Width<8>{8}); break;
    case 16: body(Width<16>{16}); break;
    case 32: body(Width<32>{32}); break;
    case 64: body(Width<64>{64}); break;
    case 128: body(Width<128>{128}); break;
    case 256: body(Width<256>{256}); break;
    default: body(Width<0>{w}); break;
  }
}

// Row accumulator: on the stack for compile-time widths, on the heap otherwise.
template <int W>
struct RowBuffer {
  alignas(64) float fixed[W > 0 ? W : 1];
  std::vector<float> dynamic;
  explicit RowBuffer(int64_t w) {
    if (W == 0) dynamic.resize(static_cast<size_t>(std::max<int64_t>(w, 1)));
  }
  float* data() { return W > 0 ? fixed : dynamic.data(); }
};

inline bool ValidRow(int32_t id, int64_t rows) { return id >= 0 && static_cast<int64_t>(id) < rows; }

// ------------------------------------------------------------------------------------------ gathers

// out[i] = table[rows[i]] (zeros for rows outside [0, R)).
template <int W>
void GatherRange(const float* table, int64_t R, const int32_t* rows, int64_t m, float* out, int64_t i0,
                 int64_t i1, Width<W> width) {
  const int64_t w = width.get();
  for (int64_t i = i0; i < i1; ++i) {
    if (i + kPrefetchIds < m && ValidRow(rows[i + kPrefetchIds], R)) {
      PrefetchRow(table + static_cast<int64_t>(rows[i + kPrefetchIds]) * w, w, false);
    }
    float* o = out + i * w;
    const int32_t r = rows[i];
    if (ValidRow(r, R)) {
      Copy(o, table + static_cast<int64_t>(r) * w, width);
    } else {
      std::memset(o, 0, static_cast<size_t>(w) * sizeof(float));
    }
  }
}

// out[b] = sum (or mean) of table[ids[b, l]] over the valid ids of bag b (zeros for an empty bag).
template <int W>
void PoolRange(const float* table, int64_t R, const int32_t* ids, int64_t B, int64_t L, int32_t pooling,
               float* out, int64_t b0, int64_t b1, Width<W> width) {
  const int64_t w = width.get();
  const int64_t n = B * L;
  RowBuffer<W> buffer(w);
  float* acc = buffer.data();
  for (int64_t b = b0; b < b1; ++b) {
    std::memset(acc, 0, static_cast<size_t>(w) * sizeof(float));
    int64_t count = 0;
    for (int64_t l = 0; l < L; ++l) {
      const int64_t p = b * L + l;
      if (p + kPrefetchIds < n && ValidRow(ids[p + kPrefetchIds], R)) {
        PrefetchRow(table + static_cast<int64_t>(ids[p + kPrefetchIds]) * w, w, false);
      }
      const int32_t id = ids[p];
      if (!ValidRow(id, R)) continue;
      AddTo(acc, table + static_cast<int64_t>(id) * w, width);
      ++count;
    }
    float* o = out + b * w;
    if (pooling == kMean && count > 1) {
      const float c = static_cast<float>(count);
      for (int64_t j = 0; j < w; ++j) o[j] = acc[j] / c;
    } else {
      Copy(o, acc, width);
    }
  }
}

// Number of equal work items for n units of cost `unit_cost` each, about `target` cost per item.
int64_t Blocks(int64_t n, int64_t unit_cost, int64_t target) {
  if (n <= 0) return 0;
  int64_t per = std::max<int64_t>(1, target / std::max<int64_t>(unit_cost, 1));
  return (n + per - 1) / per;
}

// ---------------------------------------------------------------------------- grouping (radix sort)

// A (row, source) pair packed as row << 32 | source. Sources are appended in increasing order, so sorting
// the packed values (by row, then source) is the stable sort by row: each row's sources stay in their
// original order, which fixes the summation order independently of threads and sort details.
inline uint64_t Pack(uint32_t row, uint32_t source) { return (static_cast<uint64_t>(row) << 32) | source; }
inline uint32_t RowOf(uint64_t pair) { return static_cast<uint32_t>(pair >> 32); }
inline uint32_t SourceOf(uint64_t pair) { return static_cast<uint32_t>(pair); }

// Scratch reused across calls by the calling thread (helpers only read/write through the pointers).
struct Scratch {
  std::vector<uint64_t> pairs, pairs_tmp;
  std::vector<int64_t> starts;
  std::vector<uint32_t> histogram;
  std::vector<float> scaled;
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// LSD radix sort of packed pairs by their row (rows <= max_row), in as few passes of at most kMaxDigitBits
// bits as the row count needs (fewer passes beat L1-sized digits here). Returns the buffer holding the result.
uint64_t* SortByRow(ffi::ThreadPool* pool, uint64_t* data, uint64_t* tmp, int64_t n, uint32_t max_row,
                    std::vector<uint32_t>& histogram) {
  int bits = 0;
  while (bits < 32 && (max_row >> bits) != 0) ++bits;
  if (n <= 1 || bits == 0) return data;
  const int passes = (bits + kMaxDigitBits - 1) / kMaxDigitBits;
  const int digit_bits = (bits + passes - 1) / passes;
  const uint32_t radix = 1u << digit_bits;
  const uint32_t mask = radix - 1;
  const int64_t chunks = std::min<int64_t>(64, std::max<int64_t>(1, n / 32768));
  const int64_t per_chunk = (n + chunks - 1) / chunks;
  histogram.assign(static_cast<size_t>(chunks * radix), 0);
  uint32_t* hist = histogram.data();
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = 32 + pass * digit_bits;
    std::fill(histogram.begin(), histogram.end(), 0u);
    ParallelFor(pool, chunks, [&](int64_t c) {
      uint32_t* h = hist + c * radix;
      const int64_t lo = c * per_chunk, hi = std::min(n, lo + per_chunk);
      for (int64_t i = lo; i < hi; ++i) ++h[(data[i] >> shift) & mask];
    });
    // Exclusive prefix over (digit, chunk): chunk c's items of a digit follow those of chunks < c.
    uint32_t running = 0;
    for (uint32_t d = 0; d < radix; ++d) {
      for (int64_t c = 0; c < chunks; ++c) {
        const uint32_t count = hist[c * radix + d];
        hist[c * radix + d] = running;
        running += count;
      }
    }
    ParallelFor(pool, chunks, [&](int64_t c) {
      uint32_t* h = hist + c * radix;
      const int64_t lo = c * per_chunk, hi = std::min(n, lo + per_chunk);
      for (int64_t i = lo; i < hi; ++i) tmp[h[(data[i] >> shift) & mask]++] = data[i];
    });
    std::swap(data, tmp);
  }
  return data;
}

// Sorted pairs grouped into unique rows: the pairs of unique row u are pairs[starts[u] .. starts[u+1]).
struct Groups {
  const uint64_t* pairs = nullptr;
  const int64_t* starts = nullptr;
  int64_t unique = 0;
};

// Groups the first n packed pairs of s.pairs (rows < R).
Groups GroupPairs(ffi::ThreadPool* pool, Scratch& s, int64_t n, int64_t R) {
  Groups g;
  if (n == 0) return g;
  // Pairs that arrive in order (a gather-segment-sum's segments usually do: each sender lists its bags in
  // order) need no sort; the check stops at the first pair out of order, so unsorted input costs ~nothing.
  const uint64_t* sorted = s.pairs.data();
  if (!std::is_sorted(s.pairs.data(), s.pairs.data() + n)) {
    s.pairs_tmp.resize(static_cast<size_t>(n));
    sorted = SortByRow(pool, s.pairs.data(), s.pairs_tmp.data(), n, static_cast<uint32_t>(R - 1), s.histogram);
  }
  s.starts.resize(static_cast<size_t>(n) + 1);
  int64_t* starts = s.starts.data();
  int64_t u = 0;
  starts[u++] = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (RowOf(sorted[i]) != RowOf(sorted[i - 1])) starts[u++] = i;
  }
  starts[u] = n;
  g.pairs = sorted;
  g.starts = starts;
  g.unique = u;
  return g;
}

// ------------------------------------------------------------------------------------ fused update

struct UpdateArgs {
  float* table = nullptr;          // [R, w], updated in place
  float* acc = nullptr;            // [R] (AdaGrad only)
  const float* sources = nullptr;  // gradient source rows [*, w]
  const float* increment = nullptr;  // optional per-source AdaGrad increment (first of each row is used)
  int64_t w = 0;
  int32_t optimizer = kSgd;
  float learning_rate = 0;
  float eps = 0;
};

// For every unique row of block [u0, u1): sum its source rows in sorted (= original) order, then apply.
template <int W>
void UpdateBlock(const UpdateArgs& a, const Groups& g, int64_t u0, int64_t u1, Width<W> width) {
  const int64_t w = width.get();
  RowBuffer<W> buffer(w);
  float* sum = buffer.data();
  const int64_t total = g.starts[g.unique];
  const uint64_t* pairs = g.pairs;
  for (int64_t u = u0; u < u1; ++u) {
    if (u + kPrefetchUniques < g.unique) {
      const int64_t ahead = RowOf(pairs[g.starts[u + kPrefetchUniques]]);
      PrefetchRow(a.table + ahead * w, w, true);
      if (a.optimizer == kRowwiseAdagrad) __builtin_prefetch(a.acc + ahead, 1, 3);
    }
    const int64_t s = g.starts[u], e = g.starts[u + 1];
    for (int64_t i = s; i < e; ++i) {
      if (i + kPrefetchIds < total) PrefetchRow(a.sources + static_cast<int64_t>(SourceOf(pairs[i + kPrefetchIds])) * w, w, false);
      const float* src = a.sources + static_cast<int64_t>(SourceOf(pairs[i])) * w;
      if (i == s) {
        Copy(sum, src, width);
      } else {
        AddTo(sum, src, width);
      }
    }
    const int64_t r = RowOf(pairs[s]);
    float* row = a.table + r * w;
    if (a.optimizer == kRowwiseAdagrad) {
      const float add =
          a.increment != nullptr ? a.increment[SourceOf(pairs[s])] : SumOfSquares(sum, width) / static_cast<float>(w);
      float& acc = a.acc[r];
      acc += add;
      const float multiplier = a.learning_rate / (std::sqrt(acc) + a.eps);
      for (int64_t j = 0; j < w; ++j) row[j] -= multiplier * sum[j];
    } else {
      const float lr = a.learning_rate;
      for (int64_t j = 0; j < w; ++j) row[j] -= lr * sum[j];
    }
  }
}

void ApplyGroups(ffi::ThreadPool* pool, const UpdateArgs& a, const Groups& g) {
  if (g.unique == 0) return;
  // ~64 unique rows per task; tasks are claimed dynamically, so a hot (Zipf) row does not stall a block.
  const int64_t per = 64;
  const int64_t tasks = (g.unique + per - 1) / per;
  DispatchWidth(a.w, [&](auto width) {
    ParallelFor(pool, tasks, [&](int64_t t) {
      UpdateBlock(a, g, t * per, std::min(g.unique, (t + 1) * per), width);
    });
  });
}

// Outputs alias the inputs (input_output_aliases); if XLA ever hands over distinct buffers, copy first.
void CopyIfNotAliased(const float* in, float* out, int64_t count) {
  if (in != out && count > 0) std::memcpy(out, in, static_cast<size_t>(count) * sizeof(float));
}

// ------------------------------------------------------------------------------------------ handlers

using F32R1 = ffi::Buffer<ffi::F32, 1>;
using F32R2 = ffi::Buffer<ffi::F32, 2>;
using S32R1 = ffi::Buffer<ffi::S32, 1>;
using S32R2 = ffi::Buffer<ffi::S32, 2>;
using PredR0 = ffi::Buffer<ffi::PRED, 0>;
using F32R1Out = ffi::ResultBuffer<ffi::F32, 1>;
using F32R2Out = ffi::ResultBuffer<ffi::F32, 2>;
using S32R1Out = ffi::ResultBuffer<ffi::S32, 1>;
using S32R2Out = ffi::ResultBuffer<ffi::S32, 2>;
// The table and accumulator of the update ops: any rank (the engine passes its [1, 1, R, w] / [1, 1, R]
// state blocks as they are: a reshape before an in-place custom call makes XLA copy the donated buffer).
using F32State = ffi::Buffer<ffi::F32>;
using F32StateOut = ffi::ResultBuffer<ffi::F32>;

// Rows and width of a table block of any rank >= 2 (the last axis is the width).
inline std::pair<int64_t, int64_t> TableShape(const F32State& table) {
  auto d = table.dimensions();
  const int64_t w = d.size() == 0 ? 0 : d[d.size() - 1];
  return {w == 0 ? 0 : static_cast<int64_t>(table.element_count()) / w, w};
}

ffi::Error GatherRowsImpl(ffi::ThreadPool pool, F32R2 table, S32R1 rows, F32R2Out out) {
  const int64_t R = table.dimensions()[0], w = table.dimensions()[1], m = rows.dimensions()[0];
  if (out->dimensions()[0] != m || out->dimensions()[1] != w) {
    return ffi::Error::InvalidArgument("jaxscale_gather_rows: output must be [rows, width]");
  }
  if (m == 0 || w == 0) return ffi::Error::Success();
  const float* t = table.typed_data();
  const int32_t* r = rows.typed_data();
  float* o = out->typed_data();
  const int64_t tasks = Blocks(m, w, 64 * 1024);
  const int64_t per = (m + tasks - 1) / tasks;
  DispatchWidth(w, [&](auto width) {
    ParallelFor(&pool, tasks, [&](int64_t k) {
      GatherRange(t, R, r, m, o, k * per, std::min(m, (k + 1) * per), width);
    });
  });
  return ffi::Error::Success();
}

ffi::Error GatherPoolImpl(ffi::ThreadPool pool, F32R2 table, S32R2 ids, F32R2Out out, int32_t pooling) {
  const int64_t R = table.dimensions()[0], w = table.dimensions()[1];
  const int64_t B = ids.dimensions()[0], L = ids.dimensions()[1];
  if (pooling != kSum && pooling != kMean) return ffi::Error::InvalidArgument("jaxscale_gather_pool: bad pooling");
  if (out->dimensions()[0] != B || out->dimensions()[1] != w) {
    return ffi::Error::InvalidArgument("jaxscale_gather_pool: output must be [bags, width]");
  }
  if (B == 0 || w == 0) return ffi::Error::Success();
  const float* t = table.typed_data();
  const int32_t* x = ids.typed_data();
  float* o = out->typed_data();
  const int64_t tasks = Blocks(B, std::max<int64_t>(L, 1) * w, 64 * 1024);
  const int64_t per = (B + tasks - 1) / tasks;
  DispatchWidth(w, [&](auto width) {
    ParallelFor(&pool, tasks, [&](int64_t k) {
      PoolRange(t, R, x, B, L, pooling, o, k * per, std::min(B, (k + 1) * per), width);
    });
  });
  return ffi::Error::Success();
}

ffi::Error CheckOptimizer(int32_t optimizer, int64_t R, int64_t acc_rows) {
  if (optimizer != kSgd && optimizer != kRowwiseAdagrad) {
    return ffi::Error::InvalidArgument("jaxscale update: optimizer must be 0 (sgd) or 1 (rowwise_adagrad)");
  }
  if (optimizer == kRowwiseAdagrad && acc_rows != R) {
    return ffi::Error::InvalidArgument("jaxscale update: the accumulator must have one entry per table row");
  }
  return ffi::Error::Success();
}

ffi::Error UpdateRowsImpl(ffi::ThreadPool pool, F32State table, F32State acc, S32R1 rows, F32R2 grads, PredR0 apply,
                          F32R1 increment, ffi::AnyBuffer /*after*/, F32StateOut table_out, F32StateOut acc_out, int32_t optimizer,
                          float learning_rate, float eps) {
  const auto [R, w] = TableShape(table);
  const int64_t m = rows.dimensions()[0];
  if (auto err = CheckOptimizer(optimizer, R, static_cast<int64_t>(acc.element_count())); err.failure()) return err;
  if (grads.dimensions()[0] != m || grads.dimensions()[1] != w) {
    return ffi::Error::InvalidArgument("jaxscale_update_rows: grads must be [len(rows), width]");
  }
  const bool has_increment = increment.dimensions()[0] != 0;
  if (has_increment && increment.dimensions()[0] != m) {
    return ffi::Error::InvalidArgument("jaxscale_update_rows: acc_increment must be [len(rows)]");
  }
  CopyIfNotAliased(table.typed_data(), table_out->typed_data(), R * w);
  CopyIfNotAliased(acc.typed_data(), acc_out->typed_data(), static_cast<int64_t>(acc.element_count()));
  if (!*apply.typed_data() || m == 0 || R == 0 || w == 0) return ffi::Error::Success();

  if (m > INT32_MAX) return ffi::Error::InvalidArgument("jaxscale_update_rows: more than 2**31 rows");
  Scratch& s = ThreadScratch();
  s.pairs.resize(static_cast<size_t>(m));
  const int32_t* r = rows.typed_data();
  uint64_t* pairs = s.pairs.data();
  int64_t n = 0;
  for (int64_t i = 0; i < m; ++i) {
    if (ValidRow(r[i], R)) pairs[n++] = Pack(static_cast<uint32_t>(r[i]), static_cast<uint32_t>(i));
  }
  Groups g = GroupPairs(&pool, s, n, R);
  UpdateArgs a;
  a.table = table_out->typed_data();
  a.acc = acc_out->typed_data();
  a.sources = grads.typed_data();
  a.increment = has_increment ? increment.typed_data() : nullptr;
  a.w = w;
  a.optimizer = optimizer;
  a.learning_rate = learning_rate;
  a.eps = eps;
  ApplyGroups(&pool, a, g);
  return ffi::Error::Success();
}

ffi::Error UpdatePooledImpl(ffi::ThreadPool pool, F32State table, F32State acc, S32R2 ids, F32R2 grad, PredR0 apply,
                            ffi::AnyBuffer /*after*/, F32StateOut table_out, F32StateOut acc_out, int32_t pooling, int32_t optimizer,
                            float learning_rate, float eps) {
  const auto [R, w] = TableShape(table);
  const int64_t B = ids.dimensions()[0], L = ids.dimensions()[1];
  if (auto err = CheckOptimizer(optimizer, R, static_cast<int64_t>(acc.element_count())); err.failure()) return err;
  if (pooling != kSum && pooling != kMean) return ffi::Error::InvalidArgument("jaxscale_update_pooled: bad pooling");
  if (grad.dimensions()[0] != B || grad.dimensions()[1] != w) {
    return ffi::Error::InvalidArgument("jaxscale_update_pooled: grad must be [bags, width]");
  }
  CopyIfNotAliased(table.typed_data(), table_out->typed_data(), R * w);
  CopyIfNotAliased(acc.typed_data(), acc_out->typed_data(), static_cast<int64_t>(acc.element_count()));
  const int64_t total = B * L;
  if (!*apply.typed_data() || total == 0 || R == 0 || w == 0) return ffi::Error::Success();
  if (total > INT32_MAX) return ffi::Error::InvalidArgument("jaxscale_update_pooled: more than 2**31 ids");

  Scratch& s = ThreadScratch();
  s.pairs.resize(static_cast<size_t>(total));
  uint64_t* pairs = s.pairs.data();
  const int32_t* x = ids.typed_data();
  const float* sources = grad.typed_data();
  if (pooling == kMean) s.scaled.resize(static_cast<size_t>(B * w));
  int64_t n = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = n;
    for (int64_t l = 0; l < L; ++l) {
      const int32_t id = x[b * L + l];
      // The source is the bag: its output gradient is the gradient of each of its ids.
      if (ValidRow(id, R)) pairs[n++] = Pack(static_cast<uint32_t>(id), static_cast<uint32_t>(b));
    }
    if (pooling == kMean) {  // d(mean)/d(row) = 1 / (valid ids of the bag)
      const float c = static_cast<float>(std::max<int64_t>(n - first, 1));
      const float* gb = sources + b * w;
      float* sb = s.scaled.data() + b * w;
      for (int64_t j = 0; j < w; ++j) sb[j] = gb[j] / c;
    }
  }
  Groups g = GroupPairs(&pool, s, n, R);
  UpdateArgs a;
  a.table = table_out->typed_data();
  a.acc = acc_out->typed_data();
  a.sources = pooling == kMean ? s.scaled.data() : sources;
  a.w = w;
  a.optimizer = optimizer;
  a.learning_rate = learning_rate;
  a.eps = eps;
  ApplyGroups(&pool, a, g);
  return ffi::Error::Success();
}

// out[s] = sum of table[rows[i]] over the i with segments[i] == s, in increasing i (zeros for an empty s).
ffi::Error GatherSegmentSumImpl(ffi::ThreadPool pool, F32R2 table, S32R1 rows, S32R1 segments, F32R2Out out) {
  const int64_t R = table.dimensions()[0], w = table.dimensions()[1], m = rows.dimensions()[0];
  const int64_t S = out->dimensions()[0];
  if (segments.dimensions()[0] != m || out->dimensions()[1] != w) {
    return ffi::Error::InvalidArgument("jaxscale_gather_segment_sum: segments must be [len(rows)], out [S, width]");
  }
  if (m > INT32_MAX) return ffi::Error::InvalidArgument("jaxscale_gather_segment_sum: more than 2**31 rows");
  float* o = out->typed_data();
  if (S == 0 || w == 0) return ffi::Error::Success();
  std::memset(o, 0, static_cast<size_t>(S * w) * sizeof(float));
  if (m == 0 || R == 0) return ffi::Error::Success();
  Scratch& s = ThreadScratch();
  s.pairs.resize(static_cast<size_t>(m));
  uint64_t* pairs = s.pairs.data();
  const int32_t* r = rows.typed_data();
  const int32_t* seg = segments.typed_data();
  int64_t n = 0;
  for (int64_t i = 0; i < m; ++i) {
    if (ValidRow(r[i], R) && ValidRow(seg[i], S)) pairs[n++] = Pack(static_cast<uint32_t>(seg[i]), static_cast<uint32_t>(i));
  }
  Groups g = GroupPairs(&pool, s, n, S);
  if (g.unique == 0) return ffi::Error::Success();
  const float* t = table.typed_data();
  const int64_t per = 64;
  const int64_t tasks = (g.unique + per - 1) / per;
  DispatchWidth(w, [&](auto width) {
    ParallelFor(&pool, tasks, [&](int64_t task) {
      const int64_t u1 = std::min(g.unique, (task + 1) * per);
      for (int64_t u = task * per; u < u1; ++u) {
        const int64_t b = g.starts[u], e = g.starts[u + 1];
        float* dst = o + static_cast<int64_t>(RowOf(g.pairs[b])) * w;
        for (int64_t i = b; i < e; ++i) {
          if (i + kPrefetchIds < n) PrefetchRow(t + static_cast<int64_t>(r[SourceOf(g.pairs[i + kPrefetchIds])]) * w, w, false);
          const float* src = t + static_cast<int64_t>(r[SourceOf(g.pairs[i])]) * w;
          if (i == b) {
            Copy(dst, src, width);
          } else {
            AddTo(dst, src, width);
          }
        }
      }
    });
  });
  return ffi::Error::Success();
}

// Row rows[i] receives the gradient grads[grad_index[i]]: summed per unique row, then one optimizer step.
ffi::Error UpdateRowsIndexedImpl(ffi::ThreadPool pool, F32State table, F32State acc, S32R1 rows, S32R1 grad_index,
                                 F32R2 grads, PredR0 apply, ffi::AnyBuffer /*after*/, F32StateOut table_out,
                                 F32StateOut acc_out, int32_t optimizer, float learning_rate, float eps) {
  const auto [R, w] = TableShape(table);
  const int64_t m = rows.dimensions()[0];
  const int64_t G = grads.dimensions()[0];
  if (auto err = CheckOptimizer(optimizer, R, static_cast<int64_t>(acc.element_count())); err.failure()) return err;
  if (grad_index.dimensions()[0] != m || grads.dimensions()[1] != w) {
    return ffi::Error::InvalidArgument("jaxscale_update_rows_indexed: grad_index must be [len(rows)], grads [G, width]");
  }
  if (m > INT32_MAX) return ffi::Error::InvalidArgument("jaxscale_update_rows_indexed: more than 2**31 rows");
  CopyIfNotAliased(table.typed_data(), table_out->typed_data(), R * w);
  CopyIfNotAliased(acc.typed_data(), acc_out->typed_data(), static_cast<int64_t>(acc.element_count()));
  if (!*apply.typed_data() || m == 0 || R == 0 || w == 0 || G == 0) return ffi::Error::Success();
  Scratch& s = ThreadScratch();
  s.pairs.resize(static_cast<size_t>(m));
  uint64_t* pairs = s.pairs.data();
  const int32_t* r = rows.typed_data();
  const int32_t* gi = grad_index.typed_data();
  int64_t n = 0;
  for (int64_t i = 0; i < m; ++i) {
    // Sorting (row, source) pairs orders each row's sources by index: a fixed summation order.
    if (ValidRow(r[i], R) && ValidRow(gi[i], G)) pairs[n++] = Pack(static_cast<uint32_t>(r[i]), static_cast<uint32_t>(gi[i]));
  }
  Groups g = GroupPairs(&pool, s, n, R);
  UpdateArgs a;
  a.table = table_out->typed_data();
  a.acc = acc_out->typed_data();
  a.sources = grads.typed_data();
  a.w = w;
  a.optimizer = optimizer;
  a.learning_rate = learning_rate;
  a.eps = eps;
  ApplyGroups(&pool, a, g);
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------------ routing

// rank[i] = how many j < i have owner[j] == owner[i]; -1 where owner[i] is outside [0, owners).
ffi::Error RankWithinOwnerImpl(S32R1 owner, S32R1Out rank, int32_t owners) {
  const int64_t n = owner.dimensions()[0];
  if (rank->dimensions()[0] != n) return ffi::Error::InvalidArgument("jaxscale_rank_within_owner: rank must be [n]");
  if (owners < 0) return ffi::Error::InvalidArgument("jaxscale_rank_within_owner: owners must be >= 0");
  if (n > INT32_MAX) return ffi::Error::InvalidArgument("jaxscale_rank_within_owner: more than 2**31 requests");
  std::vector<int32_t> seen(static_cast<size_t>(owners), 0);
  const int32_t* d = owner.typed_data();
  int32_t* r = rank->typed_data();
  for (int64_t i = 0; i < n; ++i) {
    const int32_t o = d[i];
    r[i] = (o >= 0 && o < owners) ? seen[static_cast<size_t>(o)]++ : -1;
  }
  return ffi::Error::Success();
}

// counts [S, G]: pairs sender s sent of each bag, listed in bag order. bag[s, j] = the bag of slot j of
// sender s; -1 past the sender's last pair (or past capacity). Negative counts count as zero.
ffi::Error SlotBagsImpl(S32R2 counts, S32R2Out bag) {
  const int64_t S = counts.dimensions()[0], G = counts.dimensions()[1];
  const int64_t C = bag->dimensions()[1];
  if (bag->dimensions()[0] != S) return ffi::Error::InvalidArgument("jaxscale_slot_bags: bag must be [S, capacity]");
  if (G > INT32_MAX) return ffi::Error::InvalidArgument("jaxscale_slot_bags: more than 2**31 bags");
  const int32_t* c = counts.typed_data();
  int32_t* out = bag->typed_data();
  for (int64_t s = 0; s < S; ++s) {
    int32_t* o = out + s * C;
    int64_t j = 0;
    for (int64_t g = 0; g < G && j < C; ++g) {
      const int64_t k = std::min<int64_t>(std::max<int32_t>(c[s * G + g], 0), C - j);
      std::fill(o + j, o + j + k, static_cast<int32_t>(g));
      j += k;
    }
    std::fill(o + j, o + C, -1);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxscale_native

using jaxscale_native::F32R1;
using jaxscale_native::F32R1Out;
using jaxscale_native::F32R2;
using jaxscale_native::F32R2Out;
using jaxscale_native::F32State;
using jaxscale_native::PredR0;
using jaxscale_native::S32R1;
using jaxscale_native::S32R2;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxscaleRankWithinOwner, jaxscale_native::RankWithinOwnerImpl,
                              ffi::Ffi::Bind().Arg<S32R1>().Ret<S32R1>().Attr<int32_t>("owners"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxscaleSlotBags, jaxscale_native::SlotBagsImpl,
                              ffi::Ffi::Bind().Arg<S32R2>().Ret<S32R2>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxscaleGatherRows, jaxscale_native::GatherRowsImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32R2>().Arg<S32R1>().Ret<F32R2>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxscaleGatherPool, jaxscale_native::GatherPoolImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32R2>()
                                  .Arg<S32R2>()
                                  .Ret<F32R2>()
                                  .Attr<int32_t>("pooling"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxscaleUpdateRows, jaxscale_native::UpdateRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32State>()  // table
                                  .Arg<F32State>()  // accumulator ([0] for SGD)
                                  .Arg<S32R1>()   // rows
                                  .Arg<F32R2>()   // grads
                                  .Arg<PredR0>()  // apply
                                  .Arg<F32R1>()   // acc_increment ([0] when absent)
                                  .Arg<ffi::AnyBuffer>()  // after: ignored; orders the update after it
                                  .Ret<F32State>()
                                  .Ret<F32State>()
                                  .Attr<int32_t>("optimizer")
                                  .Attr<float>("learning_rate")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxscaleUpdatePooled, jaxscale_native::UpdatePooledImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32State>()  // table
                                  .Arg<F32State>()  // accumulator ([0] for SGD)
                                  .Arg<S32R2>()   // ids [bags, L]
                                  .Arg<F32R2>()   // grad [bags, width]
                                  .Arg<PredR0>()  // apply
                                  .Arg<ffi::AnyBuffer>()  // after: ignored; orders the update after it
                                  .Ret<F32State>()
                                  .Ret<F32State>()
                                  .Attr<int32_t>("pooling")
                                  .Attr<int32_t>("optimizer")
                                  .Attr<float>("learning_rate")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxscaleGatherSegmentSum, jaxscale_native::GatherSegmentSumImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32R2>()  // table
                                  .Arg<S32R1>()  // rows
                                  .Arg<S32R1>()  // segments
                                  .Ret<F32R2>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxscaleUpdateRowsIndexed, jaxscale_native::UpdateRowsIndexedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32State>()  // table
                                  .Arg<F32State>()  // accumulator ([0] for SGD)
                                  .Arg<S32R1>()   // rows
                                  .Arg<S32R1>()   // grad_index
                                  .Arg<F32R2>()   // grads [G, width]
                                  .Arg<PredR0>()  // apply
                                  .Arg<ffi::AnyBuffer>()  // after: ignored; orders the update after it
                                  .Ret<F32State>()
                                  .Ret<F32State>()
                                  .Attr<int32_t>("optimizer")
                                  .Attr<float>("learning_rate")
                                  .Attr<float>("eps"));

extern "C" __attribute__((visibility("default"))) int jaxscale_native_abi_version() {
  return jaxscale_native::kAbiVersion;
}
