// Elastic replicas (fsdp/elastic.h): HSDP training that goes on when a replica dies, and takes a
// restarted replica back. Run it with the launcher's replicas mode, e.g. two replicas of two ranks,
// replica 1 killed at step 3 and restarted once:
//   build/bin/fsdp-run --replicas 2 -n 4 --max-restarts 1 --
//       build/bin/fsdp-elastic-example --steps 10 --kill 1:3 --pause-ms 300
// --check trains, next to the sharded model, the same model unsharded in fp64 on the data of the
// replicas that took part in each committed step, and compares the two at the end.
#include <fsdp/fsdp.h>
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <thread>

namespace {

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : fc1(register_module("fc1", torch::nn::Linear(d, 2 * d))),
        fc2(register_module("fc2", torch::nn::Linear(2 * d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t d, int64_t depth) {
    for (int64_t i = 0; i < depth; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), Block(d)));
    head = register_module("head", torch::nn::Linear(d, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x;
    for (auto& b : blocks) h = b(h);
    return head(h);
  }
  std::vector<fsdp::Sharded<Block>> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

struct Options {
  int steps = 10, width = 16, depth = 3, batch = 4, pause_ms = 0;
  bool check = false;
  std::vector<std::string> kills;  // "replica:step[:phase]", phase backward (default) or vote
  std::vector<std::string> stops;  // "replica:step": that replica leaves its loop there
};

// Whether a --stop names replica `id` at `step`: its ranks leave the training loop and return
// normally, as a trainer stopped by SIGTERM does, without finish(); the others go on without it.
bool stops_at(const Options& o, int id, int64_t step) {
  for (const auto& k : o.stops) {
    const auto colon = k.find(':');
    if (std::stoi(k.substr(0, colon)) == id && std::stoll(k.substr(colon + 1)) == step) return true;
  }
  return false;
}

// Rank `rank` of replica `id`'s batch at `step`: the same on every run.
std::pair<torch::Tensor, torch::Tensor> batch(const Options& o, int64_t step, int id, int rank) {
  torch::manual_seed(100000 * step + 100 * id + rank + 1);
  auto x = torch::randn({o.batch, o.width}, torch::kDouble);
  return {x, x.sin().sum(1, true)};
}

// Rank 0 of this incarnation (FSDP_REPLICA_RESTART) dies (SIGKILL) at `step` in `phase` when a
// --kill names them; in phase sync, 5 ms into the sync, from another thread.
void maybe_die(const Options& o, int id, int rank, int64_t step, const std::string& phase) {
  const char* restart = std::getenv("FSDP_REPLICA_RESTART");
  const std::string incarnation = restart ? restart : "0";
  if (rank != 0) return;
  for (const auto& k : o.kills) {
    std::istringstream is(k);
    std::string r, s, p = "backward", inc = "0";
    std::getline(is, r, ':');
    std::getline(is, s, ':');
    std::getline(is, p, ':');
    std::getline(is, inc, ':');
    if (std::stoi(r) != id || std::stoll(s) != step || p != phase || inc != incarnation) continue;
    std::cout << "replica " << id << " rank 0: killing itself at step " << step << " (" << phase
              << ")" << std::endl;
    if (phase != "sync") ::kill(::getpid(), SIGKILL);
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      ::kill(::getpid(), SIGKILL);
    }).detach();
  }
}

// The reference: the unsharded model in fp64, each committed step over the data of the replicas
// in `history` (history[1 + s], bit k: replica k took part in step s), replayed from the start.
Net reference(const Options& o, int shards, const std::vector<int64_t>& history, int64_t steps) {
  torch::manual_seed(0);
  Net net(o.width, o.depth);
  net->to(torch::kDouble);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<int> ids;
    for (int k = 0; k < 63; ++k)
      if (history[1 + step] >> k & 1) ids.push_back(k);
    const double ranks = static_cast<double>(ids.size() * shards);
    for (int id : ids)
      for (int r = 0; r < shards; ++r) {
        auto [x, y] = batch(o, step, id, r);
        (torch::mse_loss(net->forward(x), y) / ranks).backward();
      }
    opt.step();
    opt.zero_grad();
  }
  return net;
}

