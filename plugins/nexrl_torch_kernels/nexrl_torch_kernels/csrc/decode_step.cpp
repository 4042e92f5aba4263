// CPU kernels for one decode step of a Llama-family model: the work between its matmuls, fused.
// Registered as the torch ops nexrl_kernels::attend, add_rms_norm, silu_mul, pack_linear and linear,
// each checking devices, dtypes, shapes, strides and indices before it touches memory.
// nexrl_torch_kernels/__init__.py compiles this file once per machine and loads it into torch.
//
// Each row (for attention: each row and KV head) is computed by one thread, in an order fixed by
// that row's own sizes. A row's bits therefore never depend on the other rows of its batch or on
// the thread count: what keeps runs with many rollout workers reproducible.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// 16 floats: one AVX-512 register, or two AVX2 ones (the compiler splits it).
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return __builtin_bit_cast(float, uint32_t(v) << 16); }
inline void put(float* p, float v) { *p = v; }
inline void put(uint16_t* p, float v) {  // bf16: round to nearest even, as torch does; a NaN stays one
  const uint32_t u = __builtin_bit_cast(uint32_t, v);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *p = uint16_t((u >> 16) | 0x40);
    return;
  }
  *p = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
template <typename T>
inline float rounded(float v) {  // v as T holds it
  T r;
  put(&r, v);
  return widen(r);
}
template <typename T>
void widen_row(const T* src, float* dst, long n) {
  for (long i = 0; i < n; ++i) dst[i] = widen(src[i]);
}

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline float total(v16 v) {  // a fixed tree
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// sum of a[i] * b[i]: 16 lanes over the whole blocks of 16, then the tail in order.
inline float dot(const float* a, const float* b, long n) {
  const long whole = n / 16 * 16;
  float sum = 0.0f;
  if (whole) {
    v16 acc = load16(a) * load16(b);
    for (long i = 16; i < whole; i += 16) acc += load16(a + i) * load16(b + i);
    sum = total(acc);
  }
  for (long i = whole; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// exp as 2^n * p(r), p of degree 6 on |r| <= ln2 / 2 (a few ulp); 0 below -87. Plain arithmetic,
// so that the compiler vectorizes it; n is rounded by adding and removing 1.5 * 2^23.
inline float exp_approx(float x) {
  const float clamped = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = clamped - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  const float p =
      1.0f + r * (1.0f + r * (0.5f + r * (0.16666667f + r * (0.041666668f + r * (0.008333334f + r * 0.0013888889f)))));
  const float scale = __builtin_bit_cast(float, (int32_t(n) + 127) << 23);
  return x < -87.0f ? 0.0f : p * scale;
}

// Rotary embedding of one head: x * cos + rotate_half(x) * sin.
inline void rotate(const float* x, const float* cos, const float* sin, float* out, long dim) {
  const long half = dim / 2;
  for (long d = 0; d < half; ++d) out[d] = x[d] * cos[d] - x[d + half] * sin[d];
  for (long d = half; d < dim; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

// One decode step's attention in one layer. For each row and KV head: rotate the new key and the
// group's queries, write key and value into the cache at `column`, and attend over the row's own
// keys, columns [starts[row], column]. qkv rows: [queries | keys | values]; the cache
// [cache rows, kv_heads, capacity, dim]; cos and sin [rows, dim]; out [rows, heads * dim]. Row r's
// cache row is cache_rows[r] (r when null); starts is indexed by cache row.
template <typename T>
void attend(const T* qkv, long qkv_stride, const T* cos, const T* sin, T* keys, T* values, const int64_t* starts,
            const int64_t* cache_rows, long rows, long heads, long kv_heads, long dim, long capacity, long column,
            float scaling, T* out) {
  const long group = heads / kv_heads;
  at::parallel_for(0, rows * kv_heads, 1, [&](long first, long last) {
    std::vector<float> buffer((4 + 2 * group) * dim + group * (column + 1));
    float *c = buffer.data(), *s = c + dim, *raw = s + dim, *key = raw + dim, *q = key + dim,
          *o = q + group * dim, *scores = o + group * dim;
    for (long task = first; task < last; ++task) {
      const long row = task / kv_heads, kv = task % kv_heads, cached = cache_rows ? cache_rows[row] : row;
      const long start = starts[cached], n = column + 1 - start;
      const T* in = qkv + row * qkv_stride;
      T* cached_keys = keys + (cached * kv_heads + kv) * capacity * dim;
      T* cached_values = values + (cached * kv_heads + kv) * capacity * dim;
      widen_row(cos + row * dim, c, dim);
      widen_row(sin + row * dim, s, dim);
      widen_row(in + (heads + kv) * dim, raw, dim);
      rotate(raw, c, s, key, dim);
      for (long d = 0; d < dim; ++d) put(cached_keys + column * dim + d, key[d]);
      std::memcpy(cached_values + column * dim, in + (heads + kv_heads + kv) * dim, dim * sizeof(T));
      for (long h = 0; h < group; ++h) {
        widen_row(in + (kv * group + h) * dim, raw, dim);
        rotate(raw, c, s, q + h * dim, dim);
      }
      for (long j = 0; j < n; ++j) {
        const float* k = key;
        if constexpr (std::is_same_v<T, float>) k = cached_keys + (start + j) * dim;
        else widen_row(cached_keys + (start + j) * dim, key, dim);
        for (long h = 0; h < group; ++h) scores[h * n + j] = dot(q + h * dim, k, dim) * scaling;
      }
      for (long h = 0; h < group; ++h) {
        float* score = scores + h * n;
        float top = score[0];  // a maximum is exact in any order
        for (long j = 1; j < n; ++j) top = top > score[j] ? top : score[j];
        for (long j = 0; j < n; ++j) score[j] = exp_approx(score[j] - top);
        float denominator = 0.0f;
        for (long j = 0; j < n; ++j) denominator += score[j];
        float* acc = o + h * dim;
        for (long d = 0; d < dim; ++d) acc[d] = 0.0f;
        for (long j = 0; j < n; ++j) {
          const float* v = raw;
          if constexpr (std::is_same_v<T, float>) v = cached_values + (start + j) * dim;
          else widen_row(cached_values + (start + j) * dim, raw, dim);
          const float p = score[j];
          for (long d = 0; d < dim; ++d) acc[d] += p * v[d];
        }
        const float inverse = 1.0f / denominator;
        T* dst = out + row * heads * dim + (kv * group + h) * dim;
        for (long d = 0; d < dim; ++d) put(dst + d, acc[d] * inverse);
      }
    }
  });
}

// x += delta (when given), then out = RMSNorm(x) * weight. A bf16 x is normalized in float32,
// rounded, then scaled, as transformers' Llama does.
template <typename T>
void add_rms_norm(T* x, const T* delta, const T* weight, float eps, T* out, long rows, long hidden) {
  at::parallel_for(0, rows, 32, [&](long first, long last) {
    std::vector<float> v(hidden);
    for (long r = first; r < last; ++r) {
      T* xr = x + r * hidden;
      if (delta) {
        for (long i = 0; i < hidden; ++i) put(xr + i, widen(xr[i]) + widen(delta[r * hidden + i]));
      }
      widen_row(xr, v.data(), hidden);
      const float inverse = 1.0f / __builtin_sqrtf(dot(v.data(), v.data(), hidden) / float(hidden) + eps);
      for (long i = 0; i < hidden; ++i) put(out + r * hidden + i, rounded<T>(v[i] * inverse) * widen(weight[i]));
    }
  });
}

// out = silu(gate) * up, gate and up the two halves of each row of gate_up.
template <typename T>
void silu_mul(const T* gate_up, T* out, long rows, long inter) {
  at::parallel_for(0, rows, 8, [&](long first, long last) {
    for (long r = first; r < last; ++r) {
      const T* gate = gate_up + r * 2 * inter;
      for (long i = 0; i < inter; ++i) {
        const float g = widen(gate[i]);
        put(out + r * inter + i, g / (1.0f + exp_approx(-g)) * widen(gate[inter + i]));
      }
    }
  });
}

// Few-row matmuls (float32) on a packed weight: y[rows, n] = x[rows, k] @ w[n, k]^T (+ bias).
// A decode step multiplies a few rows by every weight of the model, so it streams all weights
// from memory once per step. Packed as [panels][k][16] (panel p: output columns 16p..16p+15,
// zeros past n), a weight is read front to back, one vector of 16 columns per k, while each row's
// input is broadcast from a transposed copy of the rows (one cache line per k). Every output is
// one multiply-add chain over k in order, whatever the number of rows or threads: a row keeps
// its bits beside any others.
constexpr long kLanes = 16;
constexpr long kPrefetch = 512;  // floats ahead in a panel's stream (2 KB): what the hardware prefetcher misses

template <int R, int P>
inline void linear_tile(const float* xt, long k, const float* panel, const float* bias, float* y, long ldy,
                        long column, long n) {
  v16 acc[P][R];
  for (int p = 0; p < P; ++p) {
    v16 start{};
    if (bias) {
      for (long j = 0; j < kLanes && column + p * kLanes + j < n; ++j) start[j] = bias[column + p * kLanes + j];
    }
    for (int r = 0; r < R; ++r) acc[p][r] = start;
  }
  for (long i = 0; i < k; ++i) {
    for (int p = 0; p < P; ++p) {
      const float* w = panel + (p * k + i) * kLanes;
      __builtin_prefetch(w + kPrefetch, 0, 3);
      const v16 wv = load16(w);
      for (int r = 0; r < R; ++r) acc[p][r] += xt[i * kLanes + r] * wv;
    }
  }
  for (int p = 0; p < P; ++p) {
    const long first = column + p * kLanes, valid = n - first < kLanes ? n - first : kLanes;
    for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy + first, &acc[p][r], valid * sizeof(float));
  }
}

// Panels [first, last) for R rows, P panels at a time (P * R accumulators stay in registers).
template <int R>
void linear_panels(const float* xt, long k, const float* packed, const float* bias, float* y, long ldy, long n,
                   long first, long last) {
  constexpr int P = R <= 4 ? 4 : (R <= 8 ? 2 : 1);
  long p = first;
  for (; p + P <= last; p += P) linear_tile<R, P>(xt, k, packed + p * k * kLanes, bias, y, ldy, p * kLanes, n);
  for (; p < last; ++p) linear_tile<R, 1>(xt, k, packed + p * k * kLanes, bias, y, ldy, p * kLanes, n);
}

using LinearPanels = void (*)(const float*, long, const float*, const float*, float*, long, long, long, long);
constexpr LinearPanels kLinearPanels[kLanes] = {
    linear_panels<1>, linear_panels<2>,  linear_panels<3>,  linear_panels<4>,  linear_panels<5>,  linear_panels<6>,
    linear_panels<7>, linear_panels<8>,  linear_panels<9>,  linear_panels<10>, linear_panels<11>, linear_panels<12>,
    linear_panels<13>, linear_panels<14>, linear_panels<15>, linear_panels<16>};

void linear(const float* x, long ldx, long rows, long k, const float* packed, long n, const float* bias, float* y) {
  if (rows <= 0 || n <= 0) return;
  const long chunks = (rows + kLanes - 1) / kLanes, panels = (n + kLanes - 1) / kLanes;
  std::vector<float> xt(chunks * k * kLanes);  // rows in chunks of 16, each transposed to [k][16]
  at::parallel_for(0, chunks, 1, [&](long first, long last) {
    for (long c = first; c < last; ++c) {
      float* t = xt.data() + c * k * kLanes;
      for (long r = c * kLanes; r < rows && r < (c + 1) * kLanes; ++r) {
        for (long i = 0; i < k; ++i) t[i * kLanes + r % kLanes] = x[r * ldx + i];
      }
    }
  });
  at::parallel_for(0, panels, 1, [&](long first, long last) {
    // 8 panels at a time for all chunks of rows: their weights stay in cache from one chunk to the next
    for (long p = first; p < last; p += 8) {
      const long end = p + 8 < last ? p + 8 : last;
      for (long c = 0; c < chunks; ++c) {
        const long r = rows - c * kLanes < kLanes ? rows - c * kLanes : kLanes;
        kLinearPanels[r - 1](xt.data() + c * k * kLanes, k, packed, bias, y + c * kLanes * n, n, n, p, end);
      }
    }
  });
}

// Rows of w [n, k] as output columns [column, column + n) of a packed weight of `total` columns;
// the lanes past `total` in its last panel are zeroed. Several weights packed side by side make
// the weight of their concatenated outputs.
void pack_linear(const float* w, long n, long k, float* packed, long column, long total) {
  const long first_panel = column / kLanes, end_panel = (column + n + kLanes - 1) / kLanes;
  at::parallel_for(first_panel, end_panel, 1, [&](long first, long last) {
    for (long p = first; p < last; ++p) {
      const long lane0 = column > p * kLanes ? column - p * kLanes : 0;
      const long lane1 = column + n < (p + 1) * kLanes ? column + n - p * kLanes : kLanes;
      float* out = packed + p * k * kLanes;
      const float* src = w + (p * kLanes + lane0 - column) * k;
      for (long i = 0; i < k; ++i) {
        for (long j = lane0; j < lane1; ++j) out[i * kLanes + j] = src[(j - lane0) * k + i];
        if (p * kLanes + kLanes > total) {
          for (long j = total - p * kLanes; j < kLanes; ++j) out[i * kLanes + j] = 0.0f;
        }
      }
    }
  });
}

// The ops' boundary: the kernels index raw memory, so every size, stride, dtype and index they rely
// on is checked here first, with an error that names the op and the argument.
struct Check {
  const char* op;

  // Every tensor's dtype is checked, and with it its device.
  void cpu(const at::Tensor& t, const char* name) const {
    TORCH_CHECK_VALUE(t.device().is_cpu(), "nexrl_kernels::", op, ": ", name, " is on ", t.device(),
                      ", the kernels run on the CPU");
  }
  void dtype(const at::Tensor& t, const char* name, at::ScalarType want) const {
    cpu(t, name);
    TORCH_CHECK_TYPE(t.scalar_type() == want, "nexrl_kernels::", op, ": ", name, " is ", t.scalar_type(),
                     ", expected ", want);
  }
  void shape(const at::Tensor& t, const char* name, c10::IntArrayRef want) const {
    TORCH_CHECK_VALUE(t.sizes() == want, "nexrl_kernels::", op, ": ", name, " has shape ", t.sizes(), ", expected ",
                      want);
  }
  void dims(const at::Tensor& t, const char* name, int64_t want) const {
    TORCH_CHECK_VALUE(t.dim() == want, "nexrl_kernels::", op, ": ", name, " has ", t.dim(), " dimensions (shape ",
                      t.sizes(), "), expected ", want);
  }
  void contiguous(const at::Tensor& t, const char* name) const {
    TORCH_CHECK_VALUE(t.is_contiguous(), "nexrl_kernels::", op, ": ", name, " must be contiguous (shape ", t.sizes(),
                      ", strides ", t.strides(), ")");
  }
  // A matrix read row by row: each row's values adjacent, rows any stride apart.
  void rows(const at::Tensor& t, const char* name) const {
    dims(t, name, 2);
    TORCH_CHECK_VALUE(t.stride(1) == 1 || t.size(1) <= 1, "nexrl_kernels::", op, ": ", name,
                      "'s rows must be contiguous (shape ", t.sizes(), ", strides ", t.strides(), ")");
  }
  // float32 or bfloat16, the dtype of `like` when given.
  void floating(const at::Tensor& t, const char* name, const at::Tensor* like = nullptr,
                const char* like_name = nullptr) const {
    cpu(t, name);
    if (like) {
      TORCH_CHECK_TYPE(t.scalar_type() == like->scalar_type(), "nexrl_kernels::", op, ": ", name, " is ",
                       t.scalar_type(), " but ", like_name, " is ", like->scalar_type(), " (one dtype for all)");
    } else {
      TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "nexrl_kernels::", op, ": ",
                       name, " is ", t.scalar_type(), ", expected Float (float32) or BFloat16");
    }
  }
};

template <typename T>
T* data(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

long packed_size(long n, long k) { return (n + kLanes - 1) / kLanes * kLanes * k; }

void attend_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
               const at::Tensor& values, const at::Tensor& starts, int64_t column, double scaling,
               const at::Tensor& out, const std::optional<at::Tensor>& cache_rows) {
  const Check check{"attend"};
  check.rows(qkv, "qkv");
  check.floating(qkv, "qkv");
  check.dims(keys, "keys", 4);
  const long rows = qkv.size(0), cached_rows = keys.size(0), kv_heads = keys.size(1), capacity = keys.size(2),
             dim = keys.size(3);
  TORCH_CHECK_VALUE(kv_heads > 0 && dim > 0 && dim % 2 == 0, "nexrl_kernels::attend: keys [cache rows, kv_heads, "
                    "capacity, dim] has shape ", keys.sizes(), ": needs kv_heads > 0 and an even dim");
  check.dims(out, "out", 2);
  TORCH_CHECK_VALUE(out.size(1) % (kv_heads * dim) == 0 && out.size(1) > 0, "nexrl_kernels::attend: out has shape ",
                    out.sizes(), ": its width must be heads * dim, heads a multiple of kv_heads ", kv_heads,
                    ", dim ", dim);
  const long heads = out.size(1) / dim;
  check.shape(qkv, "qkv", {rows, (heads + 2 * kv_heads) * dim});
  check.shape(out, "out", {rows, heads * dim});
  for (const auto& [t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
    check.shape(*t, name, {rows, dim});
  }
  check.shape(values, "values", keys.sizes());
  for (const auto& [t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}, std::pair{&keys, "keys"},
                                std::pair{&values, "values"}, std::pair{&out, "out"}}) {
    check.floating(*t, name, &qkv, "qkv");
    check.contiguous(*t, name);
  }
  check.dtype(starts, "starts", at::kLong);
  check.shape(starts, "starts", {cached_rows});
  check.contiguous(starts, "starts");
  TORCH_CHECK_VALUE(0 <= column && column < capacity, "nexrl_kernels::attend: column ", column,
                    " is outside the cache's capacity ", capacity);
  const int64_t* row_of = nullptr;
  if (cache_rows) {
    check.dtype(*cache_rows, "cache_rows", at::kLong);
    check.shape(*cache_rows, "cache_rows", {rows});
    check.contiguous(*cache_rows, "cache_rows");
    row_of = data<const int64_t>(*cache_rows);
  }
  const int64_t* first = data<const int64_t>(starts);
  for (long r = 0; r < rows; ++r) {
    const int64_t cached = row_of ? row_of[r] : r;
    TORCH_CHECK_VALUE(0 <= cached && cached < cached_rows, "nexrl_kernels::attend: row ", r, "'s cache row ", cached,
                      " is not one of the cache's ", cached_rows, " rows");
    TORCH_CHECK_VALUE(0 <= first[cached] && first[cached] <= column, "nexrl_kernels::attend: cache row ", cached,
                      " starts at column ", first[cached], ", past the new column ", column);
  }
  if (qkv.scalar_type() == at::kFloat) {
    attend(data<const float>(qkv), qkv.stride(0), data<const float>(cos), data<const float>(sin), data<float>(keys),
           data<float>(values), first, row_of, rows, heads, kv_heads, dim, capacity, column, float(scaling),
           data<float>(out));
  } else {
    attend(data<const uint16_t>(qkv), qkv.stride(0), data<const uint16_t>(cos), data<const uint16_t>(sin),
           data<uint16_t>(keys), data<uint16_t>(values), first, row_of, rows, heads, kv_heads, dim, capacity, column,
           float(scaling), data<uint16_t>(out));
  }
}

void add_rms_norm_op(const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps,
                     const at::Tensor& out) {
  const Check check{"add_rms_norm"};
  check.dims(x, "x", 2);
  check.floating(x, "x");
  check.contiguous(x, "x");
  const long rows = x.size(0), hidden = x.size(1);
  check.shape(weight, "weight", {hidden});
  check.shape(out, "out", x.sizes());
  for (const auto& [t, name] : {std::pair{&weight, "weight"}, std::pair{&out, "out"}}) {
    check.floating(*t, name, &x, "x");
    check.contiguous(*t, name);
  }
  if (delta) {
    check.shape(*delta, "delta", x.sizes());
    check.floating(*delta, "delta", &x, "x");
    check.contiguous(*delta, "delta");
  }
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm(data<float>(x), delta ? data<const float>(*delta) : nullptr, data<const float>(weight), float(eps),
                 data<float>(out), rows, hidden);
  } else {
    add_rms_norm(data<uint16_t>(x), delta ? data<const uint16_t>(*delta) : nullptr, data<const uint16_t>(weight),
                 float(eps), data<uint16_t>(out), rows, hidden);
  }
}

void silu_mul_op(const at::Tensor& gate_up, const at::Tensor& out) {
  const Check check{"silu_mul"};
  check.dims(out, "out", 2);
  check.floating(out, "out");
  check.contiguous(out, "out");
  const long rows = out.size(0), inter = out.size(1);
  check.shape(gate_up, "gate_up", {rows, 2 * inter});
  check.floating(gate_up, "gate_up", &out, "out");
  check.contiguous(gate_up, "gate_up");
  if (out.scalar_type() == at::kFloat) {
    silu_mul(data<const float>(gate_up), data<float>(out), rows, inter);
  } else {
    silu_mul(data<const uint16_t>(gate_up), data<uint16_t>(out), rows, inter);
  }
}

void pack_linear_op(at::TensorList weights, const at::Tensor& packed) {
  const Check check{"pack_linear"};
  TORCH_CHECK_VALUE(!weights.empty(), "nexrl_kernels::pack_linear: no weights");
  long total = 0;
  for (const auto& w : weights) {
    check.dims(w, "a weight", 2);
    check.dtype(w, "a weight", at::kFloat);
    check.contiguous(w, "a weight");
    TORCH_CHECK_VALUE(w.size(1) == weights[0].size(1), "nexrl_kernels::pack_linear: weights of ", weights[0].size(1),
                      " and ", w.size(1), " inputs: linears packed together share their input");
    total += w.size(0);
  }
  const long k = weights[0].size(1);
  check.dtype(packed, "packed", at::kFloat);
  check.contiguous(packed, "packed");
  TORCH_CHECK_VALUE(packed.numel() == packed_size(total, k), "nexrl_kernels::pack_linear: packed weight holds ",
                    packed.numel(), " values, ", packed_size(total, k), " needed");
  long column = 0;
  for (const auto& w : weights) {
    pack_linear(data<const float>(w), w.size(0), k, data<float>(packed), column, total);
    column += w.size(0);
  }
}

at::Tensor linear_op(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias) {
  const Check check{"linear"};
  check.rows(x, "x");
  check.dtype(x, "x", at::kFloat);
  const long rows = x.size(0), k = x.size(1);
  TORCH_CHECK_VALUE(n > 0, "nexrl_kernels::linear: n is ", n, ", expected output columns > 0");
  check.dtype(packed, "packed", at::kFloat);
  check.contiguous(packed, "packed");
  TORCH_CHECK_VALUE(packed.numel() == packed_size(n, k), "nexrl_kernels::linear: packed weight holds ",
                    packed.numel(), " values, ", packed_size(n, k), " for ", n, " outputs of ", k,
                    " inputs (x has shape ", x.sizes(), ")");
  if (bias) {
    check.shape(*bias, "bias", {n});
    check.dtype(*bias, "bias", at::kFloat);
    check.contiguous(*bias, "bias");
  }
  at::Tensor y = at::empty({rows, n}, x.options());
  linear(data<const float>(x), x.stride(0), rows, k, data<const float>(packed), n,
         bias ? data<const float>(*bias) : nullptr, data<float>(y));
  return y;
}

}  // namespace

// Outputs written in place are marked mutated (!), so that torch knows what each call changes. The
// kernels are registered for every backend (CompositeExplicitAutograd) so that a tensor on another
// device meets the checks above, which name it, rather than the dispatcher's missing-kernel error.
TORCH_LIBRARY(nexrl_kernels, m) {
  m.def("attend(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, Tensor starts, int column, "
        "float scaling, Tensor(c!) out, Tensor? cache_rows=None) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps, Tensor(b!) out) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("pack_linear(Tensor[] weights, Tensor(a!) packed) -> ()");
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(nexrl_kernels, CompositeExplicitAutograd, m) {
  m.impl("attend", &attend_op);
  m.impl("add_rms_norm", &add_rms_norm_op);
  m.impl("silu_mul", &silu_mul_op);
  m.impl("pack_linear", &pack_linear_op);
  m.impl("linear", &linear_op);
}
