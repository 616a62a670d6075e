// Agreement: checks that every rank issued the same collectives, in the same order, on both lanes
// (all-gathers and reduce-scatters), at every backward and at the end of every forward of the
// root without grad mode, whatever the audit's setting ([Note: agreement on both lanes] in
// docs/design.md). Ranks that call different sharded modules of equal sizes would otherwise
// exchange the wrong groups' bytes without any error.
//
// Each collective is recorded as (group registration index, padded shard elements, and for a
// reduction under HSDP whether it skips the all-reduce across replicas) into a running 64-bit
// hash per lane; one all-gather of the hashes per check (40 bytes per rank, and one bit per
// parameter after a backward: [Note: parameters that got no gradient]) compares them. Only when
// they differ are the recorded sequences exchanged, to name the first collective that differs
// and the groups on both ranks. Without the audit at most kMaxRecorded entries are kept per lane
// between checks (the hash covers all).
// Thread-safety: used under the Context's mutex.
#pragma once

#include <fsdp/communicator.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::detail {

class Group;

class Agreement {
 public:
  static constexpr size_t kMaxRecorded = 1 << 16;

  void on_gather(int group, int64_t numel) { gathers_.record(group, numel, false); }
  // `kept_aside`: HSDP without the all-reduce across replicas (FSDPModule::set_requires_all_reduce
  // off), which the ranks must decide alike too.
  void on_reduce(int group, int64_t numel, bool kept_aside) {
    reduces_.record(group, numel, kept_aside);
  }
  // Compares this rank's sequences since the previous check with every other rank of the shard
  // `lane` and, under HSDP, of the `replicate` lane (collective over both; together they connect
  // every rank of the mesh), then starts new ones. Every rank of the mesh either returns or throws
  // fsdp::Error naming the first collective that differs, the groups and the ranks. `bits` (the
  // same number of words on every rank) travel in the same exchange: returned ORed over the mesh.
  std::vector<uint64_t> check(Communicator& lane, Communicator* replicate,
                              const std::vector<Group*>& groups, std::vector<uint64_t> bits = {});
  void reset();
  // HSDP: whether each group all-reduces across replicas (FSDPModule::set_requires_all_reduce) is
  // the same on every rank of the mesh, checked when a synced backward begins, before any
  // all-reduce is issued: a rank that skipped one its peers issue would leave them waiting. Two
  // small exchanges (the shard lane, then the replicate lane); every rank returns or throws.
  void check_all_reduce_settings(Communicator& lane, Communicator& replicate,
                                 const std::vector<Group*>& groups);

 private:
  struct Sequence {
    // The first kMaxRecorded: (group, 2 * numel + flag).
    std::vector<std::pair<int, int64_t>> entries;
    uint64_t hash = 0;
    int64_t count = 0;
    void record(int group, int64_t numel, bool flag);
  };
  // The first position where `lane`'s ranks differ, named (collective over `lane`); empty when
  // the recorded entries agree.
  static std::string first_difference(Communicator& lane, const char* what, const Sequence& s,
                                      const std::vector<Group*>& groups);

  Sequence gathers_, reduces_;
};

}  // namespace fsdp::detail
