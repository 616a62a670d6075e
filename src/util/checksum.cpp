#include "util/checksum.h"

#include <ATen/ATen.h>
#include <xxhash.h>

namespace fsdp::detail {

uint64_t checksum_bytes(const void* data, size_t n) { return XXH3_64bits(data, n); }

int64_t value_checksum(const at::Tensor& t) {
  at::Tensor c = t.detach().cpu().contiguous();
  const uint64_t h = checksum_bytes(c.data_ptr(), c.nbytes());
  return static_cast<int64_t>(h & 0x7fffffffffffffffULL);
}

}  // namespace fsdp::detail
