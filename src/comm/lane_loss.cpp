#include "lane_loss.h"

#include "work_impl.h"

namespace fsdp::detail {

void LaneLoss::mark(const std::string& why) {
  MutexLock lock(mu_);
  if (reason_.empty()) reason_ = why;
  lost_.store(true, std::memory_order_release);
}

std::string LaneLoss::reason() const {
  MutexLock lock(mu_);
  return reason_;
}

Work tolerate(Work inner, std::shared_ptr<LaneLoss> loss, std::function<void()> stand_in,
              std::function<void()> copy_back) {
  Work w = inner.then(std::move(copy_back));
  Work::Impl& impl = *w.impl();
  impl.loss = std::move(loss);
  impl.stand_in = std::move(stand_in);
  return w;
}

Work stood_in(std::function<void()> stand_in) {
  stand_in();
  return Work();
}

}  // namespace fsdp::detail
