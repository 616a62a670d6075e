// The training loop of fsdp-train. One of the few TUs with <torch/torch.h> (optimizers, nn).
// What it computes is specified in docs/trainer.md; keep the two in step.
#include "train/trainer.h"

#include <fsdp/fsdp.h>
#include <fsdp/models/gpt.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "train/generate.h"
#include "train/launch.h"
#include "train/metrics.h"
#include "train/plot.h"
#include "train/progress.h"
#include "train/schedule.h"

#if FSDP_TRAIN_HAVE_CHECKPOINT
#include <fsdp/checkpoint.h>
#endif

namespace fsdp::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Rank 0's string, on every rank (the run directory must be one directory for all ranks).
std::string broadcast_string(Communicator& comm, const std::string& s) {
  constexpr int64_t kMax = 4096;
  auto t = torch::zeros({kMax + 1}, torch::kInt64);
  if (comm.rank() == 0) {
    FSDP_CHECK(static_cast<int64_t>(s.size()) <= kMax, "run directory path of ", s.size(),
               " bytes is longer than ", kMax, "; choose a shorter --run-dir");
    auto a = t.accessor<int64_t, 1>();
    a[0] = static_cast<int64_t>(s.size());
    for (size_t i = 0; i < s.size(); ++i) a[i + 1] = static_cast<unsigned char>(s[i]);
  }
  comm.broadcast(t, 0).wait();
  auto a = t.accessor<int64_t, 1>();
  std::string out(static_cast<size_t>(a[0]), '\0');
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(a[i + 1]);
  return out;
}

// The model and what the optimizer sees of it: the local shards (sharded) or the parameters.
struct Model {
  fsdp::Sharded<models::GPT> gpt;
  FSDPModule root;                   // undefined for --no-shard
  std::vector<at::Tensor> decay;     // 2-D weights: AdamW weight decay applies
  std::vector<at::Tensor> no_decay;  // biases and LayerNorm parameters
  int64_t parameter_count = 0;       // of the full model
};

std::unique_ptr<Model> build_model(const TrainConfig& cfg,
                                   const std::shared_ptr<Communicator>& comm) {
  models::GPTConfig mc;
  mc.vocab_size = 256;
  mc.seq_len = cfg.seq;
  mc.n_layer = cfg.layers;
  mc.n_head = cfg.heads;
  mc.n_embd = cfg.width;
  mc.validate();
  // Every rank (and --no-shard) draws the same initial weights from the same seed.
  torch::manual_seed(cfg.seed);
  auto m = std::make_unique<Model>(Model{fsdp::Sharded<models::GPT>(mc), {}, {}, {}, 0});
  if (comm) {
    ShardOptions block_options;
    block_options.reshard_after_forward = cfg.reshard_after_forward;
    m->root = models::shard_gpt(m->gpt, comm, block_options, ShardOptions{});
    for (const ShardInfo& s : m->root.shards()) {
      int64_t numel = 1;
      for (int64_t d : s.global_shape) numel *= d;
      m->parameter_count += numel;
      if (!s.requires_grad) continue;
      (s.global_shape.size() >= 2 ? m->decay : m->no_decay).push_back(s.shard);
    }
  } else {
    for (const auto& p : m->gpt->parameters()) {
      m->parameter_count += p.numel();
      (p.dim() >= 2 ? m->decay : m->no_decay).push_back(p);
    }
  }
  return m;
}

std::unique_ptr<torch::optim::AdamW> build_optimizer(const TrainConfig& cfg, Model& m) {
  auto options = [&](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(cfg.lr)
                                                            .betas({cfg.beta1, cfg.beta2})
                                                            .eps(cfg.eps)
                                                            .weight_decay(wd));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(m.decay, options(cfg.weight_decay));
  groups.emplace_back(m.no_decay, options(0.0));
  return std::make_unique<torch::optim::AdamW>(std::move(groups), *options(0.0));
}

// zero_grad(set_to_none): drops the gradients instead of zeroing them in place, which frees their
// memory between steps (PyTorch 2's default; same mathematics) and does not depend on how the
// sharded gradients are stored (LibTorch 1.13's Optimizer::zero_grad() calls detach_() on them).
void clear_grads(torch::optim::Optimizer& opt) {
  for (auto& g : opt.param_groups())
    for (auto& p : g.params()) p.mutable_grad() = at::Tensor();
}

