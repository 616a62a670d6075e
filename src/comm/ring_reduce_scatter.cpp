#include "ring_reduce_scatter.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "rank_order_sum.h"
#include "shm_transport.h"

namespace fsdp::detail {

// A Work completed by the ring's worker thread (c10d::Work::finish is protected), with a future
// for completion callbacks (the communicator's trace spans). Not in the anonymous namespace: a
// member of RingReduceScatter::Job holds one.
class RingWork : public c10d::Work {
 public:
  explicit RingWork(c10d::OpType op) : c10d::Work(-1, op) {}
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

namespace {

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
constexpr int kTagsPerRing = static_cast<int>(RingReduceScatter::kTagsPerJob);
constexpr uint32_t kRingTagSpace = 1u << 18;

// Elements per piece of a block of n: pieces of at most kMaxPieceBytes, at most max_pieces of
// them, all but the last of one size. A block within kMaxPieceBytes travels whole.
int64_t piece_numel(int64_t n, int64_t element_size, int64_t max_pieces) {
  const int64_t bytes = n * element_size;
  const int64_t wanted =
      (bytes + RingReduceScatter::kMaxPieceBytes - 1) / RingReduceScatter::kMaxPieceBytes;
  const int64_t count = std::clamp<int64_t>(wanted, 1, max_pieces);
  return std::max<int64_t>(1, (n + count - 1) / count);
}

// The rank-order exchange's chunk, in elements of a block of n.
int64_t rank_order_chunk(int64_t n, int64_t element_size) {
  return piece_numel(n, element_size, kTagsPerRing);
}

}  // namespace

struct RingReduceScatter::Job {
  Job() = default;
  Job(at::Tensor out, at::Tensor in, at::Tensor scratch_, std::chrono::milliseconds timeout_,
      c10d::OpType op)
      : output(std::move(out)),
        input(std::move(in)),
        scratch(std::move(scratch_)),
        timeout(timeout_),
        work(c10::make_intrusive<RingWork>(op)) {}

