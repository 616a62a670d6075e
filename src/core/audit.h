// Audit: checks the post-backward invariants Final, Once and Complete at every backward on every
// rank ([Note: the post-backward guarantee] in docs/design.md). Enabled by DebugOptions::audit or
// FSDP_AUDIT=1. Violations are collected while backward runs and thrown as fsdp::AuditError from
// the final callback, naming the group, the parameter and the event. Agreed (both lanes) is checked
// at every backward whether the audit is on or not (core/agreed.h).
// Thread-safety: used under the root's mutex.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::detail {

class Group;
class Backward;

class Audit {
 public:
  bool enabled = false;

  // Events seen while backward runs.
  void late_gradient(const Group& g, size_t param_index);  // Final: after the group was issued
  void issued_twice(const Group& g);                       // Once

  // At the end of backward: Final (no gradient re-appeared after reduction), Once and Complete
  // (every group the backward reduces issued once and waited, every trainable shard that some
  // rank contributed a gradient to has one: `any_rank`, one bit per parameter of `groups` in
  // order, ORed over the mesh). Throws AuditError naming this rank (`rank`).
  void check(const Backward& pass, const std::vector<Group*>& groups,
             const std::vector<uint64_t>& any_rank, int rank);

 private:
  void check_reductions(const Backward& pass, const std::vector<Group*>& groups,
                        const std::vector<uint64_t>& any_rank);

  std::vector<std::string> violations_;
};

}  // namespace fsdp::detail
