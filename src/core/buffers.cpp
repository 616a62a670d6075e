// Buffers across ranks: one flat broadcast of rank 0's bytes, and a checksum comparison.
#include "core/buffers.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <torch/nn/module.h>

#include <cstring>

#include "core/value_agreement.h"

namespace fsdp::detail {

namespace {

int64_t byte_size(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> defined_buffers(const torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : m.named_buffers(/*recurse=*/true))
    if (item.value().defined()) out.emplace_back(item.key(), item.value());
  return out;
}

void broadcast_buffers(torch::nn::Module& m, Communicator& c) {
  if (c.size() == 1) return;
  const auto buffers = defined_buffers(m);
  int64_t total = 0;
  for (const auto& [name, b] : buffers) {
    FSDP_CHECK(b.device().is_cpu(), "broadcast_buffers: buffer '", name, "' is on ", b.device(),
               "; buffers are broadcast from CPU memory (move the module to the CPU)");
    total += byte_size(b);
  }
  if (total == 0) return;
  // (total bytes,) uint8: every buffer's contiguous bytes, in named_buffers order.
  at::Tensor flat = at::empty({total}, at::kByte);
  auto* dst = static_cast<unsigned char*>(flat.data_ptr());
  int64_t offset = 0;
  if (c.rank() == 0) {
    for (const auto& [name, b] : buffers) {
      at::Tensor src = b.detach().contiguous();
      std::memcpy(dst + offset, src.data_ptr(), byte_size(src));
      offset += byte_size(src);
    }
  }
  c.broadcast(flat, 0).wait();
  if (c.rank() == 0) return;
  at::NoGradGuard no_grad;
  offset = 0;
  for (const auto& [name, b] : buffers) {
    const int64_t n = byte_size(b);
    at::Tensor src = at::empty(b.sizes(), b.options().device(at::kCPU));
    std::memcpy(src.data_ptr(), dst + offset, n);
    b.copy_(src);
    offset += n;
  }
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