  at::Tensor output, input, scratch;
  std::chrono::milliseconds timeout{0};
  int tag_base = 0;
  c10::intrusive_ptr<RingWork> work;
  Algorithm algorithm = Algorithm::kRing;
  bool average = false;  // kRankOrder: divide by the world size as the alltoall path does
  // kAllGather: piece i of peer j lands in into[j][i]; from `pieces` (else input) to every peer.
  std::vector<std::vector<at::Tensor>> into;
  std::vector<at::Tensor> pieces;
};

RingReduceScatter::RingReduceScatter(c10::intrusive_ptr<c10d::ProcessGroup> pg, int tag_offset)
    : pg_(std::move(pg)), tag_offset_(tag_offset) {}

RingReduceScatter::~RingReduceScatter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  if (shm_) shm_->abort();  // a shared-memory job waiting for its peers ends within a tick
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

int64_t RingReduceScatter::rank_order_scratch_numel(int64_t n, int world, int64_t element_size) {
  const int64_t chunk = rank_order_chunk(n, element_size);
  const int64_t chunks = n == 0 ? 0 : (n + chunk - 1) / chunk;
  return std::min<int64_t>(chunks, kWindowChunks) * std::max(world - 1, 1) * chunk;
}

bool RingReduceScatter::supports(const at::Tensor& input, int world) {
  return world == 2 && input.is_cpu() &&
         (input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble);
}

void RingReduceScatter::attach_shared_memory(std::unique_ptr<ShmTransport> shm) {
  std::lock_guard<std::mutex> lock(mu_);
  FSDP_CHECK(!worker_.joinable(), "attach_shared_memory: the exchange has already run jobs");
  shm_ = std::move(shm);
}

std::optional<RingReduceScatter::Algorithm> RingReduceScatter::choose(const at::Tensor& input,
                                                                      int world,
                                                                      bool shared_memory) {
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
  if (supports(input, world) && !shared_memory) return Algorithm::kRing;
  return Algorithm::kRankOrder;
}

c10::intrusive_ptr<c10d::Work> RingReduceScatter::run(const at::Tensor& output,
                                                      const at::Tensor& input,
                                                      const at::Tensor& scratch,
                                                      std::chrono::milliseconds timeout) {
  const int64_t ws = pg_->getSize(), n = output.numel();
  FSDP_CHECK(input.numel() == ws * n, "ring reduce_scatter: input has ", input.numel(),
             " elements, expected ", ws * n);
  Job job(output, input, scratch, timeout, c10d::OpType::REDUCE_SCATTER);
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
  Job job(output, input, scratch, timeout, c10d::OpType::REDUCE_SCATTER);
  job.algorithm = Algorithm::kRankOrder;
  job.average = average;
  // Without a caller's scratch (or with too small a one) the worker lends its own window.
  if (job.scratch.defined() &&
      job.scratch.numel() < rank_order_scratch_numel(n, ws, input.element_size()))
    job.scratch = at::Tensor();
  return enqueue(std::move(job));
}

c10::intrusive_ptr<c10d::Work> RingReduceScatter::run_all_gather(
    const at::Tensor& output, const at::Tensor& input, std::chrono::milliseconds timeout) {
  const int ws = pg_->getSize();
  const int64_t n = input.numel();
  FSDP_CHECK(output.numel() == ws * n, "direct all_gather: output has ", output.numel(),
             " elements, expected ", ws * n);
  std::vector<std::vector<at::Tensor>> into(ws);
  for (int j = 0; j < ws; ++j) into[j].push_back(output.narrow(0, j * n, n));
  into[pg_->getRank()][0].copy_(input);
  return run_all_gather_pieces(std::move(into), {input}, timeout);
}

c10::intrusive_ptr<c10d::Work> RingReduceScatter::run_all_gather_pieces(
    std::vector<std::vector<at::Tensor>> outputs, std::vector<at::Tensor> inputs,
    std::chrono::milliseconds timeout) {
  FSDP_CHECK(inputs.size() <= kTagsPerJob, "all_gather of ", inputs.size(), " pieces: at most ",
             kTagsPerJob, " fit one collective");
  FSDP_CHECK(outputs.size() == static_cast<size_t>(pg_->getSize()),
             "all_gather pieces: one output list per rank expected");
  for (const auto& row : outputs)
    FSDP_CHECK(row.size() == inputs.size(), "all_gather pieces: ", row.size(),
               " outputs for a rank but ", inputs.size(), " inputs");
  Job job({}, {}, {}, timeout, c10d::OpType::ALLGATHER);
  job.algorithm = Algorithm::kAllGather;
  job.into = std::move(outputs);
  job.pieces = std::move(inputs);
  return enqueue(std::move(job));
}

c10::intrusive_ptr<c10d::Work> RingReduceScatter::enqueue(Job job) {
  job.tag_base = tag_offset_ + static_cast<int>(rings_++ % kRingTagSpace) * kTagsPerRing;
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
  // The rank-order sums run on this thread, one pass per chunk (rank_order_sum.h).
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
      } else if (job.algorithm == Algorithm::kRankOrder) {
        if (shm_) {
          shm_->reduce(job.output, job.input, job.average, job.timeout);
        } else {
          reduce_rank_order(job);
        }
      } else if (shm_) {
        shm_->all_gather(job.into, job.pieces, job.timeout);
      } else {
        all_gather(job);
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
  // Pieces per step within the ring's tag space.
  const int64_t max_pieces = std::max<int64_t>(1, kTagsPerRing / std::max(ws - 1, 1));
  const int64_t piece = piece_numel(n, job.input.element_size(), max_pieces);
  const int64_t pieces = (n + piece - 1) / piece;
  auto slice = [&](const at::Tensor& t, int64_t k) {
    return t.narrow(0, k * piece, std::min(piece, n - k * piece));
  };
  auto block = [&](int64_t b) { return job.input.narrow(0, ((b % ws + ws) % ws) * n, n); };
  // In place: the output is this rank's own block of the input, which the last step adds to, so
  // that step cannot receive into the output; its pieces land in a window of a few pieces instead,
  // each re-posted once added (received + mine == mine + received: the same bits).
  const int last = ws - 2;
  const bool in_place = job.output.data_ptr() == block(r).data_ptr();
  const int64_t window = in_place ? std::min<int64_t>(pieces, kWindowChunks) : 0;
  const at::Tensor slots =
      in_place ? at::empty({window * piece}, job.input.options()) : at::Tensor();
  // Step s receives piece k into landing(s, k): scratch for the partial sums, the output (or the
  // window) in the last step.
  auto landing = [&](int s, int64_t k) {
    if (s < last) return slice(job.scratch.narrow(0, s * n, n), k);
    if (!in_place) return slice(job.output, k);
    return slots.narrow(0, (k % window) * piece, std::min(piece, n - k * piece));
  };
  auto tag = [&](int s, int64_t k) { return job.tag_base + static_cast<int>(s * pieces + k); };
  auto wait = [&](const c10::intrusive_ptr<c10d::Work>& w) { w->wait(job.timeout); };
  auto add = [](const at::Tensor& dst, const at::Tensor& src) {
    if (dst.scalar_type() == at::kFloat) {
      add_into<float>(dst, src);
    } else {
      add_into<double>(dst, src);
    }
  };

  std::vector<c10::intrusive_ptr<c10d::Work>> recvs((ws - 1) * pieces), sends;
  auto post = [&](int s, int64_t k) {
    std::vector<at::Tensor> t{landing(s, k)};
    recvs[s * pieces + k] = pg_->recv(t, left, tag(s, k));
  };
  for (int s = 0; s < ws - 1; ++s)
    for (int64_t k = 0; k < (s == last && in_place ? window : pieces); ++k) post(s, k);
  for (int64_t k = 0; k < pieces; ++k) {
    std::vector<at::Tensor> t{slice(block(r - 1), k)};
    sends.push_back(pg_->send(t, right, tag(0, k)));
  }
  for (int s = 0; s < ws - 1; ++s) {
    const at::Tensor mine = block(r - 2 - s);
    for (int64_t k = 0; k < pieces; ++k) {
      wait(recvs[s * pieces + k]);
      at::Tensor got = landing(s, k);
      if (s == last && in_place) {
        add(slice(job.output, k), got);  // the output is `mine`
        if (k + window < pieces) post(s, k + window);
        continue;
      }
      add(got, slice(mine, k));
      if (s < last) {
        std::vector<at::Tensor> t{got};
        sends.push_back(pg_->send(t, right, tag(s + 1, k)));
      }
    }
  }
  for (auto& w : sends) wait(w);
}

void RingReduceScatter::all_gather(Job& job) {
  const int ws = pg_->getSize(), r = pg_->getRank();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (int d = 1; d < ws; ++d) {  // from r-1, r-2, ... and to r+1, r+2, ...: no common first peer
    const int from = (r - d + ws) % ws, to = (r + d) % ws;
    for (size_t i = 0; i < job.pieces.size(); ++i) {
      const int tag = job.tag_base + static_cast<int>(i);
      if (job.into[from][i].numel() > 0) {
        std::vector<at::Tensor> t{job.into[from][i]};
        works.push_back(pg_->recv(t, from, tag));
      }
      if (job.pieces[i].numel() > 0) {
        std::vector<at::Tensor> t{job.pieces[i]};
        works.push_back(pg_->send(t, to, tag));
      }
    }
  }
  for (auto& w : works) w->wait(job.timeout);
}

void RingReduceScatter::reduce_rank_order(Job& job) {
  const int ws = pg_->getSize(), r = pg_->getRank();
  const int64_t n = job.output.numel();
  if (n == 0) return;
  const int64_t chunk = rank_order_chunk(n, job.input.element_size());
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t window = std::min<int64_t>(chunks, kWindowChunks);
  auto cols = [&](int64_t k) { return std::make_pair(k * chunk, std::min(chunk, n - k * chunk)); };
  // Chunk k from every other rank lands in slot k % window: (N - 1, chunk), rows in rank order
  // without this rank's own (read where it lies). The slot is received into again (chunk
  // k + window) once chunk k is summed. Without a caller's scratch, the window this worker keeps
  // (reused from job to job: a fresh one per call cost a page fault per 4 KiB).
  const int64_t need = window * (ws - 1) * chunk;
  if (!job.scratch.defined()) {
    if (!window_.defined() || window_.scalar_type() != job.input.scalar_type() ||
        window_.numel() < need)
      window_ = at::empty({need}, job.input.options());
    job.scratch = window_;
  }
  const at::Tensor slots = job.scratch.narrow(0, 0, need).view({window, ws - 1, chunk});
  auto landing = [&](int64_t k, int j) {
    return slots[k % window][j < r ? j : j - 1].narrow(0, 0, cols(k).second);
  };
  auto mine_for = [&](int j, int64_t k) {
    const auto [off, len] = cols(k);
    return job.input.narrow(0, j * n + off, len);
  };
  auto wait = [&](const c10::intrusive_ptr<c10d::Work>& w) { w->wait(job.timeout); };

  // recvs[k * ws + j]: chunk k of the block from rank j, posted `window` chunks ahead. Sends are
  // all posted up front (Gloo moves a send once its receive is posted) and go to r+1, r+2, ... so
  // that every rank does not start with the same peer.
  std::vector<c10::intrusive_ptr<c10d::Work>> recvs(chunks * ws), sends;
  auto post_recvs = [&](int64_t k) {
    for (int j = 0; j < ws; ++j) {
      if (j == r) continue;
      std::vector<at::Tensor> t{landing(k, j)};
      recvs[k * ws + j] = pg_->recv(t, j, job.tag_base + static_cast<int>(k));
    }
  };
  for (int64_t k = 0; k < window; ++k) post_recvs(k);
  for (int64_t k = 0; k < chunks; ++k)
    for (int i = 1; i < ws; ++i) {
      const int j = (r + i) % ws;
      std::vector<at::Tensor> t{mine_for(j, k)};
      sends.push_back(pg_->send(t, j, job.tag_base + static_cast<int>(k)));
    }
  std::vector<at::Tensor> rows(ws);
  for (int64_t k = 0; k < chunks; ++k) {
    const auto [off, len] = cols(k);
    for (int j = 0; j < ws; ++j) {
      if (j != r) wait(recvs[k * ws + j]);
      rows[j] = j == r ? mine_for(r, k) : landing(k, j);
    }
    // The alltoall path's finish, on these columns: summed over the ranks in order, this rank's
    // own chunk read where it lies (the output may be that very chunk: an in-place call).
    sum_in_rank_order(job.output.narrow(0, off, len), rows, job.average);
    if (k + window < chunks) post_recvs(k + window);
  }
  for (auto& w : sends) wait(w);
}

}  // namespace fsdp::detail
