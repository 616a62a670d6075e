// Audit: checks the four post-backward invariants at every backward on every rank
// ([Note: the post-backward guarantee] in docs/design.md). Enabled by ShardOptions::audit or
// FSDP_AUDIT=1. Violations are collected while backward runs and thrown as fsdp::AuditError from
// the final callback, naming the group, the parameter and the event.
// Thread-safety: used under the Context's mutex.
#pragma once

#include <fsdp/communicator.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp::detail {

class Group;
struct TaskState;

class Audit {
 public:
  bool enabled = false;
  std::shared_ptr<Communicator> lane;  // its own ordering lane for the Agreed exchange

  // Events seen while backward runs.
  void late_gradient(const Group& g, size_t param_index);  // Final: after the group was issued
  void issued_twice(const Group& g);                       // Once

  // At the end of backward: Final (no gradient re-appeared after reduction), Once, Complete (every
  // synced trainable group issued and waited, every trainable shard has a gradient) and Agreed
  // (every rank issued the same reductions in the same order). Throws AuditError.
  void check(const TaskState& t, const std::vector<Group*>& groups);

  int64_t backwards_checked() const { return checked_; }

 private:
  std::vector<std::string> violations_;
  int64_t checked_ = 0;
};

}  // namespace fsdp::detail
