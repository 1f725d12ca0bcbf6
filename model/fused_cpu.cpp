// Fused CPU (fp32) kernels for the no-autograd small-batch paths of the model: decoding and short prefills,
// where a step's cost is the number of tiny torch ops, not arithmetic. Each kernel does one sublayer's work
// between its input matmul and its output matmul (both stay MKL matmuls in model/):
//
//   kda_decode     KDA decode step: short conv, SiLU, L2 norms, gate (with its rank-K up-projection), beta,
//                  recurrence (1), head RMSNorm, output gate (with its rank-K up-projection)   model/kda.py
//   mla_decode     absorbed MLA decode step: latent RMSNorm, q~ = W_uk^T q, softmax over the cached latents and
//                  the new one, W_uv o~, output gate                                            model/mla.py
//   moe_small      LatentMoE for a few tokens: router (sigmoid, top-k of s + b, weights), the chosen experts
//                  (reading their stacked weights in place), the latent RMSNorm, the shared experts' SiTU-GLU
//                                                                                               model/moe.py
//   moe_route      the router alone (tested against model/moe.py `Router`)
//   situ_glu_gu    SiTU-GLU of a [gate | up] projection                                         model/activations.py
//   attn_res_read  one Block AttnRes read, optionally with the RMSNorm after it                 model/attn_res.py
//   short_conv_silu / _backward  KDA's causal depthwise short conv over packed sequences, then SiLU   model/short_conv.py
//   kda_recurrent_fwd / _bwd   the KDA recurrence (1) over packed sequences, forward and backward: the CPU
//                  backend of chunk_kda (fp32); each (sequence, head) chain keeps its K x V state in L1  model/kda_recurrent.py
//
// The torch code next to each caller is the reference (and the autograd path); tests/ compare them. Loaded by
// model/fused_cpu.py.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

using at::Tensor;

namespace {

void check_f32_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), "fused_cpu: ", name,
              " must be a contiguous fp32 CPU tensor");
}

// y[r] = sum_c W[r, c] x[c] for a row-major W [rows, cols].
inline void gemv(const float* W, const float* x, float* y, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* w = W + r * cols;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t c = 0; c < cols; ++c) acc += w[c] * x[c];
    y[r] = acc;
  }
}

// ---- vectorisable elementwise math (plain float / int arithmetic, no libm calls, so `omp simd` loops vectorise;
// selects are ternaries on values or 0/1 blends, never std::min/max or branches, which GCC will not if-convert)
// e^x to ~2 ulp for x in [-87, 88] (clamped outside): Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, then the
// degree-7 Taylor polynomial of e^r and 2^n written into the exponent bits.
inline float exp_f(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float y = x * 1.44269504f + 0.5f;
  int32_t n = static_cast<int32_t>(y);
  n -= static_cast<int32_t>(y < static_cast<float>(n));  // floor
  const float fn = static_cast<float>(n);
  const float r = (x - fn * 0.693145751953125f) - fn * 1.428606765330187e-6f;
  float p = 1.9841270e-4f;
  p = p * r + 1.3888889e-3f;
  p = p * r + 8.3333333e-3f;
  p = p * r + 4.1666667e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return p * scale;
}

// e^x - 1 without cancellation near 0: the degree-9 Taylor polynomial for |x| < 0.5, e^x - 1 beyond.
inline float expm1_f(float x) {
  float p = 2.7557319e-6f;
  p = p * x + 2.4801587e-5f;
  p = p * x + 1.9841270e-4f;
  p = p * x + 1.3888889e-3f;
  p = p * x + 8.3333333e-3f;
  p = p * x + 4.1666667e-2f;
  p = p * x + 1.6666667e-1f;
  p = p * x + 0.5f;
  p = p * x * x + x;
  const float big = exp_f(x) - 1.0f;
  const float small = static_cast<float>(std::fabs(x) < 0.5f);
  return small * p + (1.0f - small) * big;
}

inline float sigmoid_f(float x) { return 1.0f / (1.0f + exp_f(-x)); }

// tanh(x) = -expm1(-2|x|) / (2 + expm1(-2|x|)), sign restored; accurate near 0 (no 1 - 2/(e^2x + 1) cancellation).
inline float tanh_f(float x) {
  const float a = std::fabs(x);
  const float e = expm1_f(-2.0f * (a > 9.0f ? 9.0f : a));
  return std::copysign(-e / (2.0f + e), x);
}

// 1 - tanh^2(x) = 4 e^{-2|x|} / (1 + e^{-2|x|})^2, without the cancellation of 1 - tanh^2 near |tanh| = 1.
inline float sech2_f(float x) {
  const float a = std::fabs(x);
  const float e = exp_f(-2.0f * (a > 40.0f ? 40.0f : a));
  return 4.0f * e / ((1.0f + e) * (1.0f + e));
}

// SiTU-GLU (model/activations.py): 4 tanh(g / 4) sigmoid(g) * 25 tanh(u / 25).
inline float situ_glu(float g, float u) { return 4.f * tanh_f(g * 0.25f) * sigmoid_f(g) * (25.f * tanh_f(u * 0.04f)); }


// Rows of a 2-D fp32 CPU tensor with unit column stride (e.g. a column slice of a projection).
struct Rows {
  const float* data;
  int64_t stride;
  const float* row(int64_t i) const { return data + i * stride; }
};

Rows rows_of(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1,
              "fused_cpu: ", name, " must be a 2-D fp32 CPU tensor with contiguous rows");
  return {t.data_ptr<float>(), t.stride(0)};
}

// x * rsqrt(mean(x^2) + eps) * w over n values, into out (out may alias x).
inline void rms_norm_row(const float* x, const float* w, float eps, float* out, int64_t n) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// LatentMoE's router for one token: s = sigmoid(logits); the chosen experts (topk(s + b, k), descending, ties to the
// lower id, or the given forced ones); p = rsf s_idx / sum s_idx.
inline void route_row(const float* logits, const float* bias, int64_t n, int64_t k, float rsf, const int64_t* forced,
                      float* s, int64_t* idx, float* p) {
  for (int64_t j = 0; j < n; ++j) s[j] = 1.0f / (1.0f + std::exp(-logits[j]));
  if (forced != nullptr) {
    std::copy(forced, forced + k, idx);
  } else {
    for (int64_t j = 0; j < k; ++j) {  // k passes of argmax over the experts not taken yet (k is small)
      int64_t best = -1;
      float bv = -INFINITY;
      for (int64_t e = 0; e < n; ++e) {
        bool taken = false;
        for (int64_t q = 0; q < j; ++q) taken |= idx[q] == e;
        const float v = s[e] + bias[e];
        if (!taken && (best < 0 || v > bv)) best = e, bv = v;
      }
      idx[j] = best;
    }
  }
  float sum = 0.f;
  for (int64_t j = 0; j < k; ++j) sum += s[idx[j]];
  for (int64_t j = 0; j < k; ++j) p[j] = s[idx[j]] / sum * rsf;
}

}  // namespace

// LatentMoE's router for a few tokens (model/moe.py `Router`): logits [T, n] = W_r x (fp32), bias b [n]:
//   s = sigmoid(logits), idx = topk(s + b, k) or the replayed `forced` [T, k] (int64; empty = free choice),
//   p = rsf s_idx / sum s_idx. Returns s [T, n], idx [T, k] int64, p [T, k].
std::vector<Tensor> moe_route(const Tensor& logits, const Tensor& bias, const Tensor& forced, int64_t k,
                              double rsf) {
  const Rows L = rows_of(logits, "logits");
  check_f32_contiguous(bias, "bias");
  const int64_t T = logits.size(0), n = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= n && bias.numel() == n, "fused_cpu.moe_route: need 1 <= k <= n and b [n]");
  const bool replay = forced.numel() > 0;
  TORCH_CHECK(!replay || (forced.scalar_type() == at::kLong && forced.is_contiguous() && forced.size(0) == T &&
                          forced.size(1) == k),
              "fused_cpu.moe_route: forced experts must be a contiguous int64 [T, k]");
  Tensor s = at::empty({T, n}, logits.options()), p = at::empty({T, k}, logits.options());
  Tensor idx = at::empty({T, k}, logits.options().dtype(at::kLong));
  const int64_t* F = replay ? forced.data_ptr<int64_t>() : nullptr;
  for (int64_t t = 0; t < T; ++t)
    route_row(L.row(t), bias.data_ptr<float>(), n, k, static_cast<float>(rsf), F ? F + t * k : nullptr,
              s.data_ptr<float>() + t * n, idx.data_ptr<int64_t>() + t * k, p.data_ptr<float>() + t * k);
  return {s, idx, p};
}

