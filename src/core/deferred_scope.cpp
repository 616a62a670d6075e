// One deferred_init call (include/fsdp/deferred_init.h): saves the generator's state, makes every
// operator on the building thread reach the recorder (core/deferred_record.cpp), checks the build
// and keeps the recording for materialize. [Note: deferred initialisation] in docs/design.md.
#include <ATen/ATen.h>
#include <fsdp/deferred_init.h>
#include <fsdp/error.h>
#include <torch/nn/module.h>

#include <optional>
#include <string>

#include "compat/interception.h"
#include "core/deferred_recording.h"
#include "core/guard.h"

namespace fsdp::detail::deferred {

namespace {
thread_local bool t_recording = false;
}  // namespace

struct RecordingScope::State {
  std::shared_ptr<Recording> rec = std::make_shared<Recording>();
  std::optional<guard::ScopedInterceptor> interceptor;
  std::optional<compat::interception::InterceptAll> include;
  bool kept = false;

  void stop() {
    include.reset();
    interceptor.reset();
    t_recording = false;
  }
};

RecordingScope::RecordingScope() {
  FSDP_CHECK(!t_recording,
             "deferred_init: called inside another deferred_init's build. Fix: build the whole "
             "model in one deferred_init call");
  state_ = std::make_unique<State>();
  state_->rec->generator_state = generator_state();
  state_->interceptor.emplace(make_recorder(*state_->rec));
  state_->include.emplace();  // factories reach the recorder too
  t_recording = true;
}

RecordingScope::~RecordingScope() {
  if (!state_) return;
  if (t_recording && state_->include) state_->stop();
  if (!state_->kept) drop_recording(*state_->rec);
}

void RecordingScope::run(const std::function<void()>& build) {
  try {
    build();
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    if (what.find("data is not allocated yet") == std::string::npos) throw;
    throw Error(
        "deferred_init: the build read the bytes of a tensor built under fsdp::deferred_init "
        "(data_ptr, an accessor, printing), but deferred_init records operators without "
        "running them, so there are no bytes yet. Fix: move the read after fsdp::materialize, "
        "or compute it from tensors built outside deferred_init");
  }
}

void RecordingScope::finish(const torch::nn::Module* model) {
  state_->stop();
  FSDP_CHECK(generator_state().equal(state_->rec->generator_state),
             "deferred_init: the random generator's state changed during the build outside the "
             "recorded operators (torch::manual_seed inside the build, or a random operator on a "
             "tensor built outside it), so materialize could not replay the draws in order. Fix: "
             "seed before deferred_init, and draw only into tensors the build creates");
  auto& rec = *state_->rec;
  if (model) {
    auto keep = [&](const at::Tensor& t) {
      const int64_t v = rec.value_of(t);
      if (v < 0) return;
      rec.known.push_back(Recording::Known{
          c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), rec.ref_of(t, v)});
    };
    for (const auto& p : model->named_parameters(/*recurse=*/true)) keep(p.value());
    for (const auto& b : model->named_buffers(/*recurse=*/true)) keep(b.value());
  }
  add_recording(state_->rec);
  state_->kept = true;
}

}  // namespace fsdp::detail::deferred
