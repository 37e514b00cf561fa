// A matrix product of a few rows with a weight packed in column panels, on a pool of threads that
// wait for work by spinning first: an XLA FFI custom call for the CPU decode step.
//
//   y[M, P * 16] = x[M, K] @ W,  W given packed as panels[P, K, 16] (panel p = columns 16p .. 16p + 15),
//
// Why: a decode step multiplies a few rows by each weight, so a product streams the weight once and
// does little arithmetic per byte.  XLA:CPU splits such a product over its intra-op pool, whose
// helper threads wake 30-70 us after the caller (a futex wake on a virtual machine), by which time
// the caller has done most of the work alone.  Here the caller and helpers that spin for a while
// after each product claim chunks of panels from one counter, so all start at once and a helper that
// starts late takes less (or nothing); each panel is one contiguous stream.  Every output element is summed by one thread in the same order (k
// ascending, one fused multiply-add per k), so the result does not depend on the number of threads
// or on which thread took which chunk of panels.
//
// Built with the host's own vector width (-march=native) by mimo_jax.kernels.cpu_rows on first use.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <pthread.h>

#if defined(__linux__)
#include <sched.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kPanel = 16;  // floats per panel row: one 64-byte line
typedef float Vec __attribute__((vector_size(kPanel * sizeof(float))));

// Rows per pass over a panel: as many accumulators as the vector registers hold.
#if defined(__AVX512F__)
constexpr int kMaxRows = 16;  // 16 zmm accumulators of 32
#elif defined(__aarch64__)
constexpr int kMaxRows = 6;  // 6 x 4 q accumulators of 32
#elif defined(__AVX__)
constexpr int kMaxRows = 6;  // 6 x 2 ymm accumulators of 16
#else
constexpr int kMaxRows = 3;
#endif

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// R rows of x times one panel.
template <int R>
void PanelRows(const float* x, int64_t K, const float* panel, float* y, int64_t ldy) {
  Vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Vec{};
  for (int64_t k = 0; k < K; ++k) {
    Vec w;
    std::memcpy(&w, panel + k * kPanel, sizeof(Vec));
    for (int r = 0; r < R; ++r) acc[r] += x[r * K + k] * w;
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, &acc[r], sizeof(Vec));
}

typedef void (*PanelRowsFn)(const float*, int64_t, const float*, float*, int64_t);

template <size_t... I>
constexpr std::array<PanelRowsFn, sizeof...(I)> MakeTable(std::index_sequence<I...>) {
  return {&PanelRows<static_cast<int>(I) + 1>...};
}
constexpr auto kPanelRows = MakeTable(std::make_index_sequence<kMaxRows>{});

struct Product {
  const float* x;
  const float* panels;
  float* y;
  int64_t rows, k, num_panels;
};

// Panels [p0, p1) of the product, all rows.
void RunPanels(const Product& t, int64_t p0, int64_t p1) {
  const int64_t ldy = t.num_panels * kPanel;
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = t.panels + p * t.k * kPanel;
    for (int64_t m = 0; m < t.rows; m += kMaxRows) {
      const int r = static_cast<int>(std::min<int64_t>(kMaxRows, t.rows - m));
      kPanelRows[r - 1](t.x + m * t.k, t.k, panel, t.y + m * ldy + p * kPanel, ldy);
    }
  }
}

