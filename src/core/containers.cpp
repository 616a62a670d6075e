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
    const ShardOptions& options) {
  FSDP_CHECK(!options.activation_checkpointing, "fully_shard_elements(", container,
             "): activation_checkpointing needs the element's calls, which LibTorch's containers "
             "make directly. Declare the block fsdp::Sharded<Block> and call it through the "
             "holder to checkpoint it");
  FSDP_CHECK(options.reshard_after_forward.value_or(false).world() == 1, "fully_shard_elements(",
             container,
             "): reshard_after_forward (true, or a smaller world) cannot be honoured: nothing "
             "marks the end of an "
             "element's forward (see fsdp/containers.h). Declare the block fsdp::Sharded<Block> "
             "and call it through the holder to reshard after forward");
  std::vector<FSDPModule> out;
  for (const auto& e : elements) {
    if (e->parameters(/*recurse=*/true).empty()) continue;
    out.push_back(fully_shard_impl(e, comm, replicate, options, CallPath::kGatherOnUse));
  }
  return out;
}

}  // namespace fsdp::detail
