// Operator interception (src/compat/interception.h), the mechanism under the resharded-parameter
// guard, the elements gathered on use and deferred_init's recorder. It rests on LibTorch internals
// that change between versions; these tests fail naming the LibTorch version and the mechanism
// when an operator is no longer routed to fsdp-cpp.
#include "compat/interception.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <fsdp/deferred_init.h>
#include <fsdp/error.h>
#include <gtest/gtest.h>
#include <torch/library.h>

#include <string>

#include "compat.h"
#include "core/guard.h"

namespace {

using fsdp::compat::interception::describe;
using fsdp::compat::interception::is_marked;

// `what` on a resharded tensor must end in the guard's fsdp::Error.
template <class F>
void expect_guarded(const char* what, F&& f) {
  try {
    f();
    ADD_FAILURE() << what << " on a resharded parameter was not intercepted: the guard is not "
                  << "working on " << describe();
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("resharded"), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << " on a resharded parameter failed inside LibTorch instead of reaching "
                  << "the guard, on " << describe() << ":\n"
                  << e.what();
  }
}

TEST(Interception, ReshardedParameterReadsThrowTheGuardsError) {
  fsdp::detail::guard::install();
  at::Tensor p = at::ones({4, 3});
  fsdp::detail::guard::set_active(p, true);
  ASSERT_TRUE(is_marked(p)) << describe();
  expect_guarded("sum", [&] { (void)p.sum(); });
  expect_guarded("add_", [&] { p.add_(1); });
  expect_guarded("mm", [&] { (void)at::mm(p, at::ones({3, 2})); });
  expect_guarded("detach then sum", [&] { (void)p.detach().sum(); });
  // .data() and variable_data() copy through the stand-in interpreter: the copy stays marked.
  expect_guarded(".data() then sum", [&] { (void)p.data().sum(); });
  expect_guarded("variable_data() then sum", [&] { (void)p.variable_data().sum(); });
  EXPECT_EQ(p.sizes(), at::IntArrayRef({4, 3})) << "metadata must stay readable";
  fsdp::detail::guard::set_active(p, false);
  EXPECT_EQ(p.sum().item<float>(), 12.0f) << describe();
}

TEST(Interception, AnOperatorDefinedAfterInstallIsIntercepted) {
  fsdp::detail::guard::install();
  // A library loaded after the kernels were first registered: covered at the next mark().
  torch::Library lib(torch::Library::DEF, "fsdp_interception_test", c10::nullopt, __FILE__,
                     __LINE__);
  lib.def("twice(Tensor x) -> Tensor");
  lib.impl("twice", torch::dispatch(c10::DispatchKey::CPU,
                                    [](const at::Tensor& x) -> at::Tensor { return x * 2; }));
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("fsdp_interception_test::twice", "")
                .typed<at::Tensor(const at::Tensor&)>();
  at::Tensor p = at::ones({2});
  fsdp::detail::guard::set_active(p, true);
  expect_guarded("an operator defined after install", [&] { (void)op.call(p); });
  fsdp::detail::guard::set_active(p, false);
  EXPECT_EQ(op.call(p).sum().item<float>(), 4.0f);
}

TEST(Interception, DeferredInitRecordsFactoriesAndOperators) {
  at::Tensor w, v;
  {
    fsdp::detail::deferred::RecordingScope scope;
    scope.run([&] {
      w = at::randn({8, 4});  // a factory: no tensor argument
      v = w.mul(2).add_(1);   // operators on a recorded tensor
    });
    scope.finish(nullptr);
  }
  EXPECT_TRUE(is_marked(w)) << "a factory under deferred_init was not recorded on " << describe();
  EXPECT_TRUE(is_marked(v)) << "an operator under deferred_init was not recorded on " << describe();
  EXPECT_FALSE(fsdp::compat::storage_allocated(w))
      << "a recorded factory ran eagerly on " << describe();
  EXPECT_EQ(v.sizes(), at::IntArrayRef({8, 4}));
}

}  // namespace
