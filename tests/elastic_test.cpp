// Elastic replicas: the membership protocol (src/elastic/membership.h) on an in-process store,
// then real jobs: fsdp-elastic-example under fsdp-run --replicas, with replicas killed by SIGKILL
// and restarted, every surviving and rejoined rank compared with the unsharded model in fp64
// trained on the data of the replicas that took part in each committed step (--check).
#include <fsdp/checkpoint.h>
#include <fsdp/checkpoint_async.h>
#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <future>
#include <regex>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/failure.h"
#include "compat.h"
#include "elastic/membership.h"
#include "harness.h"
#include "netns.h"

namespace fsdp::testing {
namespace {

using namespace std::chrono_literals;
using detail::Decision;
using detail::Membership;
using detail::ReplicaProcesses;

ReplicaProcesses alive() { return {detail::this_host(), {::getpid()}}; }

// A process that has exited and been reaped: its pid names nobody.
ReplicaProcesses dead() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return {detail::this_host(), {pid}};
}

// The replica ids of a decision's members, ascending. Members are ordered by ticket, which
// depends on which of the test's threads took its ticket first.
std::vector<int> ids(const Decision& d) {
  std::vector<int> out;
  for (const auto& m : d.members) out.push_back(m.id);
  std::sort(out.begin(), out.end());
  return out;
}

// a and b form a job of two (both join; the formation they both get).
Decision form(Membership& a, Membership& b) {
  auto fb = std::async(std::launch::async, [&] { return b.join(2, 10s); });
  const Decision formed = a.join(2, 10s);
  EXPECT_EQ(fb.get().format(), formed.format());
  return formed;
}

TEST(MembershipTest, FirstReplicasFormTheJobAndALaterOneJoinsAtTheNextVote) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  Membership a(store, 0, alive(), 5s), b(store, 1, alive(), 5s), c(store, 2, alive(), 5s);
  auto fb = std::async(std::launch::async, [&] { return b.join(2, 10s); });
  const Decision formed = a.join(2, 10s);
  EXPECT_EQ(fb.get().format(), formed.format());
  EXPECT_EQ(formed.epoch, 1);
  EXPECT_EQ(ids(formed), (std::vector<int>{0, 1}));
  EXPECT_EQ(formed.source, formed.members[0].ticket);
  auto fc = std::async(std::launch::async, [&] { return c.join(2, 10s); });
  std::this_thread::sleep_for(200ms);  // c has its ticket before the vote
  auto vb = std::async(std::launch::async, [&] { return b.vote(formed, 0, true); });
  const Decision d = a.vote(formed, 0, true);
  EXPECT_EQ(vb.get().format(), d.format());
  EXPECT_EQ(fc.get().format(), d.format());
  EXPECT_TRUE(d.commit);
  EXPECT_EQ(d.epoch, 2);
  EXPECT_EQ(ids(d), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(d.source, formed.members[0].ticket);  // the new member copies an old one
}

TEST(MembershipTest, AVoteThatFailsAbortsAndRebuildsOverTheSameMembers) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  Membership a(store, 0, alive(), 5s), b(store, 1, alive(), 5s);
  const Decision formed = form(a, b);
  auto vb = std::async(std::launch::async, [&] { return b.vote(formed, 0, false); });
  const Decision d = a.vote(formed, 0, true);
  EXPECT_EQ(vb.get().format(), d.format());
  EXPECT_FALSE(d.commit);
  EXPECT_EQ(d.epoch, 2);  // a lost lane is rebuilt even over the same members
  EXPECT_EQ(ids(d), (std::vector<int>{0, 1}));
  EXPECT_EQ(d.source, 0);  // nobody new: nothing to copy
}

