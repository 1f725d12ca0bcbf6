// Fused CPU (fp32) pieces of chunk_kda, for its no-autograd path (inference, prefill, rollouts).
//
// tile_factors and tile_inverse replace the elementwise torch ops of `_wy_intra_chunk` in model/kda.py;
// state_recurrence is chunk_kda's loop over chunk steps without the Python overhead. model/kda.py stays
// the reference (and the autograd path); tests/test_kda.py checks that both paths give the same result.
// Notation as in model/kda.py: a chunk of C = 16 nt tokens has nt tiles of 16; r_a is the cumulative
// log-decay just before tile a, Gam_s at token s, all in log2 units. Loaded by model/kda_cpu.py.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

using at::Tensor;

namespace {

constexpr int64_t kTile = 16;

// 2^x for |x| <= 126 (log2 decay factors here stay within +-116), to ~2e-7 relative error; plain float and
// int arithmetic so that the loops calling it vectorise. x = n + f with n = round(x), f in [-1/2, 1/2];
// 2^f = e^{f ln 2} by its degree-7 Taylor polynomial, 2^n by writing the exponent bits.
inline float exp2_approx(float x) {
  const float y = x + 0.5f;
  int32_t n = static_cast<int32_t>(y);      // truncation ...
  n -= static_cast<int32_t>(y < static_cast<float>(n));  // ... made floor: n = floor(x + 1/2)
  const float f = (x - static_cast<float>(n)) * 0.69314718f;  // f ln 2, |f ln 2| <= 0.347
  float p = 1.9841270e-4f;                  // 1/7!
  p = p * f + 1.3888889e-3f;                // 1/6!
  p = p * f + 8.3333333e-3f;
  p = p * f + 4.1666667e-2f;
  p = p * f + 1.6666667e-1f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (n + 127) << 23;     // 2^n as a float
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return p * scale;
}

// 2^x on the float range: 0 at x <= -127 (2^-127 would be denormal), +inf at x >= 128 (the exponent bits
// of 2^128 are those of inf, so the unbounded-gate control case overflows like the torch path).
inline float exp2_full(float x) { return exp2_approx(std::min(std::max(x, -127.0f), 128.0f)); }

// model/kda.py `_LOG2_FLOOR` (exported below; tests/test_kda.py checks that the two agree).
constexpr float kLog2Floor = -100.0f;

// 2^x where x is a log2 decay factor: exactly 0 below 2^kLog2Floor (model/kda.py `_decay`: no denormals).
// Branch-free (a 0/1 factor) so that the loops calling it vectorise.
inline float decay2(float x) { return static_cast<float>(x > kLog2Floor) * exp2_full(x); }

constexpr float kLog2e = 1.4426950408889634f;

void check_f32_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), "kda_cpu: ", name,
              " must be a contiguous fp32 CPU tensor");
}

}  // namespace

