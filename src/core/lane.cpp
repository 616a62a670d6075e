#include "core/lane.h"

#include "comm/communicator_impl.h"

namespace fsdp::detail {

Lane::Lane(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {}

int Lane::rank() const { return comm_->rank(); }
int Lane::size() const { return comm_->size(); }

Work Lane::all_gather(const Collective& c, const at::Tensor& out, const at::Tensor& in,
                      AllGather* custom) {
  for (auto* o : observers_) o->on_all_gather(c);
  Work w = custom ? (*custom)(out, in, *comm_) : comm_->all_gather(out, in);
  for (auto* o : observers_) w = o->issued_all_gather(c, out, in, std::move(w));
  return w;
}

bool Lane::gathers_into_places(const std::vector<at::Tensor>& pieces) const {
  return detail::gathers_into_places(*comm_, pieces);
}

Work Lane::all_gather_into(const Collective& c, std::vector<std::vector<at::Tensor>> places,
                           std::vector<at::Tensor> pieces) {
  for (auto* o : observers_) o->on_all_gather(c);
  Work w = detail::all_gather_into(*comm_, places, pieces);
  for (auto* o : observers_) w = o->issued_all_gather_into(c, places, pieces, std::move(w));
  return w;
}

Work Lane::reduce_scatter(const Collective& c, const at::Tensor& out, const at::Tensor& in,
                          ReduceOp op, ReduceScatter* custom) {
  for (auto* o : observers_) o->on_reduce_scatter(c);
  for (auto* o : observers_) o->issuing_reduce_scatter(c, out, in, op, custom);
  bool digested = false;
  ReceivedChunkHook hook;
  WireSpan span;
  if (!custom)
    for (auto* o : observers_) digested |= o->digests_reduce_scatter(c, &hook, &span);
  Work w = custom     ? (*custom)(out, in, op, *comm_)
           : digested ? detail::reduce_scatter_digested(*comm_, out, in, op, std::move(hook), span)
                      : comm_->reduce_scatter(out, in, op);
  for (auto* o : observers_) w = o->issued_reduce_scatter(c, out, in, std::move(w));
  return w;
}

Work Lane::all_reduce(const at::Tensor& t, ReduceOp op) { return comm_->all_reduce(t, op); }

}  // namespace fsdp::detail
