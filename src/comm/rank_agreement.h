// Cross-rank agreement: the few collectives with which ranks compare what they hold or raise an
// error together, instead of one rank throwing while the others wait in the next collective.
// Thread-safety: collectives; call from the thread that trains, in the same order on every rank of
// the communicator.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/communicator.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

// Every rank's bytes, indexed by rank (two all-gathers: lengths, then padded bytes).
std::vector<std::string> all_gather_strings(Communicator& c, const std::string& mine);

// Rank `root`'s bytes on every rank (`s` is read on `root` only).
std::string broadcast_string(Communicator& c, const std::string& s, int root = 0);

// ---- raise together ----
// A rank's failure: its rank and its error message ("" on a rank that succeeded).
struct RankFailure {
  int rank = 0;
  std::string message;
};
// Whether any rank failed (one all-reduce; every rank's message gathered only then): the first
// failing rank and its message, the same on every rank; nullopt when none failed.
std::optional<RankFailure> first_failure(Communicator& c, const std::string& error);
// Raises on every rank when `error` is non-empty on any rank: on a failing rank its own message
// (as it was, without a second "fsdp: "), elsewhere "<what> failed on rank <r>: <message>" for the
// first failing rank r.
void raise_together(Communicator& c, const std::string& error, const std::string& what);
// The same over the ranks of `c` and then across `across` (HSDP's replicas, each rank in one
// shard group `c`), so that every rank of the mesh raises; elsewhere the message names the
// communicator of the failing rank ("<what> failed on rank <r> of '<name>': ..."). `across` may be
// null (then as above).
void raise_together(Communicator& c, Communicator* across, const std::string& error,
                    const std::string& what);
// Runs fn and returns what it threw ("" when nothing), for raise_together.
template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

// ---- differences from rank 0 ----
// Where some rank's values first differ from rank 0's: the index, and the first rank (ascending)
// that differs there.
struct RankDifference {
  size_t index = 0;
  int rank = 0;
};
// Every rank's values, indexed by rank (lists may differ in length).
std::vector<std::vector<int64_t>> all_gather_values(Communicator& c,
                                                    const std::vector<int64_t>& mine);
// The first index at which a rank's list differs from rank 0's (a list ending early differs
// there); nullopt when every list equals rank 0's. Not a collective.
std::optional<RankDifference> first_difference_from_rank0(
    const std::vector<std::vector<int64_t>>& per_rank);
// The first tensor (in the given order) whose values (value_checksum, util/checksum.h) differ
// from rank 0's on some rank; nullopt when every rank agrees or at world size 1. Same answer on
// every rank. REQUIRES: the same number of tensors on every rank.
std::optional<RankDifference> first_value_difference(Communicator& c,
                                                     const std::vector<at::Tensor>& tensors);

}  // namespace fsdp::detail
