// The cross-rank protocol's rules (core/protocol.h) on plain messages: no processes, no groups.
#include "core/protocol.h"

#include <gtest/gtest.h>

namespace fsdp::detail::protocol {
namespace {

constexpr size_t kGroups = 70;  // more than one word of bits

Message msg(Kind kind, int64_t who, int64_t rank) {
  Message m;
  m.kind = kind;
  m.who = who;
  m.rank = rank;
  for (Bits* b : {&m.need, &m.prefetch, &m.changed, &m.held, &m.chunks})
    b->assign(words_for(kGroups), 0);
  return m;
}

Message with(Message m, Bits Message::*field, std::vector<size_t> groups) {
  for (size_t k : groups) set_bit(m.*field, k);
  return m;
}

std::vector<std::string> names() {
  std::vector<std::string> n;
  for (size_t k = 0; k < kGroups; ++k) n.push_back("g" + std::to_string(k));
  return n;
}

TEST(Protocol, BitsRoundTripAcrossWords) {
  std::vector<bool> v(kGroups, false);
  v[0] = v[63] = v[64] = v[69] = true;
  const Bits b = bits_of(v);
  EXPECT_EQ(b.size(), 2u);
  EXPECT_EQ(bools_of(b, kGroups), v);
  EXPECT_FALSE(test_bit(b, 1000));  // beyond the words: not set
}

TEST(Protocol, MessagesSerializeToOneLengthAndBack) {
  Message m = with(msg(Kind::kBackward, 3, 5), &Message::held, {2, 66});
  m.chunks = bits_of(std::vector<bool>(kGroups, true));
  m.plan = {4, 1};
  m.reverse = {9, 8, 7};
  m.digest = digest_of(m.need);
  const auto words = serialize(m, kGroups);
  EXPECT_EQ(words.size(), serialized_words(kGroups));
  EXPECT_EQ(serialize(msg(Kind::kCall, 0, 0), kGroups).size(), words.size());
  const Message back = deserialize(words.data(), kGroups);
  EXPECT_EQ(back.kind, Kind::kBackward);
  EXPECT_EQ(back.who, 3);
  EXPECT_EQ(back.rank, 5);
  EXPECT_EQ(back.digest, m.digest);
  EXPECT_EQ(back.held, m.held);
  EXPECT_EQ(back.chunks, m.chunks);
  EXPECT_EQ(back.plan, m.plan);
  EXPECT_EQ(back.reverse, m.reverse);
}

TEST(Protocol, CallsAndDoneRoundsMeetEachOther) {
  EXPECT_FALSE(clash(msg(Kind::kCall, 1, 0), msg(Kind::kCall, 2, 1)));
  EXPECT_FALSE(clash(msg(Kind::kCall, 1, 0), msg(Kind::kDone, 0, 1)));
  EXPECT_FALSE(clash(msg(Kind::kDone, 1, 0), msg(Kind::kDone, 1, 1)));
}

TEST(Protocol, ExclusiveKindsMeetOnlyTheSameCall) {
  EXPECT_FALSE(clash(msg(Kind::kStart, 4, 0), msg(Kind::kStart, 4, 1)));
  EXPECT_TRUE(clash(msg(Kind::kStart, 4, 0), msg(Kind::kStart, 3, 1)));
  EXPECT_TRUE(clash(msg(Kind::kStart, 4, 0), msg(Kind::kBackward, 2, 1)));
  EXPECT_TRUE(clash(msg(Kind::kCall, 4, 0), msg(Kind::kUnshard, 4, 1)));
  EXPECT_TRUE(clash(msg(Kind::kDone, 4, 0), msg(Kind::kExplicit, 1, 1)));
  EXPECT_FALSE(clash(msg(Kind::kExplicit, 1, 0), msg(Kind::kExplicit, 1, 1)));
  EXPECT_TRUE(clash(msg(Kind::kExplicit, 1, 0), msg(Kind::kExplicit, 2, 1)));
  Message a = msg(Kind::kBackward, 2, 0), b = msg(Kind::kBackward, 2, 1);
  a.digest = 7;
  b.digest = 7;
  EXPECT_FALSE(clash(a, b));
  b.digest = 8;  // they reduce other groups
  EXPECT_TRUE(clash(a, b));
  Message s = msg(Kind::kStart, 4, 0), t = msg(Kind::kStart, 4, 1);
  t.digest = 1;  // other declarations
  EXPECT_TRUE(clash(s, t));
}

TEST(Protocol, TheFirstClashIsFoundAndNamedWithTheFix) {
  const std::vector<Message> all{msg(Kind::kStart, 69, 0), msg(Kind::kStart, 69, 1),
                                 msg(Kind::kBackward, 3, 2)};
  const auto c = first_clash(all);
  ASSERT_TRUE(c.has_value());
  const std::string e = clash_error(c->first, c->second, names());
  EXPECT_NE(e.find("the ranks' top-level calls differ"), std::string::npos) << e;
  EXPECT_NE(e.find("rank 0 began a top-level forward of 'g69'"), std::string::npos) << e;
  EXPECT_NE(e.find("rank 2 began a backward reducing 3 of 70"), std::string::npos) << e;
  EXPECT_NE(e.find("Fix:"), std::string::npos) << e;
  EXPECT_FALSE(first_clash({msg(Kind::kCall, 1, 0), msg(Kind::kDone, 1, 1)}).has_value());
  Message a = msg(Kind::kFinalize, 2, 0), b = msg(Kind::kFinalize, 1, 1);
  b.digest = 5;
  const std::string sync = clash_error(a, b, names());
  EXPECT_NE(sync.find("gradient synchronisation differs"), std::string::npos) << sync;
  EXPECT_NE(sync.find("set_requires_gradient_sync"), std::string::npos) << sync;
  Message s = msg(Kind::kStart, 0, 0), t = msg(Kind::kStart, 0, 1);
  t.digest = 9;
  EXPECT_NE(clash_error(s, t, names()).find("set_calls_may_differ"), std::string::npos);
  EXPECT_NE(clash_error(msg(Kind::kExplicit, 0, 0), msg(Kind::kExplicit, 4, 1), names())
                .find("called clip_grad_norm_ while rank 1 called checkpoint::load"),
            std::string::npos);
}

TEST(Protocol, ARoundGathersTheUnionNeededFirstThenPrefetchedEachInRegistrationOrder) {
  const Message r0 =
      with(with(msg(Kind::kCall, 5, 0), &Message::need, {5}), &Message::prefetch, {6, 65});
  const Message r1 =
      with(with(msg(Kind::kCall, 2, 1), &Message::need, {2, 65}), &Message::prefetch, {6});
  const Message r2 = msg(Kind::kDone, 0, 2);  // done: serves, needs nothing
  const auto g = gathers_of_round(r0, {r0, r1, r2}, kGroups);
  ASSERT_EQ(g.size(), 4u);
  // needed: 2, 5, 65 (registration order); then prefetched and not needed: 6.
  EXPECT_EQ(g[0].group, 2);
  EXPECT_EQ(g[0].use, Gather::Use::kServe);
  EXPECT_EQ(g[1].group, 5);
  EXPECT_EQ(g[1].use, Gather::Use::kNeed);
  EXPECT_EQ(g[2].group, 65);
  EXPECT_EQ(g[2].use, Gather::Use::kPrefetch);  // r0 proposed it; r1 needs it now
  EXPECT_EQ(g[3].group, 6);
  EXPECT_EQ(g[3].use, Gather::Use::kPrefetch);
  // Every rank issues the same groups in the same order; only the use differs.
  const auto g1 = gathers_of_round(r1, {r0, r1, r2}, kGroups);
  ASSERT_EQ(g1.size(), g.size());
  for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(g1[i].group, g[i].group);
  EXPECT_EQ(g1[0].use, Gather::Use::kNeed);
  EXPECT_FALSE(all_done({r0, r1, r2}));
  EXPECT_TRUE(all_done({r2, msg(Kind::kDone, 1, 0)}));
}

TEST(Protocol, AHeldGroupIsStaleWhereAnyRankChangedOrDoesNotHoldIt) {
  const Message a =
      with(with(msg(Kind::kStart, 0, 0), &Message::held, {1, 2, 3, 66}), &Message::changed, {2});
  const Message b = with(msg(Kind::kStart, 0, 1), &Message::held, {1, 2, 66});
  const auto s = stale(a, {a, b}, kGroups);
  EXPECT_FALSE(s[1]);   // held by both, unchanged
  EXPECT_TRUE(s[2]);    // rank 0's shard changed
  EXPECT_TRUE(s[3]);    // rank 1 does not hold it: cannot tell
  EXPECT_FALSE(s[66]);  // held by both, unchanged
  EXPECT_FALSE(s[4]);   // held by nobody: nothing to drop
}

TEST(Protocol, InterleaveMergesPositionByPositionEachOnce) {
  EXPECT_EQ(interleave({{3, 1, 2}, {1, 4}, {}}), (std::vector<int64_t>{3, 1, 4, 2}));
  EXPECT_EQ(interleave({{5, 6}, {5, 6}}), (std::vector<int64_t>{5, 6}));
}

TEST(Protocol, BackwardMergesPlansReducesInOneOrderRootLast) {
  Message a = msg(Kind::kBackward, 3, 0), b = msg(Kind::kBackward, 3, 1);
  a.plan = {2, 1};
  a.reverse = {2, 1, 4};
  b.plan = {2, 1};
  b.reverse = {2, 1, 4};
  a.chunks = bits_of(std::vector<bool>{false, true, true});
  b.chunks = bits_of(std::vector<bool>{false, true, false});
  a.held = bits_of(std::vector<bool>{false, false, true});
  b.held = bits_of(std::vector<bool>{false, true, false});
  const auto d = decide_backward({a, b}, 5, /*root_index=*/4);
  EXPECT_FALSE(d.calls_differ);
  EXPECT_EQ(d.gathers, (std::vector<int64_t>{2, 1}));
  // Forwarded (reverse first-forward, root left out), never forwarded (3, 0 in reverse
  // registration order), the root last.
  EXPECT_EQ(d.reductions, (std::vector<int64_t>{2, 1, 3, 0, 4}));
  EXPECT_EQ(d.from_chunk, (std::vector<bool>{false, true, false, false, false}));  // both hold it
  EXPECT_EQ(d.held, (std::vector<bool>{false, true, true, false, false}));         // any rank's
  b.plan = {1};
  b.reverse = {1, 4};
  const auto e = decide_backward({a, b}, 5, 4);
  EXPECT_TRUE(e.calls_differ);
  EXPECT_EQ(e.gathers, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(e.reductions, (std::vector<int64_t>{2, 1, 3, 0, 4}));
}

TEST(Protocol, ReplicasMergeTheirReduceOrdersAndHoldings) {
  BackwardDecision d;
  d.held = {false, true, false};
  merge_replicas(d, {{1, 0, 2}, {0, 1, 2}}, {bits_of({true, false, false})}, false);
  EXPECT_EQ(d.reductions, (std::vector<int64_t>{1, 0, 2}));
  EXPECT_EQ(d.held, (std::vector<bool>{true, true, false}));
  EXPECT_FALSE(d.calls_differ);
}

TEST(Protocol, OneRuleDecidesWhichGroupsABackwardReduces) {
  EXPECT_TRUE(reduces(true, true, true, true));
  EXPECT_FALSE(reduces(false, true, true, true));  // explicit inputs: nothing reduced
  EXPECT_FALSE(reduces(true, false, true, true));  // gradient sync off
  EXPECT_FALSE(reduces(true, true, false, true));  // frozen group
  EXPECT_FALSE(reduces(true, true, true, false));  // no rank has anything for it
}

}  // namespace
}  // namespace fsdp::detail::protocol
