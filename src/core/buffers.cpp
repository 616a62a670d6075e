// Buffers across ranks: one flat broadcast of rank 0's bytes, and a checksum comparison.
#include "core/buffers.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <torch/nn/module.h>

#include "comm/rank_agreement.h"

namespace fsdp::detail {

namespace {

// (nbytes,) uint8: the contiguous bytes of `b`, any dtype (bool included).
at::Tensor bytes_of(const at::Tensor& b) {
  at::Tensor flat = b.detach().contiguous().reshape({-1});
  return flat.scalar_type() == at::kByte ? flat : flat.view(at::kByte);
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> defined_buffers(const torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : m.named_buffers(/*recurse=*/true))
    if (item.value().defined()) out.emplace_back(item.key(), item.value());
  return out;
}

void broadcast_buffers(const std::vector<std::pair<std::string, at::Tensor>>& buffers,
                       Communicator& c) {
  if (c.size() == 1 || buffers.empty()) return;
  const at::Device device = buffers.front().second.device();
  int64_t total = 0;
  for (const auto& [name, b] : buffers) {
    FSDP_CHECK(b.device() == device, "broadcast_buffers: buffer '", name, "' is on ", b.device(),
               ", buffer '", buffers.front().first, "' on ", device,
               "; buffers are broadcast together from one device (move the module to one device)");
    total += static_cast<int64_t>(b.nbytes());
  }
  if (total == 0) return;
  // (total bytes,) uint8: every buffer's contiguous bytes, in the given order.
  std::vector<at::Tensor> parts;
  if (c.rank() == 0)
    for (const auto& [name, b] : buffers) parts.push_back(bytes_of(b));
  at::Tensor flat = c.rank() == 0 ? at::cat(parts)
                                  : at::empty({total}, at::TensorOptions(at::kByte).device(device));
  c.broadcast(flat, 0).wait();
  if (c.rank() == 0) return;
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (const auto& [name, b] : buffers) {
    const int64_t n = static_cast<int64_t>(b.nbytes());
    // A copy at offset 0, so that its bytes may be viewed as any dtype.
    at::Tensor bytes = flat.narrow(0, offset, n).clone();
    b.copy_(b.scalar_type() == at::kByte ? bytes.view(b.sizes())
                                         : bytes.view(b.scalar_type()).view(b.sizes()));
    offset += n;
  }
}

void broadcast_buffers(torch::nn::Module& m, Communicator& c) {
  if (c.size() == 1) return;
  broadcast_buffers(defined_buffers(m), c);
}

std::optional<BufferDifference> first_differing_buffer(const torch::nn::Module& m,
                                                       Communicator& c) {
  if (c.size() == 1) return std::nullopt;
  const auto buffers = defined_buffers(m);
  if (buffers.empty()) return std::nullopt;
  std::vector<at::Tensor> values;
  for (const auto& [name, b] : buffers) values.push_back(b);
  auto diff = first_value_difference(c, values);
  if (!diff) return std::nullopt;
  return BufferDifference{buffers[diff->index].first, diff->rank};
}

}  // namespace fsdp::detail
