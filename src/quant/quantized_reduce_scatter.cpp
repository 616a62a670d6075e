// The quantized reduce-scatter (fsdp/quantized.h): every block encoded, exchanged with
// Communicator::all_to_all, decoded and summed in rank order, with the XXH3 digests of the wire
// attached to the Work for verified collectives.
#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/fully_shard.h>
#include <fsdp/quantized.h>

#include "quant/codec.h"
#include "util/checksum.h"

namespace fsdp {

QuantizedReduceScatter::QuantizedReduceScatter(Quantization q, int block) : q_(q), block_(block) {
  quant::check_block(block);
}

namespace {
// Rank r's decoded block added to `acc` (fp32, or fp64 for fp64 gradients) in rank order.
void add_block(const uint8_t* wire, int64_t n, Quantization q, at::ScalarType dtype, int block,
               const at::Tensor& decoded, const at::Tensor& acc, bool first) {
  quant::decode(wire, n, q, dtype, block, decoded.data_ptr<float>());
  if (first)
    acc.copy_(decoded);
  else
    acc.add_(decoded);
}
}  // namespace

Work QuantizedReduceScatter::operator()(const at::Tensor& output, const at::Tensor& input,
                                        ReduceOp op, Communicator& group) {
  FSDP_CHECK(at::isFloatingType(input.scalar_type()) && input.is_cpu(),
             "QuantizedReduceScatter: gradients of dtype ", input.scalar_type(), " on ",
             input.device(), "; it reduces floating-point CPU tensors");
  const int world = group.size(), me = group.rank();
  const int64_t n = output.numel();
  const at::ScalarType dtype = input.scalar_type();
  const int64_t w = quant::encoded_bytes(n, q_, dtype, block_);
  const at::Tensor flat = input.reshape({-1});
  at::Tensor send = at::empty({world * w}, at::kByte), recv = at::empty({world * w}, at::kByte);
  auto digests = std::make_shared<Work::Digests>();
  digests->sent.assign(world, 0);
  digests->received.assign(world, 0);
  uint8_t* s = send.data_ptr<uint8_t>();
  for (int j = 0; j < world; ++j) {
    quant::encode(flat.narrow(0, j * n, n), s + j * w, q_, block_);
    if (j != me) digests->sent[j] = detail::checksum_bytes(s + j * w, static_cast<size_t>(w));
  }
  Work exchanged = group.all_to_all(recv, send);
  const Quantization q = q_;
  const int block = block_;
  // Decoded and summed once every block arrived, on the waiting thread.
  Work done = exchanged.then([=] {
    const uint8_t* r = recv.data_ptr<uint8_t>();
    const at::ScalarType acc_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor acc = at::empty({n}, acc_dtype), decoded = at::empty({n}, at::kFloat);
    for (int j = 0; j < world; ++j) {
      if (j != me) digests->received[j] = detail::checksum_bytes(r + j * w, static_cast<size_t>(w));
      add_block(r + j * w, n, q, dtype, block, decoded, acc, j == 0);
    }
    if (op == ReduceOp::kAvg) acc.div_(world);
    output.view({-1}).copy_(acc);
    (void)send;  // held until the exchange is done
  });
  return done.with_digests(digests);
}

void set_quantized_reduce_scatter(const std::vector<FSDPModule>& modules, Quantization q,
                                  int block) {
  if (q == Quantization::kNone) return;
  auto rs = std::make_shared<QuantizedReduceScatter>(q, block);
  for (FSDPModule m : modules) m.set_custom_reduce_scatter(rs);
}

}  // namespace fsdp
