// Lane: one communicator on which a root's collectives of one kind travel (the all-gathers, the
// reduce-scatters, HSDP's all-reduces across replicas), and the observers that check what is
// issued on it, as c10d's ProcessGroupWrapper does: the algorithm issues, the observers watch
// (the Agreed log, core/agreed.h; verified collectives, core/verified.h). A group's custom
// collectives (fsdp/custom_collectives.h) are issued here too, so the observers see them alike.
// Thread-safety: used by the root's one training thread (the backward's hooks run on it on CPU).
#pragma once

#include <fsdp/communicator.h>
#include <fsdp/custom_collectives.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator_impl.h"

namespace fsdp::detail {

// A collective as the core issues it: whose, and how large.
struct Collective {
  int64_t group = -1;  // registration index of the group
  int64_t numel = 0;   // padded elements per rank
  bool flag = false;   // a reduction under HSDP that keeps its block aside (no all-reduce)
};

class LaneObserver {
 public:
  virtual ~LaneObserver() = default;
  // Called as each collective is issued, before it is.
  virtual void on_all_gather(const Collective&) {}
  virtual void on_reduce_scatter(const Collective&) {}
  // Once issued, with its buffers: may return `work` wrapped (Work::then) to look at the result
  // when it completes (a digest of what arrived).
  virtual Work issued_all_gather(const Collective&, const at::Tensor& /*out*/,
                                 const at::Tensor& /*in*/, Work work) {
    return work;
  }
  virtual Work issued_all_gather_into(const Collective&,
                                      const std::vector<std::vector<at::Tensor>>& /*places*/,
                                      const std::vector<at::Tensor>& /*pieces*/, Work work) {
    return work;
  }
  // Just before a reduce-scatter is issued, with its buffers, its op and the custom collective
  // that issues it (null: the communicator's). Its input is read here, not once issued: an
  // in-place reduction overwrites this rank's block of it while it runs.
  virtual void issuing_reduce_scatter(const Collective&, const at::Tensor& /*out*/,
                                      const at::Tensor& /*in*/, ReduceOp /*op*/,
                                      const ReduceScatter* /*custom*/) {}
  // Asked after issuing_reduce_scatter, for the communicator's reduce-scatter (not a custom one):
  // whether to issue it with the digests of its wire attached (detail::reduce_scatter_digested),
  // over `span` of every block (left as it is: all of it); `hook` may be set to a test seam that
  // changes the chunks as they arrive.
  virtual bool digests_reduce_scatter(const Collective&, ReceivedChunkHook* /*hook*/,
                                      WireSpan* /*span*/) {
    return false;
  }
  virtual Work issued_reduce_scatter(const Collective&, const at::Tensor& /*out*/,
                                     const at::Tensor& /*in*/, Work work) {
    return work;
  }
};

class Lane {
 public:
  explicit Lane(std::shared_ptr<Communicator> comm);
  Communicator& comm() const { return *comm_; }
  const std::shared_ptr<Communicator>& shared() const { return comm_; }
  int rank() const;
  int size() const;
  void add_observer(LaneObserver* o) { observers_.push_back(o); }
  const std::vector<LaneObserver*>& observers() const { return observers_; }

  // `custom`, when set, issues instead of the communicator (set_custom_all_gather).
  Work all_gather(const Collective& c, const at::Tensor& out, const at::Tensor& in,
                  AllGather* custom = nullptr);
  // Every rank's pieces straight into their places (Communicator's all_gather_into), where the
  // transport can put them there (gathers_into_places).
  bool gathers_into_places(const std::vector<at::Tensor>& pieces) const;
  Work all_gather_into(const Collective& c, std::vector<std::vector<at::Tensor>> places,
                       std::vector<at::Tensor> pieces);
  Work reduce_scatter(const Collective& c, const at::Tensor& out, const at::Tensor& in, ReduceOp op,
                      ReduceScatter* custom = nullptr);
  Work all_reduce(const at::Tensor& t, ReduceOp op);  // HSDP across replicas (observed as is)

 private:
  std::shared_ptr<Communicator> comm_;
  std::vector<LaneObserver*> observers_;
};

}  // namespace fsdp::detail
