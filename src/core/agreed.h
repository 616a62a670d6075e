// AgreedLog: the always-on check that every rank issued the same collectives, in the same order,
// on both lanes (all-gathers and reduce-scatters), at the end of every backward and of every
// forward of the root, whatever the audit's setting ([Note: agreement on both lanes] in
// docs/design.md). It observes the root's lanes (core/lane.h): the algorithm never records itself.
// Ranks whose collectives differ in group but not in size would otherwise exchange the wrong
// groups' bytes without any error.
//
// Each collective is recorded as (group registration index, padded elements per rank, and for a
// reduction under HSDP whether it keeps its block aside) into a running XXH3 hash per lane; one
// all-gather of the hashes per check (40 bytes per rank, and one bit per parameter after a
// backward: [Note: parameters that got no gradient]) compares them. Only when they differ are the
// recorded sequences exchanged, to name the first collective that differs and the groups on both
// ranks. Without the audit at most kMaxRecorded entries are kept per lane between checks (the hash
// covers all).
// Thread-safety: the root's training thread, under the root's mutex.
#pragma once

#include <fsdp/communicator.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/lane.h"

namespace fsdp::detail {

// A check that rides the Agreed exchange (no collective of its own): it adds the same number of
// words to every rank's row and examines every rank's words once they arrived. Every rank sees
// the same rows, so an examine that throws stops every rank alike.
class AgreedRider {
 public:
  virtual ~AgreedRider() = default;
  virtual size_t words() const = 0;
  virtual void fill(int64_t* words) = 0;
  // rows[r]: rank r's words (indexed by rank of the shard lane).
  virtual void examine(const std::vector<const int64_t*>& rows) = 0;
};

class AgreedLog : public LaneObserver {
 public:
  static constexpr size_t kMaxRecorded = 1 << 16;
  using Names = std::function<std::vector<std::string>()>;
  // Checks that ride the exchange on the shard lane (e.g. verified collectives).
  void add_rider(AgreedRider* r) { riders_.push_back(r); }

  void on_all_gather(const Collective& c) override { gathers_.record(c); }
  void on_reduce_scatter(const Collective& c) override { reduces_.record(c); }

  // Compares this rank's sequences since the previous check with every other rank of the shard
  // lane `agree` and, under HSDP, of the `replicate` lane (collective over both; together they
  // connect every rank of the mesh), then starts new ones. Every rank of the mesh either returns or
  // throws fsdp::Error naming the first collective that differs, the groups and the ranks. `bits`
  // (one length on every rank) travel in the same exchange: returned ORed over the mesh.
  std::vector<uint64_t> check(Communicator& agree, Communicator* replicate, const Names& names,
                              std::vector<uint64_t> bits = {});
  // HSDP: whether each group all-reduces across replicas (set_requires_all_reduce) is the same on
  // every rank of the mesh, checked when a synced backward begins, before any all-reduce: a rank
  // that skipped one its peers issue would leave them waiting. `all_reduces` per group.
  void check_all_reduce_settings(Communicator& agree, Communicator& replicate,
                                 const std::vector<bool>& all_reduces, const Names& names);

 private:
  struct Sequence {
    std::vector<std::pair<int64_t, int64_t>> entries;  // the first kMaxRecorded: (group, value)
    uint64_t hash = 0;
    int64_t count = 0;
    void record(const Collective& c);
  };
  // The first position where `lane`'s ranks differ, named; empty when the entries agree.
  static std::string first_difference(Communicator& lane, const char* what, const Sequence& s,
                                      const std::vector<std::string>& names);
  void reset();

  Sequence gathers_, reduces_;
  std::vector<AgreedRider*> riders_;
};

}  // namespace fsdp::detail
