// The quantized all-gather (fsdp/quantized.h): a GatherTransform per parameter, and the names
// of the settings.
#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/quantized.h>

#include "quant/codec.h"

namespace fsdp {

Quantization parse_quantization(const std::string& name) {
  if (name == "none") return Quantization::kNone;
  if (name == "bf16") return Quantization::kBf16;
  if (name == "int8") return Quantization::kInt8;
  throw Error(detail::cat("quantization '", name, "' is not one of none, bf16, int8"));
}

const char* to_string(Quantization q) {
  switch (q) {
    case Quantization::kBf16:
      return "bf16";
    case Quantization::kInt8:
      return "int8";
    default:
      return "none";
  }
}

int64_t quantized_bytes(int64_t numel, Quantization q, at::ScalarType dtype, int block) {
  return quant::encoded_bytes(numel, q, dtype, block);
}

QuantizedGather::QuantizedGather(Quantization q, at::ScalarType shard_dtype, int block)
    : q_(q), dtype_(shard_dtype), block_(block) {
  quant::check_block(block);
  FSDP_CHECK(at::isFloatingType(shard_dtype), "QuantizedGather: a parameter of dtype ", shard_dtype,
             " cannot be quantized; give quantized gathers floating-point ones only");
}

int64_t QuantizedGather::wire_bytes(int64_t padded_numel) const {
  return quant::encoded_bytes(padded_numel, q_, dtype_, block_);
}

void QuantizedGather::pre_all_gather(const at::Tensor& padded_shard, const at::Tensor& wire) {
  quant::encode(padded_shard.reshape({-1}), wire.data_ptr<uint8_t>(), q_, block_);
}

void QuantizedGather::post_all_gather(const at::Tensor& wires, const at::Tensor& padded_rows) {
  // (world, wire_bytes) -> (world, padded) in the full parameter's dtype, one row per rank.
  const at::Tensor w = wires.contiguous();
  const int64_t world = padded_rows.size(0), padded = padded_rows.size(1);
  at::Tensor decoded = at::empty({world, padded}, at::kFloat);
  for (int64_t r = 0; r < world; ++r)
    quant::decode(w[r].data_ptr<uint8_t>(), padded, q_, dtype_, block_,
                  decoded[r].data_ptr<float>());
  padded_rows.copy_(decoded);
}

GatherTransformFn quantized_gather(Quantization q, int block) {
  if (q == Quantization::kNone) return {};
  quant::check_block(block);
  return [q, block](const std::string&, const at::Tensor& p) -> std::shared_ptr<GatherTransform> {
    if (!at::isFloatingType(p.scalar_type())) return nullptr;
    return std::make_shared<QuantizedGather>(q, p.scalar_type(), block);
  };
}

at::Tensor quantize_round_trip(const at::Tensor& x, Quantization q, int block) {
  const at::Tensor flat = x.reshape({-1});
  if (q == Quantization::kNone) return flat.clone();
  std::vector<uint8_t> wire(
      static_cast<size_t>(quant::encoded_bytes(flat.numel(), q, flat.scalar_type(), block)));
  quant::encode(flat, wire.data(), q, block);
  at::Tensor out = at::empty({flat.numel()}, at::kFloat);
  quant::decode(wire.data(), flat.numel(), q, flat.scalar_type(), block, out.data_ptr<float>());
  return out;
}

}  // namespace fsdp
