#include <fsdp/error.h>
#include <fsdp/trace.h>

#include <map>
#include <optional>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "failure.h"
#include "lane_loss.h"
#include "work_impl.h"

namespace fsdp {

// Broken groups (work_impl.h): process-wide, as the worlds they record are; never destroyed,
// since the process groups kept here must outlive every static that could still wait on them.
namespace {
class BrokenGroups {
 public:
  static BrokenGroups& get() {
    static auto* groups = new BrokenGroups();
    return *groups;
  }
  void mark(const c10d::Store* group, const std::string& why) {
    detail::MutexLock lock(mu_);
    reasons_.emplace(group, why);
  }
  std::string reason(const c10d::Store* group) {
    detail::MutexLock lock(mu_);
    auto it = reasons_.find(group);
    return it == reasons_.end() ? std::string() : it->second;
  }
  void keep(c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    detail::MutexLock lock(mu_);
    kept_.push_back(std::move(pg));
  }

 private:
  detail::Mutex mu_;
  std::map<const c10d::Store*, std::string> reasons_ FSDP_GUARDED_BY(mu_);
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> kept_ FSDP_GUARDED_BY(mu_);
};

void mark_broken(const c10d::Store* group, const std::string& why) {
  BrokenGroups::get().mark(group, why);
}
}  // namespace

void detail::keep_undestroyed(c10::intrusive_ptr<c10d::ProcessGroup> pg) {
  BrokenGroups::get().keep(std::move(pg));
}

std::string detail::broken_reason(const c10d::Store* group) {
  return BrokenGroups::get().reason(group);
}

// ---------------------------------------------------------------------------------------------
// Work
// ---------------------------------------------------------------------------------------------

void Work::wait() {
  if (impl_) wait(impl_->timeout);
}

void Work::wait(std::chrono::milliseconds timeout) {
  if (!impl_) return;
  detail::MutexLock lock(impl_->mu);
  if (!impl_->error.empty()) throw CommError(impl_->error);
  if (impl_->done) return;
  // A lossy collective (lane_loss.h): the stand-in once its communicator is lost.
  if (impl_->loss && impl_->loss->lost()) {
    impl_->done = true;
    if (impl_->stand_in) impl_->stand_in();
    return;
  }
  if (std::string first = detail::broken_reason(impl_->group); !first.empty()) {
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
  for (auto& b : impl_->before) {
    try {
      b.wait(timeout);
    } catch (const std::exception& e) {
      if (impl_->loss) {  // lane_loss.h: lost from now on, this one included
        impl_->loss->mark(e.what());
        impl_->done = true;
        if (impl_->stand_in) impl_->stand_in();
        return;
      }
      impl_->done = true;
      impl_->error = e.what();
      throw;
    }
  }
  for (auto& w : impl_->works) {
    try {
      w->wait(timeout);
    } catch (const std::exception& e) {
      std::string cause = e.what();
      cause = cause.substr(0, cause.find('\n'));
      // The collective is lost: waiting again must neither hang nor pass as a success.
      impl_->done = true;
      const double elapsed_s = (trace::now_us() - impl_->issued_us) * 1e-6;
      // A timeout names nobody by itself, and a connection a live peer closed may be that peer's
      // timeout: ask which ranks are waiting too (timeout_census.h). Only the first failure of a
      // group does (later waits fail at once, above).
      std::optional<detail::Census> census;
      if (detail::wants_census(cause, *impl_->peers, impl_->rank))
        census = detail::census_of(
            impl_->store, impl_->lane, impl_->rank, impl_->size, detail::census_grace(timeout),
            detail::classify_failure(cause) == detail::FailureKind::kTimeout);
      impl_->error = detail::describe_failure(impl_->what, cause, elapsed_s, timeout, *impl_->peers,
                                              impl_->rank, nullptr, census ? &*census : nullptr);
      mark_broken(impl_->group, impl_->error);
      throw CommError(impl_->error);
    }
  }
  impl_->done = true;
  if (!impl_->finish) return;
  try {
    impl_->finish();
  } catch (const std::exception& e) {
    impl_->error = e.what();  // every later wait rethrows it
    throw;
  }
}

bool Work::is_completed() const {
  if (!impl_) return true;
  if (impl_->loss && impl_->loss->lost()) return true;
  for (auto& b : impl_->before)
    if (!b.is_completed()) return false;
  for (auto& w : impl_->works)
    if (!w->isCompleted()) return false;
  return true;
}

Work Work::then(std::function<void()> step) const {
  auto impl = std::make_shared<Impl>();
  impl->before.push_back(*this);
  impl->finish = std::move(step);
  if (impl_) {
    impl->what = impl_->what;
    impl->op = impl_->op;
    impl->lane = impl_->lane;
    impl->timeout = impl_->timeout;
    impl->peers = impl_->peers;
    impl->rank = impl_->rank;
    impl->group = impl_->group;
    impl->digests = impl_->digests;
  } else {
    impl->what = "a local step";
    impl->timeout = std::chrono::hours(24);
  }
  return Work(std::move(impl));
}

std::shared_ptr<const Work::Digests> Work::digests() const {
  return impl_ ? impl_->digests : nullptr;
}

Work Work::with_digests(std::shared_ptr<const Digests> d) const {
  Work w = then(nullptr);
  w.impl_->digests = std::move(d);
  return w;
}

}  // namespace fsdp
