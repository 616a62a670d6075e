// fully_shard's implementation entry points (src/core/fully_shard.cpp), reached from the public
// templates of fsdp/fully_shard.h and fsdp/containers.h. Not for users.
// Thread-safety: set-up, before training, on every rank in the same order.
#pragma once

#include <fsdp/communicator.h>
#include <fsdp/options.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace torch::nn {
class Module;
}

namespace fsdp {
class FSDPModule;

namespace detail {
struct Binding;

// How the calls of a module sharded by fully_shard_impl reach its group.
enum class CallPath : uint8_t {
  kHolder,  // through its fsdp::Sharded<T> holder, whose operator() runs the group's forward
  // Directly (a container element, fsdp/containers.h): gathered when the root's forward begins.
  // Owned by the registry until a sharded ancestor absorbs it.
  kGatherOnUse,
};
// `members`: set for a module list, whose `module` is the container built around them.
FSDPModule fully_shard_impl(const std::shared_ptr<torch::nn::Module>& module,
                            std::shared_ptr<Communicator> comm,
                            std::shared_ptr<Communicator> replicate, const ShardOptions& options,
                            CallPath path, const std::vector<torch::nn::Module*>& members = {});
// The options with their deprecated spellings folded into runtime and debug.
ShardOptions resolved_options(ShardOptions given);
// Throws the error of torch::save on a sharded module.
[[noreturn]] void reject_torch_save(const std::shared_ptr<Binding>& binding);

}  // namespace detail
}  // namespace fsdp
