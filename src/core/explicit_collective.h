// The round that opens an explicit collective of the user's (clip_grad_norm_, state dicts,
// checkpoints) on the model a handle belongs to: ranks where another call comes instead stop at
// once, naming both ([Note: calls that differ between ranks]).
// Thread-safety: the training thread, on every rank at the same point.
#pragma once

#include "core/protocol.h"

namespace fsdp {
class FSDPModule;
}

namespace fsdp::detail {

void agree_explicit_collective(const FSDPModule& module, protocol::Explicit what);

}  // namespace fsdp::detail
