// The cross-rank protocol, as pure functions: each rank's message in, the decision every rank takes
// out (what to gather, in which order to reduce, what is stale) or the error that names two ranks'
// calls that cannot meet. No communicator, no group: plain structs over registration indices (a
// group's place in its root, the same on every rank). core/rounds.h moves the messages; the root
// acts on the decisions. [Note: calls that differ between ranks] in docs/design.md.
//
// A round is one small all-gather of fixed-size messages on a root's gather lane. Kinds:
//   kStart     opens a top-level forward call (`who`: its group); decides staleness
//              ([Note: stale gathered parameters]) and checks the calls_may_differ declarations.
//   kCall      a forward call inside a region whose calls may differ: the groups this rank needs
//              gathered now and those it would prefetch.
//   kDone      this rank's region ended; it serves the others until every rank is done.
//   kBackward  a backward begins: the groups it reduces (must match), the groups this rank may have
//              something to reduce for, its gather plan, reverse first-forward order, hpZ chunks.
//   kUnshard   an explicit FSDPModule::unshard() of group `who`.
//   kExplicit  an explicit collective of the user's (`who`: which, Explicit).
//   kFinalize  finalize_backward: the groups it reduces (must match) and those it holds gradients
//              for.
// The exclusive kinds (all but kCall and kDone) meet only their own kind, of the same call.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::detail::protocol {

// One bit per registration index.
using Bits = std::vector<uint64_t>;
size_t words_for(size_t groups);
void set_bit(Bits& bits, size_t k);
bool test_bit(const Bits& bits, size_t k);
Bits bits_of(const std::vector<bool>& v);                // words_for(v.size()) words
std::vector<bool> bools_of(const Bits& bits, size_t n);  // the first n

enum class Kind : int64_t {
  kStart = 1,
  kCall = 2,
  kDone = 3,
  kBackward = 4,
  kUnshard = 5,
  kExplicit = 6,
  kFinalize = 7,
};
// The explicit collectives that open a round of their own (kExplicit's `who`).
enum class Explicit : int64_t {
  kClipGradNorm,
  kFullStateDict,
  kLoadFullStateDict,
  kCheckpointSave,
  kCheckpointLoad,
  kFinalizeBackward,
};
const char* name_of(Explicit what);

// One rank's message. Every field is present in every kind (the messages of one round all have
// one size, whatever kinds meet in it); unused ones stay empty.
struct Message {
  Kind kind = Kind::kStart;
  int64_t who = -1;    // see Kind; -1: none
  int64_t rank = 0;    // the rank's number in the whole mesh (errors name it)
  int64_t digest = 0;  // kBackward, kFinalize: of `need`; kStart: of the declarations
  Bits need;           // kCall, kUnshard: to gather now; kBackward, kFinalize: the groups reduced
  Bits prefetch;       // kCall: to prefetch
  Bits changed;        // kStart: held groups whose shards changed since their gather
  Bits held;           // kStart: groups held gathered from an earlier epoch; kBackward, kFinalize:
                       // groups this rank may have something to reduce for
  Bits chunks;         // kBackward: the groups whose post-forward chunk this rank holds
  std::vector<int64_t> plan;     // kBackward: this rank's gather plan (registration indices)
  std::vector<int64_t> reverse;  // kBackward: its reverse first-forward order
};

// The digest of a bit set (XXH3 of its words): what a message's bits are, in one number.
int64_t digest_of(const Bits& bits);
// A message laid out as int64 words for `groups` groups (one length for every kind), and back.
std::vector<int64_t> serialize(const Message& m, size_t groups);
Message deserialize(const int64_t* words, size_t groups);
size_t serialized_words(size_t groups);

// ---- the rules ----

// Whether two messages of one round can meet: an exclusive kind only its own kind of the same call
// (two backwards or finalizes only when they reduce the same groups).
bool clash(const Message& a, const Message& b);
// The first pair of messages that cannot meet (rank 0's against each other rank's), or none.
std::optional<std::pair<Message, Message>> first_clash(const std::vector<Message>& all);
// What a rank was doing, in words (`groups`: the groups' names by registration index), and the
// error every rank throws for a clash, naming both ranks' calls and the fix.
std::string describe(const Message& m, const std::vector<std::string>& groups);
std::string clash_error(const Message& a, const Message& b, const std::vector<std::string>& groups);

// A forward round's gathers, in the order every rank issues them: the union of the needed groups,
// then of the prefetched ones that none needed, each in registration order. What this rank does
// with each: keep it (it needed or proposed it) or serve it (send its part, keep nothing).
struct Gather {
  int64_t group;
  enum class Use : uint8_t { kNeed, kPrefetch, kServe } use;
};
std::vector<Gather> gathers_of_round(const Message& mine, const std::vector<Message>& all,
                                     size_t groups);
// Every rank's region ended: the done rounds stop.
bool all_done(const std::vector<Message>& all);
// kStart: the groups this rank holds that must be dropped (some rank's shard changed since the
// gather, or some rank does not hold it: it cannot tell), per registration index.
std::vector<bool> stale(const Message& mine, const std::vector<Message>& all, size_t groups);

// The lists of all ranks merged position by position (every rank's first entry in rank order,
// then every second, ...), each entry once: the same on every rank holding the same lists.
std::vector<int64_t> interleave(const std::vector<std::vector<int64_t>>& lists);

// kBackward: the orders every rank of a shard group issues.
struct BackwardDecision {
  std::vector<int64_t> gathers;     // the gather plan
  std::vector<int64_t> reductions;  // reverse first-forward order merged, the rest, the root last
  std::vector<bool> from_chunk;     // gathered from post-forward chunks (every rank holds one)
  std::vector<bool> held;           // some rank may have something to reduce for the group
  bool calls_differ = false;        // some rank's plan or order differed from another's
};
BackwardDecision decide_backward(const std::vector<Message>& all, size_t groups,
                                 int64_t root_index);
// HSDP: the shard groups' reduce orders merged across the replicas (each holds every group), the
// holdings ORed, whether any replica's calls differed: the same decision on every rank of the mesh.
void merge_replicas(BackwardDecision& d, const std::vector<std::vector<int64_t>>& orders,
                    const std::vector<Bits>& held, bool any_differ);

// The one rule for which groups a backward reduces ([Note: parameters that got no gradient]):
// a plain backward (no explicit inputs) with the group's gradient sync on, a group with trainable
// parameters, that some rank of the mesh may have something to reduce for.
inline bool reduces(bool plain_backward, bool sync, bool trainable, bool held_somewhere) {
  return plain_backward && sync && trainable && held_somewhere;
}

}  // namespace fsdp::detail::protocol
