// The collectives: validation on the calling rank, then the algorithm on the communicator's
// transport (communicator_impl.h): on shm and tcp, the exchange workers (an all-gather straight
// into its places; a reduce-scatter summed in rank order chunk by chunk as the blocks arrive); on
// collective, the backend's all-gather and all-to-all, summed in rank order at wait. Both sums are
// sum_in_rank_order's, so every transport gives the same bits.
#include <ATen/ATen.h>
#include <fsdp/communicator.h>
#include <fsdp/error.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "communicator_impl.h"
#include "compat.h"
#include "lane_loss.h"
#include "rank_order_sum.h"
#include "util/checksum.h"

namespace fsdp {

// ---------------------------------------------------------------------------------------------
// Validation: every check runs on the calling rank before anything is issued.
// ---------------------------------------------------------------------------------------------
namespace {

void check_supported(const at::Tensor& t, const char* op, const char* arg) {
  FSDP_CHECK(t.defined(), op, ": ", arg, " is an undefined tensor");
  switch (t.scalar_type()) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kInt:
    case at::kLong:
    case at::kByte:
    case at::kChar:
      break;
    default:
      throw Error(
          detail::cat(op, ": ", arg, " has dtype ", t.scalar_type(),
                      "; supported are float, double, half, bfloat16 and 8/32/64-bit ints"));
  }
  FSDP_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous (sizes ", t.sizes(),
             ", strides ", t.strides(), "); pass .contiguous() or a flat buffer");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op) {
  FSDP_CHECK(a.scalar_type() == b.scalar_type(), op, ": output dtype ", a.scalar_type(),
             " does not match input dtype ", b.scalar_type(), "; both must have the same dtype");
}

// LibTorch's byte count, signed as the statistics are.
int64_t nbytes(const at::Tensor& t) { return static_cast<int64_t>(t.nbytes()); }

at::Tensor as_wire(const at::Tensor& t, const std::string& backend) {
  auto w = compat::wire_dtype(t.scalar_type(), backend);
  return w == t.scalar_type() ? t : t.view(w);
}

// NCCL moves CUDA tensors only. A CPU tensor given to a collective under NCCL (the agreement's
// small messages, clip_grad_norm_'s sums, the state dicts' rows) travels through a copy on the
// current CUDA device, and the result is copied back when the collective is waited on.
bool staged(const std::string& backend, const at::Tensor& t) {
  return backend == "nccl" && t.defined() && t.is_cpu();
}
at::Tensor on_device(const at::Tensor& t) { return t.to(at::Device(at::kCUDA), false, true); }
at::Tensor empty_on_device(const at::Tensor& t) {
  return at::empty_like(t, t.options().device(at::Device(at::kCUDA)));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// All-gather
// ---------------------------------------------------------------------------------------------
namespace {
Work plain_all_gather(Communicator& self, const at::Tensor& output, const at::Tensor& input) {
  Communicator::Impl& m = self.impl();
  check_supported(output, "all_gather", "output");
  check_supported(input, "all_gather", "input");
  check_same_dtype(output, input, "all_gather");
  FSDP_CHECK(output.numel() == m.size * input.numel(), "all_gather: output has ", output.numel(),
             " elements but world size ", m.size, " x input ", input.numel(), " = ",
             m.size * input.numel(),
             " were expected; size the output as world_size * input.numel()");
  // Nothing to move (Gloo divides by the element count): complete at once, on every rank alike.
  if (output.numel() == 0) return m.make_work({}, "all_gather", 0, nullptr);
  if (m.size == 1) {
    output.view({-1}).copy_(input.view({-1}));
    return m.make_work({}, "all_gather", nbytes(output), nullptr);
  }
  auto out = as_wire(output.view({-1}), m.backend);
  auto in = as_wire(input.view({-1}), m.backend);
  if (m.uses_exchange(output)) {
    const int64_t n = in.numel();
    std::vector<std::vector<at::Tensor>> places(m.size);
    for (int r = 0; r < m.size; ++r) places[r].push_back(out.narrow(0, r * n, n));
    return detail::all_gather_into(self, std::move(places), {in});
  }
  m.stats->bytes_sent += nbytes(input) * (m.size - 1);
  if (staged(m.backend, out)) {
    const at::Tensor dev_out = empty_on_device(out);
    return m.make_work({compat::all_gather_flat(*m.pg, dev_out, on_device(in))}, "all_gather",
                       nbytes(output), [out, dev_out] { out.copy_(dev_out); });
  }
  return m.make_work({compat::all_gather_flat(*m.pg, out, in)}, "all_gather", nbytes(output),
                     nullptr);
}
}  // namespace

bool detail::gathers_into_places(const Communicator& c, const std::vector<at::Tensor>& inputs) {
  if (inputs.empty() || inputs.size() > kMaxGatherPieces) return false;
  // One rank: a local copy, whatever the transport.
  return c.size() == 1 || c.impl().uses_exchange(inputs[0]);
}

namespace {
// A contiguous tensor as 1-D (itself when it is already).
at::Tensor flat(const at::Tensor& t) { return t.dim() == 1 ? t : t.view({-1}); }

// This rank's own piece of an all-gather into places: a byte copy between host tensors (both
// contiguous, one dtype: check_places), ATen's copy elsewhere.
void copy_own_piece(const at::Tensor& out, const at::Tensor& in) {
  if (in.numel() == 0) return;
  if (out.is_cpu() && in.is_cpu()) {
    std::memmove(out.data_ptr(), in.data_ptr(), nbytes(in));
    return;
  }
  flat(out).copy_(flat(in));
}

// all_gather_into's checks; returns the bytes gathered.
int64_t check_places(const std::vector<std::vector<at::Tensor>>& outputs,
                     const std::vector<at::Tensor>& inputs, int rank, int size) {
  FSDP_CHECK(outputs.size() == static_cast<size_t>(size), "all_gather_into: ", outputs.size(),
             " output lists for a world of ", size, "; pass one per rank");
  int64_t bytes = 0;
  for (const auto& in : inputs) check_supported(in, "all_gather_into", "input");
  for (int r = 0; r < size; ++r) {
    FSDP_CHECK(outputs[r].size() == inputs.size(), "all_gather_into: ", outputs[r].size(),
               " outputs for rank ", r, " but ", inputs.size(), " inputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& o = outputs[r][i];
      check_supported(o, "all_gather_into", "output");
      check_same_dtype(o, inputs[i], "all_gather_into");
      bytes += nbytes(o);
    }
  }
  for (size_t i = 0; i < inputs.size(); ++i)
    FSDP_CHECK(outputs[rank][i].numel() == inputs[i].numel(), "all_gather_into: piece ", i, " has ",
               inputs[i].numel(), " elements but its place on this rank ",
               outputs[rank][i].numel());
  return bytes;
}
}  // namespace

Work detail::all_gather_into(Communicator& c, std::vector<std::vector<at::Tensor>> outputs,
                             std::vector<at::Tensor> inputs) {
  Communicator::Impl& m = c.impl();
  FSDP_CHECK(gathers_into_places(c, inputs), "all_gather_into: ", inputs.size(),
             " pieces cannot be gathered into their places here (1..", kMaxGatherPieces,
             " CPU pieces on the shm or tcp transport); check gathers_into_places() first and "
             "use all_gather into a flat buffer otherwise");
  const int64_t bytes = check_places(outputs, inputs, m.rank, m.size);
  int64_t sent = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    sent += nbytes(inputs[i]);
    copy_own_piece(outputs[m.rank][i], inputs[i]);
  }
  if (m.size == 1 || bytes == 0) return m.make_work({}, "all_gather", bytes, nullptr);
  for (auto& row : outputs)
    for (auto& o : row) o = as_wire(flat(o), m.backend);
  for (auto& in : inputs) in = as_wire(flat(in), m.backend);
  m.stats->bytes_sent += sent * (m.size - 1);
  auto job = [outputs = std::move(outputs), inputs = std::move(inputs),
              timeout = m.timeout](detail::Exchange& e) { e.all_gather(outputs, inputs, timeout); };
  return m.make_work({m.gathers->run(c10d::OpType::ALLGATHER, std::move(job))}, "all_gather", bytes,
                     nullptr);
}

// ---------------------------------------------------------------------------------------------
// Reduce-scatter
// ---------------------------------------------------------------------------------------------
namespace {
void check_reduce_scatter(const at::Tensor& output, const at::Tensor& input, int rank, int size) {
  check_supported(output, "reduce_scatter", "output");
  check_supported(input, "reduce_scatter", "input");
  check_same_dtype(output, input, "reduce_scatter");
  FSDP_CHECK(input.numel() == size * output.numel(), "reduce_scatter: input has ", input.numel(),
             " elements but world size ", size, " x output ", output.numel(), " = ",
             size * output.numel(),
             " were expected; size the input as world_size * output.numel()");
  const int64_t n = output.numel();
  // In place is this rank's own block exactly; any other overlap would be read after written.
  FSDP_CHECK(n == 0 || !output.storage().is_alias_of(input.storage()) ||
                 output.data_ptr() == input.view({-1}).narrow(0, rank * n, n).data_ptr(),
             "reduce_scatter: the output overlaps the input but is not this rank's own block "
             "input[rank * n : (rank + 1) * n]; pass that block (in place) or a separate tensor");
}
}  // namespace

namespace {
std::atomic<int64_t> g_wire_digest_ns{0};
// Counts its lifetime into wire_digest_seconds().
struct WireTimer {
  const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~WireTimer() {
    g_wire_digest_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now() - start)
                                   .count());
  }
};

