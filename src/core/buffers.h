// Module buffers across ranks (BatchNorm running statistics and the like): buffers are replicated,
// not sharded; these keep them equal (rank 0's values win) or find where they differ.
// Thread-safety: collectives; call from the thread that trains, in the same order on every rank.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/communicator.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}

namespace fsdp::detail {

// The defined buffers of `m` and its descendants, by name relative to `m` (named_buffers order).
std::vector<std::pair<std::string, at::Tensor>> defined_buffers(const torch::nn::Module& m);

// Copies rank 0's values of `buffers` into every rank's in place, in one flat broadcast of their
// bytes (any dtype mix, bool included, contiguous or not). No-op at world size 1 or without
// buffers. REQUIRES: every rank passes the same shapes and dtypes in the same order (the same
// model), all on one device.
void broadcast_buffers(const std::vector<std::pair<std::string, at::Tensor>>& buffers,
                       Communicator& c);
// The same for every defined buffer of `m` and its descendants (defined_buffers).
void broadcast_buffers(torch::nn::Module& m, Communicator& c);

// A buffer whose values differ from rank 0's on some rank.
struct BufferDifference {
  std::string name;
  int rank = 0;  // the first rank whose copy differs from rank 0's
};
// Compares a checksum of every buffer's bytes with rank 0's (one small all-gather); the first
// differing buffer in named_buffers order, or nullopt when every rank agrees. Same answer on
// every rank.
std::optional<BufferDifference> first_differing_buffer(const torch::nn::Module& m, Communicator& c);

}  // namespace fsdp::detail
