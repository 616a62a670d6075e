// fully_shard_elements: one group per container element, gathered on first use
// ([Note: elements gathered on use] in docs/design.md).
#include <fsdp/containers.h>

#include "core/group.h"

namespace fsdp::detail {

namespace {
std::vector<std::shared_ptr<torch::nn::Module>> children(torch::nn::Module& m) {
  return m.children();
}
}  // namespace

std::vector<std::shared_ptr<torch::nn::Module>> elements_of(torch::nn::SequentialImpl& c) {
  return children(c);
}
std::vector<std::shared_ptr<torch::nn::Module>> elements_of(torch::nn::ModuleListImpl& c) {
  return children(c);
}
std::vector<std::shared_ptr<torch::nn::Module>> elements_of(torch::nn::TransformerEncoderImpl& c) {
  return children(*c.layers);
}
std::vector<std::shared_ptr<torch::nn::Module>> elements_of(torch::nn::TransformerDecoderImpl& c) {
  return children(*c.layers);
}

std::vector<FSDPModule> fully_shard_elements_impl(
    const std::vector<std::shared_ptr<torch::nn::Module>>& elements, const std::string& container,
    std::shared_ptr<Communicator> comm, std::shared_ptr<Communicator> replicate,
    const ShardOptions& given) {
  const ShardOptions options = resolved_options(given);
  FSDP_CHECK(!options.runtime.activation_checkpointing, "fully_shard_elements(", container,
             "): activation_checkpointing needs the element's calls, which LibTorch's containers "
             "make directly. Declare the block fsdp::Sharded<Block> and call it through the "
             "holder to checkpoint it");
  FSDP_CHECK(options.reshard_after_forward.value_or(false).world() == 1, "fully_shard_elements(",
             container,
             "): reshard_after_forward (true, or a smaller world) cannot be honoured: nothing "
             "marks the end of an "
             "element's forward (see fsdp/containers.h). Declare the block fsdp::Sharded<Block> "
             "and call it through the holder to reshard after forward");
  // ignored_params: each element gets those among its own parameters; one of none is an error,
  // raised before anything is sharded.
  std::vector<ShardOptions> own(elements.size(), options);
  std::vector<char> placed(options.ignored_params.size(), 0);
  for (size_t k = 0; k < elements.size(); ++k) {
    own[k].ignored_params.clear();
    for (size_t i = 0; i < options.ignored_params.size(); ++i)
      for (const auto& p : elements[k]->parameters(/*recurse=*/true))
        if (p.is_same(options.ignored_params[i])) {
          own[k].ignored_params.push_back(p);
          placed[i] = 1;
        }
  }
  for (size_t i = 0; i < placed.size(); ++i)
    FSDP_CHECK(placed[i], "fully_shard_elements: ignored_params[", i, "] (shape ",
               options.ignored_params[i].sizes(),
               ") is not a parameter of any element; pass parameters of the container's elements");
  std::vector<FSDPModule> out;
  for (size_t k = 0; k < elements.size(); ++k) {
    if (elements[k]->parameters(/*recurse=*/true).empty()) continue;
    out.push_back(fully_shard_impl(elements[k], comm, replicate, own[k], CallPath::kGatherOnUse));
  }
  return out;
}

}  // namespace fsdp::detail
