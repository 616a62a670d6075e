// clip_grad_norm_ over shards: local partial norms, one collective, then torch's scaling rule.
#include <ATen/ATen.h>
#include <fsdp/clip_grad_norm.h>

#include <cmath>
#include <limits>

#include "core/explicit_collective.h"

namespace fsdp {

namespace {

// The shard gradients that hold elements on this rank.
std::vector<at::Tensor> local_grads(const FSDPModule& root) {
  std::vector<at::Tensor> out;
  for (const auto& s : root.shards()) {
    if (s.ignored) continue;  // each rank's own: the norm would differ between ranks
    const at::Tensor& g = s.shard.grad();
    if (g.defined() && g.numel() > 0) out.push_back(g);
  }
  return out;
}

// max over ranks of the local largest |g| (NaN propagates, as in torch's max).
double global_inf_norm(Communicator& comm, const std::vector<at::Tensor>& grads) {
  double local = 0;
  for (const auto& g : grads) {
    const double m = g.detach().abs().max().item<double>();
    if (std::isnan(m) || m > local) local = m;
    if (std::isnan(local)) break;
  }
  auto mine = at::full({1}, local, at::kDouble);
  auto all = at::empty({comm.size()}, at::kDouble);
  comm.all_gather(all, mine).wait();
  return all.max().item<double>();
}

// (sum over ranks of sum |g|^p)^(1/p), accumulated in double.
double global_p_norm(Communicator& comm, const std::vector<at::Tensor>& grads, double p) {
  // Summed on the gradients' device (a CPU sum cannot take a CUDA scalar).
  const at::Device device = grads.empty() ? at::Device(at::kCPU) : grads.front().device();
  auto sum = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (const auto& g : grads) {
    auto d = g.detach().to(at::kDouble);
    sum += p == 2.0 ? d.pow(2).sum() : d.abs().pow(p).sum();
  }
  comm.all_reduce(sum, ReduceOp::kSum).wait();
  return std::pow(sum.item<double>(), 1.0 / p);
}

}  // namespace

double clip_grad_norm_(const FSDPModule& root, double max_norm, double norm_type,
                       bool error_if_nonfinite) {
  FSDP_CHECK(root.defined(),
             "clip_grad_norm_: the FSDPModule handle is empty; pass the handle "
             "fully_shard returned for the root");
  const bool inf = norm_type == std::numeric_limits<double>::infinity();
  FSDP_CHECK(inf || (std::isfinite(norm_type) && norm_type > 0), "clip_grad_norm_(", root.name(),
             "): norm_type ", norm_type,
             " is not supported; use a positive p (2.0 for the Euclidean norm) or "
             "std::numeric_limits<double>::infinity() for the max norm");
  FSDP_CHECK(!std::isnan(max_norm), "clip_grad_norm_(", root.name(),
             "): max_norm is NaN; pass the largest gradient norm to allow (e.g. 1.0)");
  detail::agree_explicit_collective(root, detail::protocol::Explicit::kClipGradNorm);
  const auto grads = local_grads(root);
  Communicator& comm = root.communicator();
  const double total = inf ? global_inf_norm(comm, grads) : global_p_norm(comm, grads, norm_type);
  FSDP_CHECK(!error_if_nonfinite || std::isfinite(total), "clip_grad_norm_(", root.name(),
             "): the total gradient norm of order ", norm_type, " is ", total,
             " (non-finite), so it cannot be clipped; no gradient was changed. Look for a "
             "diverging loss or a NaN input, or pass error_if_nonfinite = false to scale anyway "
             "as torch does");
  // torch: clamp(max_norm / (total + 1e-6), max = 1), applied even when it is 1 (NaN stays NaN).
  double coef = max_norm / (total + 1e-6);
  if (coef > 1.0) coef = 1.0;
  at::NoGradGuard no_grad;
  for (const auto& g : grads) g.mul_(coef);
  return total;
}

}  // namespace fsdp