// LatentMoE for a few tokens (model/moe.py `LatentMoE.forward_small`), between its two matmuls:
//   proj [T, P]: columns [router logits (n) | z = W_down x (L) | shared expert s: [gate | up] (2 I_s) ...]
//   bias [n], forced [T, k] int64 or empty, w_gate_up [n, 2I, L], w_down [n, L, I], latent_norm [L], shared [I_s]
// Returns out [T, L + sum I_s] = [RMSNorm(sum_j p_j E_{e_j}(z)) | situ_glu(shared 1) | ...] (so that ONE matmul
// with [W_up | W_down,1 | ...] gives y), and the router's s [T, n], idx [T, k], p [T, k]. The (token, expert)
// pairs run grouped by expert (each expert's weights read once per group, from cache), in parallel; only the
// chosen experts' weights are read.
std::vector<Tensor> moe_small(const Tensor& proj, const Tensor& bias, const Tensor& forced, int64_t k, double rsf,
                              const Tensor& w_gate_up, const Tensor& w_down, const Tensor& latent_norm,
                              double latent_eps, const std::vector<int64_t>& shared) {
  const Rows X = rows_of(proj, "proj");
  for (auto [t, name] : {std::pair{&bias, "bias"}, {&w_gate_up, "w_gate_up"}, {&w_down, "w_down"},
                         {&latent_norm, "latent_norm"}})
    check_f32_contiguous(*t, name);
  const int64_t T = proj.size(0), n = w_gate_up.size(0), I = w_gate_up.size(1) / 2, L = w_gate_up.size(2);
  int64_t shared_total = 0, shared_cols = 0;
  for (int64_t w : shared) shared_total += w, shared_cols += 2 * w;
  TORCH_CHECK(proj.size(1) >= n + L + shared_cols && w_down.size(0) == n && w_down.size(1) == L &&
                  w_down.size(2) == I && bias.numel() == n && latent_norm.numel() == L && k >= 1 && k <= n,
              "fused_cpu.moe_small: shapes do not match");
  const bool replay = forced.numel() > 0;
  TORCH_CHECK(!replay || (forced.scalar_type() == at::kLong && forced.is_contiguous() && forced.size(0) == T &&
                          forced.size(1) == k),
              "fused_cpu.moe_small: forced experts must be a contiguous int64 [T, k]");
  Tensor s = at::empty({T, n}, proj.options()), p = at::empty({T, k}, proj.options());
  Tensor idx = at::empty({T, k}, proj.options().dtype(at::kLong));
  Tensor out = at::empty({T, L + shared_total}, proj.options());
  float *S = s.data_ptr<float>(), *Pw = p.data_ptr<float>(), *O = out.data_ptr<float>();
  int64_t* E = idx.data_ptr<int64_t>();
  const int64_t* F = replay ? forced.data_ptr<int64_t>() : nullptr;
  for (int64_t t = 0; t < T; ++t)
    route_row(X.row(t), bias.data_ptr<float>(), n, k, static_cast<float>(rsf), F ? F + t * k : nullptr, S + t * n,
              E + t * k, Pw + t * k);
  for (int64_t i = 0; i < T * k; ++i) TORCH_CHECK(E[i] >= 0 && E[i] < n, "fused_cpu.moe_small: expert id out of range");
  // pairs sorted by expert (counting sort)
  std::vector<int64_t> start(n + 1, 0), order(T * k);
  for (int64_t i = 0; i < T * k; ++i) ++start[E[i] + 1];
  for (int64_t e = 0; e < n; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < T * k; ++i) order[fill[E[i]]++] = i;
  }
  std::vector<float> Y(T * k * L);  // per pair, summed per token below (no write races)
  const float *W1 = w_gate_up.data_ptr<float>(), *W2 = w_down.data_ptr<float>();
  at::parallel_for(0, T * k, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(2 * I), a(I);
    for (int64_t q = begin; q < end; ++q) {
      const int64_t pair = order[q], t = pair / k, e = E[pair];
      gemv(W1 + e * 2 * I * L, X.row(t) + n, h.data(), 2 * I, L);
      const float* hp = h.data();
      float* ap = a.data();
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) ap[i] = situ_glu(hp[i], hp[I + i]);
      float* yp = Y.data() + pair * L;
      gemv(W2 + e * L * I, a.data(), yp, L, I);
      const float w = Pw[pair];
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) yp[l] *= w;
    }
  });
  const float* NW = latent_norm.data_ptr<float>();
  const int64_t W = L + shared_total;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = O + t * W;
      std::copy(Y.data() + t * k * L, Y.data() + (t * k + 1) * L, o);
      for (int64_t j = 1; j < k; ++j) {
        const float* yp = Y.data() + (t * k + j) * L;
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) o[l] += yp[l];
      }
      rms_norm_row(o, NW, static_cast<float>(latent_eps), o, L);
      const float* gu = X.row(t) + n + L;
      float* os = o + L;
      for (int64_t Is : shared) {
#pragma omp simd
        for (int64_t i = 0; i < Is; ++i) os[i] = situ_glu(gu[i], gu[Is + i]);
        gu += 2 * Is;
        os += Is;
      }
    }
  });
  return {out, s, idx, p};
}

// One decode step of a KDA layer (model/kda.py `KDAttention`, one new token for each of N sequences), from the
// token's projections to the gated, normalised output, in one pass per (sequence, head):
//   proj [N, P]   input projections, columns [q (H K) | k (H K) | v (H V) | beta logit (H) | W_fa x (K) | W_ga x (K)]
//   f_b [H K, K], g_b [H V, K], g_b_bias [H V]: the rank-K up-projections of the decay gate and the output gate
//   conv_w [C, W], conv_state [N, C, W-1] (C = 2 H K + H V, oldest first); dt_bias [H K]; A_log [H]
//   o_norm_w [V], state [N, H, K, V] (S of recurrence (1))
// Per head: short conv + SiLU of q, k, v; q, k L2-normalised (eps 1e-6), q scaled by K^-1/2; beta = sigmoid;
// g = g_min sigmoid(e^{A_h} (W_fb W_fa x + dt_bias)); S' = Diag(e^g) S, S_new = S' + beta k (v - S'^T k)^T,
// o = S_new^T q; o = sigmoid(W_gb W_ga x + b_gb) * RMSNorm(o) (weight o_norm_w, eps). Returns o [N, H V], the new conv state, the new state
// (new tensors: the given cache is not modified).
std::vector<Tensor> kda_decode(const Tensor& proj, const Tensor& f_b, const Tensor& g_b, const Tensor& g_b_bias,
                               const Tensor& conv_w, const Tensor& conv_state, const Tensor& dt_bias,
                               const Tensor& A_log, double g_min, const Tensor& o_norm_w, double eps,
                               const Tensor& state) {
  for (auto [t, name] : {std::pair{&proj, "proj"}, {&f_b, "f_b"}, {&g_b, "g_b"}, {&g_b_bias, "g_b_bias"}, {&conv_w, "conv_w"},
                         {&conv_state, "conv_state"}, {&dt_bias, "dt_bias"}, {&A_log, "A_log"},
                         {&o_norm_w, "o_norm_w"}, {&state, "state"}})
    check_f32_contiguous(*t, name);
  const int64_t N = state.size(0), H = state.size(1), K = state.size(2), V = state.size(3);
  const int64_t C = conv_w.size(0), W = conv_w.size(1), P = proj.size(1);
  TORCH_CHECK(C == 2 * H * K + H * V && conv_state.size(0) == N && conv_state.size(1) == C &&
                  conv_state.size(2) == W - 1 && proj.size(0) == N && P >= 3 * H * K + H + 2 * K &&
                  f_b.size(0) == H * K && f_b.size(1) == K && g_b.size(0) == H * V && g_b.size(1) == K,
              "fused_cpu.kda_decode: shapes do not match the state [N, H, K, V]");
  Tensor o = at::empty({N, H * V}, proj.options());
  Tensor conv_new = at::empty_like(conv_state), S_new = at::empty_like(state);
  const float *X = proj.data_ptr<float>(), *FB = f_b.data_ptr<float>(), *GB = g_b.data_ptr<float>();
  const float* GBB = g_b_bias.data_ptr<float>();
  const float *CW = conv_w.data_ptr<float>(), *CS = conv_state.data_ptr<float>(), *DT = dt_bias.data_ptr<float>();
  const float *AL = A_log.data_ptr<float>(), *NW = o_norm_w.data_ptr<float>(), *S0 = state.data_ptr<float>();
  float *O = o.data_ptr<float>(), *CN = conv_new.data_ptr<float>(), *S1 = S_new.data_ptr<float>();
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(K)), gm = static_cast<float>(g_min);
  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(K), k(K), v(V), decay(K), delta(V), zf(K), zg(V);
    for (int64_t nh = begin; nh < end; ++nh) {
      const int64_t n = nh / H, h = nh % H;
      // short conv (the last W-1 inputs + this token) and SiLU, for the head's q, k, v channels: the taps
      // in the outer loop, channels in the inner (vectorised) one
      auto conv = [&](int64_t c0, int64_t width, float* out) {
        const float* x = X + n * P + c0;
        const float* st = CS + (n * C + c0) * (W - 1);
        const float* w = CW + c0 * W;
        float* sn = CN + (n * C + c0) * (W - 1);
#pragma omp simd
        for (int64_t d = 0; d < width; ++d) out[d] = w[d * W + W - 1] * x[d];
        for (int64_t i = 0; i < W - 1; ++i) {
#pragma omp simd
          for (int64_t d = 0; d < width; ++d) out[d] += w[d * W + i] * st[d * (W - 1) + i];
        }
        for (int64_t i = 0; i + 1 < W - 1; ++i) {
#pragma omp simd
          for (int64_t d = 0; d < width; ++d) sn[d * (W - 1) + i] = st[d * (W - 1) + i + 1];
        }
        if (W > 1) {
#pragma omp simd
          for (int64_t d = 0; d < width; ++d) sn[d * (W - 1) + W - 2] = x[d];
        }
#pragma omp simd
        for (int64_t d = 0; d < width; ++d) out[d] *= sigmoid_f(out[d]);
      };
      conv(h * K, K, q.data());
      conv(H * K + h * K, K, k.data());
      conv(2 * H * K + h * V, V, v.data());
      float qq = 0.f, kk = 0.f;
      for (int64_t d = 0; d < K; ++d) {
        qq += q[d] * q[d];
        kk += k[d] * k[d];
      }
      const float rq = q_scale / std::sqrt(qq + 1e-6f), rk = 1.0f / std::sqrt(kk + 1e-6f);
      for (int64_t d = 0; d < K; ++d) {
        q[d] *= rq;
        k[d] *= rk;
      }
      const float beta = sigmoid_f(X[n * P + 3 * H * K + h]);
      const float a = std::exp(AL[h]);
      const float *fa = X + n * P + 3 * H * K + H, *ga = fa + K, *dt_h = DT + h * K;
      gemv(FB + h * K * K, fa, zf.data(), K, K);  // this head's rows of W_fb W_fa x
      gemv(GB + h * V * K, ga, zg.data(), V, K);  // and of W_gb W_ga x
      const float* zf_nh = zf.data();
#pragma omp simd
      for (int64_t d = 0; d < K; ++d) decay[d] = exp_f(gm * sigmoid_f(a * (zf_nh[d] + dt_h[d])));
      // S' = Diag(decay) S; delta = v - S'^T k; S_new = S' + beta k delta^T; o = S_new^T q
      const float* s0 = S0 + nh * K * V;
      float* s1 = S1 + nh * K * V;
      std::copy(v.begin(), v.end(), delta.begin());
      for (int64_t d = 0; d < K; ++d) {
        const float* row = s0 + d * V;
        float* out = s1 + d * V;
        const float f = decay[d], kd = k[d];
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) {
          out[j] = row[j] * f;
          delta[j] -= kd * out[j];
        }
      }
      float* o_nh = O + n * H * V + h * V;
      std::fill(o_nh, o_nh + V, 0.f);
      for (int64_t d = 0; d < K; ++d) {
        float* row = s1 + d * V;
        const float bk = beta * k[d], qd = q[d];
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) {
          row[j] += bk * delta[j];
          o_nh[j] += qd * row[j];
        }
      }
      float ss = 0.f;
      for (int64_t j = 0; j < V; ++j) ss += o_nh[j] * o_nh[j];
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(V) + static_cast<float>(eps));
      const float *zg_nh = zg.data(), *gbb = GBB + h * V;
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) o_nh[j] = sigmoid_f(zg_nh[j] + gbb[j]) * (o_nh[j] * r * NW[j]);
    }
  });
  return {o, conv_new, S_new};
}

