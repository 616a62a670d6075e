// The project's one checksum of bytes in memory: XXH3 (64-bit) from libxxhash. Identical bytes give
// identical sums on every rank and thread count, unlike a floating-point reduction. (The
// checkpoint files' XXH64 sums are part of their format: include/fsdp/safetensors.h.)
// Thread-safety: stateless.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>

namespace fsdp::detail {

// XXH3_64bits of `n` bytes at `data`.
uint64_t checksum_bytes(const void* data, size_t n);

// XXH3 (64-bit) of bytes fed in pieces: the same digest as checksum_bytes of their concatenation.
// Thread-safety: one thread at a time.
class StreamingChecksum {
 public:
  StreamingChecksum();
  ~StreamingChecksum();
  StreamingChecksum(const StreamingChecksum&) = delete;
  StreamingChecksum& operator=(const StreamingChecksum&) = delete;
  void update(const void* data, size_t n);
  uint64_t digest() const;

 private:
  void* state_;  // XXH3_state_t (xxhash.h stays out of this header)
};

// The checksum of a tensor's values (its contiguous bytes, copied to host memory when elsewhere),
// as a non-negative int64 (an element of an int64 tensor on the wire).
int64_t value_checksum(const at::Tensor& t);

}  // namespace fsdp::detail
