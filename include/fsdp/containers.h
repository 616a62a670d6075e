// fully_shard_elements: one group per element of the containers LibTorch users already have.
//
//   torch::nn::Sequential mlp(...);            // or ModuleList, TransformerEncoder/Decoder
//   fsdp::fully_shard_elements(mlp, comm);     // each element (each layer) its own group
//   auto root = fsdp::fully_shard(model, comm);  // the root still as fsdp::Sharded<...>
//
// LibTorch's containers call their elements directly (Sequential through AnyModule, ModuleList
// and the transformer stacks through as<Layer>()->forward), so no holder can intercept an
// element's forward. An element's group is gathered instead when an operator first reaches one of
// its resharded parameters inside a forward of the sharded root (the resharded-parameter guard
// does it), and it stays gathered until the end of that forward's backward, or of the root's
// forward without grad mode. That is FSDP2's reshard_after_forward=false for these groups: the
// all-gathers and reduce-scatters are per element, and so are the shards, but the gathered
// parameters of every element used in forward are alive together until backward ends. Where that
// memory matters, declare the block type fsdp::Sharded<Block> and call it through the holder.
//
// Requirements: the model's root is sharded (fsdp::Sharded<...> + fully_shard) after its
// elements (ranks may use different elements, in any order), and with mixed precision the
// root casts the inputs (an element's own inputs and outputs are not cast). Elements without
// parameters are left alone. activation_checkpointing and reshard_after_forward=true are refused.
// See docs/design.md, [Note: elements gathered on use].
// Thread-safety: like fully_shard (set-up, before training).
#pragma once

#include <fsdp/fully_shard.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/transformercoder.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp {
namespace detail {
std::vector<FSDPModule> fully_shard_elements_impl(
    const std::vector<std::shared_ptr<torch::nn::Module>>& elements, const std::string& container,
    std::shared_ptr<Communicator> comm, std::shared_ptr<Communicator> replicate,
    const ShardOptions& options);

// The elements each supported container shards, in call order.
std::vector<std::shared_ptr<torch::nn::Module>> elements_of(torch::nn::SequentialImpl& c);
std::vector<std::shared_ptr<torch::nn::Module>> elements_of(torch::nn::ModuleListImpl& c);
std::vector<std::shared_ptr<torch::nn::Module>> elements_of(torch::nn::TransformerEncoderImpl& c);
std::vector<std::shared_ptr<torch::nn::Module>> elements_of(torch::nn::TransformerDecoderImpl& c);
template <class Impl>
std::vector<std::shared_ptr<torch::nn::Module>> elements_of(Impl&) {
  static_assert(sizeof(Impl) == 0,
                "fsdp::fully_shard_elements shards the elements of torch::nn::Sequential, "
                "torch::nn::ModuleList and the layers of torch::nn::TransformerEncoder / "
                "TransformerDecoder. For a module of your own, declare it fsdp::Sharded<T> and "
                "call fsdp::fully_shard on it");
  return {};
}
}  // namespace detail

// Shards each element of `container` in place (one group per element, in element order) and
// returns their handles. Call before fully_shard on the model's root.
template <class Container>
std::vector<FSDPModule> fully_shard_elements(Container& container,
                                             std::shared_ptr<Communicator> comm,
                                             const ShardOptions& options = {}) {
  FSDP_CHECK(!container.is_empty(), "fully_shard_elements: the container is empty (construct it)");
  return detail::fully_shard_elements_impl(detail::elements_of(*container), container->name(),
                                           std::move(comm), nullptr, options);
}

// HSDP: each element sharded within mesh.shard, gradients averaged across mesh.replicate.
template <class Container>
std::vector<FSDPModule> fully_shard_elements(Container& container, const DeviceMesh& mesh,
                                             const ShardOptions& options = {}) {
  FSDP_CHECK(!container.is_empty(), "fully_shard_elements: the container is empty (construct it)");
  FSDP_CHECK(mesh.shard != nullptr,
             "fully_shard_elements: the DeviceMesh is empty (build it with init_mesh)");
  return detail::fully_shard_elements_impl(detail::elements_of(*container), container->name(),
                                           mesh.shard, mesh.replicate, options);
}

}  // namespace fsdp