// One absorbed MLA decode step (model/mla.py `GatedMLA.decode_step_fused`), one new token per sequence:
//   q [N, H Dh], c_raw [N, R] = W_dkv x, g [N, H Dh] = W_g x (row-strided views of the input projection)
//   kv_norm [R], w_uk, w_uv [H Dh, R] (k_b_proj / v_b_proj weights), latents [N, cap, R], lens: latents cached
//   per row (the new one is not in the buffer yet)
// c = RMSNorm(c_raw); per head q~ = W_uk,h^T q_h, scores q~ . c_j * scale over the lens[n] cached latents and c,
// softmax, o~ = sum_j p_j c_j, o_h = W_uv,h o~; o = sigmoid(g) * o. Returns o [N, H Dh] and c [N, R] (which the
// caller appends to the cache).
std::vector<Tensor> mla_decode(const Tensor& q, const Tensor& c_raw, const Tensor& g, const Tensor& kv_norm,
                               double eps, const Tensor& w_uk, const Tensor& w_uv, const Tensor& latents,
                               const std::vector<int64_t>& lens, int64_t H, double scale) {
  const Rows Q = rows_of(q, "q"), Craw = rows_of(c_raw, "c_raw"), G = rows_of(g, "g");
  for (auto [t, name] : {std::pair{&kv_norm, "kv_norm"}, {&w_uk, "w_uk"}, {&w_uv, "w_uv"}, {&latents, "latents"}})
    check_f32_contiguous(*t, name);
  const int64_t N = q.size(0), HD = q.size(1), R = kv_norm.numel(), cap = latents.size(1), Dh = HD / H;
  TORCH_CHECK(H >= 1 && Dh * H == HD && w_uk.size(0) == HD && w_uk.size(1) == R && w_uv.size(0) == HD &&
                  w_uv.size(1) == R && latents.size(0) == N && latents.size(2) == R &&
                  static_cast<int64_t>(lens.size()) == N && c_raw.size(1) == R && g.size(1) == HD &&
                  c_raw.size(0) == N && g.size(0) == N,
              "fused_cpu.mla_decode: shapes do not match");
  int64_t longest = 0;
  for (int64_t l : lens) {
    TORCH_CHECK(l >= 0 && l <= cap, "fused_cpu.mla_decode: lens beyond the buffer");
    longest = std::max(longest, l);
  }
  Tensor o = at::empty({N, HD}, q.options()), c = at::empty({N, R}, q.options());
  const float *NW = kv_norm.data_ptr<float>(), *WK = w_uk.data_ptr<float>(), *WV = w_uv.data_ptr<float>();
  const float* LAT = latents.data_ptr<float>();
  float *O = o.data_ptr<float>(), *Cn = c.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) rms_norm_row(Craw.row(n), NW, static_cast<float>(eps), Cn + n * R, R);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> ql(R), ol(R), p(longest + 1);
    for (int64_t nh = begin; nh < end; ++nh) {
      const int64_t n = nh / H, h = nh % H, len = lens[n];
      const float* qh = Q.row(n) + h * Dh;
      std::fill(ql.begin(), ql.end(), 0.f);
      float* qlp = ql.data();
      for (int64_t d = 0; d < Dh; ++d) {  // q~ = W_uk,h^T q_h
        const float* w = WK + (h * Dh + d) * R;
        const float qd = qh[d];
#pragma omp simd
        for (int64_t r = 0; r < R; ++r) qlp[r] += qd * w[r];
      }
      auto latent = [&](int64_t j) { return j < len ? LAT + (n * cap + j) * R : Cn + n * R; };
      float mx = -INFINITY;
      for (int64_t j = 0; j <= len; ++j) {
        const float* cj = latent(j);
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t r = 0; r < R; ++r) dot += qlp[r] * cj[r];
        p[j] = dot * sc;
        mx = std::max(mx, p[j]);
      }
      float z = 0.f;
      for (int64_t j = 0; j <= len; ++j) z += (p[j] = std::exp(p[j] - mx));
      std::fill(ol.begin(), ol.end(), 0.f);
      float* olp = ol.data();
      for (int64_t j = 0; j <= len; ++j) {
        const float* cj = latent(j);
        const float pj = p[j] / z;
#pragma omp simd
        for (int64_t r = 0; r < R; ++r) olp[r] += pj * cj[r];
      }
      float* oh = O + n * HD + h * Dh;
      gemv(WV + h * Dh * R, olp, oh, Dh, R);  // o_h = W_uv,h o~
      const float* gh = G.row(n) + h * Dh;
#pragma omp simd
      for (int64_t d = 0; d < Dh; ++d) oh[d] *= sigmoid_f(gh[d]);
    }
  });
  return {o, c};
}

// SiTU-GLU of the concatenated projections: gu [T, 2I] = [gate | up] -> [T, I] (model/activations.py).
Tensor situ_glu_gu(const Tensor& gu) {
  check_f32_contiguous(gu, "gu");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  Tensor out = at::empty({T, I}, gu.options());
  const float* G = gu.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *g = G + t * 2 * I, *u = g + I;
      float* o = O + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = situ_glu(g[i], u[i]);
    }
  });
  return out;
}

// The gradient of situ_glu_gu: d/d[gate | up] [T, 2I] given dout [T, I]. With A(g) = 4 tanh(g/4) sigmoid(g) and
// B(u) = 25 tanh(u/25): dg = dout B A'(g), du = dout A B'(u), A' = (1 - tanh^2(g/4)) sigmoid(g) + 4 tanh(g/4)
// sigmoid(g) (1 - sigmoid(g)), B' = 1 - tanh^2(u/25).
Tensor situ_glu_gu_backward(const Tensor& gu, const Tensor& dout) {
  check_f32_contiguous(gu, "gu");
  check_f32_contiguous(dout, "dout");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(dout.size(0) == T && dout.size(1) == I, "fused_cpu.situ_glu_gu_backward: dout must be [T, I]");
  Tensor dgu = at::empty_like(gu);
  const float *G = gu.data_ptr<float>(), *DO = dout.data_ptr<float>();
  float* DG = dgu.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *g = G + t * 2 * I, *u = g + I, *d = DO + t * I;
      float *dg = DG + t * 2 * I, *du = dg + I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float tg = tanh_f(g[i] * 0.25f), sg = sigmoid_f(g[i]), tu = tanh_f(u[i] * 0.04f);
        const float A = 4.f * tg * sg, B = 25.f * tu;
        const float dA = sech2_f(g[i] * 0.25f) * sg + A * (1.f - sg);
        dg[i] = d[i] * B * dA;
        du[i] = d[i] * A * sech2_f(u[i] * 0.04f);
      }
    }
  });
  return dgu;
}

// One AttnRes read (model/attn_res.py `AttnResRead`) over S sources [T, D]:
//   logits_i = ((query * norm_weight)^T v_i) * r_i,   h = sum_i softmax_i(logits) v_i
// with r_i = 1 / sqrt(mean(v_i^2) + eps) given for the first inv_rms.size() sources and computed here for the
// rest. With a non-empty out_norm [D], h is returned through that RMSNorm (out_eps): the pre-sublayer norm
// that always follows a read. Returns h [T, D] and the computed r_i (a list [T] each), which the stream keeps;
// with `keep` (for attn_res_read_backward) every r_i must be given and the softmax weights p [T, S] and the
// pre-norm h [T, D] (when normed) follow.
std::vector<Tensor> attn_res_read(const std::vector<Tensor>& sources, const std::vector<Tensor>& inv_rms,
                                  const Tensor& query, const Tensor& norm_weight, double eps,
                                  const Tensor& out_norm, double out_eps, bool keep) {
  const int64_t S = static_cast<int64_t>(sources.size()), m = static_cast<int64_t>(inv_rms.size());
  TORCH_CHECK(S >= 1 && m <= S, "fused_cpu.attn_res_read: needs >= 1 source and at most one r per source");
  check_f32_contiguous(query, "query");
  check_f32_contiguous(norm_weight, "norm_weight");
  const int64_t T = sources[0].size(0), D = sources[0].size(1);
  std::vector<const float*> V(S), R(S);
  for (int64_t i = 0; i < S; ++i) {
    check_f32_contiguous(sources[i], "source");
    TORCH_CHECK(sources[i].dim() == 2 && sources[i].size(0) == T && sources[i].size(1) == D,
                "fused_cpu.attn_res_read: sources must all be [T, D]");
    V[i] = sources[i].data_ptr<float>();
  }
  std::vector<Tensor> out{at::empty({T, D}, sources[0].options())};
  for (int64_t i = 0; i < S; ++i) {
    if (i < m) {
      check_f32_contiguous(inv_rms[i], "inv_rms");
      R[i] = inv_rms[i].data_ptr<float>();
    } else {
      out.push_back(at::empty({T}, sources[0].options()));
      R[i] = out.back().data_ptr<float>();
    }
  }
  const bool normed = out_norm.numel() > 0;
  if (normed) check_f32_contiguous(out_norm, "out_norm");
  TORCH_CHECK(!normed || out_norm.numel() == D, "fused_cpu.attn_res_read: out_norm must be [D]");
  const float* ON = normed ? out_norm.data_ptr<float>() : nullptr;
  TORCH_CHECK(!keep || m == S, "fused_cpu.attn_res_read: keep needs every source's inverse RMS");
  float *PK = nullptr, *HK = nullptr;
  if (keep) {
    out.push_back(at::empty({T, S}, sources[0].options()));
    PK = out.back().data_ptr<float>();
    if (normed) {
      out.push_back(at::empty({T, D}, sources[0].options()));
      HK = out.back().data_ptr<float>();
    }
  }
  std::vector<float> w(D);
  const float *Q = query.data_ptr<float>(), *NW = norm_weight.data_ptr<float>();
  for (int64_t d = 0; d < D; ++d) w[d] = Q[d] * NW[d];
  float* H = out[0].data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> logit(S);
    for (int64_t t = begin; t < end; ++t) {
      float mx = -INFINITY;
      for (int64_t i = 0; i < S; ++i) {
        const float* v = V[i] + t * D;
        float dot = 0.f, ss = 0.f;
#pragma omp simd reduction(+ : dot, ss)
        for (int64_t d = 0; d < D; ++d) {
          dot += v[d] * w[d];
          ss += v[d] * v[d];
        }
        float* r = const_cast<float*>(R[i]) + t;
        if (i >= m) *r = 1.0f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
        logit[i] = dot * *r;
        mx = std::max(mx, logit[i]);
      }
      float z = 0.f;
      for (int64_t i = 0; i < S; ++i) z += (logit[i] = std::exp(logit[i] - mx));
      float* h = H + t * D;
      std::fill(h, h + D, 0.f);
      for (int64_t i = 0; i < S; ++i) {
        const float p = logit[i] / z;
        if (PK != nullptr) PK[t * S + i] = p;
        const float* v = V[i] + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) h[d] += p * v[d];
      }
      if (HK != nullptr) std::copy(h, h + D, HK + t * D);
      if (normed) {
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < D; ++d) ss += h[d] * h[d];
        const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(out_eps));
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) h[d] = h[d] * r * ON[d];
      }
    }
  });
  return out;
}

