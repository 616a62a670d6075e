// Communicator: the collectives fully_shard needs, asynchronous, over a c10d process group.
//
// Every operation validates its buffers on the calling rank before anything is issued, returns a
// Work, and Work::wait() throws fsdp::CommError naming the operation, the byte count, the ranks and
// the timeout when the collective does not finish in time. Collectives must be issued in the same
// order on every rank of a communicator; use split() for an independent ordering lane.
//
// Thread-safety: a Communicator may be used from one thread at a time (autograd hooks run on the
// thread that called backward on CPU). Work objects may be waited from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
class Store;
class Work;
}  // namespace c10d

namespace fsdp {
namespace detail {
class RingReduceScatter;
}  // namespace detail

enum class ReduceOp {
  kSum,  // element-wise sum over ranks
  kAvg,  // sum, then divided by the world size
};

// Handle to an in-flight collective. wait() completes it (running any local post-processing such
// as the sum of a reduce-scatter) and rethrows its failure. Waiting again after a success is a
// no-op; after a failure or a timeout every later wait() rethrows the same CommError (the
// collective is lost: its buffers hold nothing usable).
class Work {
 public:
  Work() = default;
  struct Impl;
  explicit Work(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  // Waits with the communicator's timeout.
  void wait();
  // Waits at most `timeout`; throws CommError when it expires.
  void wait(std::chrono::milliseconds timeout);
  bool is_completed() const;
  bool defined() const { return impl_ != nullptr; }

 private:
  std::shared_ptr<Impl> impl_;
};

struct CommStats {
  int64_t collectives = 0;
  int64_t bytes_sent = 0;   // bytes this rank put on the wire, by the ring model of each op
  double wait_seconds = 0;  // time callers spent blocked in Work::wait
  CommStats& operator+=(const CommStats& o) {
    collectives += o.collectives;
    bytes_sent += o.bytes_sent;
    wait_seconds += o.wait_seconds;
    return *this;
  }
};

// Who a rank is, as published at the rendezvous: used to name the peer in failure messages (the
// rank whose process has died, the host behind an address in a transport error).
struct PeerInfo {
  int rank = 0;
  std::string host;     // hostname
  std::string address;  // the address its transport advertises
  int64_t pid = 0;
};

class Communicator {
 public:
  // Wraps an existing c10d process group. `store` is kept for split(); `backend` is "gloo" or
  // "nccl".
  Communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::intrusive_ptr<c10d::Store> store,
               std::string backend, std::chrono::milliseconds timeout, std::string name = "world",
               std::string bind_host = "127.0.0.1");
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  const std::string& backend() const { return backend_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  // REQUIRES: output contiguous, output.numel() == size() * input.numel(), same dtype.
  // output[r * n : (r + 1) * n] receives rank r's input.
  Work all_gather(const at::Tensor& output, const at::Tensor& input);
  // The all-gather of a list of pieces straight into their places, with no gather buffer:
  // outputs[r][i] receives rank r's inputs[i] (sizes may differ between pieces and ranks; every
  // rank must agree on them; empty pieces are skipped), outputs[rank()][i] gets a copy of this
  // rank's inputs[i]. REQUIRES gathers_into_places(inputs): CPU tensors under the point-to-point
  // all-gather (FSDP_ALL_GATHER=direct, the default on CPU), at most kMaxGatherPieces pieces,
  // every tensor contiguous and of one dtype. Elsewhere (a collective backend such as NCCL) the
  // caller gathers into a flat buffer with all_gather and copies out.
  static constexpr size_t kMaxGatherPieces = 4096;
  bool gathers_into_places(const std::vector<at::Tensor>& inputs) const;
  Work all_gather_into(std::vector<std::vector<at::Tensor>> outputs,
                       std::vector<at::Tensor> inputs);
  // REQUIRES: input contiguous, input.numel() == size() * output.numel(), same dtype.
  // output = op over ranks of input[rank * n : (rank + 1) * n]. Low-precision data is summed in
  // fp32. The output may be this rank's own block of the input, input[rank * n : (rank + 1) * n]
  // (in place: no output buffer; the rest of the input is left as it was), with the same result.
  // `scratch` (optional, same size and dtype as input, contiguous) receives the exchanged blocks;
  // without it a buffer is allocated per call: the whole exchange for the plain alltoall path
  // (FSDP_REDUCE_SCATTER=alltoall), a few chunks for the pipelined paths on CPU.
  Work reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                      const at::Tensor& scratch = {});
  // In place, all ranks end with the reduction.
  Work all_reduce(const at::Tensor& tensor, ReduceOp op);
  // In place, from `root` to all.
  Work broadcast(const at::Tensor& tensor, int root);
  Work barrier();

