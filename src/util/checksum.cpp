#include "util/checksum.h"

#include <ATen/ATen.h>
#include <xxhash.h>

#include <new>

namespace fsdp::detail {

uint64_t checksum_bytes(const void* data, size_t n) { return XXH3_64bits(data, n); }

StreamingChecksum::StreamingChecksum() : state_(XXH3_createState()) {
  if (!state_) throw std::bad_alloc();
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}

StreamingChecksum::~StreamingChecksum() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

void StreamingChecksum::update(const void* data, size_t n) {
  if (n > 0) XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, n);
}

uint64_t StreamingChecksum::digest() const {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_));
}

int64_t value_checksum(const at::Tensor& t) {
  at::Tensor c = t.detach().cpu().contiguous();
  const uint64_t h = checksum_bytes(c.data_ptr(), c.nbytes());
  return static_cast<int64_t>(h & 0x7fffffffffffffffULL);
}

}  // namespace fsdp::detail
