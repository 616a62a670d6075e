// The bf16-rounding collectives of --custom-collectives (rounding_collectives.h).
#include "train/rounding_collectives.h"

#include <ATen/ATen.h>

namespace fsdp::train {
namespace {
// A rounded copy; the communicator holds the tensors of a collective until its Work completes.
at::Tensor rounded(const at::Tensor& t) { return t.to(at::kBFloat16).to(t.scalar_type()); }
}  // namespace

Work Bf16RoundingAllGather::operator()(const at::Tensor& output, const at::Tensor& input,
                                       Communicator& group) {
  return group.all_gather(output, rounded(input));
}

Work Bf16RoundingReduceScatter::operator()(const at::Tensor& output, const at::Tensor& input,
                                           ReduceOp op, Communicator& group) {
  return group.reduce_scatter(output, rounded(input), op);
}

}  // namespace fsdp::train
