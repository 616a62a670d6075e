// What a Communicator holds (its process group, lanes, statistics and the two exchange workers its
// transport runs on), and the entry points only fsdp-cpp itself uses: the gather of a list of
// pieces straight into their places (Group's unshard) and the Work bookkeeping.
#pragma once

#include <fsdp/communicator.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "exchange_worker.h"

namespace fsdp {
namespace detail {
class LaneLoss;
}

struct Communicator::Impl {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  c10::intrusive_ptr<c10d::Store> store;  // the world's: the lanes' stores are prefixes of it
  std::string backend;
  std::chrono::milliseconds timeout;
  std::string name;
  std::string bind_host;
  int rank = 0;
  int size = 1;
  // split()/subgroup()/lane() calls per label and rank list: part of each new communicator's store
  // prefix. Counted per key, so that a subgroup over some ranks leaves the other ranks' later
  // prefixes as they are.
  std::map<std::string, int> splits;
  std::map<std::string, std::shared_ptr<Communicator>> lanes;
  // split() and subgroup() children: their statistics count in total_stats(), those of the
  // living ones read from them, those of the ones destroyed since added into `retired` (which
  // a child shares, so that it may outlive this communicator).
  std::vector<std::weak_ptr<Communicator>> children;
  std::shared_ptr<CommStats> retired = std::make_shared<CommStats>();
  std::shared_ptr<CommStats> parent_retired;  // the parent's `retired`: a child's, else null
  std::shared_ptr<CommStats> stats = std::make_shared<CommStats>();
  std::shared_ptr<const std::vector<PeerInfo>> peers;
  // What FSDP_TRANSPORT asked for when this communicator was built, or the one whose lane it is
  // (null: auto). `transport`: what was connected.
  std::optional<Transport> requested;
  Transport transport = Transport::kCollective;
  // Under shm and tcp: the all-gathers' worker and the reduce-scatters' (each with its own
  // exchange), so that gathers never queue behind reductions. Null under collective.
  std::unique_ptr<detail::ExchangeWorker> gathers, reductions;
  // An elastic job's replicate lane (lane_loss.h), shared with every lane of it; null elsewhere.
  std::shared_ptr<detail::LaneLoss> loss;

  // Connects the transport `requested` asks for (collective over the communicator's ranks).
  void connect_transport();
  // A new communicator over `ranks` of this one (all of them when empty), on a new process group
  // named after `label`, with this one's store, backend, timeout and bind host, its own
  // statistics, and the transport `want` asks for.
  std::shared_ptr<Communicator> child(const std::string& label, const std::vector<int>& ranks,
                                      std::optional<Transport> want);
  // Whether a collective on `t` runs on the exchange workers (CPU tensors under shm or tcp).
  bool uses_exchange(const at::Tensor& t) const {
    return gathers != nullptr && (!t.defined() || t.is_cpu());
  }
  // The Work of a collective issued as `works` (none: complete already); `finish` runs once on
  // the waiting thread after they complete (a sum, a division, a cast back).
  Work make_work(std::vector<c10::intrusive_ptr<c10d::Work>> works, const std::string& op,
                 int64_t bytes, std::function<void()> finish);
};

namespace detail {

// The all-gather of a list of pieces straight into their places, with no gather buffer:
// outputs[r][i] receives rank r's inputs[i] (sizes may differ between pieces and ranks; every
// rank must agree on them; empty pieces are skipped), outputs[rank()][i] gets a copy of this
// rank's inputs[i]. REQUIRES gathers_into_places(c, inputs): CPU tensors under shm or tcp (or one
// rank), at most
// kMaxGatherPieces pieces, every tensor contiguous and of one dtype. Elsewhere (collective) the
// caller gathers into a flat buffer with all_gather and copies out.
constexpr size_t kMaxGatherPieces = 4096;
bool gathers_into_places(const Communicator& c, const std::vector<at::Tensor>& inputs);
Work all_gather_into(Communicator& c, std::vector<std::vector<at::Tensor>> outputs,
                     std::vector<at::Tensor> inputs);

// Communicator::reduce_scatter with the XXH3 digests of its wire attached to its Work
// (Work::digests, for verified collectives, core/verified.h): sent[j], of the block this rank
// sends rank j, digested before it is sent; received[r], of rank r's block as it arrived here,
// digested chunk by chunk before it is summed (so a byte changed between the two is caught
// exactly, whatever the sum's rounding). `on_received`, when set, is a test seam
// (core/content_faults.h): it gets each chunk of a peer's block, a copy it may change, before
// the chunk is digested and summed. `span`: the elements of every block the digests cover,
// [lo, hi) (verified collectives' rotating part); the default, every element.
using ReceivedChunkHook = std::function<void(int from, int64_t offset, const at::Tensor& chunk)>;
struct WireSpan {
  int64_t lo = 0, hi = -1;  // hi < 0: to the block's end
};
Work reduce_scatter_digested(Communicator& c, const at::Tensor& output, const at::Tensor& input,
                             ReduceOp op, ReceivedChunkHook on_received = nullptr,
                             WireSpan span = {});
// Seconds this process spent digesting reduce-scatters' wires (any thread; fsdp-bench adds it to
// verified collectives' own time).
double wire_digest_seconds();

}  // namespace detail
}  // namespace fsdp