void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
}

#if !FSDP_TRAIN_HAVE_CHECKPOINT
[[noreturn]] void no_checkpoint_support(const char* flag) {
  throw Error(detail::cat(flag,
                          " needs checkpoint support, which this build of fsdp-train lacks "
                          "(the fsdp_checkpoint library was not found at configure time); "
                          "rebuild from a checkout that has cmake/checkpoint.cmake"));
}
#endif

// What rank 0 prints at the end.
struct Summary {
  int64_t steps_done = 0;
  int64_t first_step = 0;
  double first_loss = NAN;
  double final_loss = NAN;
  double mean_last = NAN;  // over the last min(10, steps) steps
  double tokens_per_s = 0;
  double wall_s = 0;
  std::vector<double> peak_rss_mb;  // per rank
  std::string sample;
};

std::string model_description(const TrainConfig& cfg, int64_t params) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "GPT %lld layers x %lld wide, %lld heads, seq %lld, %.2fM params",
                static_cast<long long>(cfg.layers), static_cast<long long>(cfg.width),
                static_cast<long long>(cfg.heads), static_cast<long long>(cfg.seq),
                static_cast<double>(params) / 1e6);
  return buf;
}

void print_summary(const TrainConfig& cfg, const Summary& s, int world, int64_t params,
                   bool stopped) {
  std::ostringstream os;
  char buf[256];
  std::snprintf(buf, sizeof buf, "fsdp-train: %s after %s: %lld/%lld steps on %d rank%s%s\n",
                stopped ? "stopped" : "done", format_duration(s.wall_s).c_str(),
                static_cast<long long>(s.first_step + s.steps_done),
                static_cast<long long>(cfg.steps), world, world == 1 ? "" : "s",
                cfg.no_shard ? " (--no-shard: plain LibTorch)" : " (fully sharded)");
  os << buf;
  os << "  model         " << model_description(cfg, params) << "\n";
  std::snprintf(buf, sizeof buf,
                "  final loss    %.4f (mean of the last steps %.4f; first step %.4f)\n",
                s.final_loss, s.mean_last, s.first_loss);
  os << buf;
  std::snprintf(buf, sizeof buf, "  throughput    %s tokens/s (global batch %lld x %lld tokens)\n",
                format_count(s.tokens_per_s).c_str(), static_cast<long long>(cfg.batch),
                static_cast<long long>(cfg.seq));
  os << buf;
  os << "  peak memory  ";
  for (size_t r = 0; r < s.peak_rss_mb.size(); ++r) {
    std::snprintf(buf, sizeof buf, " rank %zu: %.0f MiB%s", r, s.peak_rss_mb[r],
                  r + 1 < s.peak_rss_mb.size() ? "," : "");
    os << buf;
  }
  os << " (peak resident set)\n";
  if (!s.sample.empty()) {
    os << "  sample        prompt \"" << printable(cfg.prompt) << "\", temperature "
       << cfg.temperature << ":\n";
    std::istringstream lines(printable(cfg.prompt + s.sample));
    for (std::string line; std::getline(lines, line);) os << "    | " << line << "\n";
  }
  os << "  outputs       " << cfg.run_dir << "/ (metrics.csv, loss.svg, config.json)\n";
  std::fputs(os.str().c_str(), stdout);
  std::fflush(stdout);
}

}  // namespace