// Every per-token decay product of one block of m chunks, in one pass per (chunk, head): reads the
// block's tokens in token layout and writes head-major.
//   q, k, g [m, C, H, K], v [m, C, H, V]   block tokens; g is the log-decay (natural log)
// With rel = Gam_s - r_a (tile-local cumulative log2-decay), left = 2^rel, inv = 2^-rel, returns
//   rows [m, H, nt, 32, K]   [q; k] * left                   (row tile a of A_qk / A_kk)
//   k_inv [m, H, nt, 16, K]  k * inv                          (columns of the diagonal block)
//   cols [m, H, 16 P, K]     k 2^{r_a - Gam} for column tiles b < a, row tile a at row 8 a (a - 1)
//                            (P = nt (nt - 1) / 2 pairs), computed as (k * inv * 2^{s_b}) 2^{r_a - r_{b+1}}
//   rhs [nt, m, H, 16, V+K]  [v | k 2^Gam]                    (right-hand side of the substitution, tile-major)
//   q_e [m, H, C, K]         q 2^Gam
//   k_dec [m, H, C, K]       k 2^{Gam_C - Gam}
//   d_end [m, H, K, 1]       2^{Gam_C}
// Chunk-level factors (2^Gam, 2^{Gam_C - Gam}, 2^{Gam_C}, 2^{r_a - r_{b+1}}) are `decay2` per tile; as in
// `_wy_intra_chunk`, 2^Gam = 2^{r_a} left and 2^{Gam_C - Gam} = 2^{Gam_C - r_{a+1}} (k_inv 2^{s_a}).
std::vector<Tensor> tile_factors(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g) {
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}}) check_f32_contiguous(*t, name);
  const int64_t m = q.size(0), C = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3);
  TORCH_CHECK(C % kTile == 0, "kda_cpu: chunk length must be a multiple of 16");
  const int64_t nt = C / kTile, P = nt * (nt - 1) / 2, W = V + K;
  auto opt = q.options();
  Tensor rows = at::empty({m, H, nt, 2 * kTile, K}, opt), k_inv = at::empty({m, H, nt, kTile, K}, opt);
  Tensor cols = at::empty({m, H, kTile * P, K}, opt), rhs = at::empty({nt, m, H, kTile, W}, opt);
  Tensor q_e = at::empty({m, H, C, K}, opt), k_dec = at::empty({m, H, C, K}, opt);
  Tensor d_end = at::empty({m, H, K, 1}, opt);
  const float *Q = q.data_ptr<float>(), *Kp = k.data_ptr<float>(), *Vp = v.data_ptr<float>();
  const float* Gp = g.data_ptr<float>();
  float *ROWS = rows.data_ptr<float>(), *KINV = k_inv.data_ptr<float>(), *COLS = cols.data_ptr<float>();
  float *RHS = rhs.data_ptr<float>(), *QE = q_e.data_ptr<float>(), *KD = k_dec.data_ptr<float>();
  float* DE = d_end.data_ptr<float>();

  at::parallel_for(0, m * H, 1, [&](int64_t begin, int64_t end) {
    // per tile a, channel d: tile sum s, r_a, r_{a+1}; the tile factors; running rel; k 2^{r_{a+1} - Gam}
    std::vector<float> s(nt * K), r(nt * K), r_end(nt * K), e_r(nt * K), f_dec(nt * K), es(nt * K);
    std::vector<float> fac(nt * nt * K);  // [a2][a][d] = decay2(r_{a2} - r_{a+1}), used for a < a2
    std::vector<float> rel(K), k_end(K);
    for (int64_t ch = begin; ch < end; ++ch) {
      const int64_t c = ch / H, h = ch % H;
      auto token = [&](const float* base, int64_t t, int64_t width) { return base + ((c * C + t) * H + h) * width; };
      for (int64_t a = 0; a < nt; ++a) {
        float* sa = &s[a * K];
        std::fill(sa, sa + K, 0.0f);
        for (int64_t i = 0; i < kTile; ++i) {
          const float* gt = token(Gp, a * kTile + i, K);
#pragma omp simd
          for (int64_t d = 0; d < K; ++d) sa[d] += gt[d] * kLog2e;
        }
        for (int64_t d = 0; d < K; ++d) {
          r[a * K + d] = a ? r_end[(a - 1) * K + d] : 0.0f;
          r_end[a * K + d] = r[a * K + d] + sa[d];
        }
      }
      const float* gam_C = &r_end[(nt - 1) * K];
      for (int64_t a = 0; a < nt; ++a)
        for (int64_t d = 0; d < K; ++d) {
          e_r[a * K + d] = decay2(r[a * K + d]);
          f_dec[a * K + d] = decay2(gam_C[d] - r_end[a * K + d]);
          es[a * K + d] = exp2_full(s[a * K + d]);
        }
      for (int64_t d = 0; d < K; ++d) DE[ch * K + d] = decay2(gam_C[d]);
      for (int64_t a2 = 1; a2 < nt; ++a2)
        for (int64_t a = 0; a < a2; ++a)
          for (int64_t d = 0; d < K; ++d)
            fac[(a2 * nt + a) * K + d] = decay2(std::min(r[a2 * K + d] - r_end[a * K + d], 0.0f));

      for (int64_t a = 0; a < nt; ++a) {
        const int64_t tile = ch * nt + a;  // index into [m, H, nt, ...]
        const float *er_a = &e_r[a * K], *fd_a = &f_dec[a * K], *es_a = &es[a * K];
        std::fill(rel.begin(), rel.end(), 0.0f);
        for (int64_t i = 0; i < kTile; ++i) {
          const int64_t t = a * kTile + i;  // token within the chunk
          const float *qt = token(Q, t, K), *kt = token(Kp, t, K), *vt = token(Vp, t, V), *gt = token(Gp, t, K);
          float* row_q = ROWS + (tile * 2 * kTile + i) * K;
          float* row_k = row_q + kTile * K;
          float* kin = KINV + (tile * kTile + i) * K;
          float* rh = RHS + ((a * m * H + ch) * kTile + i) * W;
          float* qe = QE + (ch * C + t) * K;
          float* kd = KD + (ch * C + t) * K;
          std::memcpy(rh, vt, V * sizeof(float));
#pragma omp simd
          for (int64_t d = 0; d < K; ++d) {
            rel[d] += gt[d] * kLog2e;
            const float left = exp2_full(rel[d]), inv = exp2_full(-rel[d]);
            const float ql = qt[d] * left, kl = kt[d] * left, ki = kt[d] * inv;
            row_q[d] = ql;
            row_k[d] = kl;
            kin[d] = ki;
            rh[V + d] = kl * er_a[d];
            qe[d] = ql * er_a[d];
            k_end[d] = ki * es_a[d];  // k 2^{r_{a+1} - Gam}, in [2^-116, 1] |k| under the bound
            kd[d] = k_end[d] * fd_a[d];
          }
          for (int64_t a2 = a + 1; a2 < nt; ++a2) {  // row tiles below this column tile
            float* cc = COLS + (ch * kTile * P + kTile * (a2 * (a2 - 1) / 2 + a) + i) * K;
            const float* fc = &fac[(a2 * nt + a) * K];
#pragma omp simd
            for (int64_t d = 0; d < K; ++d) cc[d] = k_end[d] * fc[d];
          }
        }
      }
    }
  });
  return {rows, k_inv, cols, rhs, q_e, k_dec, d_end};
}

