// fsdp::optim::AdamW::step (include/fsdp/optim.h): torch::optim::AdamW's update, one fused pass
// per run of parameters (runs.h) through the element loops of kernels.h.
#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/optim.h>

#include <cmath>

#include "compat/optim.h"
#include "optim/kernels.h"
#include "optim/runs.h"

namespace fsdp::optim {
namespace {

using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;

// The state of p, created as LibTorch creates it (step 0; the moments are made zeros by
// make_flat or the per-parameter step). With amsgrad, state made without it cannot go on.
AdamWParamState& state_of(torch::optim::Optimizer& opt, const at::Tensor& p,
                          const AdamWOptions& o) {
  auto& states = opt.state();
  auto key = compat::optim_state_key(p);
  auto it = states.find(key);
  if (it == states.end()) {
    auto s = std::make_unique<AdamWParamState>();
    s->step(0);
    it = states.emplace(key, std::move(s)).first;
  }
  auto& s = static_cast<AdamWParamState&>(*it->second);
  FSDP_CHECK(!o.amsgrad() || s.step() == 0 || s.max_exp_avg_sq().defined(),
             "fsdp::optim::AdamW: a parameter of shape ", p.sizes(), " has state from ", s.step(),
             " steps without max_exp_avg_sq, but its parameter group has amsgrad on; the state "
             "was made with amsgrad off: keep amsgrad off for this optimizer state, or start "
             "the optimizer afresh");
  return s;
}

// torch::optim::AdamW::step for one parameter, its operations in its order: the parameters the
// fused loops do not take (CUDA, bf16, non-contiguous, ...).
void step_one(const at::Tensor& p, AdamWParamState& s, const AdamWOptions& o) {
  const at::Tensor& grad = p.grad();
  FSDP_CHECK(!grad.is_sparse(), "AdamW does not support sparse gradients");
  if (o.weight_decay() != 0) p.mul_(1 - o.lr() * o.weight_decay());
  if (!s.exp_avg().defined()) {
    s.exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    s.exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (o.amsgrad()) s.max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
  }
  s.step(s.step() + 1);
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  const double bias_correction1 = 1 - std::pow(beta1, s.step());
  const double bias_correction2 = 1 - std::pow(beta2, s.step());
  s.exp_avg().mul_(beta1).add_(grad, 1 - beta1);
  s.exp_avg_sq().mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  at::Tensor denom;
  if (o.amsgrad()) {
    at::max_out(s.max_exp_avg_sq(), s.exp_avg_sq(), s.max_exp_avg_sq());
    denom = (s.max_exp_avg_sq().sqrt() / std::sqrt(bias_correction2)).add_(o.eps());
  } else {
    denom = (s.exp_avg_sq().sqrt() / std::sqrt(bias_correction2)).add_(o.eps());
  }
  p.addcdiv_(s.exp_avg(), denom, -(o.lr() / bias_correction1));
}

// One parameter's scalars after its step count moved to `step`, rounded to T as LibTorch rounds
// its Scalar arguments.
template <class T>
detail::AdamWScalars<T> scalars(const AdamWOptions& o, int64_t step) {
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  return {static_cast<T>(o.weight_decay() != 0 ? 1 - o.lr() * o.weight_decay() : 1.0),
          static_cast<T>(beta1),
          static_cast<T>(1 - beta1),
          static_cast<T>(beta2),
          static_cast<T>(1 - beta2),
          static_cast<T>(std::sqrt(bias_correction2)),
          static_cast<T>(o.eps()),
          static_cast<T>(-(o.lr() / bias_correction1))};
}

// Elements per piece of a pass: parameter, gradient, both moments and the square roots of one
// piece (640 KiB in fp32) stay in a core's L2 cache from one loop to the next.
constexpr int64_t kCachedPiece = 32768;

// One fused pass over a run: its state made flat, every step count moved on, then the loops.
template <class T>
void step_run(const std::vector<at::Tensor>& params, const std::vector<AdamWParamState*>& states,
              const AdamWOptions& o) {
  std::vector<at::Tensor*> m, v, vmax;
  for (auto* s : states) {
    m.push_back(&s->exp_avg());
    v.push_back(&s->exp_avg_sq());
    vmax.push_back(&s->max_exp_avg_sq());
  }
  detail::make_flat(params, m);
  detail::make_flat(params, v);
  if (o.amsgrad()) detail::make_flat(params, vmax);
  struct Piece {
    T *p, *m, *v, *vmax;
    const T* g;
    detail::AdamWScalars<T> s;
  };
  std::vector<Piece> pieces;
  std::vector<int64_t> numels;
  for (size_t k = 0; k < params.size(); ++k) {
    states[k]->step(states[k]->step() + 1);
    pieces.push_back({params[k].data_ptr<T>(), m[k]->data_ptr<T>(), v[k]->data_ptr<T>(),
                      o.amsgrad() ? vmax[k]->data_ptr<T>() : nullptr,
                      params[k].grad().data_ptr<T>(), scalars<T>(o, states[k]->step())});
    numels.push_back(params[k].numel());
  }
  if (compat::kAtenSqrtIsIeee) {  // one loop: the sqrt in it is LibTorch's
    detail::parallel_pass(numels, [&](size_t k, int64_t begin, int64_t end) {
      const Piece& q = pieces[k];
      detail::adamw_fused(q.p + begin, q.g + begin, q.m + begin, q.v + begin,
                          q.vmax ? q.vmax + begin : nullptr, end - begin, q.s);
    });
    return detail::bump_versions(params);
  }
  const auto options = params[0].options().requires_grad(false);
  detail::parallel_pass(numels, [&](size_t k, int64_t begin, int64_t end) {
    // In pieces that stay in the core's cache between the three passes: the moments, LibTorch's
    // own square root of the second moment (kernels.h says why), the update.
    at::AutoDispatchBelowADInplaceOrView no_autograd;
    const Piece& q = pieces[k];
    at::Tensor root = at::empty({std::min(end - begin, kCachedPiece)}, options);
    for (int64_t b = begin; b < end; b += kCachedPiece) {
      const int64_t n = std::min(kCachedPiece, end - b);
      detail::adamw_moments(q.g + b, q.m + b, q.v + b, q.vmax ? q.vmax + b : nullptr, n, q.s);
      at::Tensor out = root.narrow(0, 0, n);
      at::sqrt_out(out, at::from_blob((q.vmax ? q.vmax : q.v) + b, {n}, options));
      detail::adamw_apply(q.p + b, q.m + b, root.data_ptr<T>(), n, q.s);
    }
  });
  detail::bump_versions(params);
}

}  // namespace

torch::Tensor AdamW::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups()) {
    const auto& o = static_cast<const AdamWOptions&>(group.options());
    const auto& all = group.params();
    for (const auto& item : detail::plan_steps(all)) {
      std::vector<at::Tensor> params;
      std::vector<AdamWParamState*> states;
      for (size_t i : item.params) {
        params.push_back(all[i]);
        states.push_back(&state_of(*this, all[i], o));
      }
      if (!item.fused)
        step_one(params[0], *states[0], o);
      else if (params[0].scalar_type() == at::kFloat)
        step_run<float>(params, states, o);
      else
        step_run<double>(params, states, o);
    }
  }
  return loss;
}

}  // namespace fsdp::optim
