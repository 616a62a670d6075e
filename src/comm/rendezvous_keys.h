// The rendezvous's store keys (under the store's own prefix), in one place: init_process_group
// writes them, its failure messages read them, and tests imitate a rank with them.
// Internal to src/comm. Thread-safety: pure functions.
#pragma once

#include <string>

namespace fsdp::detail {

// A counter every rank increments once on arrival.
inline std::string joined_key() { return "fsdp/rendezvous/joined"; }
// Claimed by rank `rank` on arrival ("host\npid\nworld size", compareSet): which ranks arrived,
// when not all did, and which process holds each rank number.
inline std::string arrived_key(int rank) {
  return "fsdp/rendezvous/arrived/" + std::to_string(rank);
}
// Set by the first rank to arrive ("host\npid\nworld size"): the job's world size.
inline std::string job_key() { return "fsdp/rendezvous/job"; }
// "host\naddress\npid" of rank `rank`.
inline std::string peer_key(int rank) { return "fsdp/rendezvous/peer/" + std::to_string(rank); }

}  // namespace fsdp::detail