// The gradient of attn_res_read (keep = true) given dout [T, D]: with w = query * norm_weight,
//   normed: dh = rh (a - h rh^2 (a . h) / D), a = dout * out_norm, rh = 1 / sqrt(mean(h^2) + out_eps);
//           d out_norm = sum_t dout * h * rh; otherwise dh = dout;
//   dp_i = v_i . dh, dl_i = p_i (dp_i - sum_j p_j dp_j);
//   dv_i = p_i dh + dl_i r_i w, dr_i = dl_i (v_i . w), dw = sum_t sum_i dl_i r_i v_i (-> dquery = dw * norm_weight,
//   d norm_weight = dw * query). r_i is an input: its own gradient (dr_i) flows back through inverse_rms.
// Returns [dquery, dnorm_weight, dout_norm (empty when not normed), dv_1 .. dv_S, dr_1 .. dr_S].
std::vector<Tensor> attn_res_read_backward(const std::vector<Tensor>& sources, const std::vector<Tensor>& inv_rms,
                                           const Tensor& query, const Tensor& norm_weight, const Tensor& out_norm,
                                           double out_eps, const Tensor& p, const Tensor& h_pre,
                                           const Tensor& dout) {
  const int64_t S = static_cast<int64_t>(sources.size()), T = sources[0].size(0), D = sources[0].size(1);
  TORCH_CHECK(static_cast<int64_t>(inv_rms.size()) == S, "fused_cpu.attn_res_read_backward: one r per source");
  for (const auto& t : {query, norm_weight, p, dout}) check_f32_contiguous(t, "attn_res_read_backward input");
  const bool normed = out_norm.numel() > 0;
  if (normed) {
    check_f32_contiguous(out_norm, "out_norm");
    check_f32_contiguous(h_pre, "h_pre");
  }
  std::vector<const float*> V(S), R(S);
  std::vector<Tensor> dvs, drs;
  std::vector<float*> DV(S), DR(S);
  for (int64_t i = 0; i < S; ++i) {
    check_f32_contiguous(sources[i], "source");
    check_f32_contiguous(inv_rms[i], "inv_rms");
    V[i] = sources[i].data_ptr<float>();
    R[i] = inv_rms[i].data_ptr<float>();
    dvs.push_back(at::empty({T, D}, sources[0].options()));
    drs.push_back(at::empty({T}, sources[0].options()));
    DV[i] = dvs.back().data_ptr<float>();
    DR[i] = drs.back().data_ptr<float>();
  }
  std::vector<float> w(D);
  const float *Q = query.data_ptr<float>(), *NW = norm_weight.data_ptr<float>(), *P = p.data_ptr<float>();
  const float *DO = dout.data_ptr<float>(), *ON = normed ? out_norm.data_ptr<float>() : nullptr;
  const float* HP = normed ? h_pre.data_ptr<float>() : nullptr;
  for (int64_t d = 0; d < D; ++d) w[d] = Q[d] * NW[d];
  const int nthreads = at::get_num_threads();
  std::vector<float> dw_parts(static_cast<size_t>(nthreads) * 2 * D, 0.f);  // per thread: dw [D], d out_norm [D]
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    float* dwp = dw_parts.data() + static_cast<size_t>(at::get_thread_num()) * 2 * D;
    float* donp = dwp + D;
    std::vector<float> dh(D), dp(S), vw(S);
    for (int64_t t = begin; t < end; ++t) {
      const float* dot = DO + t * D;
      float* dhp = dh.data();
      if (normed) {
        const float* h = HP + t * D;
        float ss = 0.f, ah = 0.f;
#pragma omp simd reduction(+ : ss, ah)
        for (int64_t d = 0; d < D; ++d) {
          ss += h[d] * h[d];
          ah += dot[d] * ON[d] * h[d];
        }
        const float rh = 1.0f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(out_eps));
        const float c = rh * rh * ah / static_cast<float>(D);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          dhp[d] = rh * (dot[d] * ON[d] - h[d] * c);
          donp[d] += dot[d] * h[d] * rh;
        }
      } else {
        std::copy(dot, dot + D, dhp);
      }
      float s = 0.f;
      for (int64_t i = 0; i < S; ++i) {
        const float* v = V[i] + t * D;
        float a = 0.f, b = 0.f;
#pragma omp simd reduction(+ : a, b)
        for (int64_t d = 0; d < D; ++d) {
          a += v[d] * dhp[d];
          b += v[d] * w[d];
        }
        dp[i] = a;
        vw[i] = b;
        s += P[t * S + i] * a;
      }
      for (int64_t i = 0; i < S; ++i) {
        const float pi = P[t * S + i], dl = pi * (dp[i] - s), ri = R[i][t];
        const float* v = V[i] + t * D;
        float* dv = DV[i] + t * D;
        const float c = dl * ri;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          dv[d] = pi * dhp[d] + c * w[d];
          dwp[d] += c * v[d];
        }
        DR[i][t] = dl * vw[i];
      }
    }
  });
  Tensor dq = at::zeros({D}, query.options()), dnw = at::zeros({D}, query.options());
  Tensor don = normed ? at::zeros({D}, query.options()) : at::empty({0}, query.options());
  float *DQ = dq.data_ptr<float>(), *DNW = dnw.data_ptr<float>(), *DON = normed ? don.data_ptr<float>() : nullptr;
  for (int th = 0; th < nthreads; ++th) {
    const float* part = dw_parts.data() + static_cast<size_t>(th) * 2 * D;
    for (int64_t d = 0; d < D; ++d) {
      DQ[d] += part[d] * NW[d];
      DNW[d] += part[d] * Q[d];
      if (normed) DON[d] += part[D + d];
    }
  }
  std::vector<Tensor> out{dq, dnw, don};
  out.insert(out.end(), dvs.begin(), dvs.end());
  out.insert(out.end(), drs.begin(), drs.end());
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Causal depthwise conv over packed sequences, then SiLU (model/short_conv.py `causal_short_conv` + F.silu):
//   p[t, c] = w[c, W-1] x[t, c] + sum_{i < W-1} w[c, i] x[t - (W-1) + i, c],   y = p sigmoid(p)
// where positions before a sequence's first token read its conv state [N, C, W-1] (oldest first; empty = zeros).
// Returns y [T, C] and the new state (the last W-1 inputs of each sequence, state rows too when it is short).
// Tokens run in parallel (each reads its W-1 predecessors), channels vectorised.
namespace {

struct ShortConv {
  const float *X, *WT, *ST;  // x [T, C], taps [W, C], state [N, C, W-1] or null
  const std::vector<int64_t>& cu;
  int64_t C, W;
  int64_t seq_of(int64_t t) const {  // the sequence holding token t
    return std::upper_bound(cu.begin(), cu.end(), t) - cu.begin() - 1;
  }
  // input row r of sequence n (r < 0: state row W-1+r, or null = zeros); buf [C] holds a gathered state row
  const float* row(int64_t n, int64_t r, float* buf) const {
    if (r >= 0) return X + (cu[n] + r) * C;
    if (ST == nullptr) return nullptr;
    for (int64_t c = 0; c < C; ++c) buf[c] = ST[(n * C + c) * (W - 1) + (W - 1 + r)];
    return buf;
  }
  void pre_activation(int64_t t, float* a, float* buf) const {  // p[t] into a [C]
    const int64_t n = seq_of(t), r = t - cu[n];
    std::fill(a, a + C, 0.f);
    for (int64_t i = 0; i < W; ++i) {
      const float* xr = row(n, r - (W - 1) + i, buf);
      if (xr == nullptr) continue;
      const float* wi = WT + i * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) a[c] += wi[c] * xr[c];
    }
  }
};

}  // namespace

