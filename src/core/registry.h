// Registry: which binding (group and root, core/binding.h) manages each sharded module and
// parameter, and the one owner of registration. fully_shard claims a module's parameters here,
// absorbs the roots of its sharded descendants into a new root, and registers the new binding.
// Process-wide, because C++ modules carry no state of their own where a parent's fully_shard could
// find its children's (FSDP2 keeps it on the Python module); weak references keyed by identity, so
// models and ranks in one process do not interfere and entries die with their bindings. The
// bindings of container elements (fsdp/containers.h), which no holder owns, are kept here until a
// sharded ancestor's binding adopts them.
// Thread-safety: every method takes the registry's mutex; none runs a collective.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/options.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "util/mutex.h"

namespace fsdp {
class Communicator;
}  // namespace fsdp

namespace fsdp::detail {

class Group;
class Root;
struct Binding;

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// A module's descendants by path, in the model's own module order: pointer order differs between
// processes, and the group order must be the same on every rank.
struct ModulePaths {
  std::map<const torch::nn::Module*, std::string> path_of;
  std::vector<const torch::nn::Module*> order;
};
ModulePaths module_paths(const torch::nn::Module& module);

class Registry {
 public:
  static Registry& instance();

  bool is_sharded(const torch::nn::Module& module);
  // The binding whose group manages `param`, or null.
  std::shared_ptr<Binding> binding_of(const at::Tensor& param);

  // The parameters a fully_shard call on `module` manages: those no sharded descendant owns, each
  // once (a parameter tied within the group counts once). A parameter shared with another group,
  // or a module sharded after its parent, is an error naming both.
  // ignored_params (checked to be parameters of `module` that no sharded descendant manages) and
  // those a descendant ignored are left out.
  NamedTensors claim_parameters(const torch::nn::Module& module, const ModulePaths& paths,
                                const std::vector<at::Tensor>& ignored_params);
  // A new root holding every group of the roots of the module's sharded descendants (with all
  // their groups), renamed by their path under the module; every binding of those roots is
  // repointed to it.
  std::shared_ptr<Root> absorb_children(const ModulePaths& paths,
                                        const std::shared_ptr<Communicator>& comm,
                                        const std::shared_ptr<Communicator>& replicate,
                                        const ShardOptions& options);
  // Registers `b` for its group's module, members and parameters; it adopts the container
  // elements' bindings below its module that no sharded ancestor owned yet, and is kept here
  // itself when its group gathers on use.
  void add(const std::shared_ptr<Binding>& b);
  // [Note: the resharded-parameter guard], one root per backward: the root already running a pass
  // of GraphTask `task`, or null after recording `root` as its owner (two separately sharded
  // models in one backward would each plan their collectives alone: the one fact about running
  // backwards that spans roots). release_backward when the pass ends or is dropped.
  const Root* claim_backward(const void* task, const Root* root);
  void release_backward(const void* task);
  // The buffers of `module` that no sharded descendant holds, with values (not pending under
  // deferred_init).
  NamedTensors own_buffers(const torch::nn::Module& module, const ModulePaths& paths);

 private:
  template <class K>
  using Index = std::unordered_map<const K*, std::weak_ptr<Binding>>;
  template <class K>
  static std::shared_ptr<Binding> find(Index<K>& index, const K* key);
  void adopt_elements(Binding& b) FSDP_REQUIRES(mu_);
  void check_ignored(const torch::nn::Module& module, const ModulePaths& paths,
                     const std::vector<at::Tensor>& ignored_params) FSDP_REQUIRES(mu_);

  Mutex mu_;
  Index<torch::nn::Module> modules_ FSDP_GUARDED_BY(mu_);
  Index<c10::TensorImpl> params_ FSDP_GUARDED_BY(mu_);
  Index<c10::TensorImpl> ignored_ FSDP_GUARDED_BY(mu_);  // by the group that ignored them
  std::vector<std::shared_ptr<Binding>> unowned_elements_ FSDP_GUARDED_BY(mu_);
  std::map<const void*, const Root*> backward_owners_ FSDP_GUARDED_BY(mu_);  // by GraphTask
};

}  // namespace fsdp::detail
