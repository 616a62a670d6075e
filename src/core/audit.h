// Audit: checks the four post-backward invariants at every backward on every rank
// ([Note: the post-backward guarantee] and [Note: agreement on both lanes] in docs/design.md).
// Enabled by ShardOptions::audit or FSDP_AUDIT=1. Violations are collected while backward runs
// and thrown as fsdp::AuditError from the final callback, naming the group, the parameter and the
// event. Agreed covers both lanes: every all-gather issued since the previous check (forward,
// backward prefetch and catch-up alike) and every reduce-scatter of this backward are compared
// with rank 0's, on a lane of the audit's own.
// Thread-safety: used under the Context's mutex.
#pragma once

#include <fsdp/communicator.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::detail {

class Group;
class BackwardPass;

class Audit {
 public:
  bool enabled = false;
  std::shared_ptr<Communicator> lane;  // its own ordering lane for the Agreed exchange

  // Collectives issued (group registration index, padded shard elements).
  void on_gather(int group, int64_t numel);
  void on_reduce(int group, int64_t numel);
  // Events seen while backward runs.
  void late_gradient(const Group& g, size_t param_index);  // Final: after the group was issued
  void issued_twice(const Group& g);                       // Once

  // At the end of backward: Final (no gradient re-appeared after reduction), Once, Complete (every
  // synced trainable group issued and waited, every trainable shard has a gradient) and Agreed
  // (every rank issued the same all-gathers and reductions in the same order). Throws AuditError.
  void check(const BackwardPass& pass, const std::vector<Group*>& groups);

  int64_t backwards_checked() const { return checked_; }

 private:
  using Log = std::vector<std::pair<int, int64_t>>;
  void check_reductions(const BackwardPass& pass, const std::vector<Group*>& groups);
  void check_agreed(const char* what, const Log& log, const std::vector<Group*>& groups);

  Log gathers_, reduces_;
  std::vector<std::string> violations_;
  int64_t checked_ = 0;
};

}  // namespace fsdp::detail