std::vector<Tensor> short_conv_silu(const Tensor& x, const Tensor& w, const std::vector<int64_t>& cu,
                                    const Tensor& state) {
  check_f32_contiguous(x, "x");
  check_f32_contiguous(w, "w");
  const int64_t T = x.size(0), C = x.size(1), W = w.size(1), N = static_cast<int64_t>(cu.size()) - 1;
  TORCH_CHECK(w.size(0) == C && N >= 0 && cu.front() == 0 && cu.back() == T,
              "fused_cpu.short_conv_silu: w [C, W], cu from 0 to T");
  const bool has_state = state.numel() > 0;
  if (has_state) {
    check_f32_contiguous(state, "state");
    TORCH_CHECK(state.size(0) == N && state.size(1) == C && state.size(2) == W - 1,
                "fused_cpu.short_conv_silu: state must be [N, C, W-1]");
  }
  Tensor y = at::empty({T, C}, x.options()), new_state = at::empty({N, C, W - 1}, x.options());
  const Tensor wt = w.t().contiguous();  // [W, C]: tap i of every channel, contiguous
  const ShortConv sc{x.data_ptr<float>(), wt.data_ptr<float>(), has_state ? state.data_ptr<float>() : nullptr, cu,
                     C, W};
  float *Y = y.data_ptr<float>(), *NS = new_state.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t tb, int64_t te) {
    std::vector<float> buf(C);
    for (int64_t t = tb; t < te; ++t) {
      float* yr = Y + t * C;
      sc.pre_activation(t, yr, buf.data());
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) yr[c] = yr[c] * sigmoid_f(yr[c]);
    }
  });
  std::vector<float> buf(C);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t L = cu[n + 1] - cu[n];
    for (int64_t j = 0; j < W - 1; ++j) {  // new state column j = input row L - (W-1) + j
      const float* xr = sc.row(n, L - (W - 1) + j, buf.data());
      for (int64_t c = 0; c < C; ++c) NS[(n * C + c) * (W - 1) + j] = xr ? xr[c] : 0.f;
    }
  }
  return {y, new_state};
}

// The gradient of short_conv_silu: dx [T, C] and dw [C, W] from dy [T, C] (none for the state, which the caller
// only passes when it needs no gradient). The pre-activation is recomputed; g = dy silu'(p) with
// silu'(p) = s (1 + p (1 - s)), s = sigmoid(p); dx[t] = sum_i w[:, i] g[t + W-1-i] (inside the sequence),
// dw[:, i] = sum_t g[t] x[t - (W-1) + i] (state rows before a sequence's first token).
std::vector<Tensor> short_conv_silu_backward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& cu,
                                             const Tensor& state, const Tensor& dy) {
  check_f32_contiguous(x, "x");
  check_f32_contiguous(w, "w");
  check_f32_contiguous(dy, "dy");
  const int64_t T = x.size(0), C = x.size(1), W = w.size(1);
  TORCH_CHECK(dy.size(0) == T && dy.size(1) == C && w.size(0) == C && cu.back() == T,
              "fused_cpu.short_conv_silu_backward: shapes do not match");
  const bool has_state = state.numel() > 0;
  if (has_state) check_f32_contiguous(state, "state");
  const Tensor wt = w.t().contiguous();
  const ShortConv sc{x.data_ptr<float>(), wt.data_ptr<float>(), has_state ? state.data_ptr<float>() : nullptr, cu,
                     C, W};
  Tensor g = at::empty({T, C}, x.options()), dx = at::empty({T, C}, x.options());
  const float *X = x.data_ptr<float>(), *WT = wt.data_ptr<float>(), *DY = dy.data_ptr<float>();
  float *G = g.data_ptr<float>(), *DX = dx.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t tb, int64_t te) {
    std::vector<float> buf(C);
    for (int64_t t = tb; t < te; ++t) {
      float* gr = G + t * C;
      sc.pre_activation(t, gr, buf.data());
      const float* dyr = DY + t * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) {
        const float p = gr[c], s = sigmoid_f(p);
        gr[c] = dyr[c] * s * (1.f + p * (1.f - s));
      }
    }
  });
  const int nthreads = at::get_num_threads();
  std::vector<float> dw_parts(static_cast<size_t>(nthreads) * W * C, 0.f);
  at::parallel_for(0, T, 64, [&](int64_t tb, int64_t te) {
    float* dwp = dw_parts.data() + static_cast<size_t>(at::get_thread_num()) * W * C;
    std::vector<float> buf(C);
    for (int64_t t = tb; t < te; ++t) {
      const int64_t n = sc.seq_of(t), r = t - cu[n], L = cu[n + 1] - cu[n];
      float* dxr = DX + t * C;
      std::fill(dxr, dxr + C, 0.f);
      for (int64_t i = 0; i < W; ++i) {
        if (r + (W - 1 - i) >= L) continue;  // the output row that read x[t] through tap i
        const float *gr = G + (t + W - 1 - i) * C, *wi = WT + i * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) dxr[c] += wi[c] * gr[c];
      }
      const float* gr = G + t * C;
      for (int64_t i = 0; i < W; ++i) {
        const float* xr = sc.row(n, r - (W - 1) + i, buf.data());
        if (xr == nullptr) continue;
        float* dwi = dwp + i * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) dwi[c] += gr[c] * xr[c];
      }
    }
  });
  Tensor dw = at::zeros({C, W}, x.options());
  float* DW = dw.data_ptr<float>();
  for (int th = 0; th < nthreads; ++th)
    for (int64_t i = 0; i < W; ++i)
      for (int64_t c = 0; c < C; ++c) DW[c * W + i] += dw_parts[(static_cast<size_t>(th) * W + i) * C + c];
  return {dx, dw};
}

// ---------------------------------------------------------------------------------------------------------------
// The KDA recurrence (1) in its delta form (2), per (sequence, head) chain, state S [K, V] (model/kda_reference.py
// `naive_recurrent_kda` is the oracle):
//   S' = Diag(e^{g_t}) S_{t-1},  d_t = v_t - S'^T k_t,  S_t = S' + beta_t k_t d_t^T,  o_t = S_t^T q_t
// Inputs in token layout: q, k, g [T, H, K], v [T, H, V], beta [T, H]; cu [N+1] sequence offsets; S0 [N, H, K, V]
// or empty (zeros). The forward stores S at the start of every `block` tokens of a chain (checkpoints
// [sum_n ceil(L_n / block), H, K, V], sequence n's blocks from ckpt_off[n]) for the backward, which recomputes
// each block forward (keeping S'_t and d_t) and then runs the adjoint recurrence backwards through it:
//   dS += q_t dO_t^T;  dq_t = S_t dO_t;  dbeta_t = k_t^T dS d_t;  dd = beta_t dS^T k_t;  dv_t = dd;
//   dk_t = beta_t dS d_t - S' dd;  M = dS - k_t dd^T;  dg_t = rowsum(M o S');  dS <- Diag(e^{g_t}) M
namespace {

// The chain loops are templates on the head sizes (KT, VT; 0 = given at run time): with the sizes known at
// compile time the row loops are fully unrolled vector code, about 2-4x faster per token than runtime bounds.

// One token: S' = Diag(e^g) S (in place, also into sp when given), d = v - S'^T k, S += beta k d^T, o = S^T q.
template <int KT, int VT>
inline void kda_token(float* __restrict S, const float* __restrict q, const float* __restrict k,
                      const float* __restrict v, const float* __restrict g, float beta, float* __restrict o,
                      float* __restrict a, float* __restrict d, float* __restrict sp, int64_t K_, int64_t V_) {
  const int64_t K = KT ? KT : K_, V = VT ? VT : V_;
#pragma omp simd
  for (int64_t i = 0; i < K; ++i) a[i] = exp_f(g[i]);
  for (int64_t j = 0; j < V; ++j) d[j] = v[j];
  for (int64_t i = 0; i < K; ++i) {
    float* row = S + i * V;
    const float ai = a[i], ki = k[i];
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) {
      row[j] *= ai;
      d[j] -= ki * row[j];
    }
    if (sp != nullptr) std::copy(row, row + V, sp + i * V);
  }
  if (o != nullptr) {
    for (int64_t j = 0; j < V; ++j) o[j] = 0.f;
    for (int64_t i = 0; i < K; ++i) {
      float* row = S + i * V;
      const float bk = beta * k[i], qi = q[i];
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) {
        row[j] += bk * d[j];
        o[j] += qi * row[j];
      }
    }
  } else {
    for (int64_t i = 0; i < K; ++i) {
      float* row = S + i * V;
      const float bk = beta * k[i];
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) row[j] += bk * d[j];
    }
  }
}

// The adjoint of one token (see the block comment above): dS is updated in place to the gradient of S_{t-1}.
template <int KT, int VT>
inline void kda_token_backward(float* __restrict dS, const float* __restrict sp, const float* __restrict d,
                               const float* __restrict a, const float* __restrict q, const float* __restrict k,
                               float beta, const float* __restrict dO, float* __restrict dq, float* __restrict dk,
                               float* __restrict dv, float* __restrict dg, float* __restrict dbeta,
                               float* __restrict dd, int64_t K_, int64_t V_) {
  const int64_t K = KT ? KT : K_, V = VT ? VT : V_;
  float d_dot_do = 0.f;  // d . dO, for dq = S_t dO = S' dO + beta k (d . dO)
#pragma omp simd reduction(+ : d_dot_do)
  for (int64_t j = 0; j < V; ++j) d_dot_do += d[j] * dO[j];
  for (int64_t j = 0; j < V; ++j) dd[j] = 0.f;
  float db = 0.f;
  for (int64_t i = 0; i < K; ++i) {
    float* dsr = dS + i * V;
    const float* spr = sp + i * V;
    const float qi = q[i], ki = k[i];
    float s_do = 0.f, ds_d = 0.f;
#pragma omp simd reduction(+ : s_do, ds_d)
    for (int64_t j = 0; j < V; ++j) {
      dsr[j] += qi * dO[j];  // dS += q dO^T
      s_do += spr[j] * dO[j];
      ds_d += dsr[j] * d[j];
      dd[j] += ki * dsr[j];
    }
    dq[i] = s_do + beta * ki * d_dot_do;
    db += ki * ds_d;
    dk[i] = beta * ds_d;  // the - S' dd part is added below
  }
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) dd[j] *= beta;
  *dbeta = db;
  for (int64_t j = 0; j < V; ++j) dv[j] = dd[j];
  for (int64_t i = 0; i < K; ++i) {
    float* dsr = dS + i * V;
    const float* spr = sp + i * V;
    const float ki = k[i], ai = a[i];
    float s_dd = 0.f, m_s = 0.f;
#pragma omp simd reduction(+ : s_dd, m_s)
    for (int64_t j = 0; j < V; ++j) {
      s_dd += spr[j] * dd[j];
      const float mij = dsr[j] - ki * dd[j];  // M = dS - k dd^T (the gradient of S')
      m_s += mij * spr[j];
      dsr[j] = ai * mij;  // the gradient of S_{t-1}
    }
    dk[i] -= s_dd;
    dg[i] = m_s;  // d/dg_i of S' = e^{g_i} S_{t-1}: sum_j M_ij S'_ij
  }
}