TEST(MembershipTest, VotesTwoDecisionsOldAreDeletedAndEveryDecisionStays) {
  // A month-long job must not grow the coordinator by every vote of every step.
  auto store = c10::make_intrusive<c10d::HashStore>();
  Membership a(store, 0, alive(), 5s), b(store, 1, alive(), 5s);
  Decision now = form(a, b);
  for (int64_t attempt = 0; attempt < 4; ++attempt) {
    auto vb = std::async(std::launch::async, [&] { return b.vote(now, attempt, true); });
    const Decision d = a.vote(now, attempt, true);
    ASSERT_EQ(vb.get().format(), d.format());
    ASSERT_TRUE(d.commit);
    ASSERT_EQ(d.epoch, now.epoch);
  }
  const std::string e = "e" + std::to_string(now.epoch);
  for (int64_t attempt = 0; attempt < 4; ++attempt) {
    const std::string at = e + "/a" + std::to_string(attempt) + "/";
    const bool kept = attempt >= 2;  // the last two decisions' votes
    for (const auto& m : now.members)
      EXPECT_EQ(store->check({at + "vote/" + std::to_string(m.ticket)}), kept) << at;
    EXPECT_TRUE(store->check({at + "decision"})) << at;
  }
}

TEST(MembershipTest, AMemberWhoseProcessIsGoneIsLeftOutWithoutWaitingForTheTimeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  Membership a(store, 0, alive(), 60s), b(store, 1, alive(), 60s);
  const Decision formed = form(a, b);
  // b's process dies after the formation (its leader's published pid now names nobody).
  const ReplicaProcesses gone = dead();
  const std::string procs = gone.host + " " + std::to_string(gone.pids[0]);
  store->set(detail::cat("proc/", b.ticket()), std::vector<uint8_t>(procs.begin(), procs.end()));
  const auto t0 = std::chrono::steady_clock::now();
  const Decision d = a.vote(formed, 0, true);  // b never votes: its process is gone
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_FALSE(d.commit);
  EXPECT_EQ(ids(d), (std::vector<int>{0}));
  EXPECT_EQ(d.epoch, 2);
}

TEST(MembershipTest, AMemberThatNeverVotesIsLeftOutAtTheTimeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  Membership a(store, 0, alive(), 500ms), b(store, 1, alive(), 500ms);
  const Decision formed = form(a, b);
  const Decision d = a.vote(formed, 0, true);  // b is alive (a hung replica) but silent
  EXPECT_FALSE(d.commit);
  EXPECT_EQ(ids(d), (std::vector<int>{0}));
  // b's late vote gets the decision already made, which leaves it out.
  const Decision late = b.vote(formed, 0, true);
  EXPECT_EQ(late.format(), d.format());
  EXPECT_EQ(late.index_of(b.ticket()), -1);
}

TEST(MembershipTest, AMemberWhoseHeartbeatStopsIsLeftOutBeforeTheTimeout) {
  // b's process is alive as far as this host can tell (a replica on another host, or hung), but
  // its heartbeat stops: the vote goes on after the heartbeat timeout, not the collective one.
  auto store = c10::make_intrusive<c10d::HashStore>();
  Membership a(store, 0, alive(), 60s, 400ms), b(store, 1, alive(), 60s, 400ms);
  const Decision formed = form(a, b);
  auto beat = std::make_unique<detail::Heartbeat>(store, b.ticket(), 50ms);
  std::this_thread::sleep_for(200ms);
  beat.reset();  // b hangs
  const auto t0 = std::chrono::steady_clock::now();
  const Decision d = a.vote(formed, 0, true);
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(waited, 300ms);
  EXPECT_LT(waited, 5s);
  EXPECT_FALSE(d.commit);
  EXPECT_EQ(ids(d), (std::vector<int>{0}));
}

