// Buffers across ranks: one flat broadcast of rank 0's bytes, and a checksum comparison.
#include "core/buffers.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <torch/nn/module.h>

#include <cstring>

namespace fsdp::detail {

namespace {

int64_t byte_size(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// FNV-1a over 64-bit words of the tensor's bytes: equal values give equal sums on every rank.
int64_t bytes_checksum(const at::Tensor& t) {
  at::Tensor c = t.detach().contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  const size_t n = static_cast<size_t>(byte_size(c));
  uint64_t h = 1469598103934665603ULL;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 1099511628211ULL;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return static_cast<int64_t>(h & 0x7fffffffffffffffULL);
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
  std::vector<int64_t> sums;
  for (const auto& [name, b] : buffers) sums.push_back(bytes_checksum(b));
  at::Tensor mine = at::tensor(sums, at::kLong);
  at::Tensor all = at::empty({c.size() * mine.numel()}, at::kLong);
  c.all_gather(all, mine).wait();
  // (world, buffers)
  auto rows = all.view({c.size(), mine.numel()});
  auto acc = rows.accessor<int64_t, 2>();
  for (int64_t i = 0; i < mine.numel(); ++i)
    for (int r = 1; r < c.size(); ++r)
      if (acc[r][i] != acc[0][i]) return BufferDifference{buffers[i].first, r};
  return std::nullopt;
}

}  // namespace fsdp::detail
