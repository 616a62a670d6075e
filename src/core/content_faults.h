// Faults a test injects into the contents of collectives, to show that verified collectives
// (core/verified.h) catch them: one bit flipped in one payload of one collective, where the bytes
// travel (between the sender's digest and the transport, or between the transport and the
// receiver's digest), so that the corrupted values also reach the model, as real corruption would.
// Nothing in the library sets them; only tests and fsdp-bench --verify-detection do, inside a
// rank, through inject(). Off unless one was injected. The pattern of core/faults.h.
// Thread-safety: set before training starts; read on the threads that wait for collectives.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace fsdp::detail::content_faults {

enum class Where {
  kNone,
  kGatheredBlock,  // an all-gather: the bytes from `rank` as they arrive on every other rank
  kSentBlock,      // a reduce-scatter: the block `rank` sends to rank (rank + 1) % N, once sketched
                   // and before the transport reads it (the sender's memory)
  kReceivedBlock,  // a reduce-scatter: that block as it arrives on rank (rank + 1) % N, before it
                   // is summed (the wire)
  kReducedValue,   // a reduce-scatter: `rank`'s reduced shard as the sum left it (a faulty sum)
};

struct Fault {
  Where where = Where::kNone;
  int rank = 0;            // the sender (kGatheredBlock, kSentBlock) or receiver, shard-group rank
  int64_t collective = 0;  // which collective of its kind (from 0, in issue order) of the model
  int64_t element = 0;     // the element flipped, modulo the payload's elements
  int bit = 0;             // the bit flipped in it (0: the lowest)
};

// The fault in force in this process (Where::kNone unless a test injected one).
const Fault& active();
// Turns `f` on for the rest of this process (a test's rank), until the next inject.
void inject(const Fault& f);

// Flips the fault's bit in the payload made of `pieces` (one dtype; the element is counted over
// their concatenation, modulo its length). Returns the element flipped.
int64_t flip(const Fault& f, const std::vector<at::Tensor>& pieces);
// Flips made in this process so far (a test or bench knows its fault took effect).
int64_t flips();

}  // namespace fsdp::detail::content_faults
