// How fast a native CPU Walsh-Hadamard transform of 2^24 float32 entries can be on this
// machine: the bound behind EDEN's goal in docs/benchmarks.md ("Where the missed goals stand").
//
// Not part of compjax (which stays JAX: compjax.hadamard runs the transform as XLA matrix
// products).  A cache-blocked butterfly, 24 additions per entry, in 16-lane vectors (GCC's
// vector extensions: AVX-512 registers where the CPU has them, two AVX2 ones otherwise):
//   1. rows of 2^12 entries (16 KiB, in L1): the 4 stages inside a vector by permutations,
//      the next 8 in registers, 16 vectors at a time (radix 16);
//   2. the remaining index bits in groups of at most 6: 64 rows of 128 entries copied into a
//      32 KiB scratch (rows a power of two apart conflict in the caches), transformed there,
//      copied back.
// So 3 passes over memory for 2^24 entries, each pass split over OpenMP threads.
//
//   g++ -O3 -march=native -fopenmp -std=c++17 experiments/bench/native_fwht.cc -o /tmp/native_fwht
//   /tmp/native_fwht [log2 n = 24] [rounds = 7]
//
// It checks the transform against a float64 butterfly (2^16, 2^20 and min(n, 2^22) entries),
// then prints the median time of a pass in place (x *= 2) and of the transform.
// Exit status 1 if a check fails.

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// The 4 stages between the lanes of one vector: lane k meets lane k ^ h, for h = 1, 2, 4, 8.
static inline v16 lane_stages(v16 x) {
  const i16 p1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  const i16 p2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const i16 p4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const i16 p8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const v16 s1 = {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1};
  const v16 s2 = {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1};
  const v16 s4 = {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1};
  const v16 s8 = {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};
  // The low lane of a pair gets a + b, the high one a - b: partner + x * (+1 or -1).
  x = __builtin_shuffle(x, p1) + x * s1;
  x = __builtin_shuffle(x, p2) + x * s2;
  x = __builtin_shuffle(x, p4) + x * s4;
  x = __builtin_shuffle(x, p8) + x * s8;
  return x;
}

// One stage between the registers a[k] and a[k + S] (R registers).
template <int R, int S>
static inline void stage(v16* a) {
#pragma GCC unroll 16
  for (int i = 0; i < R / 2; ++i) {
    const int k = (i / S) * 2 * S + i % S;
    const v16 p = a[k], q = a[k + S];
    a[k] = p + q;
    a[k + S] = p - q;
  }
}

// log2 R stages on R vectors h vectors apart, in registers.
template <int R>
static inline void radix(float* v, int64_t h) {
  v16 a[R];
#pragma GCC unroll 16
  for (int j = 0; j < R; ++j) a[j] = load(v + 16 * j * h);
  if constexpr (R >= 2) stage<R, 1>(a);
  if constexpr (R >= 4) stage<R, 2>(a);
  if constexpr (R >= 8) stage<R, 4>(a);
  if constexpr (R >= 16) stage<R, 8>(a);
#pragma GCC unroll 16
  for (int j = 0; j < R; ++j) store(v + 16 * j * h, a[j]);
}

// The stages between vectors h, 2h, ... m/2 apart, over m vectors at v.
static void vector_stages(float* v, int64_t m, int64_t h) {
  while (h < m) {
    const int64_t left = m / h;
    const int r = left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : 2;
    for (int64_t b = 0; b < m; b += r * h)
      for (int64_t k = 0; k < h; ++k) {
        float* p = v + 16 * (b + k);
        if (r == 16) radix<16>(p, h);
        else if (r == 8) radix<8>(p, h);
        else if (r == 4) radix<4>(p, h);
        else radix<2>(p, h);
      }
    h *= r;
  }
}

// Pass 1: every row of 2^row_bits entries transformed on its own, then multiplied by scale.
static void row_pass(float* x, int64_t n, int row_bits, float scale) {
  const int64_t row = int64_t(1) << row_bits, rows = n / row;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float* v = x + r * row;
    for (int64_t i = 0; i < row; i += 16) store(v + i, lane_stages(load(v + i)));
    vector_stages(v, row / 16, 1);
    if (scale != 1.0f)
      for (int64_t i = 0; i < row; i += 16) store(v + i, load(v + i) * scale);
  }
}

