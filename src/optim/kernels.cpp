// The element loops (kernels.h). Written as plain loops over restrict pointers, which GCC
// vectorises (-O3 -fno-math-errno, cmake/optim.cmake), once per instruction set: the loader picks
// the clone for this CPU (target_clones). std::fma is the hardware instruction in the AVX2 and
// AVX-512 clones and glibc's correctly rounded fma in the baseline one, so every clone gives the
// same bits. -ffp-contract=off keeps the multiplications and additions LibTorch rounds separately
// separate.
#include "optim/kernels.h"

#include <cmath>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define FSDP_OPTIM_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FSDP_OPTIM_CLONES
#endif

namespace fsdp::optim::detail {
namespace {

// at::maximum: NaN in either operand gives NaN.
template <class T>
inline T nan_max(T a, T b) {
  return a != a ? a : (b != b ? b : (a > b ? a : b));
}

template <class T, bool kAmsgrad>
inline __attribute__((always_inline)) void moments_loop(const T* __restrict g, T* __restrict m,
                                                        T* __restrict v, T* __restrict vmax,
                                                        int64_t n, const AdamWScalars<T>& s) {
  const T b1 = s.beta1, c1 = s.one_minus_beta1, b2 = s.beta2, c2 = s.one_minus_beta2;
  for (int64_t i = 0; i < n; ++i) {
    const T gi = g[i];
    m[i] = std::fma(c1, gi, m[i] * b1);             // exp_avg.mul_(b1).add_(g, 1 - b1)
    const T vi = std::fma(c2 * gi, gi, v[i] * b2);  // exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
    v[i] = vi;
    if constexpr (kAmsgrad) vmax[i] = nan_max(vi, vmax[i]);  // max_out(max_exp_avg_sq, ...)
  }
}

template <class T>
inline __attribute__((always_inline)) void apply_loop(T* __restrict p, const T* __restrict m,
                                                      const T* __restrict root, int64_t n,
                                                      const AdamWScalars<T>& s) {
  const T decay = s.decay, sbc2 = s.sqrt_bias_correction2, eps = s.eps, step = s.neg_step_size;
  for (int64_t i = 0; i < n; ++i) {
    const T d = root[i] / sbc2 + eps;         // (sqrt() / sqrt(bias_correction2)).add_(eps)
    p[i] = p[i] * decay + (step * m[i]) / d;  // p.mul_(1 - lr wd); p.addcdiv_(m, d, -step)
  }
}

template <class T, bool kAmsgrad>
inline __attribute__((always_inline)) void fused_loop(T* __restrict p, const T* __restrict g,
                                                      T* __restrict m, T* __restrict v,
                                                      T* __restrict vmax, int64_t n,
                                                      const AdamWScalars<T>& s) {
  const T decay = s.decay, b1 = s.beta1, c1 = s.one_minus_beta1, b2 = s.beta2,
          c2 = s.one_minus_beta2, sbc2 = s.sqrt_bias_correction2, eps = s.eps,
          step = s.neg_step_size;
  for (int64_t i = 0; i < n; ++i) {
    const T gi = g[i];
    const T mi = std::fma(c1, gi, m[i] * b1);
    const T vi = std::fma(c2 * gi, gi, v[i] * b2);
    T si = vi;
    if constexpr (kAmsgrad) {
      si = nan_max(vi, vmax[i]);
      vmax[i] = si;
    }
    const T d = std::sqrt(si) / sbc2 + eps;
    p[i] = p[i] * decay + (step * mi) / d;  // two roundings: -ffp-contract=off
    m[i] = mi;
    v[i] = vi;
  }
}

template <class T>
inline __attribute__((always_inline)) void moments_any(const T* g, T* m, T* v, T* vmax, int64_t n,
                                                       const AdamWScalars<T>& s) {
  if (vmax)
    moments_loop<T, true>(g, m, v, vmax, n, s);
  else
    moments_loop<T, false>(g, m, v, nullptr, n, s);
}

// kMode: 0 no momentum, 1 first step (buf = d), 2 momentum.
template <class T, bool kDecays, int kMode, bool kNesterov>
inline __attribute__((always_inline)) void sgd_loop(T* __restrict p, const T* __restrict g,
                                                    T* __restrict buf, int64_t n,
                                                    const SGDScalars<T>& s) {
  const T wd = s.weight_decay, mom = s.momentum, damp = s.one_minus_dampening, lr = s.neg_lr;
  for (int64_t i = 0; i < n; ++i) {
    T d = g[i];
    if constexpr (kDecays) d = std::fma(wd, p[i], d);  // d_p.add(p, weight_decay)
    if constexpr (kMode != 0) {
      T b;
      if constexpr (kMode == 1)
        b = d;  // torch::clone(d_p)
      else
        b = std::fma(damp, d, buf[i] * mom);  // buf.mul_(momentum).add_(d_p, 1 - dampening)
      buf[i] = b;
      if constexpr (kNesterov)
        d = std::fma(mom, b, d);  // d_p.add(buf, momentum)
      else
        d = b;
    }
    p[i] = std::fma(lr, d, p[i]);  // p.add_(d_p, -lr)
  }
}

template <class T, bool kDecays>
inline __attribute__((always_inline)) void sgd_mode(T* p, const T* g, T* buf, int64_t n,
                                                    const SGDScalars<T>& s) {
  if (!s.has_momentum) return sgd_loop<T, kDecays, 0, false>(p, g, nullptr, n, s);
  if (s.first)
    return s.nesterov ? sgd_loop<T, kDecays, 1, true>(p, g, buf, n, s)
                      : sgd_loop<T, kDecays, 1, false>(p, g, buf, n, s);
  return s.nesterov ? sgd_loop<T, kDecays, 2, true>(p, g, buf, n, s)
                    : sgd_loop<T, kDecays, 2, false>(p, g, buf, n, s);
}

template <class T>
inline __attribute__((always_inline)) void sgd_any(T* p, const T* g, T* buf, int64_t n,
                                                   const SGDScalars<T>& s) {
  if (s.decays)
    sgd_mode<T, true>(p, g, buf, n, s);
  else
    sgd_mode<T, false>(p, g, buf, n, s);
}

}  // namespace

FSDP_OPTIM_CLONES void adamw_moments(const float* g, float* m, float* v, float* vmax, int64_t n,
                                     const AdamWScalars<float>& s) {
  moments_any(g, m, v, vmax, n, s);
}

FSDP_OPTIM_CLONES void adamw_moments(const double* g, double* m, double* v, double* vmax, int64_t n,
                                     const AdamWScalars<double>& s) {
  moments_any(g, m, v, vmax, n, s);
}

FSDP_OPTIM_CLONES void adamw_fused(float* p, const float* g, float* m, float* v, float* vmax,
                                   int64_t n, const AdamWScalars<float>& s) {
  if (vmax)
    fused_loop<float, true>(p, g, m, v, vmax, n, s);
  else
    fused_loop<float, false>(p, g, m, v, nullptr, n, s);
}

FSDP_OPTIM_CLONES void adamw_fused(double* p, const double* g, double* m, double* v, double* vmax,
                                   int64_t n, const AdamWScalars<double>& s) {
  if (vmax)
    fused_loop<double, true>(p, g, m, v, vmax, n, s);
  else
    fused_loop<double, false>(p, g, m, v, nullptr, n, s);
}

FSDP_OPTIM_CLONES void adamw_apply(float* p, const float* m, const float* root, int64_t n,
                                   const AdamWScalars<float>& s) {
  apply_loop(p, m, root, n, s);
}

FSDP_OPTIM_CLONES void adamw_apply(double* p, const double* m, const double* root, int64_t n,
                                   const AdamWScalars<double>& s) {
  apply_loop(p, m, root, n, s);
}

FSDP_OPTIM_CLONES void sgd_stretch(float* p, const float* g, float* buf, int64_t n,
                                   const SGDScalars<float>& s) {
  sgd_any(p, g, buf, n, s);
}

FSDP_OPTIM_CLONES void sgd_stretch(double* p, const double* g, double* buf, int64_t n,
                                   const SGDScalars<double>& s) {
  sgd_any(p, g, buf, n, s);
}

}  // namespace fsdp::optim::detail
