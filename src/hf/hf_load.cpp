// Reading a Hugging Face Llama directory into fsdp::models::Llama, sharded or whole (fsdp/hf.h).
#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/hf.h>
#include <fsdp/safetensors_torch.h>
#include <torch/nn/module.h>

#include <set>

#include "checkpoint/checkpoint_common.h"
#include "hf/hf_internal.h"

namespace fsdp::hf {

namespace st = fsdp::safetensors;
using detail::cat;

namespace {

// Where one parameter's values go: `rows` indices of dim `dim` from `offset` on (the whole
// tensor for an unsharded parameter).
struct Destination {
  std::string name;
  at::Tensor target;
  std::vector<int64_t> global_shape;
  int64_t dim = 0;
  int64_t offset = 0;
};

void fill(const std::string& dir, const std::vector<Destination>& dests) {
  const auto cfg = read_llama_config(dir);
  const auto files = weight_files(dir);
  std::set<std::string> wanted;
  for (const auto& d : dests) wanted.insert(d.name);
  internal::check_names(dir, files, wanted, cfg);
  internal::Files open;
  at::NoGradGuard no_grad;
  for (const auto& d : dests) {
    const std::string& path = files.at(d.name);
    st::File& f = open.open(path);
    internal::check_tensor(path, f.tensor(d.name), d.global_shape);
    const int64_t n = d.target.dim() == 0 ? 1 : d.target.size(d.dim);
    // Dim 0: only these rows leave the file; another dim: the whole tensor, then the slice.
    const at::Tensor src = d.dim == 0 ? st::read_rows(f, d.name, d.offset, d.offset + n)
                                      : st::read_tensor(f, d.name).narrow(d.dim, d.offset, n);
    d.target.copy_(src.reshape(d.target.sizes()).to(d.target.scalar_type()));
  }
}

}  // namespace

void load_llama(const std::string& dir, const FSDPModule& root) {
  const std::string error = detail::error_of([&] {
    std::vector<Destination> dests;
    for (const ShardInfo& s : root.shards())
      dests.push_back({s.name, s.shard, s.global_shape, s.dim, s.row_offset});
    fill(dir, dests);
  });
  fsdp::detail::raise_together(root.communicator(), root.replicate_communicator().get(), error,
                               "loading the Hugging Face model");
}

void load_llama(const std::string& dir, torch::nn::Module& model) {
  std::vector<Destination> dests;
  for (const auto& p : model.named_parameters())
    dests.push_back({p.key(), p.value(), p.value().sizes().vec(), 0, 0});
  fill(dir, dests);
}

}  // namespace fsdp::hf
