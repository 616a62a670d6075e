// Exchange: how the bytes of the point-to-point all-gathers and reduce-scatters move between the
// ranks of one communicator. Two implementations: GlooExchange (the process group's send/recv,
// over TCP) and ShmExchange (shared memory, every rank on one host). The communicator chooses one
// when it is built (communicator_impl.h) and runs its collectives on it; the algorithms (what is
// summed, in which order) live in the communicator, not here.
//
// Jobs must run in the same order on every rank of the communicator: one ExchangeWorker per
// exchange runs them, one at a time (exchange_worker.h). Every wait on a peer gives up after
// `timeout` and throws fsdp::CommError naming the cause.
// Thread-safety: one job at a time (on the worker's thread or a waiter's, handed over under the
// worker's mutex); abort() from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

namespace fsdp::detail {

class Exchange {
 public:
  virtual ~Exchange() = default;

  // into[j][i] receives peer j's pieces[i] (same size on both sides; sizes may differ between
  // pieces and ranks; empty pieces are not sent); into[rank] is not touched. Every tensor CPU,
  // contiguous, of one dtype.
  virtual void all_gather(const std::vector<std::vector<at::Tensor>>& into,
                          const std::vector<at::Tensor>& pieces,
                          std::chrono::milliseconds timeout) = 0;

  // The block exchange under a reduce-scatter: `input` (world * n elements, CPU, contiguous) is
  // split into `world` blocks of n; block j goes to rank j. The blocks arrive in chunks, in order;
  // for each chunk, `consume(offset, rows)` gets rows[r] = rank r's chunk of this rank's block
  // (`offset` elements in, rows[rank] read from `input` where it lies). The rows are valid only
  // during the call; consume may write the chunk of this rank's own block in `input`.
  using ChunkConsumer = std::function<void(int64_t offset, const std::vector<at::Tensor>& rows)>;
  virtual void exchange_blocks(const at::Tensor& input, int64_t n, const ChunkConsumer& consume,
                               std::chrono::milliseconds timeout) = 0;

  // Whether a job may run on the thread that issues it or waits for its result, and may yield
  // (exchange_worker.h): true where the exchange moves bytes without blocking (shared memory),
  // false where its sends block (TCP).
  virtual bool waiter_may_run() const { return false; }

  // How the jobs that follow wait for their peers: `spin`, how long they watch for them before
  // sleeping; `yield`, return at once instead (throwing Yielded) where nothing can move, as they
  // do once `until` has passed. A job that yielded resumes where it stopped when it is called
  // again with the same arguments, which must happen before any other job of this exchange. Only
  // where waiter_may_run().
  struct Patience {
    std::chrono::microseconds spin{30};
    bool yield = false;
    std::chrono::steady_clock::time_point until = std::chrono::steady_clock::time_point::max();
  };
  struct Yielded {};
  virtual void set_patience(Patience patience) { (void)patience; }

  // Makes the running job (if any) and every later one fail soon instead of waiting for their
  // peers: the owner is being destroyed. Any thread.
  virtual void abort() {}
};

}  // namespace fsdp::detail
