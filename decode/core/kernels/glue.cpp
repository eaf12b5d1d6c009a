// The small ops between the linears of a decoder layer, fused, for the few rows of a round
// (decode/core/kernels/glue.py says why). float32, CPU. Built with -ffp-contract=off: a product and a sum round
// separately, as PyTorch's own elementwise ops do, so rope_ gives transformers' bits exactly.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int ivec __attribute__((vector_size(kLanes * sizeof(int))));

inline vec load(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vec v) { __builtin_memcpy(p, &v, sizeof v); }
inline float hsum(vec v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

void check_float_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, op, ": ", name, " must be a float32 CPU tensor");
}

// y = weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension: transformers' float32 RMSNorm in one pass
// (its mean sums in another order: results agree to float32 rounding).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float_cpu(x, "glue rms_norm", "x");
  check_float_cpu(weight, "glue rms_norm", "weight");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous(), "glue rms_norm: weight must be [",
              H, "]");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = H ? xc.numel() / H : 0;
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * H;
      float* yr = yp + r * H;
      vec acc = {};
      int64_t d = 0;
      for (; d + kLanes <= H; d += kLanes) {
        const vec v = load(xr + d);
        acc += v * v;
      }
      float ss = hsum(acc);
      for (; d < H; ++d) ss += xr[d] * xr[d];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + e);
      for (d = 0; d < H; ++d) yr[d] = wp[d] * (xr[d] * inv);
    }
  });
  return y;
}

// Rotary embedding in place on the q and k projections' outputs [.., n, heads * head_dim] (contiguous; [B, n, ..]
// for B rows), with the model's cos/sin for the same rows [.., n, head_dim]: x * cos + rotate_half(x) * sin,
// rotate_half(x) = cat(-x2, x1) per head.
void rope_one(at::Tensor& x, const float* cp, const float* sp, int64_t n, int64_t D) {
  check_float_cpu(x, "glue rope_", "q/k");
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % D == 0 && x.numel() / x.size(-1) == n,
              "glue rope_: q/k must be contiguous [.., heads * ", D, "] with one row per row of cos (", n, ")");
  const int64_t heads = x.size(-1) / D, half = D / 2;
  float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float* c = cp + i * D;
    const float* s = sp + i * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* p = xp + (i * heads + h) * D;
      int64_t d = 0;
      for (; half % kLanes == 0 && d < half; d += kLanes) {
        const vec a = load(p + d), b = load(p + d + half);
        store(p + d, a * load(c + d) + (-b) * load(s + d));
        store(p + d + half, b * load(c + d + half) + a * load(s + d + half));
      }
      for (; d < half; ++d) {
        const float a = p[d], b = p[d + half];
        p[d] = a * c[d] + (-b) * s[d];
        p[d + half] = b * c[d + half] + a * s[d + half];
      }
    }
  }
}

void rope_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  check_float_cpu(cos, "glue rope_", "cos");
  check_float_cpu(sin, "glue rope_", "sin");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.numel() % 2 == 0,
              "glue rope_: cos and sin must be contiguous [.., n, head_dim], the same shape");
  const int64_t D = cos.size(-1), n = cos.numel() / D;
  TORCH_CHECK(D % 2 == 0, "glue rope_: head_dim must be even");
  rope_one(q, cos.data_ptr<float>(), sin.data_ptr<float>(), n, D);
  rope_one(k, cos.data_ptr<float>(), sin.data_ptr<float>(), n, D);
}

// exp: 2^m * p(r), m = round(x / ln 2), r = x - m ln 2 (split in two constants), p the Taylor polynomial of
// degree 7 (|r| <= ln 2 / 2: relative error < 1e-8 before rounding); below -87 (exp < 2^-126) it is 0, as masked
// keys must be; x is clamped at 88 (2^m stays a float), so 88 .. 88.72 give e^88, and past 88.72 it is infinity.
inline vec exp_vec(vec x) {
  const vec lo = x < -87.f ? (vec){} - 87.f : x > 88.f ? (vec){} + 88.f : x;
  const vec shifter = (vec){} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const vec m = (lo * 1.44269504088896341f + shifter) - shifter;
  const vec r = (lo - m * 0.693359375f) - m * -2.12194440e-4f;
  vec p = (vec){} + (1.f / 5040.f);
  p = p * r + (1.f / 720.f);
  p = p * r + (1.f / 120.f);
  p = p * r + (1.f / 24.f);
  p = p * r + (1.f / 6.f);
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const ivec bits = (__builtin_convertvector(m, ivec) + 127) << 23;
  vec scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  const vec out = p * scale;
  return x < -87.f ? (vec){} : x > 88.72283935546875f ? (vec){} + std::numeric_limits<float>::infinity() : out;
}

