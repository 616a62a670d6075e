#include "core/registry.h"

#include <fsdp/error.h>

#include <algorithm>
#include <optional>
#include <set>

#include "core/binding.h"
#include "core/deferred_init.h"
#include "core/group.h"
#include "core/root.h"

namespace fsdp::detail {

ModulePaths module_paths(const torch::nn::Module& module) {
  ModulePaths m;
  for (const auto& item : module.named_modules("", /*include_self=*/false))
    if (m.path_of.emplace(item.value().get(), item.key()).second)
      m.order.push_back(item.value().get());
  return m;
}

namespace {
// Where `owner` lies under `paths` for its parameter `key` (`impl`): the path of its module, or
// for a module list of the member whose parameters `key` names (else of the member holding
// `impl`, else of its first member there); nullopt when it is not under `paths`.
std::optional<std::string> owner_path(const ModulePaths& paths, const Group& owner,
                                      const std::string& key, const c10::TensorImpl* impl) {
  std::optional<std::string> holder, first;
  for (const auto* m : owner.members()) {
    auto p = paths.path_of.find(m);
    if (p == paths.path_of.end()) continue;
    if (key.rfind(p->second + ".", 0) == 0) return p->second;
    for (const auto& t : m->parameters())
      if (!holder && t.unsafeGetTensorImpl() == impl) holder = p->second;
    if (!first) first = p->second;
  }
  return holder ? holder : first;
}
// A group in messages: its path under its root, or its type while it is a root of its own (not
// yet absorbed by a sharded parent, where every group is named "root").
std::string describe_owner(const Group& g) {
  if (g.is_root()) return detail::cat("module ", g.type_name());
  return detail::cat("module '", g.name(), "' (", g.type_name(), ")");
}
}  // namespace

Registry& Registry::instance() {
  // Never destroyed: a root held by a static may release its entries after static destruction
  // began.
  static auto* r = new Registry();
  return *r;
}

template <class K>
std::shared_ptr<Binding> Registry::find(Index<K>& index, const K* key) {
  auto it = index.find(key);
  if (it == index.end()) return nullptr;
  auto g = it->second.lock();
  if (!g) index.erase(it);
  return g;
}

bool Registry::is_sharded(const torch::nn::Module& module) {
  MutexLock lock(mu_);
  return find(modules_, &module) != nullptr;
}

std::shared_ptr<Binding> Registry::binding_of(const at::Tensor& param) {
  MutexLock lock(mu_);
  return find(params_, param.unsafeGetTensorImpl());
}

NamedTensors Registry::claim_parameters(const torch::nn::Module& module, const ModulePaths& paths,
                                        const std::vector<at::Tensor>& ignored_params) {
  MutexLock lock(mu_);
  const std::string type = module.name();
  std::set<const c10::TensorImpl*> ignored;
  for (const auto& t : ignored_params) ignored.insert(t.unsafeGetTensorImpl());
  check_ignored(module, paths, ignored_params);
  NamedTensors mine;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const auto* impl = item.value().unsafeGetTensorImpl();
    if (ignored.count(impl) || find(ignored_, impl)) continue;  // left whole, unmanaged
    if (auto bound = find(params_, impl)) {
      const Group* owner = bound->group.get();
      if (auto p = owner_path(paths, *owner, item.key(), impl)) {
        FSDP_CHECK(item.key().rfind(*p + ".", 0) == 0, "parameter '", item.key(), "' of module '",
                   type, "' is also a parameter of sharded submodule '", *p, "' (",
                   owner->is_list() ? "in " + owner->type_name() : owner->type_name(),
                   "): a parameter shared by two groups cannot be sharded. Fix: do not "
                   "fully_shard '",
                   *p,
                   "' separately, so that both uses fall in one group (shard their common parent, "
                   "or pass both modules to one fully_shard call)");
        continue;
      }
      // The module, or (for a module list's container) one of the modules it holds, lies
      // inside the owner's.
      std::set<const torch::nn::Module*> targets{&module};
      for (const auto& c : module.children()) targets.insert(c.get());
      bool owner_is_ancestor = false;
      for (const auto* member : owner->members())
        for (const auto& m : member->modules(/*include_self=*/false))
          if (targets.count(m.get())) owner_is_ancestor = true;
      FSDP_CHECK(!owner_is_ancestor, "fully_shard(", type, ") was called after its parent (",
                 owner->type_name(),
                 ") was sharded: apply fully_shard bottom-up, children first, then the parent");
      throw Error(detail::cat("parameter '", item.key(), "' of module '", type,
                              "' is already managed by fully_shard on ", describe_owner(*owner),
                              ": a parameter shared by two groups cannot be sharded. Fix: shard "
                              "their common parent only, so that both uses fall in one group, "
                              "or pass both modules to one fully_shard call"));
    }
    if (!seen.insert(impl).second) continue;  // tied within this group: one parameter
    mine.emplace_back(item.key(), item.value());
  }
  return mine;
}

