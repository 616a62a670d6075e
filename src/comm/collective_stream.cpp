// [Note: collective streams] in collective_stream.h.
#include "collective_stream.h"

#ifdef USE_C10D_NCCL
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <map>
#include <optional>
#endif

namespace fsdp::detail {

#ifdef USE_C10D_NCCL
// One side stream per device this communicator has seen (a rank normally uses one device).
struct CollectiveStream::Impl {
  std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  c10::cuda::CUDAStream stream_for(c10::DeviceIndex device) {
    auto it = streams.find(device);
    if (it == streams.end())
      it = streams.emplace(device, c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device))
               .first;
    return it->second;
  }
};

struct CollectiveStream::Scope::State {
  std::optional<c10::cuda::CUDAStreamGuard> guard;
};

CollectiveStream::Scope CollectiveStream::enter(std::initializer_list<at::Tensor> tensors) {
  const at::Tensor* first = nullptr;
  for (const auto& t : tensors)
    if (t.defined()) {
      first = &t;
      break;
    }
  if (first == nullptr || !first->is_cuda()) return {};
  const auto device = first->device().index();
  c10::cuda::CUDAStream side = impl_->stream_for(device);
  at::cuda::CUDAEvent ready;
  ready.record(c10::cuda::getCurrentCUDAStream(device));  // what the caller queued so far
  ready.block(side);
  for (const auto& t : tensors)
    if (t.defined() && t.is_cuda() && t.has_storage())
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), side);
  Scope scope;
  scope.state_ = std::make_unique<Scope::State>();
  scope.state_->guard.emplace(side);
  return scope;
}
#else
struct CollectiveStream::Impl {};
struct CollectiveStream::Scope::State {};

CollectiveStream::Scope CollectiveStream::enter(std::initializer_list<at::Tensor>) { return {}; }
#endif

CollectiveStream::CollectiveStream() : impl_(std::make_unique<Impl>()) {}
CollectiveStream::~CollectiveStream() = default;
CollectiveStream::Scope::Scope(Scope&&) noexcept = default;
CollectiveStream::Scope::~Scope() = default;

}  // namespace fsdp::detail
