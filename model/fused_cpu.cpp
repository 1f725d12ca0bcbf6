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

// SiTU-GLU (model/activations.py): 4 tanh(g / 4) sigmoid(g) * 25 tanh(u / 25).
inline float situ_glu(float g, float u) {
  return 4.f * std::tanh(g * 0.25f) / (1.f + std::exp(-g)) * (25.f * std::tanh(u * 0.04f));
}

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
      for (int64_t i = 0; i < I; ++i) a[i] = situ_glu(h[i], h[I + i]);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_experts", &moe_experts, "routed experts of LatentMoE for a small batch (CPU, fp32, no autograd)");
}