// The digests of one reduce-scatter's wire (detail::reduce_scatter_digested): the blocks this
// rank sends, digested when issued; each peer's block fed chunk by chunk, in order, as it arrives
// (the exchange's thread, or the waiting thread on the collective transport).
struct WireTap {
  WireTap(int ws, int me, detail::ReceivedChunkHook hook, detail::WireSpan span)
      : me(me),
        on_received(std::move(hook)),
        span(span),
        digests(std::make_shared<Work::Digests>()) {
    digests->sent.assign(ws, 0);
    digests->received.assign(ws, 0);
    for (int r = 0; r < ws; ++r) streams.push_back(std::make_unique<detail::StreamingChecksum>());
  }
  // The span's elements of a block of n.
  int64_t lo(int64_t n) const { return std::min(span.lo, n); }
  int64_t hi(int64_t n) const { return span.hi < 0 ? n : std::clamp(span.hi, lo(n), n); }
  void send(const at::Tensor& in, int64_t n) {
    WireTimer timer;
    block = n;
    for (int j = 0; j < static_cast<int>(digests->sent.size()); ++j) {
      if (j == me) continue;
      // Only the span travels to the host from a device.
      const at::Tensor part = in.narrow(0, j * n + lo(n), hi(n) - lo(n));
      const at::Tensor host = part.is_cpu() ? part : part.cpu();
      digests->sent[j] =
          detail::checksum_bytes(host.data_ptr(), static_cast<size_t>(host.nbytes()));
    }
  }
  // rows[r]: rank r's chunk, `offset` elements into its block; returns the rows to sum (copies
  // where the test seam may change them).
  std::vector<at::Tensor> receive(int64_t offset, const std::vector<at::Tensor>& rows) {
    WireTimer timer;
    std::vector<at::Tensor> out = rows;
    for (int r = 0; r < static_cast<int>(rows.size()); ++r) {
      if (r == me || rows[r].numel() == 0) continue;
      if (on_received) {
        out[r] = rows[r].clone();
        on_received(r, offset, out[r]);
      }
      // The chunk's elements inside the span.
      const int64_t from = std::max(offset, lo(block)),
                    to = std::min(offset + out[r].numel(), hi(block));
      if (from >= to) continue;
      const at::Tensor part = out[r].view({-1}).narrow(0, from - offset, to - from);
      const at::Tensor host = part.is_cpu() ? part : part.cpu();
      streams[r]->update(host.data_ptr(), static_cast<size_t>(host.nbytes()));
    }
    return out;
  }
  void finish() {
    for (int r = 0; r < static_cast<int>(streams.size()); ++r)
      if (r != me) digests->received[r] = streams[r]->digest();
  }
  const int me;
  const detail::ReceivedChunkHook on_received;
  const detail::WireSpan span;
  int64_t block = 0;  // elements per block, set by send()
  std::shared_ptr<Work::Digests> digests;
  std::vector<std::unique_ptr<detail::StreamingChecksum>> streams;
};