int run_training(TrainConfig cfg, const Corpus& corpus, const std::shared_ptr<Communicator>& comm) {
  const auto t_start = Clock::now();
  const int rank = comm ? comm->rank() : 0;
  const int world = comm ? comm->size() : 1;
  cfg.validate_world(world);
  at::set_num_threads(threads_per_rank(cfg.threads, world));
#if !FSDP_TRAIN_HAVE_CHECKPOINT
  if (cfg.save_every > 0) no_checkpoint_support("--save-every");
  if (!cfg.resume.empty()) no_checkpoint_support("--resume");
  if (!cfg.init_from.empty()) no_checkpoint_support("--init-from");
#endif

  // ---- run directory: rank 0's choice, created by rank 0 ----
  if (cfg.run_dir.empty()) cfg.run_dir = cfg.resume.empty() ? default_run_dir() : cfg.resume;
  if (comm) cfg.run_dir = broadcast_string(*comm, cfg.run_dir);
  if (rank == 0) {
    std::error_code ec;
    std::filesystem::create_directories(cfg.run_dir, ec);
    FSDP_CHECK(!ec, "run directory '", cfg.run_dir, "' cannot be created (", ec.message(),
               "); choose another --run-dir");
    write_text_file_atomic(cfg.run_dir + "/config.json", cfg.to_json());
  }

  // ---- model, optimizer, state ----
  auto model = build_model(cfg, comm);
  auto opt = build_optimizer(cfg, *model);
  int64_t start_step = 0;
#if FSDP_TRAIN_HAVE_CHECKPOINT
  if (!cfg.resume.empty()) {
    auto ckpt = checkpoint::latest(cfg.resume);
    FSDP_CHECK(ckpt.has_value(), "--resume '", cfg.resume,
               "' holds no complete checkpoint (no step_*/index.json); pass the run directory of "
               "a run that used --save-every");
    const checkpoint::TrainState state = checkpoint::load(*ckpt, model->root, opt.get(), *comm);
    start_step = state.step;
    FSDP_CHECK(start_step <= cfg.steps, "--resume '", *ckpt, "' is at step ", start_step,
               ", beyond --steps ", cfg.steps, "; raise --steps to train further");
    if (rank == 0)  // also with --quiet: where a run continues from matters
      std::printf("fsdp-train: resuming from %s at step %lld\n", ckpt->c_str(),
                  static_cast<long long>(start_step));
  }
  if (!cfg.init_from.empty()) checkpoint::init_from(cfg.init_from, model->root);
#endif

  const LrSchedule schedule{cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio};
  const DataStream stream(corpus, parse_data_order(cfg.data_order), cfg.seed, cfg.seq, cfg.batch);
  const int64_t local_batch = cfg.batch / world;
  const int64_t row_begin = rank * local_batch;  // this rank's contiguous slice of the global batch
  const double tokens_per_step = static_cast<double>(cfg.batch * cfg.seq);

  std::unique_ptr<MetricsWriter> metrics;
  std::unique_ptr<Progress> progress;
  if (rank == 0) {
    metrics = std::make_unique<MetricsWriter>(cfg.run_dir + "/metrics.csv", !cfg.resume.empty(),
                                              start_step);
    progress = std::make_unique<Progress>(cfg.quiet, cfg.steps, cfg.log_every);
    if (!cfg.quiet) {
      std::printf(
          "fsdp-train: %s on %d rank%s, %lld steps, global batch %lld, data %s (%lld "
          "bytes, %s order), run dir %s\n",
          model_description(cfg, model->parameter_count).c_str(), world, world == 1 ? "" : "s",
          static_cast<long long>(cfg.steps), static_cast<long long>(cfg.batch),
          corpus.path().c_str(), static_cast<long long>(corpus.size()), cfg.data_order.c_str(),
          cfg.run_dir.c_str());
      std::fflush(stdout);
    }
  }

  // Checkpoint after `steps_taken` steps; the data order is a function of the step, so the step is
  // also the data position.
  auto save = [&](int64_t steps_taken) {
#if FSDP_TRAIN_HAVE_CHECKPOINT
    checkpoint::TrainState state;
    state.step = steps_taken;
    state.data_position = steps_taken;
    state.extra = nlohmann::json::parse(cfg.to_json());
    checkpoint::save(cfg.run_dir, model->root, opt.get(), state, *comm);
#endif
  };
  // Step 0 too: the initial weights, for an external reference to start from (docs/trainer.md).
  if (cfg.save_every > 0 && start_step == 0) save(0);

  // ---- the loop ----
  Summary summary;
  summary.first_step = start_step;
  summary.peak_rss_mb.assign(static_cast<size_t>(world), 0.0);
  std::vector<double> last_losses;
  std::vector<int64_t> x_host, y_host;
  double timed_s = 0;  // time of the steps after the first (warm-up excluded from throughput)
  int64_t timed_steps = 0;
  bool stopped = false;
  // Per step: [sum of rank losses, ranks asking to stop, peak RSS of rank r at 2 + r].
  auto stats = torch::zeros({2 + world}, torch::kDouble);
  for (int64_t step = start_step; step < cfg.steps; ++step) {
    const auto t0 = Clock::now();
    const double lr = schedule.at(step);
    set_lr(*opt, lr);
    stream.fill(step, row_begin, row_begin + local_batch, x_host, y_host);
    const auto x = torch::from_blob(x_host.data(), {local_batch, cfg.seq}, torch::kInt64);
    const auto y = torch::from_blob(y_host.data(), {local_batch, cfg.seq}, torch::kInt64);

    auto loss = model->gpt(x, y);  // mean over this rank's B/world x T targets
    loss.backward();
    opt->step();
    clear_grads(*opt);

    stats.zero_();
    auto s = stats.accessor<double, 1>();
    s[0] = loss.item<double>();
    s[1] = stop_requested() ? 1.0 : 0.0;
    s[2 + rank] = peak_rss_mb();
    if (comm) comm->all_reduce(stats, ReduceOp::kSum).wait();
    const double global_loss = s[0] / world;  // equal slices: the mean over the global batch
    const double step_s = seconds_since(t0);
    if (step > start_step) {
      timed_s += step_s;
      ++timed_steps;
    }
    for (int r = 0; r < world; ++r)
      summary.peak_rss_mb[r] = std::max(summary.peak_rss_mb[r], s[2 + r]);
    if (step == start_step) summary.first_loss = global_loss;
    summary.final_loss = global_loss;
    ++summary.steps_done;
    last_losses.push_back(global_loss);
    if (last_losses.size() > 10) last_losses.erase(last_losses.begin());

    if (rank == 0) {
      MetricsRow row{
          step + 1, global_loss,
          lr,       tokens_per_step / step_s,
          step_s,   *std::max_element(summary.peak_rss_mb.begin(), summary.peak_rss_mb.end())};
      metrics->write(row);
      const double per_step = timed_steps > 0 ? timed_s / timed_steps : step_s;
      progress->update(row, per_step * static_cast<double>(cfg.steps - step - 1));
    }
    if (cfg.save_every > 0 && (step + 1) % cfg.save_every == 0) save(step + 1);
    if (s[1] > 0) {
      stopped = true;
      break;
    }
  }
  if (progress) progress->finish();
  summary.tokens_per_s = timed_steps > 0 ? tokens_per_step * timed_steps / timed_s : 0.0;
  double sum = 0;
  for (double l : last_losses) sum += l;
  summary.mean_last = last_losses.empty() ? NAN : sum / static_cast<double>(last_losses.size());

  // ---- closing sample: every rank runs the same forwards (the model is sharded) ----
  if (!stopped && cfg.sample_tokens > 0) {
    torch::NoGradGuard no_grad;
    SampleOptions so;
    so.tokens = cfg.sample_tokens;
    so.temperature = cfg.temperature;
    so.seed = cfg.seed;
    so.context = cfg.seq;
    summary.sample = generate_text(cfg.prompt, so, [&](const std::vector<int64_t>& ctx) {
      const auto idx = torch::tensor(ctx, torch::kInt64).view({1, -1});
      const auto logits = model->gpt(idx).select(0, 0).select(0, -1).to(torch::kFloat).contiguous();
      const float* p = logits.data_ptr<float>();
      return std::vector<float>(p, p + logits.numel());
    });
  }

  // ---- outputs ----
  summary.wall_s = seconds_since(t_start);
  if (rank == 0) {
    std::vector<std::pair<int64_t, double>> points;
    for (const auto& r : read_metrics(cfg.run_dir + "/metrics.csv"))
      points.emplace_back(r.step, r.loss);
    PlotOptions po;
    po.subtitle = model_description(cfg, model->parameter_count) + ", " + std::to_string(world) +
                  (world == 1 ? " rank" : " ranks") + (cfg.no_shard ? " (no-shard)" : "");
    write_text_file_atomic(cfg.run_dir + "/loss.svg", loss_curve_svg(points, po));
    print_summary(cfg, summary, world, model->parameter_count, stopped);
  }
  // A rank that got no signal itself stops because another did: report SIGTERM, as fsdp-run does.
  return stopped ? 128 + (stop_signal() != 0 ? stop_signal() : SIGTERM) : 0;
}

}  // namespace fsdp::train