std::vector<int64_t> block_offsets(const std::vector<int64_t>& cu, int64_t block) {
  std::vector<int64_t> off(cu.size(), 0);
  for (size_t n = 0; n + 1 < cu.size(); ++n) off[n + 1] = off[n] + (cu[n + 1] - cu[n] + block - 1) / block;
  return off;
}

struct KdaArgs {  // token layout: q, k, g [T, H, K], v, o [T, H, V], beta [T, H]
  const float *Q, *Kp, *Vp, *G, *B;
  int64_t H, K, V;
};

template <int KT, int VT>
void kda_forward_chains(const KdaArgs& x, const std::vector<int64_t>& cu, const float* S0, float* O, float* SF,
                        float* CK, const std::vector<int64_t>& boff, int64_t block) {
  const int64_t H = x.H, K = x.K, V = x.V, N = static_cast<int64_t>(cu.size()) - 1;
  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> a(K), d(V);
    for (int64_t nh = begin; nh < end; ++nh) {
      const int64_t n = nh / H, h = nh % H;
      float* st = SF + nh * K * V;
      if (S0 != nullptr) std::copy(S0 + nh * K * V, S0 + (nh + 1) * K * V, st);
      else std::fill(st, st + K * V, 0.f);
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        const int64_t j = t - cu[n];
        if (block > 0 && j % block == 0) std::copy(st, st + K * V, CK + ((boff[n] + j / block) * H + h) * K * V);
        const int64_t ik = (t * H + h) * K, iv = (t * H + h) * V;
        kda_token<KT, VT>(st, x.Q + ik, x.Kp + ik, x.Vp + iv, x.G + ik, x.B[t * H + h], O + iv, a.data(), d.data(),
                          nullptr, K, V);
      }
    }
  });
}

struct KdaGrads {
  float *DQ, *DK, *DV, *DG, *DB, *DS0;
};

template <int KT, int VT>
void kda_backward_chains(const KdaArgs& x, const std::vector<int64_t>& cu, const float* CK,
                         const std::vector<int64_t>& boff, int64_t block, const float* DO, const float* DSF,
                         const KdaGrads& gr) {
  const int64_t H = x.H, K = x.K, V = x.V, N = static_cast<int64_t>(cu.size()) - 1;
  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Sp(block * K * V), D(block * V), A(block * K), S(K * V), dS(K * V), dd(V);
    for (int64_t nh = begin; nh < end; ++nh) {
      const int64_t n = nh / H, h = nh % H, L = cu[n + 1] - cu[n];
      float* ds = dS.data();
      if (DSF != nullptr) std::copy(DSF + nh * K * V, DSF + (nh + 1) * K * V, ds);
      else std::fill(ds, ds + K * V, 0.f);
      for (int64_t b = (L + block - 1) / block - 1; b >= 0; --b) {
        const int64_t t0 = cu[n] + b * block, t1 = std::min(t0 + block, cu[n + 1]);
        // recompute the block forward from its checkpoint, keeping S'_t, d_t and e^{g_t}
        std::copy(CK + ((boff[n] + b) * H + h) * K * V, CK + ((boff[n] + b) * H + h + 1) * K * V, S.data());
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t r = t - t0, ik = (t * H + h) * K, iv = (t * H + h) * V;
          kda_token<KT, VT>(S.data(), x.Q + ik, x.Kp + ik, x.Vp + iv, x.G + ik, x.B[t * H + h], nullptr,
                            A.data() + r * K, D.data() + r * V, Sp.data() + r * K * V, K, V);
        }
        for (int64_t t = t1 - 1; t >= t0; --t) {  // the adjoint recurrence backwards through the block
          const int64_t r = t - t0, ik = (t * H + h) * K, iv = (t * H + h) * V;
          kda_token_backward<KT, VT>(ds, Sp.data() + r * K * V, D.data() + r * V, A.data() + r * K, x.Q + ik,
                                     x.Kp + ik, x.B[t * H + h], DO + iv, gr.DQ + ik, gr.DK + ik, gr.DV + iv,
                                     gr.DG + ik, gr.DB + t * H + h, dd.data(), K, V);
        }
      }
      std::copy(ds, ds + K * V, gr.DS0 + nh * K * V);
    }
  });
}

// calls FN<K, V>(args...) with compile-time sizes for the common square heads, FN<0, 0> otherwise
#define KDA_DISPATCH(K, V, FN, ...)                                   \
  do {                                                                \
    if ((K) == 32 && (V) == 32) FN<32, 32>(__VA_ARGS__);              \
    else if ((K) == 64 && (V) == 64) FN<64, 64>(__VA_ARGS__);         \
    else if ((K) == 128 && (V) == 128) FN<128, 128>(__VA_ARGS__);     \
    else FN<0, 0>(__VA_ARGS__);                                       \
  } while (0)

}  // namespace

// The whole middle of a KDA layer over packed sequences without autograd (prefill), per (sequence, head) chain:
//   proj [T, P]   input projections, columns [q (H K) | k (H K) | v (H V) | beta logit (H) | ...]
//   zf [T, H K]   W_fb W_fa x;  zg [T, H V] W_gb W_ga x + b_gb (the gates' rank-K up-projections, matmuls)
//   conv_w [C, W], conv_state [N, C, W-1] or empty, cu [N+1], dt_bias, A_log, g_min, o_norm_w [V], eps,
//   S0 [N, H, K, V] or empty
// Per token: short conv (previous rows of the sequence, then its conv state) + SiLU of the head's q, k, v
// channels, L2 norms (q also scaled by K^-1/2), beta = sigmoid, g = g_min sigmoid(e^{A_h} (zf + dt_bias)),
// recurrence (1), o = sigmoid(zg) * RMSNorm(o). Returns o [T, H V], the new conv state, the final state: what
// model/kda.py `KDAttention.forward` computes between its input and output projections.
namespace {

template <int KT, int VT>
void kda_prefill_chains(const float* X, int64_t P, const float* ZF, const float* ZG, const float* CW, const float* CS,
                        int64_t W, const std::vector<int64_t>& cu, const float* DT, const float* AL, float gm,
                        const float* NW, float eps, const float* S0, int64_t H, int64_t K_, int64_t V_, float* O,
                        float* SF) {
  const int64_t K = KT ? KT : K_, V = VT ? VT : V_, C = 2 * H * K + H * V, N = static_cast<int64_t>(cu.size()) - 1;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(K));
  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(K), k(V > K ? V : K), v(V), a(K), d(V), g(K);
    for (int64_t nh = begin; nh < end; ++nh) {
      const int64_t n = nh / H, h = nh % H;
      float* st = SF + nh * K * V;
      if (S0 != nullptr) std::copy(S0 + nh * K * V, S0 + (nh + 1) * K * V, st);
      else std::fill(st, st + K * V, 0.f);
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        const int64_t r = t - cu[n];
        auto conv = [&](int64_t c0, int64_t width, float* out) {  // channels [c0, c0 + width) at token t
          const float* w = CW + c0 * W;
#pragma omp simd
          for (int64_t dd = 0; dd < width; ++dd) out[dd] = w[dd * W + W - 1] * X[t * P + c0 + dd];
          for (int64_t i = 0; i < W - 1; ++i) {
            const int64_t rr = r - (W - 1) + i;  // the input row tap i reads
            if (rr >= 0) {
              const float* xr = X + (cu[n] + rr) * P + c0;
#pragma omp simd
              for (int64_t dd = 0; dd < width; ++dd) out[dd] += w[dd * W + i] * xr[dd];
            } else if (CS != nullptr) {
              const float* sr = CS + (n * C + c0) * (W - 1) + (W - 1 + rr);
#pragma omp simd
              for (int64_t dd = 0; dd < width; ++dd) out[dd] += w[dd * W + i] * sr[dd * (W - 1)];
            }
          }
#pragma omp simd
          for (int64_t dd = 0; dd < width; ++dd) out[dd] *= sigmoid_f(out[dd]);
        };
        conv(h * K, K, q.data());
        conv(H * K + h * K, K, k.data());
        conv(2 * H * K + h * V, V, v.data());
        float qq = 0.f, kk = 0.f;
        for (int64_t i = 0; i < K; ++i) {
          qq += q[i] * q[i];
          kk += k[i] * k[i];
        }
        const float rq = q_scale / std::sqrt(qq + 1e-6f), rk = 1.0f / std::sqrt(kk + 1e-6f);
        for (int64_t i = 0; i < K; ++i) {
          q[i] *= rq;
          k[i] *= rk;
        }
        const float beta = sigmoid_f(X[t * P + 3 * H * K + h]), ea = std::exp(AL[h]);
        const float *zf = ZF + t * H * K + h * K, *dt = DT + h * K;
#pragma omp simd
        for (int64_t i = 0; i < K; ++i) g[i] = gm * sigmoid_f(ea * (zf[i] + dt[i]));
        float* o = O + t * H * V + h * V;
        kda_token<KT, VT>(st, q.data(), k.data(), v.data(), g.data(), beta, o, a.data(), d.data(), nullptr, K, V);
        float ss = 0.f;
        for (int64_t j = 0; j < V; ++j) ss += o[j] * o[j];
        const float rn = 1.0f / std::sqrt(ss / static_cast<float>(V) + eps);
        const float* zg = ZG + t * H * V + h * V;
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) o[j] = sigmoid_f(zg[j]) * (o[j] * rn * NW[j]);
      }
    }
  });
}

}  // namespace