int HostThreads() {
  if (const char* env = std::getenv("MIMO_JAX_CPU_ROWS_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

class Pool {
 public:
  explicit Pool(int threads) : threads_(std::max(1, threads)) {
    for (int i = 1; i < threads_; ++i) std::thread([this] { Helper(); }).detach();
  }

  int threads() const { return threads_; }

  void Run(const Product& t) {
    // One product at a time on the helpers; a concurrent caller (another device's program) runs alone.
    std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
    if (!lock.owns_lock() || threads_ == 1 || t.num_panels < 2) {
      RunPanels(t, 0, t.num_panels);
      return;
    }
    // The new generation is closed while its product is written: a helper still holding the last
    // product's exhausted work word must not read this product's size and claim panels under the
    // old word (a claim that would write past the old product's output and count against this one).
    const uint64_t gen = (work_.load(std::memory_order_relaxed) >> 32) + 1;
    work_.store((gen << 32) | kClosed);
    // A helper that reads any of the product below also sees the generation closed (its fence).
    std::atomic_thread_fence(std::memory_order_release);
    x_.store(t.x, std::memory_order_relaxed);
    panels_.store(t.panels, std::memory_order_relaxed);
    y_.store(t.y, std::memory_order_relaxed);
    rows_.store(t.rows, std::memory_order_relaxed);
    k_.store(t.k, std::memory_order_relaxed);
    num_panels_.store(t.num_panels, std::memory_order_relaxed);
    chunk_.store(std::max<int64_t>(1, t.num_panels / (4 * threads_)), std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    work_.store(gen << 32);  // publishes the product; its first panel is next
    if (sleepers_.load() > 0) work_.notify_all();
    Work(gen);  // the caller takes chunks too: a helper that starts late finds less or nothing left
    while (done_.load(std::memory_order_acquire) != t.num_panels) CpuRelax();
  }

 private:
  static constexpr uint64_t kPanelMask = 0xffffffffu;
  static constexpr uint64_t kClosed = kPanelMask;  // next panel of a generation being written

  // Claims and runs chunks of product `gen` until none is left.  The work word holds the product's
  // generation (high half) and its next unclaimed panel (low half, kClosed while the caller writes
  // the product): a claim is one compare-exchange, and one that succeeds proves that the product
  // read just before it is still the current one (the caller closes the next generation before it
  // writes the next product, and does so only after every panel of this one is done).
  void Work(uint64_t gen) {
    uint64_t w = work_.load(std::memory_order_acquire);
    for (;;) {
      if ((w >> 32) != (gen & kPanelMask)) return;
      if ((w & kPanelMask) == kClosed) {  // published in a moment
        CpuRelax();
        w = work_.load(std::memory_order_acquire);
        continue;
      }
      const Product t{x_.load(std::memory_order_relaxed),      panels_.load(std::memory_order_relaxed),
                      y_.load(std::memory_order_relaxed),      rows_.load(std::memory_order_relaxed),
                      k_.load(std::memory_order_relaxed),      num_panels_.load(std::memory_order_relaxed)};
      const int64_t chunk = chunk_.load(std::memory_order_relaxed);
      // Pairs with the caller's fence: had any of these loads read the next product, the claim below
      // would see its generation closed and fail.
      std::atomic_thread_fence(std::memory_order_acquire);
      const int64_t p0 = static_cast<int64_t>(w & kPanelMask);
      if (p0 >= t.num_panels) return;
      const int64_t p1 = std::min(p0 + chunk, t.num_panels);
      if (!work_.compare_exchange_weak(w, (w & ~kPanelMask) | static_cast<uint64_t>(p1), std::memory_order_acq_rel,
                                       std::memory_order_acquire)) {
        continue;
      }
      RunPanels(t, p0, p1);
      done_.fetch_add(p1 - p0, std::memory_order_release);
      w = work_.load(std::memory_order_acquire);
    }
  }

  void Helper() {
    uint64_t seen = 0;  // the pool is made before its first product
    for (;;) {
      seen = Await(seen);
      Work(seen);
    }
  }

  // The next product's generation after `seen`.  Spins for kSpin after the last product (a decode
  // step's products come tens of microseconds apart), then sleeps until the next.
  uint64_t Await(uint64_t seen) {
    constexpr auto kSpin = std::chrono::microseconds(300);
    auto start = std::chrono::steady_clock::now();
    for (int i = 0;; ++i) {
      const uint64_t gen = work_.load(std::memory_order_acquire) >> 32;
      if (gen != seen) return gen;
      CpuRelax();
      if ((i & 255) == 255 && std::chrono::steady_clock::now() - start > kSpin) break;
    }
    for (;;) {
      sleepers_.fetch_add(1);
      const uint64_t w = work_.load();
      if ((w >> 32) == seen) work_.wait(w);  // wakes on any change of the word: checked again below
      sleepers_.fetch_sub(1);
      const uint64_t gen = work_.load(std::memory_order_acquire) >> 32;
      if (gen != seen) return gen;
    }
  }

  const int threads_;
  std::mutex busy_;
  // The current product (written by the caller before it publishes the work word).
  std::atomic<const float*> x_{nullptr};
  std::atomic<const float*> panels_{nullptr};
  std::atomic<float*> y_{nullptr};
  std::atomic<int64_t> rows_{0}, k_{0}, num_panels_{0}, chunk_{1};
  std::atomic<uint64_t> work_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
};

// The process's pool, made at the first product.  Never destroyed (helpers outlive static
// destruction); a forked child, which has none of its parent's helper threads, makes its own.
std::atomic<Pool*> g_pool{nullptr};
std::mutex g_pool_mutex;

void ForgetPoolInChild() { g_pool.store(nullptr); }

Pool& GetPool() {
  Pool* pool = g_pool.load(std::memory_order_acquire);
  if (pool != nullptr) return *pool;
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  pool = g_pool.load();
  if (pool == nullptr) {
    static const bool registered = (pthread_atfork(nullptr, nullptr, ForgetPoolInChild), true);
    (void)registered;
    pool = new Pool(HostThreads());
    g_pool.store(pool, std::memory_order_release);
  }
  return *pool;
}

ffi::Error RowsMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto pd = panels.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2 || pd[2] != kPanel || pd[1] != xd[1] ||
      yd[0] != xd[0] || yd[1] != pd[0] * kPanel) {
    return ffi::Error::InvalidArgument("rows_matmul: expected x [M, K], panels [P, K, 16] and y [M, 16 P]");
  }
  const Product t{x.typed_data(), panels.typed_data(), y->typed_data(), xd[0], xd[1], pd[0]};
  if (t.rows == 0 || t.num_panels == 0) return ffi::Error::Success();
  GetPool().Run(t);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MimoRowsMatmulF32, RowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int MimoRowsMatmulPanel() { return kPanel; }
extern "C" int MimoRowsMatmulMaxRows() { return kMaxRows; }
extern "C" int MimoRowsMatmulThreads() { return GetPool().threads(); }