TEST(MembershipTest, AMemberWhoseHeartbeatGoesOnIsWaitedFor) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  // (A heartbeat timeout of 3 s: this machine's other jobs may hold a 50 ms pulse back.)
  Membership a(store, 0, alive(), 60s, 3s), b(store, 1, alive(), 60s, 3s);
  const Decision formed = form(a, b);
  detail::Heartbeat beat(store, b.ticket(), 50ms);
  // b votes late (a step longer than the heartbeat timeout), its heartbeat going on meanwhile:
  // a waits for it.
  auto vb = std::async(std::launch::async, [&] {
    std::this_thread::sleep_for(4s);
    return b.vote(formed, 0, true);
  });
  const Decision d = a.vote(formed, 0, true);
  EXPECT_TRUE(d.commit);
  EXPECT_EQ(ids(d), (std::vector<int>{0, 1}));
  EXPECT_EQ(vb.get().format(), d.format());
}

TEST(MembershipTest, AReplicaWithTheIdOfALiveMemberIsRefused) {
  // Two members with one id would train one slice of the data twice, silently.
  auto store = c10::make_intrusive<c10d::HashStore>();
  Membership a(store, 0, alive(), 5s), b(store, 1, alive(), 5s), twin(store, 1, alive(), 5s);
  const Decision formed = form(a, b);
  auto ft = std::async(std::launch::async, [&] { return twin.join(2, 10s); });
  std::this_thread::sleep_for(200ms);
  auto vb = std::async(std::launch::async, [&] { return b.vote(formed, 0, true); });
  const Decision d = a.vote(formed, 0, true);
  EXPECT_EQ(vb.get().format(), d.format());
  EXPECT_TRUE(d.commit);
  EXPECT_EQ(ids(d), (std::vector<int>{0, 1}));  // unchanged
  expect_error([&] { ft.get(); }, {"replica 1", "was refused",
                                   "replica id 1 belongs to a live "
                                   "member",
                                   "FSDP_REPLICA_ID of its own"});
}

TEST(MembershipTest, AReplicaJoiningAJobWhoseMembersAreAllGoneIsToldSo) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  Membership a(store, 0, alive(), 5s, 300ms), late(store, 1, alive(), 5s, 300ms);
  a.join(1, 10s);
  auto beat = std::make_unique<detail::Heartbeat>(store, a.ticket(), 50ms);
  std::this_thread::sleep_for(150ms);
  beat.reset();  // a's process dies (on another host: only its heartbeat tells)
  expect_error([&] { late.join(1, 30s); },
               {"replica 1", "has nothing to join", "every member of the job is gone"});
}

TEST(MembershipTest, TooFewReplicasToStartAreCountedInTheError) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  Membership a(store, 0, alive(), 5s);
  expect_error([&] { a.join(2, 300ms); },
               {"replica 0", "was not admitted", "1 of the 2 replicas needed to start the job",
                "FSDP_MIN_REPLICAS"});
}

TEST(MembershipTest, AReplicaArrivingAfterTheJobFinishedIsToldSo) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  Membership a(store, 0, alive(), 5s), late(store, 1, alive(), 5s);
  a.join(1, 10s);
  a.finish();
  expect_error([&] { late.join(1, 10s); }, {"replica 1", "arrived after the job finished"});
}

TEST(MembershipTest, DecisionsRoundTripAndBadTextIsNamed) {
  Decision d;
  d.commit = false;
  d.epoch = 7;
  d.admitted = 9;
  d.source = 4;
  d.members = {{4, 0}, {9, 2}};
  EXPECT_EQ(Decision::parse(d.format()).format(), d.format());
  EXPECT_EQ(d.index_of(9), 1);
  expect_error([] { Decision::parse("maybe 1 2 3 x"); }, {"cannot read", "maybe 1 2 3 x"});
}

// ---- the model's side ----

struct TinyImpl : torch::nn::Module {
  TinyImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (during) during();
    return fc(x);
  }
  torch::nn::Linear fc;
  std::function<void()> during;  // runs inside the forward
};
TORCH_MODULE(Tiny);

