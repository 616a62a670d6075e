// The only translation unit that includes ProcessGroupGloo.hpp (see compat/gloo.h). It constructs
// the backend and its options through LibTorch's exported functions and hands it back as a
// Backend (2.x) or ProcessGroup (1.13): no gloo type, inline gloo code or GlooStore is used here,
// so the gloo headers' version (Debian's, on 2.x) does not reach the object code.
#include "compat/gloo.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace fsdp::compat {

BackendPtr make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     std::chrono::milliseconds timeout, const std::string& bind_host) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  if (bind_host.empty()) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  } else {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind_host));
  }
  // Two worker threads: an all-gather and a reduce-scatter can be in flight together.
  opts->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
}

}  // namespace fsdp::compat
