// Fused CPU (fp32) kernels for the no-autograd small-batch paths of the model: decoding and short prefills,
// where a step's cost is the number of tiny torch ops, not arithmetic.
//
//   moe_experts: the routed part of LatentMoE, sum_j p_tj E_{e_tj}(z_t), for a few tokens, reading the stacked
//                expert weights in place (model/moe.py `LatentMoE.dispatch` is the reference and the autograd path).
//
// Loaded by model/fused_cpu.py; tests compare each kernel with its torch reference.
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

// SiTU-GLU (model/activations.py): 4 tanh(g / 4) sigmoid(g) * 25 tanh(u / 25).
inline float situ_glu(float g, float u) { return 4.f * tanh_f(g * 0.25f) * sigmoid_f(g) * (25.f * tanh_f(u * 0.04f)); }

}  // namespace

// The routed experts of LatentMoE for a small batch:
//   z [T, L] latent tokens, idx [T, k] int64 expert ids, p [T, k] mixing weights,
//   w_gate_up [n, 2I, L] (gate rows first), w_down [n, L, I]
// out[t] = sum_j p[t, j] W2_e situ_glu(W1_e z_t, W3_e z_t), e = idx[t, j]. Pairs are processed grouped by expert
// (so an expert's weights are read once per group, from cache), in parallel; only the chosen experts' weights are
// read. Returns out [T, L].
Tensor moe_experts(const Tensor& z, const Tensor& idx, const Tensor& p, const Tensor& w_gate_up,
                   const Tensor& w_down) {
  check_f32_contiguous(z, "z");
  check_f32_contiguous(p, "p");
  check_f32_contiguous(w_gate_up, "w_gate_up");
  check_f32_contiguous(w_down, "w_down");
  TORCH_CHECK(idx.device().is_cpu() && idx.scalar_type() == at::kLong && idx.is_contiguous(),
              "fused_cpu: idx must be a contiguous int64 CPU tensor");
  const int64_t T = z.size(0), L = z.size(1), k = idx.size(1), n = w_gate_up.size(0);
  const int64_t I = w_gate_up.size(1) / 2;
  TORCH_CHECK(w_gate_up.size(2) == L && w_down.size(0) == n && w_down.size(1) == L && w_down.size(2) == I,
              "fused_cpu: expert weight shapes do not match z");
  TORCH_CHECK(p.size(0) == T && p.size(1) == k && idx.size(0) == T, "fused_cpu: idx / p must be [T, k]");
  const int64_t* E = idx.data_ptr<int64_t>();
  // pairs sorted by expert (counting sort), so that each thread walks its experts' tokens consecutively
  std::vector<int64_t> start(n + 1, 0), order(T * k);
  for (int64_t i = 0; i < T * k; ++i) {
    TORCH_CHECK(E[i] >= 0 && E[i] < n, "fused_cpu: expert id out of range");
    ++start[E[i] + 1];
  }
  for (int64_t e = 0; e < n; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < T * k; ++i) order[fill[E[i]]++] = i;
  }
  Tensor y = at::empty({T * k, L}, z.options());  // per pair, summed per token below (no write races)
  const float *Z = z.data_ptr<float>(), *P = p.data_ptr<float>();
  const float *W1 = w_gate_up.data_ptr<float>(), *W2 = w_down.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, T * k, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(2 * I), a(I);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t pair = order[s], t = pair / k, e = E[pair];
      gemv(W1 + e * 2 * I * L, Z + t * L, h.data(), 2 * I, L);
      const float* hp = h.data();
      float* ap = a.data();
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) ap[i] = situ_glu(hp[i], hp[I + i]);
      float* yp = Y + pair * L;
      gemv(W2 + e * L * I, a.data(), yp, L, I);
      const float w = P[pair];
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) yp[l] *= w;
    }
  });
  Tensor out = at::empty({T, L}, z.options());
  float* O = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* o = O + t * L;
    std::copy(Y + t * k * L, Y + (t * k + 1) * L, o);
    for (int64_t j = 1; j < k; ++j) {
      const float* yp = Y + (t * k + j) * L;
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) o[l] += yp[l];
    }
  }
  return out;
}

