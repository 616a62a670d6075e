#include <fsdp/communicator.h>
#include <fsdp/error.h>
#include <fsdp/trace.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "compat.h"
#include "failure.h"
#include "rank_order_sum.h"
#include "ring_reduce_scatter.h"
#include "shm_transport.h"

namespace fsdp {

// ---------------------------------------------------------------------------------------------
// Broken groups
// ---------------------------------------------------------------------------------------------
// Once a collective of a world (or of a lane split from it) has failed, the group is broken: Gloo
// 1.13 cannot abort, so every collective still queued or in flight would wait out its own full
// timeout, one after the other (an exit took 2-5x the limit). Later waits fail at once instead,
// and a broken communicator's process group is left undestroyed (its worker threads would be
// joined mid-collective); the process is expected to exit. Keyed by the world's store, which the
// world and all its lanes share.
namespace {
std::mutex g_broken_mu;
std::map<const c10d::Store*, std::string>& broken_groups() {
  static auto* groups = new std::map<const c10d::Store*, std::string>();  // never destroyed
  return *groups;
}
std::string broken_reason(const c10d::Store* group) {
  std::lock_guard<std::mutex> lock(g_broken_mu);
  auto it = broken_groups().find(group);
  return it == broken_groups().end() ? std::string() : it->second;
}
void mark_broken(const c10d::Store* group, const std::string& why) {
  std::lock_guard<std::mutex> lock(g_broken_mu);
  broken_groups().emplace(group, why);
}
// A broken communicator's process group, never destroyed: held here for the life of the process,
// where it stays reachable (a released pointer was reported as leaked by LeakSanitizer).
void keep_undestroyed(c10::intrusive_ptr<c10d::ProcessGroup> pg) {
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>();  // never destroyed
  std::lock_guard<std::mutex> lock(g_broken_mu);
  kept->push_back(std::move(pg));
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// Work
// ---------------------------------------------------------------------------------------------
struct Work::Impl {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::function<void()> finish;  // local post-processing, run once on the waiting thread
  std::string what;              // "all_gather of 4096 bytes on 'world' (rank 0 of 2)"
  std::string op, lane;          // for the timeline
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<CommStats> stats;
  int64_t issued_us = 0;
  std::shared_ptr<const std::vector<PeerInfo>> peers;
  int rank = 0;
  const c10d::Store* group = nullptr;  // the world's store: identifies the world and its lanes
  std::mutex mu;
  bool done = false;
  std::string error;  // set by a failed wait; every later wait rethrows it
};

void Work::wait() {
  if (impl_) wait(impl_->timeout);
}

void Work::wait(std::chrono::milliseconds timeout) {
  if (!impl_) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->error.empty()) throw CommError(impl_->error);
  if (impl_->done) return;
  if (std::string first = broken_reason(impl_->group); !first.empty()) {
    impl_->done = true;
    impl_->error =
        detail::cat(impl_->what, " cannot complete: an earlier collective of this group failed (",
                    first.substr(0, first.find(':')), "); see that error");
    throw CommError(impl_->error);
  }
  const int64_t start = trace::now_us();
  struct Account {  // charged however the wait ends
    Work::Impl& w;
    int64_t start;
    ~Account() {
      const int64_t end = trace::now_us();
      if (w.stats) w.stats->wait_seconds += (end - start) * 1e-6;
      trace::complete("wait " + w.op, "wait", start, end - start);
    }
  } account{*impl_, start};
  for (auto& w : impl_->works) {
    try {
      w->wait(timeout);
    } catch (const std::exception& e) {
      std::string cause = e.what();
      cause = cause.substr(0, cause.find('\n'));
      // The collective is lost: waiting again must neither hang nor pass as a success.
      impl_->done = true;
      impl_->error =
          detail::describe_failure(impl_->what, cause, (trace::now_us() - impl_->issued_us) * 1e-6,
                                   timeout, *impl_->peers, impl_->rank);
      mark_broken(impl_->group, impl_->error);
      throw CommError(impl_->error);
    }
  }
  impl_->done = true;
  if (impl_->finish) impl_->finish();
}

bool Work::is_completed() const {
  if (!impl_) return true;
  for (auto& w : impl_->works)
    if (!w->isCompleted()) return false;
  return true;
}

// ---------------------------------------------------------------------------------------------
// Validation: every check runs on the calling rank before anything is issued.
// ---------------------------------------------------------------------------------------------
namespace {

void check_supported(const at::Tensor& t, const char* op, const char* arg) {
  FSDP_CHECK(t.defined(), op, ": ", arg, " is an undefined tensor");
  switch (t.scalar_type()) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kInt:
    case at::kLong:
    case at::kByte:
    case at::kChar:
      break;
    default:
      throw Error(
          detail::cat(op, ": ", arg, " has dtype ", t.scalar_type(),
                      "; supported are float, double, half, bfloat16 and 8/32/64-bit ints"));
  }
  FSDP_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous (sizes ", t.sizes(),
             ", strides ", t.strides(), "); pass .contiguous() or a flat buffer");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op) {
  FSDP_CHECK(a.scalar_type() == b.scalar_type(), op, ": output dtype ", a.scalar_type(),
             " does not match input dtype ", b.scalar_type(), "; both must have the same dtype");
}

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

at::Tensor as_wire(const at::Tensor& t, const std::string& backend) {
  auto w = compat::wire_dtype(t.scalar_type(), backend);
  return w == t.scalar_type() ? t : t.view(w);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Communicator
// ---------------------------------------------------------------------------------------------
Communicator::Communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                           c10::intrusive_ptr<c10d::Store> store, std::string backend,
                           std::chrono::milliseconds timeout, std::string name,
                           std::string bind_host)
    : pg_(std::move(pg)),
      store_(std::move(store)),
      backend_(std::move(backend)),
      timeout_(timeout),
      name_(std::move(name)),
      bind_host_(std::move(bind_host)) {
  rank_ = pg_->getRank();
  size_ = pg_->getSize();
}

Communicator::~Communicator() {
  // See "Broken groups": joining Gloo's workers mid-collective would wait out their timeouts.
  if (!broken_reason(store_.get()).empty()) keep_undestroyed(std::move(pg_));
}

Work Communicator::make_work(std::vector<c10::intrusive_ptr<c10d::Work>> works, std::string op,
                             int64_t bytes, std::function<void()> finish) {
  auto impl = std::make_shared<Work::Impl>();
  impl->works = std::move(works);
  impl->finish = std::move(finish);
  impl->timeout = timeout_;
  impl->stats = stats_;
  impl->op = op;
  impl->lane = name_;
  impl->issued_us = trace::now_us();
  impl->peers = peers_;
  impl->rank = rank_;
  impl->group = store_.get();
  impl->what = detail::cat(op, " of ", bytes, " bytes on communicator '", name_, "' (rank ", rank_,
                           " of ranks 0..", size_ - 1, ")");
  stats_->collectives++;
  if (trace::enabled()) {
    // The collective's own span, from issue to completion (the future completes on the
    // backend's thread), on one timeline row per communication lane.
    for (auto& w : impl->works) {
      try {
        w->getFuture()->addCallback([op = impl->op, track = "comm " + name_,
                                     start = impl->issued_us](c10::ivalue::Future&) {
          trace::complete(op, "comm", start, trace::now_us() - start, track);
        });
      } catch (const std::exception&) {
        // A backend without futures: the wait spans still show the exposed time.
      }
    }
  }
  return Work(std::move(impl));
}

void Communicator::connect_local_transport() {
  if (size_ == 1 || ring_ || gather_p2p_) return;
  const auto mode = detail::ShmTransport::mode_from_env();
  const std::string here = detail::this_host();
  for (const auto& p : *peers_) {
    if (p.host == here) continue;
    FSDP_CHECK(mode != detail::ShmTransport::Mode::kShm, "FSDP_TRANSPORT=shm: rank ", p.rank,
               " of communicator '", name_, "' is on host '", p.host, "', not '", here,
               "'; shared memory needs every rank on one host (unset FSDP_TRANSPORT or set it to "
               "tcp)");
    return;
  }
  // One transport per worker: the all-gathers and the reduce-scatters run concurrently.
  auto connect = [&](const char* what) {
    return detail::ShmTransport::connect(*store_, detail::cat(name_, "/", what), rank_, size_, mode,
                                         timeout_);
  };
  auto gather = connect("gather");
  if (!gather) return;  // every rank alike: shared memory cannot serve this communicator
  gather_p2p().attach_shared_memory(std::move(gather));
  auto reduce = connect("reduce");
  if (reduce) reduce_p2p().attach_shared_memory(std::move(reduce));
}

bool Communicator::uses_shared_memory() const {
  return gather_p2p_ && gather_p2p_->shared_memory();
}

// The point-to-point all-gathers' own worker (they do not queue behind reduce-scatters) and its
// own tags, made at first use.
detail::RingReduceScatter& Communicator::gather_p2p() {
  if (!gather_p2p_)
    gather_p2p_ =
        std::make_unique<detail::RingReduceScatter>(pg_, detail::RingReduceScatter::kTagRange);
  return *gather_p2p_;
}

detail::RingReduceScatter& Communicator::reduce_p2p() {
  if (!ring_) ring_ = std::make_unique<detail::RingReduceScatter>(pg_);
  return *ring_;
}

namespace {
// FSDP_ALL_GATHER: "direct" (point to point, the default on CPU) or "collective" (the backend's
// allgather); read at every call, so that fsdp-bench --comm can compare them in one process.
bool direct_all_gather(const at::Tensor& output) {
  const char* env = std::getenv("FSDP_ALL_GATHER");
  const std::string choice = env && *env ? env : "direct";
  FSDP_CHECK(choice == "direct" || choice == "collective", "FSDP_ALL_GATHER='", choice,
             "' is not one of direct, collective");
  return choice == "direct" && (!output.defined() || output.is_cpu());
}
}  // namespace

Work Communicator::all_gather(const at::Tensor& output, const at::Tensor& input) {
  check_supported(output, "all_gather", "output");
  check_supported(input, "all_gather", "input");
  check_same_dtype(output, input, "all_gather");
  FSDP_CHECK(output.numel() == size_ * input.numel(), "all_gather: output has ", output.numel(),
             " elements but world size ", size_, " x input ", input.numel(), " = ",
             size_ * input.numel(),
             " were expected; size the output as world_size * input.numel()");
  // Nothing to move (Gloo divides by the element count): complete at once, on every rank alike.
  if (output.numel() == 0) return make_work({}, "all_gather", 0, nullptr);
  if (size_ == 1) {
    output.view({-1}).copy_(input.view({-1}));
    return make_work({}, "all_gather", nbytes(output), nullptr);
  }
  auto out = as_wire(output.view({-1}), backend_);
  auto in = as_wire(input.view({-1}), backend_);
  stats_->bytes_sent += nbytes(input) * (size_ - 1);
  if (direct_all_gather(output)) {
    return make_work({gather_p2p().run_all_gather(out, in, timeout_)}, "all_gather", nbytes(output),
                     nullptr);
  }
  return make_work({compat::all_gather_flat(*pg_, out, in)}, "all_gather", nbytes(output), nullptr);
}

static_assert(Communicator::kMaxGatherPieces <= detail::RingReduceScatter::kTagsPerJob,
              "a gather into places is one point-to-point job: its pieces need a tag each");

bool Communicator::gathers_into_places(const std::vector<at::Tensor>& inputs) const {
  if (inputs.empty() || inputs.size() > kMaxGatherPieces) return false;
  return direct_all_gather(inputs[0]);
}

Work Communicator::all_gather_into(std::vector<std::vector<at::Tensor>> outputs,
                                   std::vector<at::Tensor> inputs) {
  FSDP_CHECK(gathers_into_places(inputs), "all_gather_into: ", inputs.size(),
             " pieces cannot be gathered into their places here (1..", kMaxGatherPieces,
             " CPU pieces under FSDP_ALL_GATHER=direct); check gathers_into_places() first and "
             "use all_gather into a flat buffer otherwise");
  FSDP_CHECK(outputs.size() == static_cast<size_t>(size_), "all_gather_into: ", outputs.size(),
             " output lists for a world of ", size_, "; pass one per rank");
  int64_t bytes = 0, sent = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_supported(inputs[i], "all_gather_into", "input");
    FSDP_CHECK(inputs[i].is_contiguous(), "all_gather_into: input ", i, " is not contiguous");
    sent += nbytes(inputs[i]);
  }
  for (int r = 0; r < size_; ++r) {
    FSDP_CHECK(outputs[r].size() == inputs.size(), "all_gather_into: ", outputs[r].size(),
               " outputs for rank ", r, " but ", inputs.size(), " inputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& o = outputs[r][i];
      check_supported(o, "all_gather_into", "output");
      check_same_dtype(o, inputs[i], "all_gather_into");
      FSDP_CHECK(o.is_contiguous(), "all_gather_into: output ", i, " of rank ", r,
                 " is not contiguous");
      bytes += nbytes(o);
    }
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    FSDP_CHECK(outputs[rank_][i].numel() == inputs[i].numel(), "all_gather_into: piece ", i,
               " has ", inputs[i].numel(), " elements but its place on this rank ",
               outputs[rank_][i].numel());
    if (inputs[i].numel() > 0) outputs[rank_][i].view({-1}).copy_(inputs[i].view({-1}));
  }
  if (size_ == 1 || bytes == 0) return make_work({}, "all_gather", bytes, nullptr);
  for (auto& row : outputs)
    for (auto& o : row) o = as_wire(o.view({-1}), backend_);
  for (auto& in : inputs) in = as_wire(in.view({-1}), backend_);
  stats_->bytes_sent += sent * (size_ - 1);
  return make_work(
      {gather_p2p().run_all_gather_pieces(std::move(outputs), std::move(inputs), timeout_)},
      "all_gather", bytes, nullptr);
}

Work Communicator::reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                                  const at::Tensor& scratch) {
  check_supported(output, "reduce_scatter", "output");
  check_supported(input, "reduce_scatter", "input");
  check_same_dtype(output, input, "reduce_scatter");
  FSDP_CHECK(input.numel() == size_ * output.numel(), "reduce_scatter: input has ", input.numel(),
             " elements but world size ", size_, " x output ", output.numel(), " = ",
             size_ * output.numel(),
             " were expected; size the input as world_size * output.numel()");
  const int64_t n = output.numel();
  const int ws = size_;
  // In place is this rank's own block exactly; any other overlap would be read after written.
  FSDP_CHECK(n == 0 || !output.storage().is_alias_of(input.storage()) ||
                 (output.is_contiguous() &&
                  output.data_ptr() == input.view({-1}).narrow(0, rank_ * n, n).data_ptr()),
             "reduce_scatter: the output overlaps the input but is not this rank's own block "
             "input[rank * n : (rank + 1) * n]; pass that block (in place) or a separate tensor");
  auto finish_sum = [output, op, ws, n](const at::Tensor& blocks) {
    // blocks: (ws, n), block r from rank r, summed in rank order (the rank-order exchange's sum).
    const at::Tensor b = blocks.view({ws, n}).contiguous();
    std::vector<at::Tensor> rows;
    for (int j = 0; j < ws; ++j) rows.push_back(b[j]);
    const at::Tensor out = output.view({-1});
    if (out.is_contiguous()) {
      detail::sum_in_rank_order(out, rows, op == ReduceOp::kAvg);
    } else {
      const at::Tensor tmp = at::empty_like(out, at::MemoryFormat::Contiguous);
      detail::sum_in_rank_order(tmp, rows, op == ReduceOp::kAvg);
      out.copy_(tmp);
    }
  };
  if (input.numel() == 0) return make_work({}, "reduce_scatter", 0, nullptr);
  if (ws == 1) {
    finish_sum(input);
    return make_work({}, "reduce_scatter", nbytes(input), nullptr);
  }
  if (scratch.defined()) {
    check_supported(scratch, "reduce_scatter", "scratch");
    check_same_dtype(scratch, input, "reduce_scatter");
    FSDP_CHECK(scratch.numel() == input.numel(), "reduce_scatter: scratch has ", scratch.numel(),
               " elements but the input has ", input.numel(), "; they must match");
  }
  using Algorithm = detail::RingReduceScatter::Algorithm;
  auto& p2p = reduce_p2p();
  if (const auto algorithm = detail::RingReduceScatter::choose(input, ws, p2p.shared_memory())) {
    // Point-to-point, pipelined: the sums overlap the transfer, and only a few chunks are ever
    // received ahead of them (a caller's scratch is used when given, else a small one; none
    // over shared memory, where the sums read the peers' slots).
    const at::Tensor window = scratch.defined() ? scratch.view({-1}) : at::Tensor();
    stats_->bytes_sent += nbytes(output) * (ws - 1);
    if (*algorithm == Algorithm::kRankOrder) {
      return make_work({p2p.run_rank_order(output.view({-1}), input.view({-1}), window,
                                           op == ReduceOp::kAvg, timeout_)},
                       "reduce_scatter", nbytes(input), nullptr);
    }
    return make_work({p2p.run(output.view({-1}), input.view({-1}), window, timeout_)},
                     "reduce_scatter", nbytes(input), [output, op, ws] {
                       if (op == ReduceOp::kAvg) output.div_(ws);
                     });
  }
  const at::Tensor received =
      scratch.defined() ? scratch.view({-1}) : at::empty_like(input.view({-1}));
  auto work = compat::exchange_blocks(*pg_, as_wire(received, backend_),
                                      as_wire(input.view({-1}), backend_));
  stats_->bytes_sent += nbytes(output) * (ws - 1);
  return make_work({work}, "reduce_scatter", nbytes(input),
                   [finish_sum, received] { finish_sum(received); });
}

