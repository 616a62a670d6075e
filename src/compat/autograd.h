// Autograd node ownership, the one LibTorch version difference in graph code.
// 1.13 to 2.11: a Node is owned by std::shared_ptr and must be deleted through
// torch::autograd::deleteNode (it unlinks long chains iteratively). 2.15: a Node is a
// c10::intrusive_ptr_target, owned by c10::intrusive_ptr; its destructor does that unlinking and
// deleteNode is gone. The change came with the header that now declares Node (node.h), which is
// what tells the two apart.
// Code outside compat names nodes only through NodePtr, WeakNodePtr and make_node.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/version.h>

#include <memory>
#include <utility>

#if __has_include(<torch/csrc/autograd/node.h>)
#define FSDP_INTRUSIVE_NODES 1
#else
#define FSDP_INTRUSIVE_NODES 0
#endif

namespace fsdp::compat {

using torch::autograd::Node;

#if FSDP_INTRUSIVE_NODES

using NodePtr = c10::intrusive_ptr<Node>;

// A weak reference to a node. c10::weak_intrusive_ptr has no default constructor and an explicit
// one from intrusive_ptr; this wrapper converts implicitly like std::weak_ptr, so containers of
// weak nodes read the same on both versions.
class WeakNodePtr {
 public:
  template <class T>
  WeakNodePtr(const c10::intrusive_ptr<T>& p)  // NOLINT: implicit, as std::weak_ptr's
      : p_(NodePtr(p)) {}
  NodePtr lock() const { return p_.lock(); }
  bool expired() const { return p_.expired(); }

 private:
  c10::weak_intrusive_ptr<Node> p_;
};

// A custom node, owned the way this LibTorch owns nodes.
template <class T, class... Args>
c10::intrusive_ptr<T> make_node(Args&&... args) {
  return c10::make_intrusive<T>(std::forward<Args>(args)...);
}

#else

using NodePtr = std::shared_ptr<Node>;
using WeakNodePtr = std::weak_ptr<Node>;

template <class T, class... Args>
std::shared_ptr<T> make_node(Args&&... args) {
  return std::shared_ptr<T>(new T(std::forward<Args>(args)...), torch::autograd::deleteNode);
}

#endif

}  // namespace fsdp::compat