std::vector<Tensor> kda_prefill(const Tensor& proj, const Tensor& zf, const Tensor& zg, const Tensor& conv_w,
                                const Tensor& conv_state, const std::vector<int64_t>& cu, const Tensor& dt_bias,
                                const Tensor& A_log, double g_min, const Tensor& o_norm_w, double eps,
                                const Tensor& S0, int64_t H, int64_t K, int64_t V) {
  for (auto [t, name] : {std::pair{&proj, "proj"}, {&zf, "zf"}, {&zg, "zg"}, {&conv_w, "conv_w"},
                         {&dt_bias, "dt_bias"}, {&A_log, "A_log"}, {&o_norm_w, "o_norm_w"}})
    check_f32_contiguous(*t, name);
  const int64_t T = proj.size(0), P = proj.size(1), C = conv_w.size(0), W = conv_w.size(1);
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
  TORCH_CHECK(C == 2 * H * K + H * V && P >= 3 * H * K + H && zf.size(0) == T && zf.size(1) == H * K &&
                  zg.size(0) == T && zg.size(1) == H * V && cu.front() == 0 && cu.back() == T,
              "fused_cpu.kda_prefill: shapes do not match");
  const bool has_conv = conv_state.numel() > 0, has_state = S0.numel() > 0;
  if (has_conv) check_f32_contiguous(conv_state, "conv_state");
  if (has_state) check_f32_contiguous(S0, "initial_state");
  TORCH_CHECK(!has_conv || (conv_state.size(0) == N && conv_state.size(1) == C && conv_state.size(2) == W - 1),
              "fused_cpu.kda_prefill: conv_state must be [N, C, W-1]");
  TORCH_CHECK(!has_state || (S0.size(0) == N && S0.size(1) == H && S0.size(2) == K && S0.size(3) == V),
              "fused_cpu.kda_prefill: initial_state must be [N, H, K, V]");
  Tensor o = at::empty({T, H * V}, proj.options()), S = at::empty({N, H, K, V}, proj.options());
  Tensor conv_new = at::empty({N, C, W - 1}, proj.options());
  KDA_DISPATCH(K, V, kda_prefill_chains, proj.data_ptr<float>(), P, zf.data_ptr<float>(), zg.data_ptr<float>(),
               conv_w.data_ptr<float>(), has_conv ? conv_state.data_ptr<float>() : nullptr, W, cu,
               dt_bias.data_ptr<float>(), A_log.data_ptr<float>(), static_cast<float>(g_min),
               o_norm_w.data_ptr<float>(), static_cast<float>(eps), has_state ? S0.data_ptr<float>() : nullptr, H, K, V,
               o.data_ptr<float>(), S.data_ptr<float>());
  // the new conv state: the last W-1 inputs of each sequence (conv state rows too when it is short)
  const float *X = proj.data_ptr<float>(), *CS = has_conv ? conv_state.data_ptr<float>() : nullptr;
  float* CN = conv_new.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t L = cu[n + 1] - cu[n];
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < W - 1; ++j) {
        const int64_t rr = L - (W - 1) + j;
        CN[(n * C + c) * (W - 1) + j] = rr >= 0 ? X[(cu[n] + rr) * P + c]
                                                : (CS != nullptr ? CS[(n * C + c) * (W - 1) + (W - 1 + rr)] : 0.f);
      }
  }
  return {o, conv_new, S};
}

// The elementwise work of a KDA layer around the recurrence, for training (forward and backward; model/kda.py
// `KDAttention.forward` is the reference):
//   kda_gates:  act [T, 2 H K + H V] = SiLU(conv) as [q | k | v], b [T, H] beta logits, zf [T, H K] = W_fb W_fa x
//     -> q = K^-1/2 q / ||q||, k = k / ||k|| (eps 1e-6 inside the sqrt), v, g = g_min sigmoid(e^{A_h} (zf + dt)),
//        beta = sigmoid(b)
//   kda_output: o [T, H, V], zg [T, H V], w [V] -> sigmoid(zg) * o / sqrt(mean_head(o^2) + eps) * w
std::vector<Tensor> kda_gates(const Tensor& act, const Tensor& b, const Tensor& zf, const Tensor& dt,
                              const Tensor& A_log, double g_min, int64_t H, int64_t K) {
  for (auto [t, name] : {std::pair{&act, "act"}, {&b, "b"}, {&zf, "zf"}, {&dt, "dt_bias"}, {&A_log, "A_log"}})
    check_f32_contiguous(*t, name);
  const int64_t T = act.size(0), C = act.size(1), V = (C - 2 * H * K) / H;
  TORCH_CHECK(V > 0 && b.size(0) == T && b.size(1) == H && zf.size(0) == T && zf.size(1) == H * K,
              "fused_cpu.kda_gates: shapes do not match");
  Tensor q = at::empty({T, H, K}, act.options()), k = at::empty({T, H, K}, act.options());
  Tensor v = at::empty({T, H, V}, act.options()), g = at::empty({T, H, K}, act.options());
  Tensor beta = at::empty({T, H}, act.options());
  const float *A = act.data_ptr<float>(), *Bl = b.data_ptr<float>(), *ZF = zf.data_ptr<float>();
  const float *DT = dt.data_ptr<float>(), *AL = A_log.data_ptr<float>();
  float *Q = q.data_ptr<float>(), *Kp = k.data_ptr<float>(), *Vp = v.data_ptr<float>(), *G = g.data_ptr<float>();
  float* BE = beta.data_ptr<float>();
  const float qs = 1.0f / std::sqrt(static_cast<float>(K)), gm = static_cast<float>(g_min);
  at::parallel_for(0, T, 32, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float *aq = A + t * C + h * K, *ak = A + t * C + H * K + h * K, *av = A + t * C + 2 * H * K + h * V;
        float qq = 0.f, kk = 0.f;
#pragma omp simd reduction(+ : qq, kk)
        for (int64_t i = 0; i < K; ++i) {
          qq += aq[i] * aq[i];
          kk += ak[i] * ak[i];
        }
        const float rq = qs / std::sqrt(qq + 1e-6f), rk = 1.0f / std::sqrt(kk + 1e-6f), ea = std::exp(AL[h]);
        float *qo = Q + (t * H + h) * K, *ko = Kp + (t * H + h) * K, *go = G + (t * H + h) * K;
        const float *zf = ZF + t * H * K + h * K, *dh = DT + h * K;
#pragma omp simd
        for (int64_t i = 0; i < K; ++i) {
          qo[i] = aq[i] * rq;
          ko[i] = ak[i] * rk;
          go[i] = gm * sigmoid_f(ea * (zf[i] + dh[i]));
        }
        std::copy(av, av + V, Vp + (t * H + h) * V);
        BE[t * H + h] = sigmoid_f(Bl[t * H + h]);
      }
  });
  return {q, k, v, g, beta};
}

// The gradient of kda_gates: d act [T, C], d b [T, H], d zf [T, H K], d dt [H K], d A_log [H].
//   q = s a r (r = 1 / sqrt(|a|^2 + eps)): da = s r (dq - a r^2 (a . dq)); the same for k with s = 1;
//   g = g_min sigmoid(e^A z'), z' = zf + dt: dz' = dg g_min sig (1 - sig) e^A, dA = sum dg g_min sig (1 - sig) e^A z'.
std::vector<Tensor> kda_gates_backward(const Tensor& act, const Tensor& b, const Tensor& zf, const Tensor& dt,
                                       const Tensor& A_log, double g_min, int64_t H, int64_t K, const Tensor& dq,
                                       const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dbeta) {
  for (const auto& t : {act, b, zf, dt, A_log, dq, dk, dv, dg, dbeta})
    check_f32_contiguous(t, "kda_gates_backward input");
  const int64_t T = act.size(0), C = act.size(1), V = (C - 2 * H * K) / H;
  Tensor da = at::empty_like(act), db = at::empty_like(b), dzf = at::empty_like(zf);
  const float *A = act.data_ptr<float>(), *Bl = b.data_ptr<float>(), *ZF = zf.data_ptr<float>();
  const float *DT = dt.data_ptr<float>(), *AL = A_log.data_ptr<float>(), *DQ = dq.data_ptr<float>();
  const float *DK = dk.data_ptr<float>(), *DV = dv.data_ptr<float>(), *DG = dg.data_ptr<float>();
  const float* DB = dbeta.data_ptr<float>();
  float *DA = da.data_ptr<float>(), *DBl = db.data_ptr<float>(), *DZ = dzf.data_ptr<float>();
  const float qs = 1.0f / std::sqrt(static_cast<float>(K)), gm = static_cast<float>(g_min);
  const int nthreads = at::get_num_threads();
  std::vector<double> part(static_cast<size_t>(nthreads) * (H * K + H), 0.0);  // d dt [H K], d A_log [H]
  at::parallel_for(0, T, 32, [&](int64_t tb, int64_t te) {
    double* pd = part.data() + static_cast<size_t>(at::get_thread_num()) * (H * K + H);
    for (int64_t t = tb; t < te; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float *aq = A + t * C + h * K, *ak = A + t * C + H * K + h * K;
        const float *dq_ = DQ + (t * H + h) * K, *dk_ = DK + (t * H + h) * K;
        float qq = 0.f, kk = 0.f, qd = 0.f, kd = 0.f;
#pragma omp simd reduction(+ : qq, kk, qd, kd)
        for (int64_t i = 0; i < K; ++i) {
          qq += aq[i] * aq[i];
          kk += ak[i] * ak[i];
          qd += aq[i] * dq_[i];
          kd += ak[i] * dk_[i];
        }
        const float rq = 1.0f / std::sqrt(qq + 1e-6f), rk = 1.0f / std::sqrt(kk + 1e-6f);
        float *daq = DA + t * C + h * K, *dak = DA + t * C + H * K + h * K;
        const float cq = rq * rq * qd, ck = rk * rk * kd;
#pragma omp simd
        for (int64_t i = 0; i < K; ++i) {
          daq[i] = qs * rq * (dq_[i] - aq[i] * cq);
          dak[i] = rk * (dk_[i] - ak[i] * ck);
        }
        std::copy(DV + (t * H + h) * V, DV + (t * H + h + 1) * V, DA + t * C + 2 * H * K + h * V);
        const float ea = std::exp(AL[h]);
        const float *zf = ZF + t * H * K + h * K, *dh = DT + h * K, *dg_ = DG + (t * H + h) * K;
        float* dz = DZ + t * H * K + h * K;
        float dA = 0.f;
        for (int64_t i = 0; i < K; ++i) {
          const float z = zf[i] + dh[i], s = sigmoid_f(ea * z), c = dg_[i] * gm * s * (1.f - s) * ea;
          dz[i] = c;
          pd[h * K + i] += c;
          dA += c * z;
        }
        pd[H * K + h] += dA;
        const float be = sigmoid_f(Bl[t * H + h]);
        DBl[t * H + h] = DB[t * H + h] * be * (1.f - be);
      }
  });
  Tensor ddt = at::zeros({H * K}, act.options()), dal = at::zeros({H}, act.options());
  float *DDT = ddt.data_ptr<float>(), *DAL = dal.data_ptr<float>();
  for (int th = 0; th < nthreads; ++th) {
    const double* pd = part.data() + static_cast<size_t>(th) * (H * K + H);
    for (int64_t i = 0; i < H * K; ++i) DDT[i] += static_cast<float>(pd[i]);
    for (int64_t h = 0; h < H; ++h) DAL[h] += static_cast<float>(pd[H * K + h]);
  }
  return {da, db, dzf, ddt, dal};
}

