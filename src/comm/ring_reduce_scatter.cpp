#include "ring_reduce_scatter.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

namespace fsdp::detail {
namespace {

// A Work completed by the ring's worker thread (c10d::Work::finish is protected), with a future
// for completion callbacks (the communicator's trace spans).
class RingWork : public c10d::Work {
 public:
  RingWork() : c10d::Work(-1, c10d::OpType::REDUCE_SCATTER) {}
  void complete(std::exception_ptr error) {
    finish(error);
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(std::vector<at::Tensor>{}));
    }
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_ =
      c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
};

// dst += src, one thread: memory-bound, and an intra-op (OpenMP) team here would spin on the
// cores the ranks' compute and Gloo's threads need.
template <class T>
void add_into(const at::Tensor& dst, const at::Tensor& src) {
  T* d = dst.data_ptr<T>();
  const T* s = src.data_ptr<T>();
  const int64_t n = dst.numel();
  for (int64_t i = 0; i < n; ++i) d[i] += s[i];
}

// Tags: 2^18 rings in flight before reuse, 4096 (step, piece) pairs per ring.
constexpr int kTagsPerRing = 4096;
constexpr uint32_t kRingTagSpace = 1u << 18;

}  // namespace

struct RingReduceScatter::Job {
  at::Tensor output, input, scratch;
  std::chrono::milliseconds timeout;
  int tag_base = 0;
  c10::intrusive_ptr<RingWork> work;
  Algorithm algorithm = Algorithm::kRing;
  bool average = false;  // kRankOrder: divide by the world size as the alltoall path does
};

RingReduceScatter::RingReduceScatter(c10::intrusive_ptr<c10d::ProcessGroup> pg)
    : pg_(std::move(pg)) {}

RingReduceScatter::~RingReduceScatter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

bool RingReduceScatter::supports(const at::Tensor& input, int world) {
  return world == 2 && input.is_cpu() &&
         (input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble);
}

std::optional<RingReduceScatter::Algorithm> RingReduceScatter::choose(const at::Tensor& input,
                                                                      int world) {
  if (!input.is_cpu() || world < 2) return std::nullopt;
  const char* env = std::getenv("FSDP_REDUCE_SCATTER");
  const std::string choice = env && *env ? env : "auto";
  if (choice == "alltoall") return std::nullopt;
  if (choice == "rank-order") return Algorithm::kRankOrder;
  if (choice == "ring") {
    FSDP_CHECK(supports(input, world),
               "FSDP_REDUCE_SCATTER=ring needs fp32 or fp64 tensors on two "
               "ranks (here ",
               input.scalar_type(), " on ", world,
               " ranks); unset it or use rank-order or alltoall");
    return Algorithm::kRing;
  }
  FSDP_CHECK(choice == "auto", "FSDP_REDUCE_SCATTER='", choice,
             "' is not one of auto, rank-order, ring, alltoall");
  if (supports(input, world)) return Algorithm::kRing;
  return Algorithm::kRankOrder;
}

c10::intrusive_ptr<c10d::Work> RingReduceScatter::run(const at::Tensor& output,
                                                      const at::Tensor& input,
                                                      const at::Tensor& scratch,
                                                      std::chrono::milliseconds timeout) {
  const int64_t ws = pg_->getSize(), n = output.numel();
  FSDP_CHECK(input.numel() == ws * n, "ring reduce_scatter: input has ", input.numel(),
             " elements, expected ", ws * n);
  Job job{output, input, scratch, timeout, 0, c10::make_intrusive<RingWork>()};
  if (!job.scratch.defined() || job.scratch.numel() < (ws - 2) * n)
    job.scratch = at::empty({std::max<int64_t>(ws - 2, 0) * n}, input.options());
  return enqueue(std::move(job));
}

c10::intrusive_ptr<c10d::Work> RingReduceScatter::run_rank_order(
    const at::Tensor& output, const at::Tensor& input, const at::Tensor& scratch, bool average,
    std::chrono::milliseconds timeout) {
  const int64_t ws = pg_->getSize(), n = output.numel();
  FSDP_CHECK(input.numel() == ws * n, "rank-order reduce_scatter: input has ", input.numel(),
             " elements, expected ", ws * n);
  Job job{output, input, scratch, timeout, 0, c10::make_intrusive<RingWork>()};
  job.algorithm = Algorithm::kRankOrder;
  job.average = average;
  if (!job.scratch.defined() || job.scratch.numel() < ws * n)
    job.scratch = at::empty({ws * n}, input.options());
  return enqueue(std::move(job));
}

c10::intrusive_ptr<c10d::Work> RingReduceScatter::enqueue(Job job) {
  job.tag_base = static_cast<int>(rings_++ % kRingTagSpace) * kTagsPerRing;
  auto work = job.work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(job));
    if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
  }
  cv_.notify_one();
  return work;
}

void RingReduceScatter::worker_loop() {
  // The rank-order sums use ATen ops here; ATen's parallel_for gives this thread the program's
  // intra-op thread count on first use, as the alltoall path's sum has on the waiting thread.
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      if (stopping_) {
        job.work->complete(std::make_exception_ptr(
            Error("reduce_scatter: the communicator was destroyed before this ring ran")));
        continue;
      }
    }
    try {
      if (job.algorithm == Algorithm::kRing) {
        reduce(job);
      } else {
        reduce_rank_order(job);
      }
      job.work->complete(nullptr);
    } catch (...) {
      job.work->complete(std::current_exception());
    }
  }
}

