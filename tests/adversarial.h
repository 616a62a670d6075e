// Adversarial graphs for the post-backward guarantee (tests/guarantee_test.cpp). Each root holds
// sharded children; sizes are odd so that world sizes 2 and 3 pad and leave empty shards.
#pragma once

#include <fsdp/fsdp.h>
#include <torch/torch.h>

namespace fsdp::testing::adv {

using SLinear = fsdp::Sharded<torch::nn::Linear>;

// (a), (d), (i), (j): a plain stack, plus a root parameter with fewer rows than ranks.
struct PlainImpl : torch::nn::Module {
  PlainImpl() {
    a = register_module("a", torch::nn::Linear(5, 7));
    b = register_module("b", torch::nn::Linear(7, 3));
    scale = register_parameter("scale", torch::ones({3}) * 0.5);
    tiny = register_parameter("tiny", torch::full({2, 3}, 0.1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return b(torch::relu(a(x))) * scale + tiny.sum(0);  // (B, 3)
  }
  SLinear a{nullptr}, b{nullptr};
  torch::Tensor scale, tiny;
};
TORCH_MODULE(Plain);

// (b): a weight used in a branch that does not reach the module's input.
struct BranchImpl : torch::nn::Module {
  BranchImpl() { w = register_parameter("w", torch::randn({7, 5}) * 0.3); }
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(w) + w.pow(2).sum(0); }
  torch::Tensor w;
};
TORCH_MODULE(Branch);
struct BranchNetImpl : torch::nn::Module {
  BranchNetImpl() {
    a = register_module("a", torch::nn::Linear(4, 7));
    br = register_module("br", Branch());
  }
  torch::Tensor forward(const torch::Tensor& x) { return br(torch::tanh(a(x))); }
  SLinear a{nullptr};
  fsdp::Sharded<Branch> br{nullptr};
};
TORCH_MODULE(BranchNet);

// (c): an embedding tied to the output head, both in the root group; ids need no grad.
struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    emb = register_module("emb", torch::nn::Embedding(11, 6));
    block = register_module("block", torch::nn::Linear(6, 6));
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    return block(emb(ids)).matmul(emb->weight.t());  // (B, T, 11)
  }
  torch::nn::Embedding emb{nullptr};
  SLinear block{nullptr};
};
TORCH_MODULE(Tied);

// (e): a module whose output ignores its input.
struct IgnoreImpl : torch::nn::Module {
  IgnoreImpl() { w = register_parameter("w", torch::randn({3, 4}) * 0.2); }
  torch::Tensor forward(const torch::Tensor& x) { return w.sum(0).expand({x.size(0), 4}); }
  torch::Tensor w;
};
TORCH_MODULE(Ignore);
struct IgnoreNetImpl : torch::nn::Module {
  IgnoreNetImpl() {
    a = register_module("a", torch::nn::Linear(5, 3));
    ign = register_module("ign", Ignore());
    c = register_module("c", torch::nn::Linear(4, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = a(x);
    return c(ign(h)).sum(1) + h.sum(1);
  }
  SLinear a{nullptr}, c{nullptr};
  fsdp::Sharded<Ignore> ign{nullptr};
};
TORCH_MODULE(IgnoreNet);

// (f): a module called twice in one forward.
struct TwiceImpl : torch::nn::Module {
  TwiceImpl() {
    lin = register_module("lin", torch::nn::Linear(5, 5));
    head = register_parameter("head", torch::randn({5}) * 0.3);
  }
  torch::Tensor forward(const torch::Tensor& x) { return lin(torch::tanh(lin(x))) * head; }
  SLinear lin{nullptr};
  torch::Tensor head;
};
TORCH_MODULE(Twice);

// (g): a root weight transformed (W_eff = tanh(W)) before a child runs, used after it.
struct TransformImpl : torch::nn::Module {
  TransformImpl() {
    w = register_parameter("w", torch::randn({5, 3}) * 0.4);
    lin = register_module("lin", torch::nn::Linear(5, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto w_eff = torch::tanh(w);
    return lin(x).matmul(w_eff);
  }
  torch::Tensor w;
  SLinear lin{nullptr};
};
TORCH_MODULE(Transform);

// (h): parameters used on some ranks only (a data-dependent branch inside one group).
struct ForkImpl : torch::nn::Module {
  ForkImpl() {
    left = register_module("left", torch::nn::Linear(5, 3));
    right = register_module("right", torch::nn::Linear(5, 3));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_left) {
    return use_left ? left(x) : right(x);
  }
  torch::nn::Linear left{nullptr}, right{nullptr};
};
TORCH_MODULE(Fork);
struct ForkNetImpl : torch::nn::Module {
  ForkNetImpl() {
    pre = register_module("pre", torch::nn::Linear(5, 5));
    fork = register_module("fork", Fork());
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_left) {
    return fork(torch::tanh(pre(x)), use_left);
  }
  SLinear pre{nullptr};
  fsdp::Sharded<Fork> fork{nullptr};
};
TORCH_MODULE(ForkNet);

// (k): frozen and trainable parameters in one group.
struct MixImpl : torch::nn::Module {
  MixImpl() {
    w = register_parameter("w", torch::randn({5, 5}) * 0.3);
    frozen = register_parameter("frozen", torch::randn({5, 5}) * 0.3, /*requires_grad=*/false);
  }
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(w) + x.matmul(frozen); }
  torch::Tensor w, frozen;
};
TORCH_MODULE(Mix);
struct MixNetImpl : torch::nn::Module {
  MixNetImpl() {
    mix = register_module("mix", Mix());
    out = register_module("out", torch::nn::Linear(5, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out(torch::tanh(mix(x))); }
  fsdp::Sharded<Mix> mix{nullptr};
  SLinear out{nullptr};
};
TORCH_MODULE(MixNet);

// (l): a group whose parameters get no gradient: called with its output discarded, or not called.
struct IdleImpl : torch::nn::Module {
  IdleImpl() {
    used = register_module("used", torch::nn::Linear(5, 3));
    discarded = register_module("discarded", torch::nn::Linear(5, 3));
    never = register_module("never", torch::nn::Linear(5, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto ignored = discarded(x);
    (void)ignored;
    return used(x);
  }
  SLinear used{nullptr}, discarded{nullptr}, never{nullptr};
};
TORCH_MODULE(Idle);

}  // namespace fsdp::testing::adv
