// VerifiedCollectives' mutable state (core/verified.h), shared with the completion steps of the
// collectives in flight: a step may run on any thread that waits, and after the root is gone (a
// handle waited late), so it holds this, not the observer.
// Thread-safety: every field under mu.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/verified.h"
#include "util/mutex.h"

namespace fsdp::detail {

struct VerifiedCollectives::State {
  State(int n, int me) : n(n), me(me), window(n) {}
  // A completion step's token: `orphaned` once a check came before the step ran (the window it
  // belonged to was skipped on every rank; it folds nothing into the next).
  struct Pending {
    bool done = false, orphaned = false;
  };
  // Between issuing_reduce_scatter and issued_reduce_scatter of one collective.
  struct Issuing {
    int64_t total = 0;  // its place among the model's reduce-scatters
    bool custom = false, sketched = false;
    size_t record = SIZE_MAX;  // its ReduceRecord in window.reduces (past the end: not recorded)
    double scale = 1;          // m: N for a mean, 1 for a sum
    double out_gamma = 0;      // c: the relative rounding of the output
    double out_absolute = 0;   // e: its absolute rounding (subnormals)
    uint64_t seed = 0;
    int64_t lo = 0, hi = 0;  // the elements sketched
    int64_t numel = 0;       // elements per rank (the output's)
  };

  void fold_gather(int64_t position, int64_t group, int first, const std::vector<uint64_t>& digests,
                   int64_t bytes) FSDP_REQUIRES(mu);
  void fold_wire(const Issuing& is, const Work::Digests* d) FSDP_REQUIRES(mu);
  void fold_output(const Issuing& is, const at::Tensor& out) FSDP_REQUIRES(mu);

  const int n, me;
  Mutex mu;
  Settings settings FSDP_GUARDED_BY(mu);
  bool active FSDP_GUARDED_BY(mu) = false;
  int64_t step FSDP_GUARDED_BY(mu) = 0;  // iterations (backward checks) completed
  int64_t gathers_issued FSDP_GUARDED_BY(mu) = 0, reduces_issued FSDP_GUARDED_BY(mu) = 0;
  Window window FSDP_GUARDED_BY(mu);
  std::vector<std::shared_ptr<Pending>> pending FSDP_GUARDED_BY(mu);
  Issuing issuing FSDP_GUARDED_BY(mu);
};

}  // namespace fsdp::detail
