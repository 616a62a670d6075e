// Deferred initialisation: build a model without allocating or initialising its tensors, shard it,
// then materialise only this rank's shards, with the values an eager build would have given.
//
//   torch::manual_seed(0);                                    // the same seed on every rank
//   auto gpt = fsdp::deferred_init([&] { return fsdp::Sharded<GPT>(cfg); });
//   for (auto& b : gpt->blocks) fsdp::fully_shard(b, world);
//   auto root = fsdp::fully_shard(gpt, world);
//   fsdp::materialize(gpt);                                   // replay: shards get their rows
//   torch::optim::AdamW opt(root.parameters(), ...);
//
// Inside `build`, every factory (torch::empty, torch::zeros, torch::randn, ...) returns a CPU
// tensor of the right shape and dtype with no bytes, and every operator applied to such tensors
// (the torch::nn constructors' init, a model's own init_weights) is recorded, not run. materialize
// replays the recording in order from the random generator's state at deferred_init, so values
// equal an eager build's bit for bit, and leaves the generator where the eager build would have
// left it. A result that is overwritten before it is read (kaiming_uniform_ followed by
// init_weights' normal_) is computed into scratch memory that is freed at once (the generator
// still advances), and each parameter is handed over as soon as its last operator ran: the peak is
// the shards plus about one parameter. [Note: deferred initialisation] in docs/design.md.
//
// Limits: CPU tensors only; reading values on the host inside `build` (item(), printing,
// data_ptr, accessor, indexing with a 0-d tensor built there as torch::nn::init::sparse_ does)
// throws naming the operator; a tensor built outside `build` may be read by it but not written
// with recorded values; the whole model must come from one deferred_init call and be
// materialised as a whole.
// Thread-safety: deferred_init records the calling thread's operators; materialize is a
// collective (a checksum per tensor compared with rank 0's) when the model is sharded.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

namespace torch::nn {
class Module;
template <class Contained>
class ModuleHolder;
}  // namespace torch::nn

namespace fsdp {

// What materialize did (the peak memory test reads it).
struct MaterializeReport {
  int64_t operators = 0;             // recorded operators replayed
  int64_t operators_on_scratch = 0;  // of those, whose results were dead (run for the generator)
  int64_t tensors = 0;               // parameters and buffers filled
  int64_t sharded = 0;               // of those, parameters whose rows went to fully_shard's shards
  // Most bytes the replay held at once besides the shards and the model's own storage (for an
  // unsharded model, the parameters filled in place): about one parameter.
  int64_t peak_live_bytes = 0;
  int64_t largest_tensor_bytes = 0;  // the largest parameter or buffer filled
};

namespace detail::deferred {
struct Recording;

// One deferred_init call: intercepts this thread's operators from construction until finish (or
// destruction, which drops the recording).
class RecordingScope {
 public:
  RecordingScope();
  ~RecordingScope();
  RecordingScope(const RecordingScope&) = delete;
  RecordingScope& operator=(const RecordingScope&) = delete;

  // Runs the build; turns a host read of a tensor without bytes (printing, data_ptr) into a
  // clear error.
  void run(const std::function<void()>& build);
  // Stops intercepting, checks that the build did not touch the random generator directly, and
  // keeps the recording for materialize. `model`: the build's result when it is a module.
  void finish(const torch::nn::Module* model);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

template <class T, class = void>
struct HasModulePtr : std::false_type {};
template <class T>
struct HasModulePtr<T, std::void_t<decltype(std::declval<const T&>().ptr().get())>>
    : std::is_convertible<decltype(std::declval<const T&>().ptr().get()),
                          const torch::nn::Module*> {};

// The module a build returned (a holder, a shared_ptr or a module), or null.
template <class T>
const torch::nn::Module* module_of(const T& r) {
  if constexpr (HasModulePtr<T>::value) {
    return r.ptr().get();
  } else if constexpr (std::is_convertible_v<T, std::shared_ptr<const torch::nn::Module>>) {
    return r.get();
  } else if constexpr (std::is_convertible_v<const T*, const torch::nn::Module*>) {
    return &r;
  } else {
    return nullptr;
  }
}
}  // namespace detail::deferred

// Runs `build` with every tensor it creates left without bytes and every operator on them
// recorded; returns what build returned.
template <class F>
auto deferred_init(F&& build) -> decltype(build()) {
  using R = decltype(build());
  detail::deferred::RecordingScope scope;
  if constexpr (std::is_void_v<R>) {
    scope.run([&] { build(); });
    scope.finish(nullptr);
  } else {
    std::optional<R> result;
    scope.run([&] { result.emplace(build()); });
    scope.finish(detail::deferred::module_of(*result));
    return std::move(*result);
  }
}

// Replays the recording that built `model`: parameters that fully_shard manages receive only this
// rank's rows; other parameters and buffers are filled in place. Then compares a checksum of every
// sharded tensor with rank 0's and throws naming the first that differs. Call after fully_shard
// and before the first forward, once.
MaterializeReport materialize(torch::nn::Module& model);
template <class Contained>
MaterializeReport materialize(const torch::nn::ModuleHolder<Contained>& model) {
  return materialize(static_cast<torch::nn::Module&>(*model.ptr()));
}
template <class M>
MaterializeReport materialize(const std::shared_ptr<M>& model) {
  return materialize(static_cast<torch::nn::Module&>(*model));
}

}  // namespace fsdp