  // A new communicator over the same ranks whose collectives are ordered independently of this
  // one. Collective itself: every rank must call split() with the same name in the same order.
  std::shared_ptr<Communicator> split(const std::string& name);
  // A communicator over `ranks` (ranks of this communicator, ascending, including this one),
  // ordered independently of this one; its rank() is this rank's position in `ranks`. Collective
  // over `ranks` only: each of them calls subgroup() with the same name and list, in the same order
  // relative to its other subgroup()/split() calls. Used for HSDP's mesh (fsdp/mesh.h).
  std::shared_ptr<Communicator> subgroup(const std::string& name, const std::vector<int>& ranks);
  // The split named `name`, created on first use and shared afterwards (collective on first use).
  std::shared_ptr<Communicator> lane(const std::string& name);

  // The c10d process group underneath, for c10d facilities that take one (e.g. c10d::Reducer);
  // collectives issued on it bypass this communicator's checks, timeouts and statistics.
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return pg_; }
  // The ranks' identities (from init_process_group; empty for a hand-built communicator).
  void set_peers(std::vector<PeerInfo> peers);
  // Collective: where every rank is on this host (by the peers' host names; for a hand-built
  // communicator, by what the ranks publish on the store), moves the point-to-point all-gathers
  // and reduce-scatters through shared memory instead of the process group's TCP
  // (FSDP_TRANSPORT: auto, shm or tcp; src/comm/shm_transport.h). init_process_group, split()
  // and subgroup() call it; on a hand-built communicator, call it before its first collective
  // (after that, and a second time, it does nothing).
  void connect_local_transport();
  // Whether this communicator's all-gathers and reduce-scatters go through shared memory.
  bool uses_shared_memory() const;
  const std::vector<PeerInfo>& peers() const { return *peers_; }

  const CommStats& stats() const { return *stats_; }
  // This communicator's statistics plus those of every lane split from it.
  CommStats total_stats() const;
  void reset_stats();

 private:
  Work make_work(std::vector<c10::intrusive_ptr<c10d::Work>> works, std::string op, int64_t bytes,
                 std::function<void()> finish);

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string backend_;
  std::chrono::milliseconds timeout_;
  std::string name_;
  std::string bind_host_;
  int rank_ = 0;
  int size_ = 1;
  int splits_ = 0;
  std::map<std::string, std::shared_ptr<Communicator>> lanes_;
  std::shared_ptr<CommStats> stats_ = std::make_shared<CommStats>();
  std::unique_ptr<detail::RingReduceScatter> ring_;  // reduce_scatter's pipelined exchange, lazily
  std::unique_ptr<detail::RingReduceScatter> gather_p2p_;  // all_gather's direct exchange, lazily
  detail::RingReduceScatter& gather_p2p();                 // gather_p2p_, made at first use
  detail::RingReduceScatter& reduce_p2p();                 // ring_, made at first use
  std::shared_ptr<const std::vector<PeerInfo>> peers_ = std::make_shared<std::vector<PeerInfo>>();
};

}  // namespace fsdp