// Causal masks of the diagonal 16-blocks and their WY inverses, for all tiles of a block.
//   diag [m, H, nt, 32, 16]: rows 0-15 A_qk[a, a], rows 16-31 A_kk[a, a] (unmasked products; masked IN PLACE:
//                            A_qk keeps j <= s, A_kk keeps j < s)
//   beta [m, C, H]           token layout
// Returns G [nt, m, H, 16, 16] (tile-major) = (I + Diag(beta_a) A_kk[a, a])^{-1} Diag(beta_a), by forward
// substitution.
Tensor tile_inverse(Tensor diag, const Tensor& beta) {
  check_f32_contiguous(diag, "diag");
  check_f32_contiguous(beta, "beta");
  const int64_t m = diag.size(0), H = diag.size(1), nt = diag.size(2), C = nt * kTile;
  Tensor G = at::empty({nt, m, H, kTile, kTile}, diag.options());
  float* D = diag.data_ptr<float>();
  float* Gp = G.data_ptr<float>();
  const float* B = beta.data_ptr<float>();
  at::parallel_for(0, m * H * nt, 16, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t a = tile % nt, h = (tile / nt) % H, c = tile / (nt * H);
      float* Aq = D + tile * 2 * kTile * kTile;
      float* Ak = Aq + kTile * kTile;
      float* g = Gp + (a * m * H + c * H + h) * kTile * kTile;
      float b[kTile];
      for (int64_t s = 0; s < kTile; ++s) {
        b[s] = B[(c * C + a * kTile + s) * H + h];
        for (int64_t j = s + 1; j < kTile; ++j) Aq[s * kTile + j] = 0.f;
        for (int64_t j = s; j < kTile; ++j) Ak[s * kTile + j] = 0.f;
      }
      // column j of X = (I + Diag(b) A)^{-1} Diag(b): x_j = b_j, x_i = -b_i sum_{j <= l < i} A[i, l] x_l
      for (int64_t i = 0; i < kTile; ++i)
        for (int64_t j = 0; j < kTile; ++j) g[i * kTile + j] = 0.f;
      for (int64_t j = 0; j < kTile; ++j) {
        g[j * kTile + j] = b[j];
        for (int64_t i = j + 1; i < kTile; ++i) {
          float acc = 0.f;
          for (int64_t l = j; l < i; ++l) acc += Ak[i * kTile + l] * g[l * kTile + j];
          g[i * kTile + j] = -b[i] * acc;
        }
      }
    }
  });
  return G;
}

// The sequential part of chunk_kda: the state recurrence over the chunk steps of one block.
//   u [R, C, V], w [R, C, K], kd_T [R, K, C], d_end [R, K, 1]: per (chunk, head) row, step-major, where chunk
//     step j owns the next rows[j] rows (its running sequences x heads, in sorted order)
//   state [N H, K, V]: the state entering the block (sequence-sorted x heads)
// For each step: S_0 = state[:n], U = u - w S_0, state[:n] = Diag(d_end) S_0 + kd_T U.
// Returns S_0 for every row [R, K, V], U [R, C, V] and the state after the block [N H, K, V].
std::vector<Tensor> state_recurrence(const Tensor& u, const Tensor& w, const Tensor& kd_T, const Tensor& d_end,
                                     const Tensor& state_in, const std::vector<int64_t>& rows) {
  const int64_t R = u.size(0), C = u.size(1), V = u.size(2), K = w.size(2);
  Tensor starts = at::empty({R, K, V}, u.options()), U = at::empty({R, C, V}, u.options());
  Tensor state = state_in.clone();
  int64_t off = 0;
  for (const int64_t n : rows) {
    Tensor S0 = starts.narrow(0, off, n), Uj = U.narrow(0, off, n), S = state.narrow(0, 0, n);
    S0.copy_(S);
    at::baddbmm_out(Uj, u.narrow(0, off, n), w.narrow(0, off, n), S0, /*beta=*/1, /*alpha=*/-1);
    at::mul_out(S, S0, d_end.narrow(0, off, n));
    S.baddbmm_(kd_T.narrow(0, off, n), Uj);
    off += n;
  }
  TORCH_CHECK(off == R, "kda_cpu: rows per step must add up to u.size(0)");
  return {starts, U, state};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("LOG2_FLOOR") = kLog2Floor;
  m.def("tile_factors", &tile_factors, "fused per-token factor products of chunk_kda (CPU, fp32)");
  m.def("tile_inverse", &tile_inverse, "diagonal-block masks and WY inverses of chunk_kda (CPU, fp32)");
  m.def("state_recurrence", &state_recurrence, "chunk_kda's state recurrence over one block (CPU, fp32)");
}