// The reduce-scatter, with its wire digested when `tap` is set.
Work issue_reduce_scatter(Communicator::Impl& m, const at::Tensor& output, const at::Tensor& input,
                          ReduceOp op, const std::shared_ptr<WireTap>& tap) {
  check_reduce_scatter(output, input, m.rank, m.size);
  const int64_t n = output.numel();
  const int ws = m.size;
  const bool average = op == ReduceOp::kAvg;
  const at::Tensor out = output.view({-1}), in = input.view({-1});
  // rows[r]: rank r's chunk of this rank's block, `offset` elements in.
  auto sum_chunk = [out, average, tap](int64_t offset, const std::vector<at::Tensor>& rows) {
    if (tap) {
      detail::sum_in_rank_order(out.narrow(0, offset, rows[0].numel()), tap->receive(offset, rows),
                                average);
      return;
    }
    detail::sum_in_rank_order(out.narrow(0, offset, rows[0].numel()), rows, average);
  };
  auto sum_blocks = [sum_chunk, ws, n](const at::Tensor& blocks) {  // (ws * n): block r from r
    std::vector<at::Tensor> rows;
    for (int j = 0; j < ws; ++j) rows.push_back(blocks.narrow(0, j * n, n));
    sum_chunk(0, rows);
  };
  if (input.numel() == 0) return m.make_work({}, "reduce_scatter", 0, nullptr);
  if (ws == 1) {
    sum_blocks(in);
    return m.make_work({}, "reduce_scatter", nbytes(input), nullptr);
  }
  if (tap) tap->send(in, n);
  m.stats->bytes_sent += nbytes(output) * (ws - 1);
  if (m.uses_exchange(input)) {
    // The sums run on the exchange's thread as the chunks arrive, overlapping the transfer.
    auto job = [in, n, sum_chunk, tap, timeout = m.timeout](detail::Exchange& e) {
      e.exchange_blocks(in, n, sum_chunk, timeout);
      if (tap) tap->finish();
    };
    return m.make_work({m.reductions->run(c10d::OpType::REDUCE_SCATTER, std::move(job))},
                       "reduce_scatter", nbytes(input), nullptr);
  }
  const at::Tensor received = at::empty_like(in);
  auto finish = [sum_blocks, received, tap] {
    sum_blocks(received);
    if (tap) tap->finish();
  };
  if (staged(m.backend, in)) {
    const at::Tensor dev_received = empty_on_device(received);
    auto work = compat::exchange_blocks(*m.pg, as_wire(dev_received, m.backend),
                                        as_wire(on_device(in), m.backend));
    return m.make_work({work}, "reduce_scatter", nbytes(input), [finish, received, dev_received] {
      received.copy_(dev_received);
      finish();
    });
  }
  auto work = compat::exchange_blocks(*m.pg, as_wire(received, m.backend), as_wire(in, m.backend));
  return m.make_work({work}, "reduce_scatter", nbytes(input), finish);
}
}  // namespace