void RingReduceScatter::reduce(Job& job) {
  const int ws = pg_->getSize(), r = pg_->getRank();
  const int right = (r + 1) % ws, left = (r + ws - 1) % ws;
  const int64_t n = job.output.numel();
  if (n == 0) return;
  // Pieces per step: at most kMaxPieceBytes each, at least kMinPiecesPerStep of at least
  // kMinPieceBytes (fewer for small blocks), within the ring's tag space.
  const int64_t block_bytes = n * job.input.element_size();
  const int64_t max_pieces = std::max<int64_t>(1, kTagsPerRing / std::max(ws - 1, 1));
  const int64_t wanted = std::max((block_bytes + kMaxPieceBytes - 1) / kMaxPieceBytes,
                                  std::min(kMinPiecesPerStep, block_bytes / kMinPieceBytes));
  const int64_t count = std::clamp<int64_t>(wanted, 1, max_pieces);
  const int64_t piece = (n + count - 1) / count;
  const int64_t pieces = (n + piece - 1) / piece;
  auto slice = [&](const at::Tensor& t, int64_t k) {
    return t.narrow(0, k * piece, std::min(piece, n - k * piece));
  };
  auto block = [&](int64_t b) { return job.input.narrow(0, ((b % ws + ws) % ws) * n, n); };
  // Step s receives into dest(s): scratch for the partial sums, the output in the last step.
  auto dest = [&](int s) { return s == ws - 2 ? job.output : job.scratch.narrow(0, s * n, n); };
  auto tag = [&](int s, int64_t k) { return job.tag_base + static_cast<int>(s * pieces + k); };
  auto wait = [&](const c10::intrusive_ptr<c10d::Work>& w) { w->wait(job.timeout); };

  std::vector<c10::intrusive_ptr<c10d::Work>> recvs, sends;
  for (int s = 0; s < ws - 1; ++s)
    for (int64_t k = 0; k < pieces; ++k) {
      std::vector<at::Tensor> t{slice(dest(s), k)};
      recvs.push_back(pg_->recv(t, left, tag(s, k)));
    }
  for (int64_t k = 0; k < pieces; ++k) {
    std::vector<at::Tensor> t{slice(block(r - 1), k)};
    sends.push_back(pg_->send(t, right, tag(0, k)));
  }
  for (int s = 0; s < ws - 1; ++s) {
    const at::Tensor mine = block(r - 2 - s), d = dest(s);
    for (int64_t k = 0; k < pieces; ++k) {
      wait(recvs[s * pieces + k]);
      at::Tensor got = slice(d, k);
      if (got.scalar_type() == at::kFloat) {
        add_into<float>(got, slice(mine, k));
      } else {
        add_into<double>(got, slice(mine, k));
      }
      if (s < ws - 2) {
        std::vector<at::Tensor> t{got};
        sends.push_back(pg_->send(t, right, tag(s + 1, k)));
      }
    }
  }
  for (auto& w : sends) wait(w);
}

void RingReduceScatter::reduce_rank_order(Job& job) {
  const int ws = pg_->getSize(), r = pg_->getRank();
  const int64_t n = job.output.numel();
  if (n == 0) return;
  // Chunks as the ring's pieces: at most kMaxPieceBytes of each block, at least kMinPiecesPerStep
  // of at least kMinPieceBytes, within the tag space.
  const int64_t block_bytes = n * job.input.element_size();
  const int64_t wanted = std::max((block_bytes + kMaxPieceBytes - 1) / kMaxPieceBytes,
                                  std::min(kMinPiecesPerStep, block_bytes / kMinPieceBytes));
  const int64_t count = std::clamp<int64_t>(wanted, 1, kTagsPerRing);
  const int64_t chunk = (n + count - 1) / count;
  const int64_t chunks = (n + chunk - 1) / chunk;
  auto cols = [&](int64_t k) { return std::make_pair(k * chunk, std::min(chunk, n - k * chunk)); };
  const at::Tensor blocks = job.scratch.narrow(0, 0, ws * n).view({ws, n});  // (N, n), row j from j
  auto piece = [&](const at::Tensor& flat_block, int64_t k) {
    const auto [off, len] = cols(k);
    return flat_block.narrow(0, off, len);
  };
  auto wait = [&](const c10::intrusive_ptr<c10d::Work>& w) { w->wait(job.timeout); };

  // recvs[k * ws + j]: chunk k of the block from rank j. Sends go to r+1, r+2, ... so that every
  // rank does not start with the same peer.
  std::vector<c10::intrusive_ptr<c10d::Work>> recvs(chunks * ws), sends;
  for (int64_t k = 0; k < chunks; ++k) {
    for (int j = 0; j < ws; ++j) {
      if (j == r) continue;
      std::vector<at::Tensor> t{piece(blocks[j], k)};
      recvs[k * ws + j] = pg_->recv(t, j, job.tag_base + static_cast<int>(k));
    }
    for (int i = 1; i < ws; ++i) {
      const int j = (r + i) % ws;
      std::vector<at::Tensor> t{piece(job.input.narrow(0, j * n, n), k)};
      sends.push_back(pg_->send(t, j, job.tag_base + static_cast<int>(k)));
    }
  }
  const bool low = job.input.scalar_type() == at::kHalf || job.input.scalar_type() == at::kBFloat16;
  for (int64_t k = 0; k < chunks; ++k) {
    const auto [off, len] = cols(k);
    piece(blocks[r], k).copy_(piece(job.input.narrow(0, r * n, n), k));
    for (int j = 0; j < ws; ++j)
      if (j != r) wait(recvs[k * ws + j]);
    // The alltoall path's finish, on these columns: (N, len) summed over the ranks in order.
    const at::Tensor b = blocks.narrow(1, off, len);
    at::Tensor sum = low ? b.to(at::kFloat).sum(0) : b.sum(0);
    if (job.average) sum.div_(ws);
    job.output.narrow(0, off, len).copy_(sum);
  }
  for (auto& w : sends) wait(w);
}

}  // namespace fsdp::detail
