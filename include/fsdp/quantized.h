// Quantized collectives: fewer bytes on the wire for the all-gathers of weights and the
// reduce-scatters of gradients, the shards (what the optimizer steps) kept in full precision.
// Their accuracy against the exact run, and the command that measures it, are in
// docs/verified_collectives.md.
//   - Gathers as a GatherTransform (fsdp/gather_transform.h), given to fully_shard through
//     ShardOptions::gather_transform_fn = quantized_gather(...): each rank's part of a parameter
//     travels as bf16 (half the bytes of fp32) or as int8 with one fp32 scale per block of values
//     (ZeRO++'s qwZ; 0.26 of fp32's bytes with blocks of 128) and is decoded on every rank into
//     the full parameter.
//   - Reductions as a custom ReduceScatter (fsdp/custom_collectives.h), installed with
//     set_quantized_reduce_scatter: every block of the gradient is encoded the same way,
//     exchanged with Communicator::all_to_all, then decoded and summed in fp32 in rank order
//     (Megatron's bf16 communication with fp32 reduction; ZeRO++'s qgZ).
// Both are deterministic: every rank decodes the same bytes into the same values, and the result
// does not depend on the transport. Verified collectives check what travels: the quantized bytes
// (a gather's wire, the reduce-scatter's XXH3 digests of its wire, attached to its Work).
// Thread-safety: the transforms and collectives hold no state between calls; called on the
// training thread as any GatherTransform or custom collective.
#pragma once

#include <fsdp/custom_collectives.h>
#include <fsdp/gather_transform.h>

#include <string>
#include <vector>

namespace fsdp {

class FSDPModule;

enum class Quantization {
  kNone,  // the exact collective
  kBf16,  // every value rounded to bfloat16 (to nearest, ties to even)
  kInt8,  // int8 in blocks of values: scale = max |x| / 127 per block (fp32), x ~ round(x / scale)
};
// "none", "bf16" or "int8"; anything else throws naming the choices.
Quantization parse_quantization(const std::string& name);
const char* to_string(Quantization q);

// Blocks of the int8 wire: one fp32 scale per `block` values, 64 to 256 (default 128).
constexpr int kDefaultQuantBlock = 128;

// A parameter's gather on a quantized wire. `shard_dtype`: the dtype of the shard it encodes.
class QuantizedGather final : public GatherTransform {
 public:
  QuantizedGather(Quantization q, at::ScalarType shard_dtype, int block = kDefaultQuantBlock);
  int64_t wire_bytes(int64_t padded_numel) const override;
  void pre_all_gather(const at::Tensor& padded_shard, const at::Tensor& wire) override;
  void post_all_gather(const at::Tensor& wires, const at::Tensor& padded_rows) override;

 private:
  Quantization q_;
  at::ScalarType dtype_;
  int block_;
};

// ShardOptions::gather_transform_fn quantizing every floating-point parameter the same way (the
// others travel as they are). kNone gives an empty function (the plain gather).
GatherTransformFn quantized_gather(Quantization q, int block = kDefaultQuantBlock);

// A reduce-scatter on a quantized wire (fp32, bf16 or fp64 gradients; the output keeps the
// input's dtype). Every block, this rank's own too, goes through the same encoding, so that the
// result is the same whichever rank holds a shard.
class QuantizedReduceScatter final : public ReduceScatter {
 public:
  explicit QuantizedReduceScatter(Quantization q, int block = kDefaultQuantBlock);
  Work operator()(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                  Communicator& group) override;

 private:
  Quantization q_;
  int block_;
};

// Installs a QuantizedReduceScatter on each module (FSDPModule::set_custom_reduce_scatter); kNone
// leaves them as they are. Call it alike on every rank, between steps.
void set_quantized_reduce_scatter(const std::vector<FSDPModule>& modules, Quantization q,
                                  int block = kDefaultQuantBlock);

// What the wire does to values, for references and tests: `x` (any shape, floating) flattened,
// encoded and decoded as one rank's padded part of a gather or one block of a reduce-scatter is:
// fp32 values (which the gather then casts to the full parameter's dtype; the reduce-scatter sums
// them in fp32, or fp64 for fp64 gradients). kNone: a flat copy of `x`.
at::Tensor quantize_round_trip(const at::Tensor& x, Quantization q, int block = kDefaultQuantBlock);

// Bytes on the wire for `numel` values (a padded shard or one block).
int64_t quantized_bytes(int64_t numel, Quantization q, at::ScalarType dtype,
                        int block = kDefaultQuantBlock);

}  // namespace fsdp