Work Communicator::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  check_supported(tensor, "all_reduce", "tensor");
  const int ws = size_;
  if (ws == 1 || tensor.numel() == 0) return make_work({}, "all_reduce", nbytes(tensor), nullptr);
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  if (compat::backend_reduces(tensor.scalar_type(), backend_)) {
    std::vector<at::Tensor> ts{tensor};
    stats_->bytes_sent += 2 * nbytes(tensor) * (ws - 1) / ws;
    auto w = pg_->allreduce(ts, opts);
    return make_work({w}, "all_reduce", nbytes(tensor), [tensor, op, ws] {
      if (op == ReduceOp::kAvg) tensor.div_(ws);
    });
  }
  // The backend cannot sum this dtype: sum an fp32 copy (accumulating in fp32), cast back at wait.
  auto wide = tensor.to(at::kFloat);
  std::vector<at::Tensor> ts{wide};
  stats_->bytes_sent += 2 * nbytes(wide) * (ws - 1) / ws;
  auto w = pg_->allreduce(ts, opts);
  return make_work({w}, "all_reduce", nbytes(tensor), [tensor, wide, op, ws] {
    if (op == ReduceOp::kAvg) wide.div_(ws);
    tensor.copy_(wide);
  });
}

Work Communicator::broadcast(const at::Tensor& tensor, int root) {
  check_supported(tensor, "broadcast", "tensor");
  FSDP_CHECK(root >= 0 && root < size_, "broadcast: root rank ", root, " is outside 0..",
             size_ - 1);
  if (size_ == 1 || tensor.numel() == 0) return make_work({}, "broadcast", nbytes(tensor), nullptr);
  std::vector<at::Tensor> ts{as_wire(tensor, backend_)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  if (rank_ == root) stats_->bytes_sent += nbytes(tensor);
  return make_work({pg_->broadcast(ts, opts)}, "broadcast", nbytes(tensor), nullptr);
}

Work Communicator::barrier() {
  if (size_ == 1) return make_work({}, "barrier", 0, nullptr);
  return make_work({pg_->barrier()}, "barrier", 0, nullptr);
}

std::shared_ptr<Communicator> Communicator::split(const std::string& name) {
  std::string prefix = detail::cat(name_, "/", name, "#", splits_++);
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
  auto pg = compat::make_process_group(store, rank_, size_, timeout_, backend_, bind_host_);
  auto c = std::make_shared<Communicator>(pg, store_, backend_, timeout_, prefix, bind_host_);
  c->peers_ = peers_;
  c->connect_local_transport();
  return c;
}

namespace {
std::string bracketed_ranks(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? "," : "") + std::to_string(ranks[i]);
  return s + "]";
}
}  // namespace

