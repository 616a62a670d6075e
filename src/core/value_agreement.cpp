#include "core/value_agreement.h"

#include <ATen/ATen.h>

#include <cstring>

namespace fsdp::detail {

int64_t value_checksum(const at::Tensor& t) {
  at::Tensor c = t.detach().contiguous();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  const size_t n = c.numel() * c.element_size();
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

std::optional<ValueDifference> first_value_difference(Communicator& c,
                                                      const std::vector<at::Tensor>& tensors) {
  if (c.size() == 1 || tensors.empty()) return std::nullopt;
  std::vector<int64_t> sums;
  for (const auto& t : tensors) sums.push_back(value_checksum(t));
  at::Tensor mine = at::tensor(sums, at::kLong);
  at::Tensor all = at::empty({c.size() * mine.numel()}, at::kLong);
  c.all_gather(all, mine).wait();
  auto rows = all.view({c.size(), mine.numel()});  // (world, tensors)
  auto acc = rows.accessor<int64_t, 2>();
  for (int64_t i = 0; i < mine.numel(); ++i)
    for (int r = 1; r < c.size(); ++r)
      if (acc[r][i] != acc[0][i]) return ValueDifference{static_cast<size_t>(i), r};
  return std::nullopt;
}

}  // namespace fsdp::detail
