// fsdp-cpp's internals behind fsdp::Sharded<T> (fsdp/fully_shard.h): how a call of a sharded
// module reaches its root (ForwardScope), how the tensors of a forward's arguments and result are
// found, and activation checkpointing's replay of a call. Not for users: nothing here is stable.
// Thread-safety: as the module (one thread calls a model at a time).
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/activation_checkpoint.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}

namespace fsdp {
class FSDPModule;

namespace detail {
struct Binding;

template <class T>
struct IsVector : std::false_type {};
template <class T, class A>
struct IsVector<std::vector<T, A>> : std::true_type {};
template <class T>
struct IsTupleLike : std::false_type {};
template <class... T>
struct IsTupleLike<std::tuple<T...>> : std::true_type {};
template <class A, class B>
struct IsTupleLike<std::pair<A, B>> : std::true_type {};
// std::optional and c10::optional (distinct in LibTorch 1.13, one type in 2.x).
template <class T, class = void>
struct IsOptional : std::false_type {};
template <class T>
struct IsOptional<T, std::void_t<typename T::value_type, decltype(std::declval<T>().has_value()),
                                 decltype(*std::declval<T>())>> : std::true_type {};
template <class>
inline constexpr bool kUnsupportedOutput = false;

// Visits the tensors in a forward's result (mixed precision casts them, then they get the
// pre-backward hooks). Supported: at::Tensor, std::vector, std::tuple, std::pair and std::optional
// of supported types (nested), and values holding no tensor (arithmetic, enums, std::string),
// which pass through untouched.
template <class T, class F>
void visit_output_tensors(T& v, F& f) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, at::Tensor>) {
    f(v);
  } else if constexpr (IsVector<D>::value) {
    for (auto& e : v) visit_output_tensors(e, f);
  } else if constexpr (IsTupleLike<D>::value) {
    std::apply([&](auto&... e) { (visit_output_tensors(e, f), ...); }, v);
  } else if constexpr (IsOptional<D>::value) {
    if (v) visit_output_tensors(*v, f);
  } else if constexpr (std::is_arithmetic_v<D> || std::is_enum_v<D> ||
                       std::is_same_v<D, std::string>) {
  } else {
    static_assert(kUnsupportedOutput<D>,
                  "fsdp::Sharded: this forward returns a type fsdp-cpp cannot look into for "
                  "tensors. Supported results: at::Tensor, std::vector, std::tuple, std::pair and "
                  "std::optional of supported types (nested), and values holding no tensor "
                  "(arithmetic, enums, std::string). Return one of these (e.g. a std::tuple of the "
                  "struct's tensors) from the sharded module's forward");
  }
}

// The tensors in `v` (visit_output_tensors' rules), in order.
template <class T>
void collect_output_tensors(const T& v, std::vector<at::Tensor>& out) {
  auto push = [&](const at::Tensor& t) { out.push_back(t); };
  visit_output_tensors(v, push);
}

// One call of a sharded module, from its root's pre-forward (gathers) to its post-forward (output
// hooks, reshard); a call that throws is unwound by the destructor (reshards, drops prefetches).
class ForwardScope {
 public:
  explicit ForwardScope(std::shared_ptr<Binding> binding);
  ~ForwardScope();
  ForwardScope(const ForwardScope&) = delete;
  ForwardScope& operator=(const ForwardScope&) = delete;
  // Casts the result's tensors (mixed precision's output_dtype) and finishes the call.
  template <class T>
  std::decay_t<T> finish(T&& out) {
    std::decay_t<T> result(std::forward<T>(out));
    std::vector<at::Tensor> tensors;
    auto visit = [&](at::Tensor& t) {
      t = output(t);
      tensors.push_back(t);
    };
    visit_output_tensors(result, visit);
    finish_tensors(tensors);
    return result;
  }
  void finish_tensors(const std::vector<at::Tensor>& outs);
  at::Tensor output(const at::Tensor& y);  // the output_dtype cast (identity when unset)
  at::Tensor input(const at::Tensor& x);   // through the call's input-side node
  bool checkpointed() const;               // RuntimeOptions::activation_checkpointing
  // The full parameters the recomputation differentiates (activation checkpointing).
  std::vector<at::Tensor> checkpoint_parameters() const;
  void check_checkpointable(bool traversable, bool copyable) const;  // throws, naming the module