int run(const Options& o) {
  auto world = fsdp::init_process_group();
  fsdp::ElasticReplicas replicas(world, fsdp::ElasticOptions::from_env());
  const int id = replicas.replica_id(), rank = world->rank();
  torch::manual_seed(0);
  fsdp::Sharded<Net> model(o.width, o.depth);
  model->to(torch::kDouble);
  for (auto& b : model->blocks) fsdp::fully_shard(b, replicas.mesh());
  auto root = fsdp::fully_shard(model, replicas.mesh());
  torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-2));
  // state[0]: the next step; state[1 + s]: the replicas that took part in step s.
  std::vector<int64_t> state(1 + o.steps, 0);
  while (state[0] < o.steps) {
    if (stops_at(o, id, state[0])) {
      std::cout << "replica " << id << " rank " << rank << ": stopped at step " << state[0]
                << std::endl;
      return 0;
    }
    maybe_die(o, id, rank, state[0], "sync");
    replicas.sync(root, opt, state);
    const int64_t step = state[0];
    int64_t took_part = 0;
    for (int m : replicas.member_ids()) took_part |= int64_t{1} << m;
    auto [x, y] = batch(o, step, id, rank);
    auto loss = torch::mse_loss(model(x), y);
    maybe_die(o, id, rank, step, "backward");
    loss.backward();
    maybe_die(o, id, rank, step, "vote");
    if (replicas.commit()) {
      opt.step();
      state[1 + step] = took_part;
      ++state[0];
      if (rank == 0)
        std::cout << "step " << step << " loss " << loss.item<double>() << " replicas "
                  << replicas.member_ids().size() << std::endl;
    } else if (rank == 0) {
      std::cout << "step " << step << " thrown away: the membership changed" << std::endl;
    }
    opt.zero_grad();
    if (o.pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.pause_ms));
  }
  replicas.finish();  // replicas still waiting to join are told the training is done
  const auto& st = replicas.stats();
  std::ostringstream summary;
  summary << "replica " << id << " rank " << rank << ": " << st.commits << " commits, " << st.aborts
          << " aborts, " << st.memberships << " memberships";
  if (!o.check) {
    std::cout << summary.str() << std::endl;
    return 0;
  }
  auto sharded = fsdp::full_state_dict(root);
  Net ref = reference(o, world->size(), state, o.steps);
  double worst = 0;
  for (const auto& item : ref->named_parameters())
    worst = std::max(worst, (sharded[item.key()] - item.value()).abs().max().item<double>());
  const bool ok = worst <= 1e-10;
  std::cout << "check: " << summary.str() << ", max |sharded - unsharded| = " << worst
            << (ok ? " (within 1e-10)" : " WRONG") << std::endl;
  return ok ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "fsdp-elastic-example: HSDP training that survives a replica's death (run under "
      "fsdp-run --replicas R)"};
  Options o;
  app.add_option("--steps", o.steps, "steps to train")->check(CLI::Range(1, 62));
  app.add_option("--width", o.width, "model width")->check(CLI::Range(1, 4096));
  app.add_option("--depth", o.depth, "blocks")->check(CLI::Range(1, 64));
  app.add_option("--pause-ms", o.pause_ms,
                 "sleep after each step (a slower step, so that a "
                 "restarted replica joins while the others train)")
      ->check(CLI::Range(0, 60000));
  app.add_flag("--check", o.check, "compare with the unsharded model in fp64 at the end");
  app.add_option(
      "--kill", o.kills,
      "REPLICA:STEP[:PHASE[:INCARNATION]]: that replica's rank 0 kills itself "
      "(SIGKILL) at STEP, before its backward (PHASE backward), before its vote (vote) "
      "or 5 ms into its sync (sync), in its first launch or the one FSDP_REPLICA_RESTART "
      "numbers");
  app.add_option("--stop", o.stops,
                 "REPLICA:STEP: that replica's ranks leave the training loop at STEP and exit "
                 "normally (as a trainer stopped by SIGTERM), without finish()")
      ->check([](const std::string& v) {
        const auto colon = v.find(':');
        const bool ok = colon != std::string::npos && colon > 0 && colon + 1 < v.size() &&
                        v.find_first_not_of("0123456789:") == std::string::npos &&
                        v.find(':', colon + 1) == std::string::npos;
        return ok ? std::string() : "expected REPLICA:STEP, e.g. 1:3";
      });
  CLI11_PARSE(app, argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}