std::vector<Tensor> kda_output(const Tensor& o, const Tensor& zg, const Tensor& w, double eps) {
  for (auto [t, name] : {std::pair{&o, "o"}, {&zg, "zg"}, {&w, "w"}}) check_f32_contiguous(*t, name);
  const int64_t T = o.size(0), H = o.size(1), V = o.size(2);
  Tensor y = at::empty({T, H * V}, o.options()), r = at::empty({T, H}, o.options());
  const float *O = o.data_ptr<float>(), *ZG = zg.data_ptr<float>(), *W = w.data_ptr<float>();
  float *Y = y.data_ptr<float>(), *R = r.data_ptr<float>();
  at::parallel_for(0, T * H, 64, [&](int64_t b, int64_t e) {
    for (int64_t th = b; th < e; ++th) {
      const float *oo = O + th * V, *z = ZG + th * V;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < V; ++j) ss += oo[j] * oo[j];
      const float rr = 1.0f / std::sqrt(ss / static_cast<float>(V) + static_cast<float>(eps));
      R[th] = rr;
      float* yy = Y + th * V;
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) yy[j] = sigmoid_f(z[j]) * (oo[j] * rr * W[j]);
    }
  });
  return {y, r};
}

// The gradient of kda_output: with n = o r w (r the saved inverse RMS), s = sigmoid(zg), y = s n:
//   d zg = dy n s (1 - s);  d w = sum dy s o r;  d o = r (u - o r^2 (u . o) / V), u = dy s w.
std::vector<Tensor> kda_output_backward(const Tensor& o, const Tensor& zg, const Tensor& w, const Tensor& r,
                                        const Tensor& dy) {
  for (const auto& t : {o, zg, w, r, dy}) check_f32_contiguous(t, "kda_output_backward input");
  const int64_t T = o.size(0), H = o.size(1), V = o.size(2);
  Tensor dO = at::empty_like(o), dzg = at::empty_like(zg);
  const float *O = o.data_ptr<float>(), *ZG = zg.data_ptr<float>(), *W = w.data_ptr<float>();
  const float *R = r.data_ptr<float>(), *DY = dy.data_ptr<float>();
  float *DO = dO.data_ptr<float>(), *DZ = dzg.data_ptr<float>();
  const int nthreads = at::get_num_threads();
  std::vector<float> part(static_cast<size_t>(nthreads) * V, 0.f);
  at::parallel_for(0, T * H, 64, [&](int64_t b, int64_t e) {
    float* pw = part.data() + static_cast<size_t>(at::get_thread_num()) * V;
    std::vector<float> u(V);
    for (int64_t th = b; th < e; ++th) {
      const float *oo = O + th * V, *z = ZG + th * V, *d = DY + th * V;
      const float rr = R[th];
      float uo = 0.f;
      float* dz = DZ + th * V;
      for (int64_t j = 0; j < V; ++j) {
        const float s = sigmoid_f(z[j]), n = oo[j] * rr * W[j];
        dz[j] = d[j] * n * s * (1.f - s);
        pw[j] += d[j] * s * oo[j] * rr;
        u[j] = d[j] * s * W[j];
        uo += u[j] * oo[j];
      }
      const float c = rr * rr * uo / static_cast<float>(V);
      float* dd = DO + th * V;
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) dd[j] = rr * (u[j] - oo[j] * c);
    }
  });
  Tensor dw = at::zeros({V}, o.options());
  float* DW = dw.data_ptr<float>();
  for (int th = 0; th < nthreads; ++th)
    for (int64_t j = 0; j < V; ++j) DW[j] += part[static_cast<size_t>(th) * V + j];
  return {dO, dzg, dw};
}

std::vector<Tensor> kda_recurrent_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                      const Tensor& beta, const std::vector<int64_t>& cu, const Tensor& S0,
                                      int64_t block) {
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}, {&beta, "beta"}})
    check_f32_contiguous(*t, name);
  const int64_t T = q.size(0), H = q.size(1), K = q.size(2), V = v.size(2), N = static_cast<int64_t>(cu.size()) - 1;
  TORCH_CHECK(N >= 0 && cu.front() == 0 && cu.back() == T && k.sizes() == q.sizes() && g.sizes() == q.sizes() &&
                  v.size(0) == T && v.size(1) == H && beta.size(0) == T && beta.size(1) == H,
              "fused_cpu.kda_recurrent_fwd: q, k, g [T, H, K], v [T, H, V], beta [T, H], cu [N+1] ending at T");
  const bool init = S0.numel() > 0;
  if (init) {
    check_f32_contiguous(S0, "initial_state");
    TORCH_CHECK(S0.size(0) == N && S0.size(1) == H && S0.size(2) == K && S0.size(3) == V,
                "fused_cpu.kda_recurrent_fwd: initial_state must be [N, H, K, V]");
  }
  const std::vector<int64_t> boff = block_offsets(cu, block > 0 ? block : 1);
  Tensor o = at::empty({T, H, V}, q.options()), S = at::empty({N, H, K, V}, q.options());
  Tensor ckpt = at::empty({block > 0 ? boff.back() : 0, H, K, V}, q.options());
  const KdaArgs x{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
                  beta.data_ptr<float>(), H, K, V};
  KDA_DISPATCH(K, V, kda_forward_chains, x, cu, init ? S0.data_ptr<float>() : nullptr, o.data_ptr<float>(),
               S.data_ptr<float>(), ckpt.data_ptr<float>(), boff, block);
  return {o, S, ckpt};
}

std::vector<Tensor> kda_recurrent_bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                      const Tensor& beta, const std::vector<int64_t>& cu, const Tensor& ckpt,
                                      int64_t block, const Tensor& dO, const Tensor& dSf) {
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}, {&beta, "beta"}, {&ckpt, "ckpt"},
                         {&dO, "dO"}})
    check_f32_contiguous(*t, name);
  const int64_t H = q.size(1), K = q.size(2), V = v.size(2), N = static_cast<int64_t>(cu.size()) - 1;
  TORCH_CHECK(block > 0 && dO.sizes() == v.sizes(), "fused_cpu.kda_recurrent_bwd: bad block or dO shape");
  const bool final_grad = dSf.numel() > 0;
  if (final_grad) check_f32_contiguous(dSf, "d_final_state");
  const std::vector<int64_t> boff = block_offsets(cu, block);
  TORCH_CHECK(ckpt.size(0) == boff.back(), "fused_cpu.kda_recurrent_bwd: checkpoints do not match cu / block");
  Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v), dg = at::empty_like(g);
  Tensor db = at::empty_like(beta), dS0 = at::empty({N, H, K, V}, q.options());
  const KdaArgs x{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
                  beta.data_ptr<float>(), H, K, V};
  const KdaGrads gr{dq.data_ptr<float>(), dk.data_ptr<float>(), dv.data_ptr<float>(), dg.data_ptr<float>(),
                    db.data_ptr<float>(), dS0.data_ptr<float>()};
  KDA_DISPATCH(K, V, kda_backward_chains, x, cu, ckpt.data_ptr<float>(), boff, block, dO.data_ptr<float>(),
               final_grad ? dSf.data_ptr<float>() : nullptr, gr);
  return {dq, dk, dv, dg, db, dS0};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("short_conv_silu", &short_conv_silu, "causal depthwise short conv over packed sequences, then SiLU");
  m.def("short_conv_silu_backward", &short_conv_silu_backward, "the gradient of short_conv_silu (x and w)");
  m.def("kda_gates", &kda_gates, "a KDA layer's q/k norms, decay gate and beta (training forward)");
  m.def("kda_gates_backward", &kda_gates_backward, "the gradient of kda_gates");
  m.def("kda_output", &kda_output, "a KDA layer's head RMSNorm and output gate (training forward)");
  m.def("kda_output_backward", &kda_output_backward, "the gradient of kda_output");
  m.def("kda_prefill", &kda_prefill, "a KDA layer between its input and output matmuls, packed sequences");
  m.def("kda_recurrent_fwd", &kda_recurrent_fwd, "the KDA recurrence over packed sequences, with checkpoints");
  m.def("kda_recurrent_bwd", &kda_recurrent_bwd, "the adjoint of kda_recurrent_fwd (recomputes each block)");
  m.def("kda_decode", &kda_decode, "one KDA layer decode step between its input and output matmuls");
  m.def("mla_decode", &mla_decode, "one absorbed MLA decode step between its input and output matmuls");
  m.def("moe_small", &moe_small, "LatentMoE for a few tokens between its input and output matmuls");
  m.def("moe_route", &moe_route, "the LatentMoE router for a few tokens");
  m.def("situ_glu_gu", &situ_glu_gu, "SiTU-GLU of a [gate | up] projection");
  m.def("situ_glu_gu_backward", &situ_glu_gu_backward, "the gradient of situ_glu_gu");
  m.def("attn_res_read", &attn_res_read, "one AttnRes read, optionally with the RMSNorm after it");
  m.def("attn_res_read_backward", &attn_res_read_backward, "the gradient of attn_res_read (keep = true)");
}
