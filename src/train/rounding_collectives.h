// fsdp-train's --custom-collectives bf16-round: all-gathers and reduce-scatters that round their
// input to bfloat16 before it goes on the wire (what a compressed collective does to values),
// installed with FSDPModule::set_custom_all_gather / set_custom_reduce_scatter on every group.
// The weights' shards and the optimizer stay in the model's dtype; forward and backward compute
// with the rounded weights, and the reduced gradients are sums of rounded gradients. The same
// rounding as bench/fsdp2_peer.py's `--custom-collectives bf16-round` (FSDP2's AllGather and
// ReduceScatter), so the two give the same losses.
// Thread-safety: as any custom collective (called on the thread that issues the group's
// collectives).
#pragma once

#include <fsdp/custom_collectives.h>

namespace fsdp::train {

class Bf16RoundingAllGather final : public AllGather {
 public:
  Work operator()(const at::Tensor& output, const at::Tensor& input, Communicator& group) override;
};

class Bf16RoundingReduceScatter final : public ReduceScatter {
 public:
  Work operator()(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                  Communicator& group) override;
};

}  // namespace fsdp::train