// One decode step of a KDA layer (model/kda.py `KDAttention`, one new token for each of N sequences), from the
// token's projections to the gated, normalised output, in one pass per (sequence, head):
//   proj [N, P]   input projections, columns [q (H K) | k (H K) | v (H V) | beta logit (H) | anything], P >= 3HK + H
//   zf [N, H K]   W_fb W_fa x (the gate pre-activation before dt_bias); zg [N, H V] W_gb W_ga x + b_gb
//   conv_w [C, W], conv_state [N, C, W-1] (C = 2 H K + H V, oldest first); dt_bias [H K]; A_log [H]
//   o_norm_w [V], state [N, H, K, V] (S of recurrence (1))
// Per head: short conv + SiLU of q, k, v; q, k L2-normalised (eps 1e-6), q scaled by K^-1/2; beta = sigmoid;
// g = g_min sigmoid(e^{A_h} (zf + dt_bias)); S' = Diag(e^g) S, S_new = S' + beta k (v - S'^T k)^T, o = S_new^T q;
// o = sigmoid(zg) * RMSNorm(o) (weight o_norm_w, eps). Returns o [N, H V], the new conv state, the new state
// (new tensors: the given cache is not modified).
std::vector<Tensor> kda_decode(const Tensor& proj, const Tensor& zf, const Tensor& zg, const Tensor& conv_w,
                               const Tensor& conv_state, const Tensor& dt_bias, const Tensor& A_log, double g_min,
                               const Tensor& o_norm_w, double eps, const Tensor& state) {
  for (auto [t, name] : {std::pair{&proj, "proj"}, {&zf, "zf"}, {&zg, "zg"}, {&conv_w, "conv_w"},
                         {&conv_state, "conv_state"}, {&dt_bias, "dt_bias"}, {&A_log, "A_log"},
                         {&o_norm_w, "o_norm_w"}, {&state, "state"}})
    check_f32_contiguous(*t, name);
  const int64_t N = state.size(0), H = state.size(1), K = state.size(2), V = state.size(3);
  const int64_t C = conv_w.size(0), W = conv_w.size(1), P = proj.size(1);
  TORCH_CHECK(C == 2 * H * K + H * V && conv_state.size(0) == N && conv_state.size(1) == C &&
                  conv_state.size(2) == W - 1 && proj.size(0) == N && P >= 3 * H * K + H,
              "fused_cpu.kda_decode: shapes do not match the state [N, H, K, V]");
  Tensor o = at::empty({N, H * V}, proj.options());
  Tensor conv_new = at::empty_like(conv_state), S_new = at::empty_like(state);
  const float *X = proj.data_ptr<float>(), *ZF = zf.data_ptr<float>(), *ZG = zg.data_ptr<float>();
  const float *CW = conv_w.data_ptr<float>(), *CS = conv_state.data_ptr<float>(), *DT = dt_bias.data_ptr<float>();
  const float *AL = A_log.data_ptr<float>(), *NW = o_norm_w.data_ptr<float>(), *S0 = state.data_ptr<float>();
  float *O = o.data_ptr<float>(), *CN = conv_new.data_ptr<float>(), *S1 = S_new.data_ptr<float>();
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(K)), gm = static_cast<float>(g_min);
  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(K), k(K), v(V), decay(K), delta(V);
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
      const float *zf_nh = ZF + n * H * K + h * K, *dt_h = DT + h * K;
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
      const float* zg_nh = ZG + n * H * V + h * V;
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) o_nh[j] = sigmoid_f(zg_nh[j]) * (o_nh[j] * r * NW[j]);
    }
  });
  return {o, conv_new, S_new};
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