std::shared_ptr<Communicator> Communicator::subgroup(const std::string& name,
                                                     const std::vector<int>& ranks) {
  auto me = std::find(ranks.begin(), ranks.end(), rank_);
  FSDP_CHECK(me != ranks.end(), "subgroup '", name, "': this rank (", rank_,
             ") is not in the list ", bracketed_ranks(ranks),
             "; only the ranks of a subgroup may create it");
  for (size_t i = 0; i < ranks.size(); ++i)
    FSDP_CHECK(ranks[i] >= 0 && ranks[i] < size_ && (i == 0 || ranks[i] > ranks[i - 1]),
               "subgroup '", name, "': ranks ", bracketed_ranks(ranks),
               " must be ascending ranks of the ", size_, "-rank communicator '", name_, "'");
  std::string prefix = detail::cat(name_, "/", name, bracketed_ranks(ranks), "#", splits_++);
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
  const int sub_rank = static_cast<int>(me - ranks.begin());
  const int sub_size = static_cast<int>(ranks.size());
  auto pg = compat::make_process_group(store, sub_rank, sub_size, timeout_, backend_, bind_host_);
  auto c = std::make_shared<Communicator>(pg, store_, backend_, timeout_, prefix, bind_host_);
  if (!peers_->empty()) {
    std::vector<PeerInfo> sub;
    for (int r : ranks) sub.push_back((*peers_)[r]);
    c->set_peers(std::move(sub));
  }
  c->connect_local_transport();
  return c;
}

void Communicator::set_peers(std::vector<PeerInfo> peers) {
  peers_ = std::make_shared<const std::vector<PeerInfo>>(std::move(peers));
}

CommStats Communicator::total_stats() const {
  CommStats s = *stats_;
  for (const auto& [name, lane] : lanes_) s += lane->total_stats();
  return s;
}

void Communicator::reset_stats() {
  *stats_ = CommStats{};
  for (auto& [name, lane] : lanes_) lane->reset_stats();
}

std::shared_ptr<Communicator> Communicator::lane(const std::string& name) {
  auto& slot = lanes_[name];
  if (!slot) slot = split(name);
  return slot;
}

}  // namespace fsdp
