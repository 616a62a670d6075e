// Whether every rank holds the same values (initial parameters at fully_shard, buffers at
// checkpoint time): a byte checksum per tensor, compared with rank 0's in one small all-gather.
// Thread-safety: a collective; call from the thread that trains, in the same order on every rank.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/communicator.h>

#include <optional>
#include <vector>

namespace fsdp::detail {

// FNV-1a over 64-bit words of the tensor's bytes: identical values give identical sums whatever
// the thread count, unlike a floating-point reduction.
int64_t value_checksum(const at::Tensor& t);

// The first tensor (in the given order) whose values differ from rank 0's on some rank, and the
// first such rank; nullopt when every rank agrees. Same answer on every rank.
struct ValueDifference {
  size_t index = 0;
  int rank = 0;
};
std::optional<ValueDifference> first_value_difference(Communicator& c,
                                                      const std::vector<at::Tensor>& tensors);

}  // namespace fsdp::detail
