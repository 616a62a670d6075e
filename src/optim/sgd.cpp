// fsdp::optim::SGD::step (include/fsdp/optim.h): torch::optim::SGD's update, one fused pass per
// run of parameters (runs.h) through the element loops of kernels.h.
#include <ATen/ATen.h>
#include <fsdp/optim.h>

#include "compat/optim.h"
#include "optim/kernels.h"
#include "optim/runs.h"

namespace fsdp::optim {
namespace {

using torch::optim::SGDOptions;
using torch::optim::SGDParamState;

// p's momentum buffer slot (created empty: LibTorch creates the state with the first buffer), or
// null without momentum, where LibTorch keeps no state.
at::Tensor* buffer_of(torch::optim::Optimizer& opt, const at::Tensor& p, const SGDOptions& o,
                      bool* first) {
  if (o.momentum() == 0) return nullptr;
  auto& states = opt.state();
  auto key = compat::optim_state_key(p);
  auto it = states.find(key);
  if (it == states.end()) it = states.emplace(key, std::make_unique<SGDParamState>()).first;
  auto& buf = static_cast<SGDParamState&>(*it->second).momentum_buffer();
  *first = !buf.defined();
  return &buf;
}

// torch::optim::SGD::step for one parameter, its operations in its order: the parameters the
// fused loops do not take.
void step_one(const at::Tensor& p, at::Tensor* buf, const SGDOptions& o) {
  at::Tensor d = p.grad().data();
  if (o.weight_decay() != 0) d = d.add(p.data(), o.weight_decay());
  if (buf) {
    if (!buf->defined())
      *buf = at::clone(d).detach();
    else
      buf->mul_(o.momentum()).add_(d, 1 - o.dampening());
    d = o.nesterov() ? d.add(*buf, o.momentum()) : *buf;
  }
  p.data().add_(d, -1 * o.lr());
}

template <class T>
void step_run(const std::vector<at::Tensor>& params, const std::vector<at::Tensor*>& buffers,
              const std::vector<bool>& first, const SGDOptions& o) {
  const bool momentum = o.momentum() != 0;
  if (momentum) detail::make_flat(params, buffers);
  struct Piece {
    T *p, *buf;
    const T* g;
    detail::SGDScalars<T> s;
  };
  std::vector<Piece> pieces;
  std::vector<int64_t> numels;
  for (size_t k = 0; k < params.size(); ++k) {
    detail::SGDScalars<T> s{static_cast<T>(o.weight_decay()),
                            static_cast<T>(o.momentum()),
                            static_cast<T>(1 - o.dampening()),
                            static_cast<T>(-1 * o.lr()),
                            o.weight_decay() != 0,
                            momentum,
                            momentum && first[k],
                            o.nesterov()};
    pieces.push_back({params[k].data_ptr<T>(), momentum ? buffers[k]->data_ptr<T>() : nullptr,
                      params[k].grad().data_ptr<T>(), s});
    numels.push_back(params[k].numel());
  }
  detail::parallel_pass(numels, [&](size_t k, int64_t begin, int64_t end) {
    const Piece& q = pieces[k];
    detail::sgd_stretch(q.p + begin, q.g + begin, q.buf ? q.buf + begin : nullptr, end - begin,
                        q.s);
  });
  detail::bump_versions(params);
}

}  // namespace

torch::Tensor SGD::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups()) {
    const auto& o = static_cast<const SGDOptions&>(group.options());
    const auto& all = group.params();
    for (const auto& item : detail::plan_steps(all)) {
      std::vector<at::Tensor> params;
      std::vector<at::Tensor*> buffers;
      std::vector<bool> first;
      for (size_t i : item.params) {
        bool f = false;
        params.push_back(all[i]);
        buffers.push_back(buffer_of(*this, all[i], o, &f));
        first.push_back(f);
      }
      if (!item.fused) {
        step_one(params[0], buffers[0], o);
      } else if (params[0].scalar_type() == at::kFloat) {
        step_run<float>(params, buffers, first, o);
      } else {
        step_run<double>(params, buffers, first, o);
      }
    }
  }
  return loss;
}

}  // namespace fsdp::optim