std::shared_ptr<Communicator> one_rank(const std::string& name) {
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  auto pg = compat::make_process_group(store, 0, 1, std::chrono::seconds(30), "gloo", "127.0.0.1");
  return std::make_shared<Communicator>(pg, store, "gloo", std::chrono::seconds(30), name);
}

TEST(SetReplicateCommunicatorTest, APlainFsdpModelHasNoReplicaGroupToReplace) {
  Sharded<Tiny> model;
  auto root = fully_shard(model, one_rank("world"));
  expect_error([&] { root.set_replicate_communicator(one_rank("other")); },
               {"set_replicate_communicator", "mesh with replicas (HSDP)"});
}

TEST(SetReplicateCommunicatorTest, InsideAForwardItIsRefused) {
  Sharded<Tiny> model;
  DeviceMesh mesh;
  mesh.world = mesh.shard = one_rank("world");
  mesh.replicate = one_rank("replicas");
  auto root = fully_shard(model, mesh);
  auto loss = model(torch::ones({2, 4})).sum();  // the root stays gathered until the backward
  loss.backward();
  root.set_replicate_communicator(one_rank("replicas.2"));  // between steps: fine
  EXPECT_EQ(root.replicate_communicator()->name(), "replicas.2");
  model->during = [&] { root.set_replicate_communicator(one_rank("replicas.3")); };
  expect_error(
      [&] {
        model(torch::ones({2, 4}));
      },
      {"called inside a forward or a backward", "between steps"});
}

// A job of one replica of one rank, its coordinator's store served in this process.
struct OneReplicaJob {
  c10::intrusive_ptr<c10d::Store> server;
  std::unique_ptr<ElasticReplicas> replicas;
  OneReplicaJob() {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(free_port());
    o.isServer = true;
    o.waitWorkers = false;
    server = compat::make_tcp_store("127.0.0.1", o);
    ElasticOptions e;
    e.coordinator = "127.0.0.1:" + std::to_string(o.port);
    e.replica_id = 0;
    replicas = std::make_unique<ElasticReplicas>(one_rank("world"), e);
  }
};

TEST(ElasticCheckpointTest, ASaveOfElasticReplicasIsRefusedByName) {
  OneReplicaJob job;
  Sharded<Tiny> model;
  auto root = fully_shard(model, job.replicas->mesh());
  torch::optim::SGD opt(root.parameters(), 0.1);
  std::vector<int64_t> state{0};
  job.replicas->sync(root, opt, state);
  model(torch::ones({2, 4})).sum().backward();
  EXPECT_TRUE(job.replicas->commit());  // alone: every vote is its own
  opt.step();
  const std::string dir = test_scratch_dir("FSDP_TEST_DIR", "elastic-ckpt");
  checkpoint::TrainState after;
  after.step = 1;
  expect_error([&] { checkpoint::save(dir, root, &opt, after, root.communicator()); },
               {"checkpoint save", "replicas are elastic", "not supported yet"});
  checkpoint::AsyncSaver saver;
  expect_error([&] { saver.save_async(dir, root, &opt, after); },
               {"checkpoint save_async", "replicas are elastic"});
  EXPECT_FALSE(std::filesystem::exists(dir + "/step_00000001"));
  std::filesystem::remove_all(dir);
}

// ---- real jobs ----

struct Job {
  ProcResult r;
  int count(const std::string& pattern) const {
    const std::regex re(pattern);
    return static_cast<int>(std::distance(
        std::sregex_iterator(r.output.begin(), r.output.end(), re), std::sregex_iterator()));
  }
};

Job elastic_job(int replicas, int n, std::vector<std::string> args, int restarts = 0,
                const std::string& timeout_s = "60") {
  std::vector<std::string> argv{bin_dir() + "/fsdp-run",
                                "--replicas",
                                std::to_string(replicas),
                                "-n",
                                std::to_string(n),
                                "--max-restarts",
                                std::to_string(restarts),
                                "--restart-delay",
                                "0.2",
                                "--",
                                bin_dir() + "/fsdp-elastic-example",
                                "--check"};
  argv.insert(argv.end(), args.begin(), args.end());
  return {run_process(argv, 240s, {{"FSDP_TIMEOUT_S", timeout_s}})};
}