// One AttnRes read (model/attn_res.py `AttnResRead`) over S sources [T, D]:
//   logits_i = ((query * norm_weight)^T v_i) * r_i,   h = sum_i softmax_i(logits) v_i
// with r_i = 1 / sqrt(mean(v_i^2) + eps) given for the first inv_rms.size() sources and computed here for the
// rest. With a non-empty out_norm [D], h is returned through that RMSNorm (out_eps): the pre-sublayer norm
// that always follows a read. Returns h [T, D] and the computed r_i (a list [T] each), which the stream keeps.
std::vector<Tensor> attn_res_read(const std::vector<Tensor>& sources, const std::vector<Tensor>& inv_rms,
                                  const Tensor& query, const Tensor& norm_weight, double eps,
                                  const Tensor& out_norm, double out_eps) {
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
        const float* v = V[i] + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) h[d] += p * v[d];
      }
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

// LatentMoE's router for a few tokens (model/moe.py `Router`): logits [T, n] = W_r x (fp32), bias b [n]:
//   s = sigmoid(logits), idx = topk(s + b, k) (descending, ties to the lower expert id) or the given replay
//   `forced` [T, k] (int64; empty = free choice), p = rsf s_idx / sum s_idx.
// Returns s [T, n], idx [T, k] int64, p [T, k]. Free and replayed choices compute s and p the same way, so
// replaying the free choice reproduces it bit for bit.
std::vector<Tensor> moe_route(const Tensor& logits, const Tensor& bias, const Tensor& forced, int64_t k,
                              double rsf) {
  check_f32_contiguous(logits, "logits");
  check_f32_contiguous(bias, "bias");
  const int64_t T = logits.size(0), n = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= n && bias.numel() == n, "fused_cpu.moe_route: need 1 <= k <= n and b [n]");
  const bool replay = forced.numel() > 0;
  TORCH_CHECK(!replay || (forced.scalar_type() == at::kLong && forced.is_contiguous() && forced.size(0) == T &&
                          forced.size(1) == k),
              "fused_cpu.moe_route: forced experts must be a contiguous int64 [T, k]");
  Tensor s = at::empty({T, n}, logits.options()), p = at::empty({T, k}, logits.options());
  Tensor idx = replay ? forced : at::empty({T, k}, logits.options().dtype(at::kLong));
  const float *L = logits.data_ptr<float>(), *B = bias.data_ptr<float>();
  float *Sp = s.data_ptr<float>(), *P = p.data_ptr<float>();
  int64_t* I = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    float* st = Sp + t * n;
    for (int64_t j = 0; j < n; ++j) st[j] = 1.0f / (1.0f + std::exp(-L[t * n + j]));
    int64_t* it = I + t * k;
    for (int64_t j = 0; j < k && !replay; ++j) {  // k passes of argmax over the experts not taken yet (k is small)
      int64_t best = -1;
      float bv = -INFINITY;
      for (int64_t e = 0; e < n; ++e) {
        bool taken = false;
        for (int64_t q = 0; q < j; ++q) taken |= it[q] == e;
        const float v = st[e] + B[e];
        if (!taken && (best < 0 || v > bv)) best = e, bv = v;
      }
      it[j] = best;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) sum += st[it[j]];
    for (int64_t j = 0; j < k; ++j) P[t * k + j] = st[it[j]] / sum * static_cast<float>(rsf);
  }
  return {s, idx, p};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("situ_glu_gu", &situ_glu_gu, "SiTU-GLU of [gate | up] (CPU, fp32, no autograd)");
  m.def("attn_res_read", &attn_res_read, "one AttnRes read with cached inverse RMS (CPU, fp32, no autograd)");
  m.def("moe_route", &moe_route, "sigmoid top-k router for a few tokens (CPU, fp32, no autograd)");
  m.def("kda_decode", &kda_decode, "one KDA layer decode step after the input projections (CPU, fp32)");
  m.def("moe_experts", &moe_experts, "routed experts of LatentMoE for a small batch (CPU, fp32, no autograd)");
}
