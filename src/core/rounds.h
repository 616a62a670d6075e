// Rounds: the one place that moves the cross-rank protocol's messages (core/protocol.h). A round is
// one all-gather of every rank's fixed-size message on the root's gather lane, so that it keeps its
// place among the lane's all-gathers; the exclusive kinds also meet across HSDP's replicas, on the
// replicate lane. What the messages mean is the protocol's; what is done with them, the root's.
// Thread-safety: the root's training thread.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/comm_context.h"
#include "core/protocol.h"

namespace fsdp::detail {

class Rounds {
 public:
  explicit Rounds(CommContext& ctx) : ctx_(ctx) {}
  // Whether rounds exchange anything at all: more than one rank on the gather lane.
  bool active() const;
  // This rank's number in the whole mesh (errors name it).
  int64_t mesh_rank() const;
  // One round over `groups` groups: every rank's message, indexed by gather-lane rank. When two
  // cannot meet, every rank of the mesh throws the protocol's error (`names` gives the groups'
  // names, asked only then).
  using Names = std::function<std::vector<std::string>()>;
  std::vector<protocol::Message> exchange(const protocol::Message& mine, size_t groups,
                                          const Names& names);
  // HSDP: every replica's row (one length on every rank) over the replicate lane; empty without
  // replicas.
  std::vector<std::vector<int64_t>> across_replicas(const std::vector<int64_t>& row);
  bool has_replicas() const;

 private:
  using Clash = std::pair<protocol::Message, protocol::Message>;
  std::vector<protocol::Message> gather(const protocol::Message& mine, size_t groups);
  std::optional<Clash> meet_replicas(const protocol::Message& mine,
                                     const std::optional<Clash>& found);
  void log(const std::vector<protocol::Message>& all, size_t groups) const;

  CommContext& ctx_;
};

// Every rank's row (all of one length) over `c`: one all-gather.
std::vector<std::vector<int64_t>> gather_rows(Communicator& c, const std::vector<int64_t>& row);

}  // namespace fsdp::detail
