// The one summation every reduce-scatter path that promises rank order uses (the alltoall
// exchange's finish, the rank-order point-to-point exchange and the shared-memory exchange), so
// that they agree bit for bit.
//
// output[i] = ((rows[0][i] + rows[1][i]) + rows[2][i]) + ... in that order, divided by the number
// of rows when averaging; fp16 and bf16 accumulate (and divide) in fp32 and are rounded once at
// the end; 8/32/64-bit ints accumulate in int64 and wrap once (no average: it is refused). One
// pass: each row is read once and the output written once (beyond 8 rows, the rows between the
// second and the last add into a small accumulator that stays in cache), on the calling thread
// (no intra-op team: the ranks' compute and the backend's threads need the cores). The output may
// be one of the rows exactly (an in-place reduce-scatter's own block); any other overlap is the
// caller's error.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace fsdp::detail {

// rows: contiguous 1-D tensors of output's dtype and length (output contiguous too).
void sum_in_rank_order(const at::Tensor& output, const std::vector<at::Tensor>& rows, bool average);

}  // namespace fsdp::detail