// silu(gate) * up, the MLP's activation (transformers' SiLU: x * sigmoid(x), computed as x / (1 + exp(-x))).
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_float_cpu(gate, "glue silu_mul", "gate");
  check_float_cpu(up, "glue silu_mul", "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "glue silu_mul: gate and up must have the same shape");
  const at::Tensor gc = gate.contiguous(), uc = up.contiguous();
  at::Tensor y = at::empty_like(gc);
  const float *gp = gc.data_ptr<float>(), *up_ = uc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t total = gc.numel(), full = total / kLanes * kLanes;
  at::parallel_for(0, full / kLanes, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0 * kLanes; i < b1 * kLanes; i += kLanes) {
      const vec x = load(gp + i);
      store(yp + i, x / (1.f + exp_vec(-x)) * load(up_ + i));
    }
  });
  for (int64_t i = full; i < total; ++i) yp[i] = gp[i] / (1.f + std::exp(-gp[i])) * up_[i];
  return y;
}

// Grouped-query attention of a few query rows: the query heads of one key/value head share its keys, so a head's
// rows (query position i, head h of the group: row i * group + h) are scored together. Keys are transposed kLanes
// at a time, so one vector holds kLanes keys' scores of a row (no horizontal sums); the weighted sum of values
// keeps a few rows' outputs in registers (values_task's RB). Two parallel passes: scores per (kv head, half of the
// keys), then softmax and the values per (kv head, half of the rows).
struct Attn {
  const float *q, *k, *v;
  int64_t k_head, k_row, v_head, v_row;  // strides of the cache views
  const bool* mask_b;                    // [n, mask_row] True = attend, or
  const float* mask_f;                   // [n, mask_row] added to the scores
  int64_t mask_row;
  float* out;
  int64_t group, heads, D, T, Tpad, R;
  float scale;
  float* scores;  // [kv heads][R][Tpad]
  const float* qrow(int64_t g, int64_t r) const { return q + ((r / group) * heads + g * group + r % group) * D; }
  float* orow(int64_t g, int64_t r) const { return out + ((r / group) * heads + g * group + r % group) * D; }
  float* srow(int64_t g, int64_t r) const { return scores + (g * R + r) * Tpad; }
};

constexpr int kScoreRows = 8;  // rows sharing each transposed key vector

void scores_task(const Attn& a, int64_t g, int64_t j0, int64_t j1) {
  thread_local std::vector<float> kt;
  kt.resize(a.D * kLanes);
  const float* kg = a.k + g * a.k_head;
  for (int64_t jb = j0; jb < j1; jb += kLanes) {
    const int64_t keys = std::min<int64_t>(kLanes, a.T - jb);
    const float* kb = kg + jb * a.k_row;
    if (keys == kLanes) {
      for (int64_t d = 0; d < a.D; ++d)
        for (int64_t jj = 0; jj < kLanes; ++jj) kt[d * kLanes + jj] = kb[jj * a.k_row + d];
    } else {
      for (int64_t d = 0; d < a.D; ++d)
        for (int64_t jj = 0; jj < kLanes; ++jj) kt[d * kLanes + jj] = jj < keys ? kb[jj * a.k_row + d] : 0.f;
    }
    for (int64_t rb = 0; rb < a.R; rb += kScoreRows) {
      const int64_t rows = std::min<int64_t>(kScoreRows, a.R - rb);
      const float* qr[kScoreRows];
      vec acc[kScoreRows];
      for (int x = 0; x < kScoreRows; ++x) {
        qr[x] = a.qrow(g, rb + std::min<int64_t>(x, rows - 1));
        acc[x] = (vec){};
      }
      for (int64_t d = 0; d < a.D; ++d) {
        const vec kv = load(kt.data() + d * kLanes);
        for (int x = 0; x < kScoreRows; ++x) acc[x] += qr[x][d] * kv;
      }
      for (int64_t x = 0; x < rows; ++x) store(a.srow(g, rb + x) + jb, acc[x]);
    }
  }
}

