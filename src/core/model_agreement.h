// Every rank must build the same model from the same values: the checks fully_shard runs across
// the ranks before it shards a module. Each names the first difference on every rank.
// Thread-safety: collectives; call from the thread that trains, in the same order on every rank.
#pragma once

#include <c10/core/ScalarType.h>
#include <fsdp/communicator.h>

#include <optional>
#include <string>
#include <vector>

#include "core/registry.h"

namespace fsdp::detail {

// Compares (name, shape, dtype, requires_grad, shard dim, compute dtype) of `params` with rank
// 0's.
void check_same_model(Communicator& comm, const std::string& module, const NamedTensors& params,
                      const std::vector<int64_t>& dims,
                      const std::vector<std::optional<at::ScalarType>>& compute);
// Broadcasts rank 0's values (`sync`), or compares checksums with rank 0's. Parameters pending
// under deferred_init are skipped (materialize compares them).
void agree_on_values(Communicator& comm, const std::string& module, const NamedTensors& params,
                     bool sync);

}  // namespace fsdp::detail