Work Communicator::reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  FSDP_CHECK(!impl_->loss, "reduce_scatter on communicator '", impl_->name,
             "': an elastic job's replicate lane carries all-reduces, all-gathers, broadcasts and "
             "barriers only");
  return issue_reduce_scatter(*impl_, output, input, op, nullptr);
}

double detail::wire_digest_seconds() { return static_cast<double>(g_wire_digest_ns.load()) * 1e-9; }

Work detail::reduce_scatter_digested(Communicator& c, const at::Tensor& output,
                                     const at::Tensor& input, ReduceOp op,
                                     ReceivedChunkHook on_received, WireSpan span) {
  Communicator::Impl& m = c.impl();
  auto tap = std::make_shared<WireTap>(m.size, m.rank, std::move(on_received), span);
  return issue_reduce_scatter(m, output, input, op, tap).with_digests(tap->digests);
}

// ---------------------------------------------------------------------------------------------
// All-to-all: the reduce-scatter's block exchange, each block copied into its place
// ---------------------------------------------------------------------------------------------
Work Communicator::all_to_all(const at::Tensor& output, const at::Tensor& input) {
  Impl& m = *impl_;
  FSDP_CHECK(!m.loss, "all_to_all on communicator '", m.name,
             "': an elastic job's replicate lane carries all-reduces, all-gathers, broadcasts and "
             "barriers only");
  check_supported(output, "all_to_all", "output");
  check_supported(input, "all_to_all", "input");
  check_same_dtype(output, input, "all_to_all");
  FSDP_CHECK(output.numel() == input.numel() && input.numel() % m.size == 0, "all_to_all: input ",
             input.numel(), " and output ", output.numel(), " elements; both must hold world size ",
             m.size, " equal blocks");
  FSDP_CHECK(input.numel() == 0 || !output.storage().is_alias_of(input.storage()),
             "all_to_all: the output shares storage with the input; pass a separate output");
  const int64_t n = input.numel() / m.size;
  const at::Tensor out = output.view({-1}), in = input.view({-1});
  if (n == 0) return m.make_work({}, "all_to_all", 0, nullptr);
  if (m.size == 1) {
    out.copy_(in);
    return m.make_work({}, "all_to_all", nbytes(input), nullptr);
  }
  m.stats->bytes_sent += nbytes(input) / m.size * (m.size - 1);
  if (m.uses_exchange(input)) {
    // rows[r]: rank r's chunk of this rank's block, `offset` elements in: copied to block r.
    auto copy_chunk = [out, n](int64_t offset, const std::vector<at::Tensor>& rows) {
      for (size_t r = 0; r < rows.size(); ++r)
        out.narrow(0, static_cast<int64_t>(r) * n + offset, rows[r].numel()).copy_(rows[r]);
    };
    auto job = [in, n, copy_chunk, timeout = m.timeout](detail::Exchange& e) {
      e.exchange_blocks(in, n, copy_chunk, timeout);
    };
    return m.make_work({m.reductions->run(c10d::OpType::ALLTOALL_BASE, std::move(job))},
                       "all_to_all", nbytes(input), nullptr);
  }
  if (staged(m.backend, in)) {
    const at::Tensor dev_out = empty_on_device(out);
    auto work = compat::exchange_blocks(*m.pg, as_wire(dev_out, m.backend),
                                        as_wire(on_device(in), m.backend));
    return m.make_work({work}, "all_to_all", nbytes(input), [out, dev_out] { out.copy_(dev_out); });
  }
  auto work = compat::exchange_blocks(*m.pg, as_wire(out, m.backend), as_wire(in, m.backend));
  return m.make_work({work}, "all_to_all", nbytes(input), nullptr);
}