// Every rank of `replica` that finished matched the unsharded model.
void expect_matches(const Job& j, int replica, int ranks) {
  EXPECT_EQ(j.count("\\[replica " + std::to_string(replica) +
                    " rank [0-9]+\\] check: .*\\(within 1e-10\\)"),
            ranks)
      << j.r.output;
}

TEST(ElasticJobTest, AReplicaKilledBeforeItsBackwardIsLeftOutAndTheSurvivorMatchesUnsharded) {
  const Job j = elastic_job(2, 4, {"--steps", "8", "--kill", "1:3"});
  ASSERT_EQ(j.r.exit_code, 0) << j.r.output;
  expect_matches(j, 0, 2);
  EXPECT_EQ(j.count("WRONG"), 0) << j.r.output;
  EXPECT_EQ(j.count("\\[replica 0 rank 0\\] step 3 thrown away"), 1) << j.r.output;
  EXPECT_EQ(j.count("replica 0 rank 0: 8 commits, 1 aborts, 2 memberships"), 1) << j.r.output;
}

TEST(ElasticJobTest, AReplicaKilledBeforeItsVoteIsLeftOutAndTheSurvivorMatchesUnsharded) {
  // Its gradients reached the survivor's all-reduces: the step is thrown away all the same.
  const Job j = elastic_job(2, 4, {"--steps", "8", "--kill", "1:4:vote"});
  ASSERT_EQ(j.r.exit_code, 0) << j.r.output;
  expect_matches(j, 0, 2);
  EXPECT_EQ(j.count("\\[replica 0 rank 0\\] step 4 thrown away"), 1) << j.r.output;
}

TEST(ElasticJobTest, AReplicaThatStopsEarlyAndExitsNormallyLeavesTheOthersTraining) {
  // As a trainer stopped by SIGTERM: it returns from its loop without finish(). Its exit must not
  // tell the survivor that the job finished (the survivor then looped on thrown-away steps).
  const Job j = elastic_job(2, 4, {"--steps", "8", "--stop", "1:3"});
  ASSERT_EQ(j.r.exit_code, 0) << j.r.output;
  EXPECT_EQ(j.count("replica 1 rank [01]: stopped at step 3"), 2) << j.r.output;
  expect_matches(j, 0, 2);
  EXPECT_EQ(j.count("replica 0 rank 0: 8 commits"), 1) << j.r.output;
}

TEST(ElasticJobTest, ARestartedReplicaCopiesTheStateAndEveryRankMatchesUnsharded) {
  const Job j = elastic_job(2, 4, {"--steps", "16", "--kill", "1:2", "--pause-ms", "400"}, 1);
  ASSERT_EQ(j.r.exit_code, 0) << j.r.output;
  expect_matches(j, 0, 2);
  expect_matches(j, 1, 2);  // the restarted incarnation, which joined mid-run
  EXPECT_EQ(j.count("restarting replica 1"), 1) << j.r.output;
  EXPECT_EQ(j.count("replica 0 rank 0: 16 commits, 1 aborts, 3 memberships"), 1) << j.r.output;
  EXPECT_EQ(j.count("replica 1 rank 0: 16 commits"), 0) << "the new replica trained every step?\n"
                                                        << j.r.output;
}