// softmax of one row of scores in place (masked and padded keys: exp 0); returns the sum of the exps
float softmax_row(const Attn& a, float* s, int64_t i) {
  typedef char cvec __attribute__((vector_size(kLanes)));
  const float ninf = -std::numeric_limits<float>::infinity();
  const bool* mb = a.mask_b ? a.mask_b + i * a.mask_row : nullptr;
  const float* mf = a.mask_f ? a.mask_f + i * a.mask_row : nullptr;
  const int64_t full = a.T / kLanes * kLanes;
  vec mx = (vec){} + ninf;
  for (int64_t j = 0; j < full; j += kLanes) {
    vec val = load(s + j) * a.scale;
    if (mb) {
      cvec m;
      __builtin_memcpy(&m, mb + j, sizeof m);
      val = __builtin_convertvector(m, ivec) != 0 ? val : (vec){} + ninf;
    } else if (mf) {
      val += load(mf + j);
    }
    store(s + j, val);
    mx = val > mx ? val : mx;
  }
  float m = ninf;
  for (int l = 0; l < kLanes; ++l) m = std::max(m, mx[l]);
  for (int64_t j = full; j < a.Tpad; ++j) {
    float val = s[j] * a.scale;
    if (j >= a.T || (mb && !mb[j])) val = ninf;
    else if (mf) val += mf[j];
    s[j] = val;
    m = std::max(m, val);
  }
  vec acc = {};
  for (int64_t j = 0; j < a.Tpad; j += kLanes) {
    const vec e = exp_vec(load(s + j) - m);
    store(s + j, e);
    acc += e;
  }
  return hsum(acc);
}

template <int DV>
void values_task(const Attn& a, int64_t g, int64_t r0, int64_t r1) {
  constexpr int RB = DV >= 16 ? 1 : DV >= 8 ? 2 : 4;  // rows per pass: RB * DV accumulators stay in registers
  const int64_t tail0 = DV * kLanes;                  // dims past the last full vector (head_dim % kLanes)
  float total[RB];
  const float* vg = a.v + g * a.v_head;
  for (int64_t rb = r0; rb < r1; rb += RB) {
    const int64_t rows = std::min<int64_t>(RB, r1 - rb);
    const float* p[RB];
    for (int x = 0; x < RB; ++x) {
      const int64_t r = rb + std::min<int64_t>(x, rows - 1);
      p[x] = a.srow(g, r);
      if (x < rows) total[x] = softmax_row(a, a.srow(g, r), r / a.group);
    }
    vec acc[RB][DV > 0 ? DV : 1];
    float tail[RB][kLanes] = {};
    for (int x = 0; x < RB; ++x)
      for (int dv = 0; dv < DV; ++dv) acc[x][dv] = (vec){};
    for (int64_t j = 0; j < a.T; ++j) {
      const float* vj = vg + j * a.v_row;
      vec vv[DV > 0 ? DV : 1];
      for (int dv = 0; dv < DV; ++dv) vv[dv] = load(vj + dv * kLanes);
      for (int x = 0; x < RB; ++x) {
        const float w = p[x][j];
        for (int dv = 0; dv < DV; ++dv) acc[x][dv] += w * vv[dv];
        for (int64_t d = tail0; d < a.D; ++d) tail[x][d - tail0] += w * vj[d];
      }
    }
    for (int64_t x = 0; x < rows; ++x) {
      float* o = a.orow(g, rb + x);
      const float inv = 1.f / total[x];
      for (int dv = 0; dv < DV; ++dv) store(o + dv * kLanes, acc[x][dv] * inv);
      for (int64_t d = tail0; d < a.D; ++d) o[d] = tail[x][d - tail0] * inv;
    }
  }
}

using ValuesFn = void (*)(const Attn&, int64_t, int64_t, int64_t);
constexpr int kMaxDV = 16;  // full vectors of a head: head_dim below 272 with AVX-512 (136 with AVX2)
constexpr ValuesFn kValues[kMaxDV + 1] = {
    values_task<0>,  values_task<1>,  values_task<2>,  values_task<3>,  values_task<4>,  values_task<5>,
    values_task<6>,  values_task<7>,  values_task<8>,  values_task<9>,  values_task<10>, values_task<11>,
    values_task<12>, values_task<13>, values_task<14>, values_task<15>, values_task<16>};

