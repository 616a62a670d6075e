// Building a c10d process group from a backend, on LibTorch 1.13 and 2.x.
// 1.13: ProcessGroupGloo/NCCL are ProcessGroups themselves. 2.x: they derive from c10d::Backend,
// and a c10d::ProcessGroup routes each collective to the backend registered for the tensors'
// device type.
//
// make_gloo is defined in compat/gloo.cpp, the only translation unit that includes
// ProcessGroupGloo.hpp: LibTorch 2.x's pip wheel ships no gloo headers, so that file compiles
// against Debian's libgloo-dev headers ([Note: Gloo headers] in docs/design.md says why that is
// safe for what the file does, and what it must not do).
#pragma once

#include <torch/version.h>

#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

namespace fsdp::compat {

#if TORCH_VERSION_MAJOR >= 2
using BackendPtr = c10::intrusive_ptr<c10d::Backend>;
#else
using BackendPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
#endif

// A Gloo backend with two worker threads, bound to `bind_host` (empty: the default device).
BackendPtr make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     std::chrono::milliseconds timeout, const std::string& bind_host);

// The process group that callers hold: on 1.13 the backend itself; on 2.x a ProcessGroup with
// `backend` ("gloo": CPU tensors, "nccl": CUDA tensors) registered and made the default.
inline c10::intrusive_ptr<c10d::ProcessGroup> wrap_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, BackendPtr backend,
    const std::string& name) {
#if TORCH_VERSION_MAJOR >= 2
  using Type = c10d::ProcessGroup::BackendType;
  const bool nccl = name == "nccl";
  const Type type = nccl ? Type::NCCL : Type::GLOO;
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  pg->setBackend(nccl ? c10::DeviceType::CUDA : c10::DeviceType::CPU, type, std::move(backend));
  pg->setDefaultBackend(type);
  return pg;
#else
  (void)store, (void)rank, (void)size, (void)name;
  return backend;
#endif
}

}  // namespace fsdp::compat