TEST(ElasticJobTest, AReplicaDyingWhileItJoinsLeavesTheSurvivorTraining) {
  // Replica 1 dies at step 2; its relaunch dies 5 ms into its first sync (while the survivor
  // connects the new lanes with it: that connection waits half the collective timeout); the next
  // relaunch joins.
  const Job j = elastic_job(
      2, 4, {"--steps", "16", "--kill", "1:2", "--kill", "1:0:sync:1", "--pause-ms", "300"}, 2,
      "10");
  ASSERT_EQ(j.r.exit_code, 0) << j.r.output;
  expect_matches(j, 0, 2);
  expect_matches(j, 1, 2);
  EXPECT_EQ(j.count("restarting replica 1"), 2) << j.r.output;
}

TEST(ElasticJobTest, ThreeReplicasLoseTwoAndTakeOneBack) {
  const Job j = elastic_job(
      3, 3, {"--steps", "14", "--kill", "1:2", "--kill", "2:6:vote", "--pause-ms", "300"}, 1);
  ASSERT_EQ(j.r.exit_code, 0) << j.r.output;
  expect_matches(j, 0, 1);
  expect_matches(j, 1, 1);
  EXPECT_EQ(j.count("WRONG"), 0) << j.r.output;
  EXPECT_EQ(j.count("replica 2 stays down"), 1) << j.r.output;
}

TEST(ElasticJobTest, OneRankReplicasOnTwoHostsTrainTogether) {
  // Two "hosts" (network namespaces): the coordinator and replica 0 on 10.99.0.1, replica 1 on
  // 10.99.0.2, each replica one rank (its own rendezvous is loopback). The lanes between them
  // must bind the route to the coordinator, not the replica's loopback.
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces";
  Namespaces ns(::getpid());
  if (auto e = ns.create(); !e.empty()) GTEST_SKIP() << "cannot build the namespaces: " << e;
  const std::string port = std::to_string(free_port());
  auto in = [](const std::string& n, std::vector<std::string> argv) {
    argv.insert(argv.begin(), {"ip", "netns", "exec", n});
    return argv;
  };
  auto coordinator = std::async(std::launch::async, [&] {
    return run_process(in(ns.a, {bin_dir() + "/fsdp-coordinator", "--port", port}), 120s);
  });
  auto replica = [&](int id, const std::string& n) {
    return std::async(std::launch::async, [&, id, n] {
      return run_process(in(n, {bin_dir() + "/fsdp-elastic-example", "--check", "--steps", "6"}),
                         100s,
                         {{"FSDP_ELASTIC_COORDINATOR", "10.99.0.1:" + port},
                          {"FSDP_REPLICA_ID", std::to_string(id)},
                          {"FSDP_MIN_REPLICAS", "2"},
                          {"FSDP_TIMEOUT_S", "10"},
                          {"WORLD_SIZE", "1"},
                          {"RANK", "0"},
                          {"LOCAL_RANK", "0"},
                          {"FSDP_SOCKET_IFNAME", ""},
                          {"GLOO_SOCKET_IFNAME", ""}});
    });
  };
  std::this_thread::sleep_for(300ms);  // the coordinator serves before the replicas connect
  auto r0 = replica(0, ns.a);
  auto r1 = replica(1, ns.b);
  const ProcResult a = r0.get(), b = r1.get();
  run_process({"ip", "netns", "exec", ns.a, "pkill", "-f", "fsdp-coordinator --port " + port}, 10s);
  coordinator.get();
  for (const ProcResult* r : {&a, &b}) {
    EXPECT_EQ(r->exit_code, 0) << r->output;
    EXPECT_NE(r->output.find("6 commits, 0 aborts, 1 memberships"), std::string::npos) << r->output;
    EXPECT_NE(r->output.find("(within 1e-10)"), std::string::npos) << r->output;
  }
}

TEST(ElasticJobTest, WithoutTheCoordinatorVariablesTheProgramSaysWhatToSet) {
  const ProcResult r = run_process(
      {bin_dir() + "/fsdp-run", "-n", "1", "--", bin_dir() + "/fsdp-elastic-example"}, 60s);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("FSDP_ELASTIC_COORDINATOR is not set"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("fsdp-run --replicas"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace fsdp::testing