// ---------------------------------------------------------------------------------------------
// All-reduce, broadcast, barrier: the backend's own
// ---------------------------------------------------------------------------------------------
namespace {
Work plain_all_reduce(Communicator& self, const at::Tensor& tensor, ReduceOp op) {
  Communicator::Impl& m = self.impl();
  check_supported(tensor, "all_reduce", "tensor");
  const int ws = m.size;
  if (ws == 1 || tensor.numel() == 0) return m.make_work({}, "all_reduce", nbytes(tensor), nullptr);
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  const bool stage = staged(m.backend, tensor);
  const at::Tensor target = stage ? on_device(tensor) : tensor;  // what the backend reduces
  if (compat::backend_reduces(tensor.scalar_type(), m.backend)) {
    std::vector<at::Tensor> ts{target};
    m.stats->bytes_sent += 2 * nbytes(tensor) * (ws - 1) / ws;
    auto w = m.pg->allreduce(ts, opts);
    return m.make_work({w}, "all_reduce", nbytes(tensor), [tensor, target, stage, op, ws] {
      if (op == ReduceOp::kAvg) target.div_(ws);
      if (stage) tensor.copy_(target);
    });
  }
  // The backend cannot sum this dtype: sum an fp32 copy (accumulating in fp32), cast back at wait.
  auto wide = target.to(at::kFloat);
  std::vector<at::Tensor> ts{wide};
  m.stats->bytes_sent += 2 * nbytes(wide) * (ws - 1) / ws;
  auto w = m.pg->allreduce(ts, opts);
  return m.make_work({w}, "all_reduce", nbytes(tensor), [tensor, wide, op, ws] {
    if (op == ReduceOp::kAvg) wide.div_(ws);
    tensor.copy_(wide);
  });
}

Work plain_broadcast(Communicator& self, const at::Tensor& tensor, int root) {
  Communicator::Impl& m = self.impl();
  check_supported(tensor, "broadcast", "tensor");
  FSDP_CHECK(root >= 0 && root < m.size, "broadcast: root rank ", root, " is outside 0..",
             m.size - 1);
  if (m.size == 1 || tensor.numel() == 0)
    return m.make_work({}, "broadcast", nbytes(tensor), nullptr);
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  if (m.rank == root) m.stats->bytes_sent += nbytes(tensor);
  if (staged(m.backend, tensor)) {
    const at::Tensor dev = on_device(tensor);
    std::vector<at::Tensor> ts{as_wire(dev, m.backend)};
    return m.make_work({m.pg->broadcast(ts, opts)}, "broadcast", nbytes(tensor),
                       [tensor, dev] { tensor.copy_(dev); });
  }
  std::vector<at::Tensor> ts{as_wire(tensor, m.backend)};
  return m.make_work({m.pg->broadcast(ts, opts)}, "broadcast", nbytes(tensor), nullptr);
}

Work plain_barrier(Communicator& self) {
  Communicator::Impl& m = self.impl();
  if (m.size == 1) return m.make_work({}, "barrier", 0, nullptr);
  return m.make_work({m.pg->barrier()}, "barrier", 0, nullptr);
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// The public entries: under a lane loss (lane_loss.h), on private copies with a stand-in
// ---------------------------------------------------------------------------------------------
Work Communicator::all_gather(const at::Tensor& output, const at::Tensor& input) {
  const auto& loss = impl_->loss;
  if (!loss) return plain_all_gather(*this, output, input);
  check_supported(output, "all_gather", "output");
  auto stand_in = [output, input, n = impl_->size] {
    output.view({n, -1}).copy_(input.reshape({1, -1}).expand({n, -1}));
  };
  if (loss->lost()) return detail::stood_in(stand_in);
  const at::Tensor mine = at::empty_like(output);
  return detail::tolerate(plain_all_gather(*this, mine, input), loss, stand_in,
                          [output, mine] { output.copy_(mine); });
}

Work Communicator::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  const auto& loss = impl_->loss;
  if (!loss) return plain_all_reduce(*this, tensor, op);
  check_supported(tensor, "all_reduce", "tensor");
  auto stand_in = [tensor, op, n = impl_->size] {
    if (op == ReduceOp::kSum) tensor.mul_(n);
  };
  if (loss->lost()) return detail::stood_in(stand_in);
  const at::Tensor mine = tensor.clone();
  return detail::tolerate(plain_all_reduce(*this, mine, op), loss, stand_in,
                          [tensor, mine] { tensor.copy_(mine); });
}

Work Communicator::broadcast(const at::Tensor& tensor, int root) {
  const auto& loss = impl_->loss;
  if (!loss) return plain_broadcast(*this, tensor, root);
  check_supported(tensor, "broadcast", "tensor");
  if (loss->lost()) return detail::stood_in([] {});
  const at::Tensor mine = tensor.clone();
  return detail::tolerate(
      plain_broadcast(*this, mine, root), loss, [] {}, [tensor, mine] { tensor.copy_(mine); });
}

Work Communicator::barrier() {
  const auto& loss = impl_->loss;
  if (!loss) return plain_barrier(*this);
  if (loss->lost()) return detail::stood_in([] {});
  return detail::tolerate(
      plain_barrier(*this), loss, [] {}, nullptr);
}

}  // namespace fsdp
