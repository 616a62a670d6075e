#include "ring_reduce_scatter.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include <algorithm>
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
      reduce(job);
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

}  // namespace fsdp::detail
