// Internal helpers shared by the checkpoint's save and load sides (checkpoint_save.cpp,
// checkpoint_load.cpp, reader.cpp, optim_state.cpp): names, message formatting and the one
// agreement with which every fallible step ends. Thread-safety: as the public API.
#pragma once

#include <fsdp/checkpoint.h>

#include <cstdint>
#include <string>
#include <vector>

#include "comm/rank_agreement.h"

namespace fsdp::checkpoint::internal {

// "step_00000042": the directory of one step's checkpoint.
std::string step_dir_name(int64_t step);
// "'a', 'b', ... (N more)": names for a message, at most `max` of them.
std::string join(const std::vector<std::string>& names, size_t max = 10);
// "[2, 3]".
std::string shape_str(const std::vector<int64_t>& s);
// A buffer is stored whole (replicated, rank 0's copy) under its own name, without "::".
bool is_buffer_entry(const IndexEntry& e);

// Raises on every rank when `error` is non-empty on any rank: the local message where this rank
// failed, else "checkpoint <what> failed on rank <r>: <message>" (detail::raise_together).
// Refuses a save of a model whose replicas are elastic (fsdp/elastic.h): the writing replica
// and its outcome would be decided over a lane that a replica's death may stand in for.
void refuse_elastic(const FSDPModule& root, const char* what);

inline void agree(Communicator& comm, const std::string& error, const char* what) {
  fsdp::detail::raise_together(comm, error, std::string("checkpoint ") + what);
}

}  // namespace fsdp::checkpoint::internal
