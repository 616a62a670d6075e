// The training run of fsdp-train (trainer.h). One of the few TUs with <torch/torch.h>.
// What it computes is specified in docs/trainer.md; keep the two in step.
#include "train/trainer.h"

#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <new>

#include "checkpoint/atomic_file.h"
#include "comm/rank_agreement.h"
#include "train/generate.h"
#include "train/hf_init.h"
#include "train/launch.h"
#include "train/malloc.h"
#include "train/metrics.h"
#include "train/model_setup.h"
#include "train/model_size.h"
#include "train/plot.h"
#include "train/progress.h"
#include "train/summary.h"
#include "train/token_sample.h"

#if FSDP_TRAIN_HAVE_CHECKPOINT
#include <fsdp/checkpoint.h>

#include "train/run_checkpoints.h"
#endif

namespace fsdp::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

bool is_allocation_failure(const char* what) {
  const std::string m = what;
  return m.find("can't allocate memory") != std::string::npos ||
         m.find("not enough memory") != std::string::npos ||
         m.find("std::bad_alloc") != std::string::npos;
}

// Runs f; an allocation failure becomes an fsdp::Error naming `what` and the settings behind it
// (and `or_else`, another way out, when not empty).
template <class F>
void naming_allocation_failure(const std::string& what, const std::string& settings, F&& f,
                               const std::string& or_else = "") {
  auto fail = [&](const char* detail) {
    throw Error(detail::cat(what, " ran out of memory (", detail, "); its size comes from ",
                            settings, ": lower them", or_else.empty() ? "" : ", or ", or_else));
  };
  try {
    f();
  } catch (const std::bad_alloc& e) {
    fail(e.what());
  } catch (const c10::Error& e) {
    if (!is_allocation_failure(e.what_without_backtrace())) throw;
    fail(e.what_without_backtrace());
  }
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

// Peak FLOP/s of this rank's threads: the fastest of about 0.3 s of 256x256 fp32 matrix
// products (the fastest, not the mean, so that time the cores spent on other processes does not
// count; small enough, about 33 MFLOP, to run within one scheduler slice on a loaded machine).
double measure_peak_flops() {
  torch::NoGradGuard no_grad;
  const int64_t n = 256;
  const auto a = torch::randn({n, n}), b = torch::randn({n, n});
  auto c = torch::mm(a, b);  // warm-up
  double best = INFINITY;
  const auto t0 = Clock::now();
  do {
    const auto t = Clock::now();
    c = torch::mm(a, b);
    best = std::min(best, seconds_since(t));
  } while (seconds_since(t0) < 0.3);
  return 2.0 * n * n * n / best;
}

class Trainer {
 public:
  Trainer(const RunPlan& plan, const Corpus& corpus, std::shared_ptr<Communicator> comm)
      : cfg_(plan.cfg),
        plan_(plan),
        schedule_(plan.schedule),
        comm_(std::move(comm)),
        rank_(comm_ ? comm_->rank() : 0),
        world_(comm_ ? comm_->size() : 1),
        splits_(split_validation(corpus, cfg_.val_fraction, cfg_.seq)) {}

  int run() {
    set_up();
    resume();
    open_outputs();
    loop();
    return finish();
  }

 private:
  // ---- set-up ----
  void set_up() {
    join_replicas();
    cfg_.validate_world(data_world_);
    at::set_num_threads(threads_per_rank(cfg_.threads, world_));
#if !FSDP_TRAIN_HAVE_CHECKPOINT
    FSDP_CHECK(cfg_.save_every == 0 && cfg_.resume.empty() && cfg_.init_from.empty(),
               "--save-every/--resume/--init-from need checkpoint support, which this build of "
               "fsdp-train lacks; rebuild from a checkout that has cmake/checkpoint.cmake");
#endif
    if (cfg_.run_dir.empty()) cfg_.run_dir = default_run_dir();
    if (comm_) cfg_.run_dir = detail::broadcast_string(*comm_, cfg_.run_dir);
    naming_allocation_failure(
        "building the model",
        detail::cat("--layers ", cfg_.layers, ", --width ", cfg_.width, ", --vocab ", cfg_.vocab),
        [&] {
          const DeviceMesh mesh = elastic_ ? elastic_->mesh() : DeviceMesh{};
          model_ = build_model(cfg_, comm_, elastic_ ? &mesh : nullptr);
          opt_ = build_optimizer(cfg_, *model_);
        });
    train_stream_ = std::make_unique<DataStream>(splits_.first, parse_data_order(cfg_.data_order),
                                                 cfg_.seed, cfg_.seq, cfg_.batch);
    if (splits_.second.size() > 0)
      val_stream_ = std::make_unique<DataStream>(splits_.second, DataOrder::kSequential, cfg_.seed,
                                                 cfg_.seq, cfg_.batch);
    summary_.peak_rss_mb.assign(static_cast<size_t>(world_), 0.0);
    summary_.peak_measured = cfg_.peak_tflops <= 0;
    double peak = cfg_.peak_tflops > 0 ? cfg_.peak_tflops * 1e12 : measure_peak_flops();
    if (comm_ && summary_.peak_measured) {  // the mean over ranks
      auto t = torch::tensor({peak}, torch::kDouble);
      comm_->all_reduce(t, ReduceOp::kSum).wait();
      peak = t.item<double>() / world_;
    }
    summary_.peak_tflops = peak / 1e12;
    flops_per_token_ = flops_per_token(cfg_);
  }

  // Under fsdp-run --replicas (fsdp/elastic.h): this process is a rank of one replica, which joins
  // the job; the global batch is spread over the job's first replicas (FSDP_MIN_REPLICAS), each
  // replica training its slice, and each writes its outputs under run-dir/replica-<id>.
  void join_replicas() {
    if (!comm_ || !ElasticOptions::requested()) return;
    FSDP_CHECK(cfg_.hsdp == 1, "--hsdp ", cfg_.hsdp,
               " with elastic replicas: the replicas come from fsdp-run --replicas; drop --hsdp");
    FSDP_CHECK(cfg_.save_every == 0 && cfg_.resume.empty(),
               "--save-every and --resume are not available with elastic replicas yet (a replica "
               "that dies is replaced from a survivor's state, not from a checkpoint); drop them, "
               "or train without fsdp-run --replicas");
    const ElasticOptions options = ElasticOptions::from_env();
    // Before joining: a replica admitted and then stopped would cost the others a membership.
    FSDP_CHECK(options.replica_id < options.min_replicas, "elastic: replica id ",
               options.replica_id, " is not below FSDP_MIN_REPLICAS=", options.min_replicas,
               ": the global batch is spread over that many replicas");
    elastic_ = std::make_unique<ElasticReplicas>(comm_, options);
    data_world_ = options.min_replicas * world_;
    data_rank_ = options.replica_id * world_ + rank_;
    const char* restart = std::getenv("FSDP_REPLICA_RESTART");
    if (cfg_.run_dir.empty()) cfg_.run_dir = default_run_dir();
    cfg_.run_dir =
        detail::cat(detail::broadcast_string(*comm_, cfg_.run_dir), "/replica-", options.replica_id,
                    restart && std::string(restart) != "0" ? ".restart-" : "",
                    restart && std::string(restart) != "0" ? restart : "");
  }

  // An elastic replica's start: the first sync binds the membership's lanes and, for a replica
  // joining a running job, copies the model, the optimizer and the step from a member.
  void sync_replicas() {
    elastic_state_[0] = start_step_;
    elastic_->sync(model_->root, *opt_, elastic_state_);
    if (elastic_state_[0] != start_step_ && rank_ == 0)
      std::printf(
          "fsdp-train: replica %d joined the running job at step %lld, %.2f s after it "
          "started (membership %lld)\n",
          elastic_->replica_id(), static_cast<long long>(elastic_state_[0]),
          seconds_since(t_start_), static_cast<long long>(elastic_->epoch()));
    start_step_ = elastic_state_[0];
  }

  // ---- resume: load first; the run directory is untouched until this has succeeded ----
  void resume() {
#if FSDP_TRAIN_HAVE_CHECKPOINT
    if (plan_.from) {
      const ResumePoint& p = *plan_.from;
      if (comm_) {  // every rank raises when one chose another checkpoint than rank 0
        const std::string chosen = detail::broadcast_string(*comm_, p.checkpoint);
        detail::raise_together(
            *comm_,
            chosen == p.checkpoint
                ? std::string()
                : detail::cat("rank ", rank_, " chose checkpoint '", p.checkpoint,
                              "' but rank 0 chose '", chosen,
                              "': the run directory changed while the ranks started; start again"),
            "resume");
      }
      if (rank_ == 0) {  // also with --quiet: where a run continues from matters
        // One stream, so that the reports come before the fallback in any log.
        std::string text;
        for (const auto& s : p.skipped) text += "fsdp-train: skipping " + s + "\n";
        text += detail::cat("fsdp-train: resuming from ", p.checkpoint, " at step ", p.step, "\n");
        std::fputs(text.c_str(), stdout);
        std::fflush(stdout);
      }
      try {
        start_step_ =
            checkpoint::load(p.checkpoint, model_->root, opt_.get(), model_->shard_group()).step;
      } catch (const CommError&) {
        throw;
      } catch (const Error& e) {  // damaged inside: say how to fall back (resume.h)
        throw Error(with_fallback_hint(e.what(), cfg_.resume, cfg_.run_dir));
      }
    } else if (!cfg_.init_from.empty()) {
      init_model_from(cfg_, *model_);
    }
#endif
  }

  void open_outputs() {
    if (rank_ != 0) return;
    std::error_code ec;
    std::filesystem::create_directories(cfg_.run_dir, ec);
    FSDP_CHECK(!ec, "run directory '", cfg_.run_dir, "' cannot be created (", ec.message(),
               "); choose another --run-dir");
    fsdp::write_text_atomic(cfg_.run_dir + "/config.json", cfg_.to_json());
    metrics_ = std::make_unique<MetricsWriter>(cfg_.run_dir + "/metrics.csv",
                                               plan_.from.has_value(), start_step_);
    progress_ = std::make_unique<Progress>(cfg_.quiet, cfg_.steps, cfg_.log_every);
    if (cfg_.quiet) return;
    std::printf(
        "fsdp-train: %s on %d rank%s, %lld steps, global batch %lld%s, data %s (%lld tokens: "
        "%lld train, %lld validation; %s order), malloc %s, run dir %s\n",
        model_description(cfg_, model_->parameter_count).c_str(), world_, world_ == 1 ? "" : "s",
        static_cast<long long>(cfg_.steps), static_cast<long long>(cfg_.batch),
        cfg_.grad_accum > 1 ? (" in " + std::to_string(cfg_.grad_accum) + " micro-batches").c_str()
                            : "",
        cfg_.data.c_str(), static_cast<long long>(splits_.first.size() + splits_.second.size()),
        static_cast<long long>(splits_.first.size()), static_cast<long long>(splits_.second.size()),
        cfg_.data_order.c_str(), describe_malloc_policy(cfg_.malloc_policy).c_str(),
        cfg_.run_dir.c_str());
    std::fflush(stdout);
  }

  // ---- the loop ----
  void loop() {
    if (elastic_) sync_replicas();
    // Step 0 too: the initial weights, for an external reference to start from (docs/trainer.md).
    if (cfg_.save_every > 0 && start_step_ == 0) save(0);
    summary_.first_step = start_step_;
    for (int64_t s = start_step_; s < cfg_.steps; ++s) {
      const auto t0 = Clock::now();
      const double lr = schedule_.at(s);
      const double loss = step(s, lr);
      const bool stop = gather_stats(loss);
      MetricsRow row{s + 1, global_loss_, lr, 0, seconds_since(t0), max_rss()};
      row.tokens_per_s = tokens_per_step() / row.step_time_s;
      row.mfu = row.tokens_per_s * flops_per_token_ / (world_ * summary_.peak_tflops * 1e12);
      row.grad_norm = grad_norm_;
      const bool last = s + 1 == cfg_.steps || stop;
      if (val_stream_ && cfg_.eval_every > 0 && ((s + 1) % cfg_.eval_every == 0 || last))
        row.val_loss = evaluate(s + 1);
      log(row, s);
      if (cfg_.save_every > 0 && (s + 1) % cfg_.save_every == 0) save(s + 1);
      if (stop) {
        stopped_ = true;
        break;
      }
    }
    // The job's training is done: replicas waiting to join are told so. Not when stopped early:
    // the other replicas go on without this one.
    if (elastic_ && !stopped_) elastic_->finish();
#if FSDP_TRAIN_HAVE_CHECKPOINT
    if (checkpoints_) checkpoints_->finish();  // --async-save: the last save commits before the end
#endif
    if (progress_) progress_->finish();
  }

  // One optimizer step over grad_accum micro-batches; returns this rank's mean loss. An elastic
  // replica runs it again when the membership changed during it (its gradients thrown away).
  double step(int64_t s, double lr) {
    set_lr(*opt_, lr);
    const int64_t micro = cfg_.micro_batch(data_world_);
    double loss = 0;
    naming_allocation_failure("a training step", micro_batch_settings(micro), [&] {
      const auto attempt0 = Clock::now();
      for (int attempts = 1;; ++attempts) {
        if (elastic_) {
          elastic_state_[0] = s;
          elastic_->sync(model_->root, *opt_, elastic_state_);
        }
        loss = forward_backward(s, micro);
        if (!elastic_ || elastic_->commit()) {
          if (attempts > 1) report_redone(s, attempt0);
          break;
        }
        clear_grads(*opt_);
      }
      if (cfg_.clip > 0) grad_norm_ = clip_gradients();
      opt_->step();
      clear_grads(*opt_);
    });
    return loss;
  }

  // The micro-batches of step `s` on this rank's slice of the global batch.
  double forward_backward(int64_t s, int64_t micro) {
    const int64_t row0 = data_rank_ * (cfg_.batch / data_world_);
    double loss_sum = 0;
    for (int64_t k = 0; k < cfg_.grad_accum; ++k) {
      // Micro-batches before the last keep their gradients unreduced; the last reduces
      // the sum (the mean over micro-batches, as each loss is divided by grad_accum).
      if (model_->sharded()) model_->root.set_requires_gradient_sync(k + 1 == cfg_.grad_accum);
      const int64_t begin = row0 + k * micro;
      train_stream_->fill(s, begin, begin + micro, x_host_, y_host_);
      auto loss = loss_of(tensor_of(x_host_, micro), tensor_of(y_host_, micro));
      (loss / static_cast<double>(cfg_.grad_accum)).backward();
      loss_sum += loss.item<double>();
    }
    return loss_sum / static_cast<double>(cfg_.grad_accum);
  }

  void report_redone(int64_t s, Clock::time_point attempt0) {
    if (rank_ != 0) return;
    std::string ids;
    for (int id : elastic_->member_ids()) ids += (ids.empty() ? "" : ", ") + std::to_string(id);
    std::printf(
        "fsdp-train: step %lld redone over replicas [%s] after the membership changed: "
        "%.3f s from its first attempt to its commit\n",
        static_cast<long long>(s + 1), ids.c_str(), seconds_since(attempt0));
    std::fflush(stdout);
  }

  // Where a micro-batch's size comes from, for allocation-failure messages.
  std::string micro_batch_settings(int64_t micro) const {
    return detail::cat("--batch ", cfg_.batch, " / ", data_world_, " ranks / --grad-accum ",
                       cfg_.grad_accum, " = ", micro, " rows x --seq ", cfg_.seq, " x --width ",
                       cfg_.width, " x --layers ", cfg_.layers);
  }

  // The mean cross-entropy of the logits, outside the model's forward: with --mixed-precision the
  // root casts the logits to fp32 (output_dtype), so the loss is computed in fp32, not bf16.
  // In fp32 the same operations as GPT::forward(idx, targets).
  at::Tensor loss_of(const at::Tensor& x, const at::Tensor& y) {
    auto logits = model_->logits(x);
    return torch::nn::functional::cross_entropy(logits.view({-1, cfg_.vocab}), y.reshape({-1}));
  }

  // --clip: the global gradient 2-norm before clipping (every rank gets the same value).
  double clip_gradients() {
    if (model_->sharded()) return fsdp::clip_grad_norm_(model_->root, cfg_.clip);
    return torch::nn::utils::clip_grad_norm_(model_->module().parameters(), cfg_.clip);
  }

  // Per step: [sum of rank losses, ranks asking to stop, peak RSS of rank r at 2 + r].
  bool gather_stats(double rank_loss) {
    auto stats = torch::zeros({2 + world_}, torch::kDouble);
    auto a = stats.accessor<double, 1>();
    a[0] = rank_loss;
    a[1] = stop_requested() ? 1.0 : 0.0;
    a[2 + rank_] = peak_rss_mb();
    if (comm_) comm_->all_reduce(stats, ReduceOp::kSum).wait();
    global_loss_ = a[0] / world_;  // equal slices: the mean over the global batch
    for (int r = 0; r < world_; ++r)
      summary_.peak_rss_mb[r] = std::max(summary_.peak_rss_mb[r], a[2 + r]);
    return a[1] > 0;
  }

  // Mean loss over eval_batches global batches of the validation split (the same batches every
  // time: sequential windows from its start), each rank its slice, in micro-batch chunks.
  double evaluate(int64_t after_step) {
    torch::NoGradGuard no_grad;
    const int64_t micro = cfg_.micro_batch(world_);
    const int64_t row0 = rank_ * (cfg_.batch / world_);
    double sum = 0;
    naming_allocation_failure(
        "the evaluation", micro_batch_settings(micro),
        [&] {
          for (int64_t b = 0; b < cfg_.eval_batches; ++b)
            for (int64_t k = 0; k < cfg_.grad_accum; ++k) {
              const int64_t begin = row0 + k * micro;
              val_stream_->fill(b, begin, begin + micro, x_host_, y_host_);
              sum += loss_of(tensor_of(x_host_, micro), tensor_of(y_host_, micro)).item<double>();
            }
        },
        "skip the evaluation (--eval-every 0)");
    auto t = torch::tensor({sum}, torch::kDouble);
    if (comm_) comm_->all_reduce(t, ReduceOp::kSum).wait();
    const double val =
        t.item<double>() / static_cast<double>(world_ * cfg_.eval_batches * cfg_.grad_accum);
    summary_.val_loss = val;
    summary_.val_step = after_step;
    return val;
  }

  void log(const MetricsRow& row, int64_t s) {
    if (s > start_step_) {  // the first step (warm-up) is left out of the throughput
      timed_s_ += row.step_time_s;
      ++timed_steps_;
    }
    if (s == start_step_) summary_.first_loss = row.loss;
    summary_.final_loss = row.loss;
    ++summary_.steps_done;
    last_losses_.push_back(row.loss);
    if (last_losses_.size() > 10) last_losses_.erase(last_losses_.begin());
    if (rank_ != 0) return;
    metrics_->write(row);
    const double per_step = timed_steps_ > 0 ? timed_s_ / timed_steps_ : row.step_time_s;
    progress_->update(row, per_step * static_cast<double>(cfg_.steps - s - 1));
  }

  // Checkpoint after `steps_taken` steps, then --keep-last retention (run_checkpoints.h).
  void save(int64_t steps_taken) {
#if FSDP_TRAIN_HAVE_CHECKPOINT
    if (!checkpoints_) checkpoints_ = std::make_unique<RunCheckpoints>(cfg_, schedule_, rank_);
    checkpoints_->save(steps_taken, model_->root, opt_.get(), model_->shard_group());
#else
    (void)steps_taken;
#endif
  }

  // ---- finish ----
  int finish() {
    summary_.tokens_per_s = timed_steps_ > 0 ? tokens_per_step() * timed_steps_ / timed_s_ : 0.0;
    summary_.mfu =
        summary_.tokens_per_s * flops_per_token_ / (world_ * summary_.peak_tflops * 1e12);
    double sum = 0;
    for (double l : last_losses_) sum += l;
    summary_.mean_last =
        last_losses_.empty() ? NAN : sum / static_cast<double>(last_losses_.size());
    if (!stopped_) sample();
    summary_.wall_s = seconds_since(t_start_);
    if (rank_ == 0) {
      write_plot();
#if FSDP_TRAIN_HAVE_CHECKPOINT
      if (checkpoints_) summary_.checkpoints = checkpoints_->summary_line();
#endif
      std::string text = format_summary(cfg_, summary_, world_, model_->parameter_count, stopped_);
      if (elastic_) text += elastic_summary();
      std::fputs(text.c_str(), stdout);
      std::fflush(stdout);
    }
    // A rank that got no signal itself stops because another did: report SIGTERM, as fsdp-run
    // does.
    return stopped_ ? 128 + (stop_signal() != 0 ? stop_signal() : SIGTERM) : 0;
  }

  std::string elastic_summary() const {
    const auto& st = elastic_->stats();
    return detail::cat("  elastic       replica ", elastic_->replica_id(), ": ", st.commits,
                       " steps committed, ", st.aborts, " attempts thrown away (step efficiency ",
                       st.commits + st.aborts > 0
                           ? static_cast<double>(st.commits) / (st.commits + st.aborts)
                           : 1.0,
                       "), ", st.memberships, " memberships; ", st.vote_seconds, " s in votes, ",
                       st.sync_seconds, " s rebinding and copying state\n");
  }

  // The closing sample: every rank runs the same forwards (the model is sharded). Text data:
  // bytes from --prompt; token data: ids (token_sample.h), shown as text with --tokenizer.
  void sample() {
    if (cfg_.sample_tokens == 0) return;
    const bool bytes = splits_.first.format() == TokenFormat::kBytes && cfg_.vocab == 256;
    torch::NoGradGuard no_grad;
    SampleOptions so;
    so.tokens = cfg_.sample_tokens;
    so.temperature = cfg_.temperature;
    so.seed = cfg_.seed;
    so.context = cfg_.seq;
    const NextLogits next = [&](const std::vector<int64_t>& ctx) {
      const auto idx = torch::tensor(ctx, torch::kInt64).view({1, -1});
      const auto logits =
          model_->logits(idx).select(0, 0).select(0, -1).to(torch::kFloat).contiguous();
      const float* p = logits.data_ptr<float>();
      return std::vector<float>(p, p + logits.numel());
    };
    // One row of up to --seq tokens: its attention scores (--heads x seq x seq) dominate.
    naming_allocation_failure(
        "the closing sample",
        detail::cat("1 row x --seq ", cfg_.seq, " (the context) x --heads ", cfg_.heads,
                    " x --width ", cfg_.width, " x --layers ", cfg_.layers),
        [&] {
          if (bytes) {
            summary_.sample = generate_text(cfg_.prompt, so, next);
            return;
          }
          const auto prompt = sample_prompt_tokens(cfg_, splits_.second, splits_.first);
          const auto ids = generate_tokens(prompt, so, next);
          summary_.sample_prompt = "prompt tokens [" + format_ids(prompt) + "]";
          summary_.sample = "token ids: " + format_ids(ids) + "\n";
          if (!cfg_.tokenizer.empty()) {
            const auto vocab = TokenizerVocab::load(cfg_.tokenizer);
            summary_.sample +=
                "text: " + one_line(vocab.decode(prompt) + "[" + vocab.decode(ids) + "]") + "\n";
          }
        },
        "generate no sample (--sample-tokens 0)");
  }

  void write_plot() {
    PlotSeries series;
    for (const auto& r : read_metrics(cfg_.run_dir + "/metrics.csv")) {
      series.loss.emplace_back(r.step, r.loss);
      series.lr.emplace_back(r.step, r.lr);
      if (std::isfinite(r.val_loss)) series.val_loss.emplace_back(r.step, r.val_loss);
    }
    PlotOptions po;
    po.subtitle = model_description(cfg_, model_->parameter_count) + ", " + std::to_string(world_) +
                  (world_ == 1 ? " rank" : " ranks") + (cfg_.no_shard ? " (no-shard)" : "");
    fsdp::write_text_atomic(cfg_.run_dir + "/loss.svg", loss_curve_svg(series, po));
  }

  // The tokens this process's ranks train per step (an elastic replica: its slice).
  double tokens_per_step() const {
    return static_cast<double>(cfg_.batch * cfg_.seq) * world_ / data_world_;
  }

  at::Tensor tensor_of(std::vector<int64_t>& host, int64_t rows) const {
    return torch::from_blob(host.data(), {rows, cfg_.seq}, torch::kInt64);
  }
  double max_rss() const {
    return *std::max_element(summary_.peak_rss_mb.begin(), summary_.peak_rss_mb.end());
  }

  const Clock::time_point t_start_ = Clock::now();
  TrainConfig cfg_;
  const RunPlan& plan_;
  const LrSchedule schedule_;
  std::shared_ptr<Communicator> comm_;
  const int rank_;
  const int world_;
  const std::pair<Corpus, Corpus> splits_;       // training, validation
  std::unique_ptr<ElasticReplicas> elastic_;     // under fsdp-run --replicas
  std::vector<int64_t> elastic_state_{0};        // what a joining replica copies: the step
  int data_world_ = world_, data_rank_ = rank_;  // this rank's slice of the global batch
  std::unique_ptr<TrainModel> model_;
  std::unique_ptr<torch::optim::AdamW> opt_;
  std::unique_ptr<DataStream> train_stream_, val_stream_;
  std::unique_ptr<MetricsWriter> metrics_;  // rank 0
  double grad_norm_ = NAN;                  // of the last step, before clipping (--clip)
  std::unique_ptr<Progress> progress_;      // rank 0
  std::vector<int64_t> x_host_, y_host_;
  int64_t start_step_ = 0;
  double flops_per_token_ = 0;
  double global_loss_ = NAN;
  double timed_s_ = 0;
  int64_t timed_steps_ = 0;
  std::vector<double> last_losses_;
  bool stopped_ = false;
  Summary summary_;
#if FSDP_TRAIN_HAVE_CHECKPOINT
  std::unique_ptr<RunCheckpoints> checkpoints_;  // created by the first save
#endif
};

}  // namespace

int run_training(const RunPlan& plan, const Corpus& corpus,
                 const std::shared_ptr<Communicator>& comm) {
  return Trainer(plan, corpus, comm).run();
}

}  // namespace fsdp::train
