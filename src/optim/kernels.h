// The element loops of fsdp::optim's fused steps: one pass over a stretch of one parameter, its
// gradient and its state, with the operations of LibTorch's torch::optim step in its order and
// precision (include/fsdp/optim.h, Numerics). Torch-free; compiled with -ffp-contract=off (the
// compiler must not fuse what LibTorch rounds twice) and vectorised for AVX-512, AVX2 and
// baseline x86-64, chosen at load time (cmake/optim.cmake).
// Thread-safety: pure functions over the caller's memory; stretches must not overlap.
#pragma once

#include <cstdint>

namespace fsdp::optim::detail {

// The scalars of one parameter's AdamW update, each rounded to the parameter's type as LibTorch
// rounds a Scalar argument. decay is 1 - lr * weight_decay (exactly 1 without weight decay: p * 1
// is p); neg_step_size is -lr / (1 - beta1^step); sqrt_bias_correction2 is sqrt(1 - beta2^step).
template <class T>
struct AdamWScalars {
  T decay, beta1, one_minus_beta1, beta2, one_minus_beta2, sqrt_bias_correction2, eps,
      neg_step_size;
};

// The update of one stretch in two halves around the square root, which the caller takes with
// ATen's own sqrt (at::sqrt_out): LibTorch's float sqrt is MKL's vsSqrt where LibTorch has MKL
// (PyPI's wheel), which is not correctly rounded, and the fused step must give LibTorch's bits.
//
// adamw_moments: m (exp_avg), v (exp_avg_sq) and, with amsgrad, vmax (max_exp_avg_sq; else
// null) updated in place from g over n elements:
//   m = fma(1 - beta1, g, m * beta1);  v = fma((1 - beta2) * g, g, v * beta2);
//   vmax = max(vmax, v) (NaN wins)
// adamw_apply: with root = sqrt(vmax or v) over the same n elements:
//   d = root / sqrt_bc2 + eps;  p = p * decay + (-step * m) / d   (two roundings, as LibTorch's
//   p.mul_ then p.addcdiv_)
void adamw_moments(const float* g, float* m, float* v, float* vmax, int64_t n,
                   const AdamWScalars<float>& s);
void adamw_moments(const double* g, double* m, double* v, double* vmax, int64_t n,
                   const AdamWScalars<double>& s);
void adamw_apply(float* p, const float* m, const float* root, int64_t n,
                 const AdamWScalars<float>& s);
void adamw_apply(double* p, const double* m, const double* root, int64_t n,
                 const AdamWScalars<double>& s);
// Both halves in one loop with the correctly rounded sqrt (std::sqrt): for a LibTorch whose own
// sqrt is that one (compat::kAtenSqrtIsIeee).
void adamw_fused(float* p, const float* g, float* m, float* v, float* vmax, int64_t n,
                 const AdamWScalars<float>& s);
void adamw_fused(double* p, const double* g, double* m, double* v, double* vmax, int64_t n,
                 const AdamWScalars<double>& s);

// The scalars of one parameter's SGD update and which of its branches apply.
template <class T>
struct SGDScalars {
  T weight_decay, momentum, one_minus_dampening, neg_lr;
  bool decays;        // weight_decay != 0: d = fma(weight_decay, p, g), else d = g
  bool has_momentum;  // momentum != 0 (else buf is null and unused)
  bool first;         // the buffer is new: buf = d (LibTorch clones d), no momentum applied
  bool nesterov;      // d = fma(momentum, buf, d), else d = buf
};

// p (and buf) updated in place from g over n elements; then p = fma(-lr, d, p).
void sgd_stretch(float* p, const float* g, float* buf, int64_t n, const SGDScalars<float>& s);
void sgd_stretch(double* p, const double* g, double* buf, int64_t n, const SGDScalars<double>& s);

}  // namespace fsdp::optim::detail