// The stages of index bits [low, low + bits), in tiles of 2^bits rows of width entries, then
// multiplied by scale (as the tile is copied back).
static void group_pass(float* x, int64_t n, int low, int bits, int64_t width, float scale) {
  const int64_t stride = int64_t(1) << low, rows = int64_t(1) << bits, span = stride << bits;
  width = std::min(width, stride);
  const int64_t per_span = stride / width, tiles = (n / span) * per_span;
#pragma omp parallel
  {
    std::vector<float> scratch(rows * width);
    float* s = scratch.data();
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      float* p = x + (t / per_span) * span + (t % per_span) * width;
      for (int64_t r = 0; r < rows; ++r) std::memcpy(s + r * width, p + r * stride, width * 4);
      vector_stages(s, rows * width / 16, width / 16);
      if (scale != 1.0f)
        for (int64_t i = 0; i < rows * width; i += 16) store(s + i, load(s + i) * scale);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(p + r * stride, s + r * width, width * 4);
    }
  }
}

constexpr int kRowBits = 12, kGroupBits = 6;
constexpr int64_t kWidth = 128;

// H x / sqrt(n), in place, n = 2^log2n >= 16; returns the passes over memory.
static int transform(float* x, int log2n) {
  const int64_t n = int64_t(1) << log2n;
  const float scale = 1.0f / std::sqrt(float(n));  // applied in the last pass
  row_pass(x, n, std::min(log2n, kRowBits), log2n <= kRowBits ? scale : 1.0f);
  int passes = 1;
  for (int low = kRowBits; low < log2n; low += kGroupBits, ++passes) {
    const int bits = std::min(kGroupBits, log2n - low);
    group_pass(x, n, low, bits, kWidth, low + bits == log2n ? scale : 1.0f);
  }
  return passes;
}

static double worst_error(int log2n) {
  const int64_t n = int64_t(1) << log2n;
  std::vector<float> x(n);
  std::vector<double> y(n);
  srand(log2n);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] = rand() / float(RAND_MAX) - 0.5f;
  transform(x.data(), log2n);
  for (int64_t h = 1; h < n; h <<= 1)
    for (int64_t j = 0; j < n; j += 2 * h)
      for (int64_t k = j; k < j + h; ++k) {
        const double a = y[k], b = y[k + h];
        y[k] = a + b;
        y[k + h] = a - b;
      }
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) worst = std::max(worst, std::fabs(x[i] - y[i] / std::sqrt(double(n))));
  return worst;
}

template <class F>
static double median_ms(F f, int rounds) {
  std::vector<double> t;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  const int log2n = argc > 1 ? std::atoi(argv[1]) : 24;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  if (log2n < 4 || log2n > 30 || rounds < 1) {
    std::fprintf(stderr, "usage: native_fwht [log2 n in 4..30] [rounds >= 1]\n");
    return 2;
  }
  bool ok = true;
  for (int bits : {16, 20, std::min(log2n, 22)}) {
    const double e = worst_error(bits);  // float32 sums of 2^bits terms of |x| <= 0.5
    std::printf("2^%d entries: max abs error %.2e against the float64 butterfly\n", bits, e);
    ok = ok && e < 2e-5;
  }
  const int64_t n = int64_t(1) << log2n;
  float* x = static_cast<float*>(std::aligned_alloc(64, n * sizeof(float)));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] = float(i % 1000) / 1000.0f;
  int passes = 0;
  const double pass = median_ms(
      [&] {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; ++i) x[i] *= 2.0f;
      },
      rounds);
  const double fwht = median_ms([&] { passes = transform(x, log2n); }, rounds);
  std::printf("2^%d entries, %d threads, median of %d: a pass in place %.2f ms, the transform "
              "%.2f ms (%d passes, %.2f ms each)\n",
              log2n, omp_get_max_threads(), rounds, pass, fwht, passes, fwht / passes);
  std::free(x);
  return ok ? 0 : 1;
}