std::shared_ptr<Root> Registry::absorb_children(const ModulePaths& paths,
                                                const std::shared_ptr<Communicator>& comm,
                                                const std::shared_ptr<Communicator>& replicate,
                                                const ShardOptions& options) {
  MutexLock lock(mu_);
  auto root = std::make_shared<Root>(comm, replicate, options.debug.audit);
  std::vector<std::shared_ptr<Root>> absorbed;
  for (const auto* m : paths.order) {
    auto b = find(modules_, m);
    if (b && std::find(absorbed.begin(), absorbed.end(), b->root) == absorbed.end())
      absorbed.push_back(b->root);
  }
  for (const auto& old : absorbed) {
    for (Group* g : old->groups()) {
      if (g->is_list()) {
        std::vector<std::string> member_paths;
        for (const auto* m : g->members()) {
          auto p = paths.path_of.find(m);
          FSDP_CHECK(p != paths.path_of.end(), "fully_shard: the sharded module list ",
                     g->type_name(), " lies partly outside the module being sharded (its ",
                     m->name(),
                     " is not a submodule of it): a parent absorbs a list only whole. Fix: shard "
                     "a module that holds every module of the list");
          member_paths.push_back(p->second);
        }
        g->set_member_paths(member_paths);
      } else {
        g->set_path(paths.path_of.at(g->module()));
      }
    }
    root->absorb(*old);
  }
  // Every binding of an absorbed root now reaches the new one.
  for (auto& [m, weak] : modules_)
    if (auto b = weak.lock();
        b && std::find(absorbed.begin(), absorbed.end(), b->root) != absorbed.end())
      b->root = root;
  return root;
}

void Registry::add(const std::shared_ptr<Binding>& b) {
  MutexLock lock(mu_);
  adopt_elements(*b);
  const Group& g = *b->group;
  if (g.gathers_on_use()) unowned_elements_.push_back(b);
  modules_[g.module()] = b;
  for (const auto* m : g.members()) modules_[m] = b;
  for (const auto& p : g.params()) params_[p.param().unsafeGetTensorImpl()] = b;
  for (const auto& t : g.ignored()) ignored_[t.unsafeGetTensorImpl()] = b;
}

// The container elements below `b`'s module that no sharded ancestor owned yet become owned by
// `b` (they live as long as it).
void Registry::adopt_elements(Binding& b) {
  std::set<const torch::nn::Module*> below;
  for (const auto& m : b.group->module()->modules(/*include_self=*/false)) below.insert(m.get());
  auto& v = unowned_elements_;
  for (auto it = v.begin(); it != v.end();) {
    if (below.count((*it)->group->module())) {
      b.elements.push_back(*it);
      it = v.erase(it);
    } else {
      ++it;
    }
  }
}

// Each ignored tensor must be a parameter of `module` that no sharded descendant manages, with
// values (deferred_init's materialize fills managed parameters only).
void Registry::check_ignored(const torch::nn::Module& module, const ModulePaths& paths,
                             const std::vector<at::Tensor>& ignored_params) {
  const std::string type = module.name();
  std::map<const c10::TensorImpl*, std::string> names;
  for (const auto& item : module.named_parameters(/*recurse=*/true))
    names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  for (size_t i = 0; i < ignored_params.size(); ++i) {
    const at::Tensor& t = ignored_params[i];
    FSDP_CHECK(t.defined(), "fully_shard(", type, "): ignored_params[", i,
               "] is an undefined tensor; pass the module's parameters to leave unsharded");
    auto it = names.find(t.unsafeGetTensorImpl());
    FSDP_CHECK(it != names.end(), "fully_shard(", type, "): ignored_params[", i, "] (shape ",
               t.sizes(),
               ") is not a parameter of this module; pass parameters of the module "
               "being sharded (e.g. module->sub->weight)");
    if (auto bound = find(params_, t.unsafeGetTensorImpl())) {
      const Group* owner = bound->group.get();
      auto path = paths.path_of.find(owner->module());
      throw Error(detail::cat("fully_shard(", type, "): ignored parameter '", it->second,
                              "' is already managed by sharded submodule '",
                              path != paths.path_of.end() ? path->second : owner->name(), "' (",
                              owner->type_name(), "); pass it in that submodule's ignored_params"));
    }
    FSDP_CHECK(!deferred::is_pending(t), "fully_shard(", type, "): ignored parameter '", it->second,
               "' was built under fsdp::deferred_init and has no values (materialize fills "
               "sharded parameters only); build it eagerly, or shard it");
  }
}

const Root* Registry::claim_backward(const void* task, const Root* root) {
  MutexLock lock(mu_);
  auto [it, fresh] = backward_owners_.emplace(task, root);
  return fresh || it->second == root ? nullptr : it->second;
}

void Registry::release_backward(const void* task) {
  MutexLock lock(mu_);
  backward_owners_.erase(task);
}

NamedTensors Registry::own_buffers(const torch::nn::Module& module, const ModulePaths& paths) {
  MutexLock lock(mu_);
  NamedTensors own;
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    bool in_child = false;
    for (const auto& [m, path] : paths.path_of)
      if (find(modules_, m) && item.key().rfind(path + ".", 0) == 0) in_child = true;
    // A buffer built under deferred_init has no values yet: materialize fills it (and compares
    // it across ranks).
    if (in_child || !item.value().defined() || deferred::is_pending(item.value())) continue;
    own.emplace_back(item.key(), item.value());
  }
  return own;
}

}  // namespace fsdp::detail