 private:
  std::shared_ptr<Binding> binding_;
  bool finished_ = false;
};

template <class T>
decltype(auto) wrap_input(ForwardScope& s, T&& x) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    return s.input(x);
  } else {
    return std::forward<T>(x);
  }
}

// Calls a module's forward; the member-function pointer of Sharded::call stands for any other.
struct CallForward {
  template <class Impl, class... Args>
  decltype(auto) operator()(Impl& impl, Args&&... args) const {
    return impl.forward(std::forward<Args>(args)...);
  }
};

// Whether a forward argument is a type whose tensors can be found and replaced: the result types
// of collect_output_tensors (at::Tensor, vectors, tuples, pairs, optionals of them, values holding
// no tensor).
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

// [Note: activation checkpointing] Runs method(*impl, args...) as one checkpointed call: the
// tensors found in the arguments are the recomputation's inputs and the tensors of the result its
// outputs. The ForwardScope has already wrapped the tensor arguments.
template <class Impl, class Method, class... Args>
std::decay_t<std::invoke_result_t<const Method&, Impl&, std::decay_t<Args>&...>> checkpointed_call(
    ForwardScope& scope, const std::shared_ptr<Impl>& impl, const Method& method, Args&&... args) {
  using R = std::decay_t<std::invoke_result_t<const Method&, Impl&, std::decay_t<Args>&...>>;
  using Held = std::tuple<std::decay_t<Args>...>;
  constexpr bool kCopyable = (std::is_copy_constructible_v<std::decay_t<Args>> && ...);
  constexpr bool kTraversable = Traversable<Held>::value && Traversable<R>::value;
  scope.check_checkpointable(kTraversable, kCopyable);
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
    auto outs = checkpoint_activations(fn, inputs, scope.checkpoint_parameters());
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

// A call of a sharded module (Sharded::operator() and Sharded::call): gathered first, the tensor
// inputs handed over, checkpointed if configured, finished (output hooks, reshard).
template <class Impl, class Method, class... Args>
decltype(auto) call_sharded(const std::shared_ptr<Binding>& binding,
                            const std::shared_ptr<Impl>& impl, const Method& method,
                            Args&&... args) {
  ForwardScope scope(binding);
  using Result = std::invoke_result_t<const Method&, Impl&, Args&&...>;
  if constexpr (std::is_void_v<Result>) {
    std::invoke(method, *impl, wrap_input(scope, std::forward<Args>(args))...);
    scope.finish_tensors({});
  } else {
    if (scope.checkpointed())
      return scope.finish(
          checkpointed_call(scope, impl, method, wrap_input(scope, std::forward<Args>(args))...));
    return scope.finish(std::invoke(method, *impl, wrap_input(scope, std::forward<Args>(args))...));
  }
}

// fsdp-cpp's own access to the binding behind a handle or a holder.
struct HandleAccess {
  static FSDPModule make(std::shared_ptr<Binding> b);
  template <class H>
  static const std::shared_ptr<Binding>& binding(const H& h) {
    return h.binding_;
  }
  template <class H, class M>  // M: FSDPModule (incomplete here)
  static void attach(H& holder, const M& handle) {
    holder.binding_ = handle.binding_;
  }
  // A ShardedRef's module, whether its holder is sharded already, and its attachment.
  template <class R>
  static const std::shared_ptr<torch::nn::Module>& module(const R& ref) {
    return ref.module_;
  }
  template <class R>
  static bool sharded(const R& ref) {
    return ref.sharded_;
  }
  template <class R>
  static void attach_ref(const R& ref, const FSDPModule& handle) {
    ref.attach_(handle);
  }
};

}  // namespace detail
}  // namespace fsdp