// Attention of n query positions over T cached keys, grouped-query: q [n, heads * D] (contiguous: the q
// projection's output, roped), k and v [1, kv_heads, >= T, D] (the cache's views; rows of D contiguous), mask None
// (every key) or [n, >= T] bool (True = attend) or float (added to the scores). Returns [n, heads * D], what o_proj
// takes.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, int64_t heads, double scale) {
  check_float_cpu(q, "glue attention", "q");
  check_float_cpu(k, "glue attention", "k");
  check_float_cpu(v, "glue attention", "v");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.size(1) % heads == 0,
              "glue attention: q must be contiguous [n, heads * D]");
  Attn a;
  a.D = q.size(1) / heads;
  const int64_t n = q.size(0), DV = a.D / kLanes;
  TORCH_CHECK(n > 0, "glue attention: no queries");
  TORCH_CHECK(DV <= kMaxDV, "glue attention: head_dim ", a.D, " is over ", (kMaxDV + 1) * kLanes - 1);
  TORCH_CHECK(k.dim() == 4 && k.size(0) == 1 && k.size(3) == a.D && v.sizes() == k.sizes() && k.stride(3) == 1 &&
              v.stride(3) == 1, "glue attention: k and v must be [1, kv_heads, T, ", a.D, "] with rows of ", a.D,
              " contiguous");
  const int64_t Hk = k.size(1);
  a.T = k.size(2);
  TORCH_CHECK(a.T > 0 && heads % Hk == 0, "glue attention: ", heads, " query heads over ", Hk, " kv heads and ", a.T,
              " keys");
  a.mask_b = nullptr;
  a.mask_f = nullptr;
  a.mask_row = 0;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->dim() == 2 && mask->size(0) == n && mask->size(1) >= a.T && mask->stride(1) == 1,
                "glue attention: mask must be [", n, ", >= ", a.T, "] with contiguous rows");
    a.mask_row = mask->stride(0);
    if (mask->scalar_type() == at::kBool) {
      a.mask_b = mask->data_ptr<bool>();
    } else {
      TORCH_CHECK(mask->scalar_type() == at::kFloat, "glue attention: mask must be bool or float32");
      a.mask_f = mask->data_ptr<float>();
    }
  }
  a.q = q.data_ptr<float>();
  a.k = k.data_ptr<float>();
  a.v = v.data_ptr<float>();
  a.k_head = k.stride(1);
  a.k_row = k.stride(2);
  a.v_head = v.stride(1);
  a.v_row = v.stride(2);
  a.group = heads / Hk;
  a.heads = heads;
  a.R = n * a.group;
  a.Tpad = (a.T + kLanes - 1) / kLanes * kLanes;
  a.scale = static_cast<float>(scale);
  at::Tensor scores = at::empty({Hk * a.R * a.Tpad}, q.options());  // every entry written by the scores pass
  a.scores = scores.data_ptr<float>();
  at::Tensor out = at::empty({n, heads * a.D}, q.options());
  a.out = out.data_ptr<float>();
  // two shares of each kv head's keys, then of its rows: even work for two threads over Hk * 2 tasks
  const int64_t key_chunk = (a.Tpad / kLanes + 1) / 2 * kLanes, key_chunks = (a.Tpad + key_chunk - 1) / key_chunk;
  at::parallel_for(0, Hk * key_chunks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j0 = (t % key_chunks) * key_chunk;
      scores_task(a, t / key_chunks, j0, std::min(a.Tpad, j0 + key_chunk));
    }
  });
  const int64_t row_chunk = (a.R + 1) / 2, row_chunks = (a.R + row_chunk - 1) / row_chunk;
  const ValuesFn values = kValues[DV];
  at::parallel_for(0, Hk * row_chunks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = (t % row_chunks) * row_chunk;
      values(a, t / row_chunks, r0, std::min(a.R, r0 + row_chunk));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(adaspec_glue, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, int heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(adaspec_glue, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_", &rope_);
  m.impl("attention", &attention);
}
