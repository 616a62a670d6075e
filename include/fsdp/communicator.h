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
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
class Store;
class Work;
}  // namespace c10d

namespace fsdp {

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
  // A Work that completes once this one has and `step` has run (once, on the thread that waits
  // for it): a collective followed by a local step of the caller's, such as decoding a quantized
  // all-gather's bytes or summing a reduce-scatter's blocks. A failure of this one is rethrown
  // without the step; a step that throws fails the Work the same way.
  Work then(std::function<void()> step) const;

  // Digests of the bytes a collective moved, for checks of its contents (verified collectives,
  // docs/verified_collectives.md): the XXH3 of what this rank sent to each rank and of what it
  // received from each rank, indexed by rank of the communicator (this rank's own entries 0).
  // A collective that computes them attaches them (with_digests), filled by the time its Work
  // completes; then() keeps them. Null where none were attached.
  struct Digests {
    std::vector<uint64_t> sent, received;
  };
  std::shared_ptr<const Digests> digests() const;
  // This Work with `d` attached (the same completion).
  Work with_digests(std::shared_ptr<const Digests> d) const;
  // Internal (src/comm): what this Work holds; null for an empty Work.
  Impl* impl() const { return impl_.get(); }

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

// How a communicator's all-gathers and reduce-scatters travel, chosen once when it is built
// (FSDP_TRANSPORT: auto, shm, tcp or collective; default auto):
//   shm: shared memory between the ranks (auto's choice when every rank is on this host);
//   tcp: the process group's point-to-point send/recv (auto's choice across hosts);
//   collective: the backend's own all-gather and all-to-all (the only choice under NCCL).
// shm and tcp sum a reduce-scatter's blocks in rank order as they arrive, bitwise equal to
// collective's (the blocks exchanged, then summed in rank order); CUDA tensors always take the
// collective path. all_reduce, broadcast and barrier are the backend's in every case. Under NCCL a
// CPU tensor is copied to the current CUDA device for the collective and back at wait().
enum class Transport { kShm, kTcp, kCollective };
const char* to_string(Transport t);

class Communicator {
 public:
  // Wraps an existing c10d process group. `store` is kept for split(); `backend` is "gloo" or
  // "nccl"; `peers`: the ranks' identities (init_process_group passes them), which name a dead
  // peer in failure messages and tell which ranks share this host. Collective: connects the
  // transport (FSDP_TRANSPORT), so every rank of `pg` constructs its communicator together.
  Communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::intrusive_ptr<c10d::Store> store,
               std::string backend, std::chrono::milliseconds timeout, std::string name = "world",
               std::string bind_host = "127.0.0.1", std::vector<PeerInfo> peers = {});
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int size() const;
  const std::string& name() const;
  const std::string& backend() const;
  std::chrono::milliseconds timeout() const;
  void set_timeout(std::chrono::milliseconds t);
  // How this communicator's all-gathers and reduce-scatters travel.
  Transport transport() const;

  // Collectives return once issued; each holds the tensors it was given until its Work completes,
  // so a temporary input (a converted copy) may be passed and dropped by the caller.
  //
  // REQUIRES: output contiguous, output.numel() == size() * input.numel(), same dtype.
  // output[r * n : (r + 1) * n] receives rank r's input.
  Work all_gather(const at::Tensor& output, const at::Tensor& input);
  // REQUIRES: input contiguous, input.numel() == size() * output.numel(), same dtype.
  // output = op over ranks of input[rank * n : (rank + 1) * n], summed in rank order 0..N-1 (the
  // same bits on every transport). Low-precision data is summed in fp32. The output may be this
  // rank's own block of the input, input[rank * n : (rank + 1) * n] (in place: no output buffer;
  // the rest of the input is left as it was), with the same result.
  Work reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op);
  // REQUIRES: output and input contiguous, distinct, of one dtype and size, a multiple of size().
  // Block j of the input (numel / size() elements) goes to rank j; block r of the output comes
  // from rank r (this rank's own block copied). The exchange under a reduce-scatter that sums
  // blocks of its own making (a quantized wire, fsdp/quantized.h); on the reduce-scatters'
  // transport and in their order (shm and tcp: their worker; collective: the backend's
  // all-to-all).
  Work all_to_all(const at::Tensor& output, const at::Tensor& input);
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
  // Unlike split() and subgroup(), which read FSDP_TRANSPORT when they build their communicator,
  // a lane keeps the transport this communicator was built with.
  std::shared_ptr<Communicator> lane(const std::string& name);
  // The same over `ranks` only (subgroup()'s rules): created on first use by those ranks, shared
  // afterwards (hpZ's post-forward lanes, one per shard group and world size).
  std::shared_ptr<Communicator> lane(const std::string& name, const std::vector<int>& ranks);

  // The c10d process group underneath, for c10d facilities that take one (e.g. c10d::Reducer);
  // collectives issued on it bypass this communicator's checks, timeouts and statistics.
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const;
  const std::vector<PeerInfo>& peers() const;

  const CommStats& stats() const;
  // This communicator's statistics plus those of every lane, split and subgroup created from it,
  // recursively (a destroyed one's up to its end): all the traffic of this rank that started
  // here.
  CommStats total_stats() const;
  void reset_stats();

  struct Impl;  // src/comm/communicator_impl.h
  // Internal (split, subgroup, lane): a communicator over `impl`'s process group; connects the
  // transport impl->requested names.
  explicit Communicator(std::unique_ptr<Impl> impl);
  Impl& impl() { return *impl_; }
  const Impl& impl() const { return *impl_; }

 private:
  void adopt(const std::shared_ptr<Communicator>& child);  // split, subgroup: count its traffic
  // subgroup()'s checks of `ranks`: ascending ranks of this communicator, this one among them.
  void check_subgroup(const std::string& name, const std::vector<int>& ranks) const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp
