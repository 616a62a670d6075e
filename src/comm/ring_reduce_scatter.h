// Reduce-scatter over the process group's point-to-point send/recv, pipelined so that the sums
// overlap the transfer: a ring (two ranks), or a chunked exchange summed in rank order (three ranks
// and more; bitwise equal to the alltoall + sum).
//
// The ring (Algorithm::kRing):
// Rank r sends to r+1 and receives from r-1. In step s (0 .. N-2) it forwards the partial sum of
// block (r-1-s) and receives the partial sum of block (r-2-s), to which it adds its own input; the
// last step delivers block r, summed over all ranks, straight into the output. Each step's block
// travels in pieces: every receive is posted up front, and a piece is summed and forwarded as soon
// as it arrives, so the sums overlap the transfer of the following pieces instead of following the
// whole exchange (alltoall + sum, docs/bench_comm.md). Same bytes on the wire as the alltoall:
// (N-1)/N of the input per rank.
//
// The rank-order exchange (Algorithm::kRankOrder): each rank's block for rank j travels to j in
// chunks (every send and receive posted up front); once chunk k has arrived from every rank it is
// summed over the ranks in rank order 0..N-1 by the function the alltoall path finishes with
// (rank_order_sum.h: one pass, fp32 accumulation for fp16/bf16, the average's division, the cast
// back; this rank's own chunk read where it lies): so its results are bitwise those of alltoall +
// sum, while chunk k+1 is still on the wire. Same bytes on the wire as the alltoall.
//
// The direct all-gather (run_all_gather) uses the same machinery: each rank's block goes to every
// peer point to point and lands straight in the output, with no temporary (Gloo 1.13's allgather
// gathers into one as large as the output, then copies out). The communicator gives it an
// instance of its own (own worker, own tag range), so all-gathers never queue behind
// reduce-scatters.
//
// Between ranks on one host, a ShmTransport (shm_transport.h) may carry the rank-order exchange
// and the all-gathers instead of the process group's send/recv (attach_shared_memory): the same
// jobs, in the same order, on the same worker; the ring is not used then (the rank-order sum gives
// the same bits at two ranks).
//
// One worker thread per RingReduceScatter runs the rings in the order they were issued, so every
// rank posts the same point-to-point operations in the same order (tags are unique per ring).
// Thread-safety: run() may be called from one thread at a time; the returned Work may be waited
// from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d

namespace fsdp::detail {

class ShmTransport;

class RingReduceScatter {
 public:
  // Each step's block travels in pieces of at most kMaxPieceBytes; a smaller block travels whole.
  // (Splitting a 256 KiB block into four pieces to overlap its sums cost more than it saved: each
  // piece is a send/recv pair per peer, and at four ranks on two cores the messages, not the sums,
  // dominated: fsdp-bench --comm at 1 MiB, reduce-scatter 0.47-0.58 of the all-gather's bus
  // bandwidth in four pieces, 0.84-0.95 whole; docs/performance.md.)
  static constexpr int64_t kMaxPieceBytes = 1 << 20;
  // The rank-order exchange receives at most this many chunks ahead of its sums: its scratch is
  // kWindowChunks x (N - 1) chunks (a few MiB), not the whole (N, n) exchange.
  static constexpr int64_t kWindowChunks = 4;

  // `tag_offset`: the first point-to-point tag this instance uses (instances on one process group
  // need disjoint ranges: kTagRange tags each).
  static constexpr int kTagRange = 1 << 30;
  explicit RingReduceScatter(c10::intrusive_ptr<c10d::ProcessGroup> pg, int tag_offset = 0);
  // Rings already running finish (each bounded by its timeout; over shared memory they stop at
  // once); queued ones fail.
  ~RingReduceScatter();
  RingReduceScatter(const RingReduceScatter&) = delete;
  RingReduceScatter& operator=(const RingReduceScatter&) = delete;

  // Whether the communicator uses the ring for this input on `world` ranks: CPU tensors of a dtype
  // summed exactly as the alltoall path sums it (fp32, fp64; low precision accumulates in fp32
  // there), and two ranks only. From three ranks on, the ring adds each block's contributions in
  // ring order starting after its owner, not in rank order as the alltoall path's sum does, so
  // results differ in the last bits from the rank-ordered reference; AdamW turns that noise on
  // zero-gradient parameters (an attention key bias) into visible parameter differences (the
  // parity tests at N=3, 4). run() itself is written for any world size, but is used and tested at
  // two ranks only.
  static bool supports(const at::Tensor& input, int world);

  // Moves the rank-order exchanges and all-gathers through `shm` (before the first run: every
  // rank attaches it at the same point, right after ShmTransport::connect).
  void attach_shared_memory(std::unique_ptr<ShmTransport> shm);
  bool shared_memory() const { return shm_ != nullptr; }

  enum class Algorithm {
    kRing,       // the pipelined ring: fp32/fp64 at two ranks (supports())
    kRankOrder,  // the chunked exchange summed in rank order: any CPU dtype, any world size
    kAllGather,  // run_all_gather and run_all_gather_pieces
  };
  // The algorithm the communicator uses for `input` on `world` (>= 2) ranks; nullopt: none (the
  // plain alltoall + sum at wait). FSDP_REDUCE_SCATTER chooses instead of the default ("auto": the
  // ring where supports(), else rank order): "rank-order", "ring" (an error where unsupported) or
  // "alltoall"; read at every call (tests and fsdp-bench compare the paths in one process). With
  // `shared_memory`, "auto" is the rank-order exchange at every world size.
  static std::optional<Algorithm> choose(const at::Tensor& input, int world,
                                         bool shared_memory = false);

  // REQUIRES: CPU fp32/fp64 tensors; output (n), input (N*n) and scratch (at least (N-2)*n, or
  // undefined: allocated) flat, contiguous, one dtype. output = sum over ranks of block `rank` of
  // each rank's input. The inputs must stay alive and unchanged until the Work completes. Every
  // wait on a peer gives up after `timeout` and fails the Work with the cause.
  c10::intrusive_ptr<c10d::Work> run(const at::Tensor& output, const at::Tensor& input,
                                     const at::Tensor& scratch, std::chrono::milliseconds timeout);

  // Elements of the scratch run_rank_order needs for blocks of n elements on `world` ranks.
  static int64_t rank_order_scratch_numel(int64_t n, int world, int64_t element_size);

  // REQUIRES: CPU tensors of one dtype, output (n), input (N*n) and scratch (at least
  // rank_order_scratch_numel, or undefined: a window the worker keeps) flat and contiguous.
  // output = (sum over ranks r = 0..N-1 of block `rank` of rank r's input) [/ N when `average`],
  // computed as Communicator's alltoall path computes it. Lifetime and timeout as run().
  c10::intrusive_ptr<c10d::Work> run_rank_order(const at::Tensor& output, const at::Tensor& input,
                                                const at::Tensor& scratch, bool average,
                                                std::chrono::milliseconds timeout);

  // REQUIRES: CPU tensors of one dtype, output (N*n) and input (n) flat and contiguous. An
  // all-gather over point-to-point messages straight into `output` (one per peer). 1.13 Gloo's
  // allgather gathers into a temporary as large as the output on its own thread and copies it
  // out: this needs neither the second buffer nor the copy. Lifetime and timeout as run().
  c10::intrusive_ptr<c10d::Work> run_all_gather(const at::Tensor& output, const at::Tensor& input,
                                                std::chrono::milliseconds timeout);
  // The all-gather of a list of pieces: outputs[j][i] receives peer j's inputs[i] (of the same
  // size, which may differ between ranks; empty pieces are not sent). outputs[rank] is not
  // touched. At most kTagsPerJob pieces (Communicator::all_gather_into).
  c10::intrusive_ptr<c10d::Work> run_all_gather_pieces(std::vector<std::vector<at::Tensor>> outputs,
                                                       std::vector<at::Tensor> inputs,
                                                       std::chrono::milliseconds timeout);

  static constexpr size_t kTagsPerJob = 4096;  // point-to-point tags of one job

 private:
  struct Job;
  void worker_loop();
  c10::intrusive_ptr<c10d::Work> enqueue(Job job);
  void reduce(Job& job);
  void reduce_rank_order(Job& job);
  void all_gather(Job& job);

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::unique_ptr<ShmTransport> shm_;  // the worker thread's only, once attached
  at::Tensor window_;  // the rank-order exchange's receive window; the worker thread's only
  int tag_offset_;
  uint32_t rings_ = 0;  // rings issued: the tag space of the next one
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool stopping_ = false;
  std::thread worker_;  // started on the first run()
};

}  // namespace fsdp::detail
