// Activation checkpointing for C++ (LibTorch has no torch::utils::checkpoint): a block's forward
// runs without recording its activations; backward runs it again, with the same random numbers,
// and differentiates the recomputation. See docs/design.md, [Note: activation checkpointing].
//
// Two entry points:
//  - ShardOptions::activation_checkpointing on a fully_shard call: every forward of that module
//    goes through checkpointed_call below (Sharded::operator() and Sharded::call route it). The
//    recomputation runs after the group's pre-backward hook has gathered the parameters again, and
//    the gradients of the parameters flow into their accumulators through the outer backward, so
//    the post-backward guarantee and the audit see an ordinary backward.
//  - checkpoint_activations(fn, inputs, params) for code that is not sharded.
//
// Thread-safety: as the module; the recomputation runs on the thread that runs backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/fully_shard.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp {

// A function of tensors to tensors that checkpointing may run twice.
using TensorFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Runs fn(inputs) without keeping its activations and returns its outputs; backward recomputes
// fn on detached copies of `inputs` (the CPU random state restored to what it was at the first
// run) and passes gradients to `inputs` and to `params`, the tensors fn reads that need gradients
// (e.g. a module's parameters(): fn must use these same tensors). fn must be deterministic given
// the random state and its inputs; inputs changed in place before backward are an error.
// Without grad mode, or when nothing needs a gradient, fn simply runs once.
std::vector<at::Tensor> checkpoint_activations(const TensorFunction& fn,
                                               const std::vector<at::Tensor>& inputs,
                                               const std::vector<at::Tensor>& params);

namespace detail {

// The option, read from the group; throws when the group's module contains sharded modules
// (their hooks would run during backward's recomputation), naming the group and the first one.
bool activation_checkpointing(Group& group);
// The full parameters of `group` that need gradients (the recomputation's extra inputs).
std::vector<at::Tensor> checkpoint_parameters(Group& group);

// Whether a forward argument is a type whose tensors can be found and replaced: the result types
// of [collect_output_tensors] (at::Tensor, vectors, tuples, pairs, optionals of them, values
// holding no tensor).
template <class T, class = void>
struct Traversable : std::bool_constant<std::is_same_v<T, at::Tensor> || std::is_arithmetic_v<T> ||
                                        std::is_enum_v<T> || std::is_same_v<T, std::string>> {};
template <class T, class A>
struct Traversable<std::vector<T, A>> : Traversable<T> {};
template <class... T>
struct Traversable<std::tuple<T...>> : std::bool_constant<(Traversable<T>::value && ...)> {};
template <class A, class B>
struct Traversable<std::pair<A, B>>
    : std::bool_constant<Traversable<A>::value && Traversable<B>::value> {};
template <class T>
struct Traversable<T, std::enable_if_t<IsOptional<T>::value && !std::is_same_v<T, std::string>>>
    : Traversable<std::decay_t<typename T::value_type>> {};

// Replaces the tensors of `v`, in collect_output_tensors order, by src[i], src[i + 1], ...
template <class T>
void replace_tensors(T& v, const std::vector<at::Tensor>& src, size_t& i) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, at::Tensor>) {
    v = src.at(i++);
  } else if constexpr (IsVector<D>::value) {
    for (auto& e : v) replace_tensors(e, src, i);
  } else if constexpr (IsTupleLike<D>::value) {
    std::apply([&](auto&... e) { (replace_tensors(e, src, i), ...); }, v);
  } else if constexpr (IsOptional<D>::value && !std::is_same_v<D, std::string>) {
    if (v) replace_tensors(*v, src, i);
  }
}

void check_checkpointable_arguments(Group& group, bool traversable, bool copyable);

// Runs method(*impl, args...) (the module's forward, or the method Sharded::call names) as one
// checkpointed call: the tensors found in the arguments are the recomputation's inputs and the
// tensors of the result its outputs. The ForwardScope has already wrapped the tensor arguments.
// (Declared in fully_shard.h with this exact signature.)
template <class Impl, class Method, class... Args>
std::decay_t<std::invoke_result_t<const Method&, Impl&, std::decay_t<Args>&...>> checkpointed_call(
    Group& group, const std::shared_ptr<Impl>& impl, const Method& method, Args&&... args) {
  using R = std::decay_t<std::invoke_result_t<const Method&, Impl&, std::decay_t<Args>&...>>;
  using Held = std::tuple<std::decay_t<Args>...>;
  constexpr bool kCopyable = (std::is_copy_constructible_v<std::decay_t<Args>> && ...);
  constexpr bool kTraversable = Traversable<Held>::value && Traversable<R>::value;
  check_checkpointable_arguments(group, kTraversable, kCopyable);
  if constexpr (kCopyable && kTraversable) {
    auto held = std::make_shared<Held>(std::forward<Args>(args)...);
    std::vector<at::Tensor> inputs;
    collect_output_tensors(*held, inputs);
    struct First {
      std::optional<R> result;
      bool done = false;
    };
    auto first = std::make_shared<First>();
    TensorFunction fn = [impl, method, held, first](const std::vector<at::Tensor>& ts) {
      Held a = *held;
      size_t i = 0;
      replace_tensors(a, ts, i);
      R r = std::apply([&](auto&... x) { return std::invoke(method, *impl, x...); }, a);
      std::vector<at::Tensor> outs;
      collect_output_tensors(r, outs);
      if (!first->done) first->result.emplace(std::move(r));
      first->done = true;
      return outs;
    };
    auto outs = checkpoint_activations(fn, inputs, checkpoint_parameters(group));
    // Only the tensors' storage is kept by the recomputation, not the wrapped originals.
    std::vector<at::Tensor> none(inputs.size());
    size_t k = 0;
    replace_tensors(*held, none, k);
    R r = std::move(*first->result);
    first->result.reset();
    size_t i = 0;
    replace_tensors(r, outs, i);
    return r;
  } else {
    return std::invoke(method, *impl, std::forward<Args>(args)...);  // unreachable: it threw
  }
}

}  // namespace detail
}  // namespace fsdp
