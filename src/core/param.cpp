#include "core/param.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <torch/csrc/autograd/variable.h>

#include <cstring>

#include "compat.h"
#include "core/deferred_init.h"
#include "core/guard.h"
#include "util/checksum.h"

namespace fsdp::detail {

namespace {
// [Note: plain host copies] The copies between a group's flat buffers and its parameters run per
// parameter and rank on every gather and reduction. Where both sides are dense, contiguous host
// tensors of one real dtype they are moved with memmove / memset (all-zero bytes are +0.0 in every
// floating dtype), not as an operator per piece: on small blocks the dispatcher's cost per
// operator (narrow, view, copy_, zero_) was most of each group's copy time. Anything else (a
// device, a cast, a strided dimension) goes through ATen as before. The buffers written are the
// group's own (send buffers, the pooled block of full parameters), whose version counters no
// autograd graph reads, so skipping the operator's version bump changes nothing.
bool plain_host(const at::Tensor& t) {
  return t.layout() == at::kStrided && t.device().is_cpu() && !t.is_complex() && t.is_contiguous();
}
bool plain_host_pair(const at::Tensor& a, const at::Tensor& b) {
  return plain_host(a) && plain_host(b) && a.scalar_type() == b.scalar_type();
}
// A gradient assigned through mutable_grad() is not checked by LibTorch; one of another shape
// would be read or added out of its bounds by the copies below, so it is refused by name.
void check_grad_shape(const at::Tensor& grad, const at::Tensor& of, const std::string& name,
                      const char* what) {
  FSDP_CHECK(grad.sizes() == of.sizes(), "the gradient of ", what, " '", name, "' has shape ",
             grad.sizes(), " but the ", what, " has shape ", of.sizes(),
             ": assign a gradient of the tensor's own shape (or none)");
}

// The address of element `i` of a contiguous tensor (its storage offset included).
char* address_of(const at::Tensor& t, int64_t i) {
  return static_cast<char*>(t.data_ptr()) + i * static_cast<int64_t>(t.element_size());
}
void copy_elements(const at::Tensor& dst, int64_t dst_at, const at::Tensor& src, int64_t src_at,
                   int64_t n) {
  if (n > 0)  // memmove: a shard that already lives in its slot is its own source
    std::memmove(address_of(dst, dst_at), address_of(src, src_at),
                 static_cast<size_t>(n) * dst.element_size());
}
void zero_elements(const at::Tensor& dst, int64_t at, int64_t n) {
  if (n > 0) std::memset(address_of(dst, at), 0, static_cast<size_t>(n) * dst.element_size());
}

// Contiguous, from the start of a storage that holds nothing else.
bool owns_contiguous_storage(const at::Tensor& t) {
  return t.is_contiguous() && t.storage_offset() == 0 &&
         t.storage().nbytes() == static_cast<size_t>(t.numel()) * t.element_size();
}
}  // namespace

ParamState::ParamState(std::string name, at::Tensor param, int64_t dim, int rank, int world,
                       const std::optional<CPUOffloadPolicy>& offload,
                       std::optional<at::ScalarType> compute_dtype)
    : name_(std::move(name)), param_(std::move(param)), rank_(rank), world_(world), dim_(dim) {
  rows_ = param_.dim() == 0 ? 1 : param_.size(dim_);
  row_numel_ = 1;
  for (int64_t d = 0; d < param_.dim(); ++d)
    if (d != dim_) row_numel_ *= param_.size(d);
  chunk_ = (rows_ + world_ - 1) / world_;
  const int64_t mine = rows_of(rank_);
  std::vector<int64_t> shape = param_.dim() == 0 ? std::vector<int64_t>{1} : param_.sizes().vec();
  shape[dim_] = mine;
  if (deferred::is_pending(param_)) {
    materialized_ = false;  // values come with materialize(); no operator may touch param_
    shard_ = at::empty(shape, at::TensorOptions().dtype(param_.scalar_type()));
  } else {
    at::Tensor rows = rows_in(param_.detach(), rank_);
    if (offload && !param_.is_cpu()) {
      shard_ = at::empty(
          shape,
          at::TensorOptions().dtype(param_.scalar_type()).pinned_memory(offload->pin_memory));
      shard_.copy_(rows);
    } else {
      shard_ = rows.clone(at::MemoryFormat::Contiguous);
    }
  }
  shard_.set_requires_grad(param_.requires_grad());
  if (compute_dtype && *compute_dtype != param_.scalar_type()) {
    // set_data keeps the Variable (the module's registration, autograd identity, version counter)
    // and drops a gradient accumulator made for the old dtype, so the one taken below accumulates
    // in the compute dtype. Its values come from the first gather.
    at::NoGradGuard no_grad;
    param_.mutable_grad() = at::Tensor();
    param_.set_data(at::empty(param_.sizes(), param_.options().dtype(*compute_dtype)));
  } else if (materialized_ && !owns_contiguous_storage(param_)) {
    // The full parameter's storage comes and goes as the bytes of the gathered block, laid out
    // contiguously, as FSDP2's unsharded parameters are: a transposed parameter, or a view into
    // a larger tensor (whose storage others share), gets storage of its own in that layout. Its
    // values come from the first gather (the shard holds them).
    at::NoGradGuard no_grad;
    param_.set_data(at::empty(param_.sizes(), param_.options()));
  } else if (!materialized_) {
    // Built under deferred_init: its recorded geometry may be such a view too (a transposed
    // parameter, a slice, one of several views into one pending storage). It gets storage of its
    // own, laid out contiguously and still without bytes: materialize finds it by its identity
    // (the recording keeps it) and delivers its values to the shard; the first gather its bytes.
    at::NoGradGuard no_grad;
    param_.set_data(compat::storageless_like(param_));
  }
  // A view shares its base's version counter, and set_data above keeps it: a parameter made from
  // one buffer with another (left whole, say ignored and stepped in place) would see that one's
  // writes as its own ([Note: writes to gathered parameters]). Its storage is its own now (or
  // comes from the gathered block): so is its counter.
  torch::autograd::impl::set_version_counter(param_, c10::VariableVersion(param_._version()));
  if (param_.requires_grad()) acc_ = torch::autograd::impl::grad_accumulator(param_);
}

void ParamState::materialize(const at::Tensor& full) {
  FSDP_CHECK(full.sizes() == param_.sizes(), "materialize: '", name_, "' has shape ",
             param_.sizes(), " but its recorded values have shape ", full.sizes());
  at::NoGradGuard no_grad;
  if (shard_.numel() > 0) shard_.detach().copy_(rows_in(full.detach(), rank_));
  materialized_ = true;
}

at::Tensor ParamState::rows_in(const at::Tensor& full, int r) const {
  const at::Tensor t = full.dim() == 0 ? full.reshape({1}) : full;
  return t.narrow(dim_, row_offset_of(r), rows_of(r));
}

int64_t ParamState::row_offset_of(int rank) const {
  return std::min<int64_t>(rank * chunk_, rows_);
}

at::Tensor ParamState::full_in(const at::Tensor& block, size_t byte_offset) const {
  if (block.scalar_type() != param_.scalar_type()) {
    // A block of a wider dtype (param_dtype_override_fn kept other parameters wider): its bytes.
    return block.view(at::kByte)
        .narrow(0, static_cast<int64_t>(byte_offset), full_bytes())
        .view(param_.scalar_type())
        .view(param_.sizes());
  }
  const int64_t start = static_cast<int64_t>(byte_offset) / block.element_size();
  return block.narrow(0, start, param_.numel()).view(param_.sizes());
}

int64_t ParamState::rows_of(int rank) const {
  return std::max<int64_t>(0, std::min<int64_t>(chunk_, rows_ - rank * chunk_));
}

void ParamState::place_shard_in(const at::Tensor& slot) {
  at::NoGradGuard no_grad;
  const int64_t n = shard_.numel();
  if (n > 0) slot.narrow(0, 0, n).copy_(shard_.detach().reshape({-1}));
  // set_ rather than a view: a view would share the block's version counter with every other
  // parameter of the group, and shard_changed_since_gather is per parameter.
  at::Tensor placed = at::empty({0}, slot.options());
  placed.set_(slot.storage(), slot.storage_offset(), shard_.sizes());
  placed.set_requires_grad(shard_.requires_grad());
  shard_ = std::move(placed);
}

bool ParamState::shard_is_at(const at::Tensor& flat, int64_t offset) const {
  if (shard_.numel() == 0) return rows_of(rank_) == 0;  // the slot is all padding
  return shard_.scalar_type() == flat.scalar_type() && shard_.is_contiguous() &&
         shard_.storage().unsafeGetStorageImpl() == flat.storage().unsafeGetStorageImpl() &&
         shard_.storage_offset() == flat.storage_offset() + offset;
}

void ParamState::copy_in_shard(const at::Tensor& dst) {
  gathered_fingerprint_ = kNoFingerprint;
  const int64_t n = shard_.numel();
  // From pinned host memory (CPUOffloadPolicy) the copy to the device runs asynchronously on the
  // current stream, ahead of the all-gather that reads it.
  const bool async = dst.device() != shard_.device() && shard_.is_pinned();
  if (plain_host_pair(dst, shard_)) {  // [Note: plain host copies]
    copy_elements(dst, 0, shard_, 0, n);
    zero_elements(dst, n, padded_numel() - n);
    return;
  }
  if (n > 0) dst.narrow(0, 0, n).copy_(shard_.detach().reshape({-1}), async);
  if (n < padded_numel()) dst.narrow(0, n, padded_numel() - n).zero_();
}

// [Note: stale gathered parameters] Writers of the shard need not bump its version counter
// (LibTorch 1.13's SGD writes through p.data(), so do NoGradGuard + copy_ on .data() and loads),
// so staleness is decided from the values themselves: a hash of the shard's bytes taken when it
// is still gathered when the epoch of its gather ends (Context::end_epoch), and again when a
// gathered group is about to be used in a new epoch.
uint64_t ParamState::shard_fingerprint() const {
  if (!shard_.device().is_cpu() || !shard_.is_contiguous()) return kNoFingerprint;
  const size_t bytes = static_cast<size_t>(shard_.numel()) * shard_.element_size();
  const uint64_t h = bytes == 0 ? 1 : checksum_bytes(shard_.data_ptr(), bytes);
  return h == kNoFingerprint ? 1 : h;
}

bool ParamState::shard_changed_since_gather() const {
  return gathered_fingerprint_ == kNoFingerprint || gathered_fingerprint_ != shard_fingerprint();
}

void ParamState::bind_full(const at::Tensor& block, size_t byte_offset) {
  compat::borrow_storage(param_, block, byte_offset);
  guard::set_active(param_, false);
  bound_version_ = param_._version();
  bound_to_copy_ = true;
}

bool ParamState::written_while_gathered() const {
  return bound_to_copy_ && param_._version() != bound_version_;
}

at::Tensor ParamState::rows_to_send(const at::Tensor& send, int64_t offset) const {
  return compat::flat_alias(send, offset, rows_of(rank_) * row_numel_);
}

at::Tensor ParamState::place_of_rows(const at::Tensor& block, size_t byte_offset, int r) const {
  const int64_t start = static_cast<int64_t>(byte_offset) / block.element_size();
  const int64_t n = rows_of(r) * row_numel_;
  return compat::flat_alias(block, n == 0 ? start : start + r * chunk_ * row_numel_, n);
}

void ParamState::copy_out(const at::Tensor& gathered, int64_t offset, const at::Tensor& block,
                          size_t byte_offset) {
  bind_full(block, byte_offset);
  const at::Tensor full = full_in(block, byte_offset);
  if (dim_ == 0 && plain_host_pair(full, gathered)) {  // [Note: plain host copies]
    const int64_t row_length = gathered.size(1);       // S, or the wire's per-rank width
    for (int r = 0; r < world_; ++r)
      copy_elements(full, row_offset_of(r) * row_numel_, gathered, r * row_length + offset,
                    rows_of(r) * row_numel_);
    return;
  }
  for (int r = 0; r < world_; ++r) {
    at::Tensor place = rows_in(full, r);
    if (place.numel() > 0)
      place.copy_(gathered[r].narrow(0, offset, place.numel()).view(place.sizes()));
  }
}

void ParamState::borrow_shard() {
  compat::borrow_storage(param_, shard_, shard_.storage_offset() * shard_.element_size());
  guard::set_active(param_, false);
  gathered_fingerprint_ = kNoFingerprint;
  bound_to_copy_ = false;  // a write lands in the shard itself
}

void ParamState::free_full() {
  compat::free_storage(param_);
  guard::set_active(param_, param_.numel() > 0);
  bound_to_copy_ = false;
}

void ParamState::pack_grad(const at::Tensor& send, int64_t offset) {
  // Writes every element of this parameter's columns (`send` is not zero-initialised): the
  // gradient's rows, zeros for padding, all zeros when there is no gradient (frozen or unused).
  const at::Tensor g = take_unsharded_grad();
  if (g.defined()) contributed_ = true;
  if (dim_ == 0 && plain_host(send) &&
      (!g.defined() || plain_host_pair(g, send))) {  // [Note: plain host copies]
    const int64_t row_length = send.size(1);
    for (int r = 0; r < world_; ++r) {
      const int64_t n = g.defined() ? rows_of(r) * row_numel_ : 0;
      copy_elements(send, r * row_length + offset, g, row_offset_of(r) * row_numel_, n);
      zero_elements(send, r * row_length + offset + n, padded_numel() - n);
    }
    return;
  }
  for (int r = 0; r < world_; ++r) {
    const int64_t n = g.defined() ? rows_of(r) * row_numel_ : 0;
    if (n > 0) {
      at::Tensor rows = rows_in(g, r);
      send[r].narrow(0, offset, n).view(rows.sizes()).copy_(rows);
    }
    if (n < padded_numel()) send[r].narrow(0, offset + n, padded_numel() - n).zero_();
  }
}

at::Tensor ParamState::take_unsharded_grad() {
  if (!trainable()) return at::Tensor();
  // The marker means the last gradient was handed over already and nothing accumulated since
  // (the parameter got no gradient in this backward), like an undefined gradient.
  at::Tensor g = grad_is_marker() ? at::Tensor() : param_.grad();
  FSDP_CHECK(!g.defined() || g.layout() == at::kStrided, "parameter '", name_, "' got a ",
             g.defined() ? c10::str(g.layout()) : "",
             " gradient (torch::nn::Embedding with "
             "sparse(true) makes one); a sharded parameter's gradient is reduce-scattered by "
             "rows and must be dense. Fix: sparse(false), or leave the parameter out of sharding "
             "(ShardOptions::ignored_params)");
  if (g.defined()) check_grad_shape(g, param_, name_, "parameter");
  if (g.defined()) param_.mutable_grad() = moved_grad_;
  if (!accumulated_grad_.defined()) return g;
  at::Tensor sum = std::move(accumulated_grad_);
  accumulated_grad_ = at::Tensor();
  return g.defined() ? sum.add_(g) : sum;
}

void ParamState::begin_unsynced_backward(at::ScalarType reduce_dtype) {
  if (!trainable() || accumulated_grad_.defined() || holds_unsharded_grad() ||
      !accumulates_wider(reduce_dtype))
    return;
  grad_dtype_widened_ = compat::set_grad_dtype(param_, reduce_dtype);
}

void ParamState::keep_unsynced_grad(at::ScalarType reduce_dtype) {
  if (!trainable() || !holds_unsharded_grad() || !accumulates_wider(reduce_dtype)) return;
  at::Tensor g = param_.grad();
  param_.mutable_grad() = moved_grad_;
  if (accumulated_grad_.defined()) {
    accumulated_grad_.add_(g);
  } else {
    // In reduce_dtype already where autograd cast the uses (begin_unsynced_backward): its own
    // tensor, which nothing else holds.
    accumulated_grad_ = g.scalar_type() == reduce_dtype ? g.detach() : g.to(reduce_dtype);
  }
}

void ParamState::end_backward() {
  if (grad_dtype_widened_) compat::set_grad_dtype(param_, param_.scalar_type());
  grad_dtype_widened_ = false;
}

bool ParamState::grad_is_marker() const {
  // The marker or a detached copy of it (Module::zero_grad assigns grad.detach() back).
  const at::Tensor& g = param_.grad();
  return g.defined() && g.has_storage() && moved_grad_.defined() &&
         g.storage().unsafeGetStorageImpl() == moved_grad_.storage().unsafeGetStorageImpl();
}

void ParamState::clear_moved_grad() {
  if (grad_is_marker()) param_.mutable_grad() = at::Tensor();
}

void ParamState::move_grad_to_shard(at::ScalarType reduce_dtype,
                                    const std::optional<double>& divide_by) {
  if (!trainable()) return;
  at::Tensor& slot = shard_.mutable_grad();
  if (slot.defined()) check_grad_shape(slot, shard_, name_, "shard");
  at::Tensor g = take_unsharded_grad();
  if (!g.defined()) {
    // No gradient in this backward: zeros, as the reduction of zeros would give (settled by
    // settle_shard_grad like a reduction's).
    if (!slot.defined()) {
      slot = at::zeros_like(shard_.detach());
      shard_grad_created_ = true;
    }
    return;
  }
  contributed_ = true;
  shard_grad_created_ = !slot.defined();
  if (g.scalar_type() != reduce_dtype) g = g.to(reduce_dtype);   // the wire's rounding
  if (g.device() != shard_.device()) g = g.to(shard_.device());  // CPUOffloadPolicy: to the host
  if (divide_by) g = g / *divide_by;  // a new tensor: the sum over one rank, divided
  if (slot.defined()) {
    slot.add_(g.reshape(shard_.sizes()));
  } else if (g.scalar_type() == shard_.scalar_type() && g.sizes() == shard_.sizes() &&
             !g.is_view() && g.is_contiguous()) {
    slot = g.detach();  // autograd's gradient or the accumulated one: nobody else holds it
  } else {
    slot = g.reshape(shard_.sizes()).to(shard_.scalar_type(), false, /*copy=*/true);
  }
}

void ParamState::settle_shard_grad(bool any_rank) {
  // Nobody contributed: the reduction added zeros to a gradient that was there (no change), or
  // created one from none, which goes again.
  if (!any_rank && shard_grad_created_) shard_.mutable_grad() = at::Tensor();
  shard_grad_created_ = false;
  contributed_ = false;
}

void ParamState::add_shard_grad(const at::Tensor& reduced_flat, int64_t offset) {
  if (add_shard_grad_on_host(reduced_flat, offset)) return;
  at::Tensor g = reduced_flat.narrow(0, offset, shard_.numel()).view(shard_.sizes());
  if (g.device() != shard_.device()) g = g.to(shard_.device());  // CPUOffloadPolicy: to the host
  at::Tensor& slot = shard_.mutable_grad();
  if (slot.defined()) check_grad_shape(slot, shard_, name_, "shard");
  shard_grad_created_ = !slot.defined();
  if (slot.defined()) {
    slot.add_(g);  // add_ casts a low-precision reduction up to the shard's dtype
  } else {
    // A copy, never a view (optimizers detach_() gradients in zero_grad), in the shard's dtype.
    slot = g.to(shard_.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  }
}

bool ParamState::add_shard_grad_on_host(const at::Tensor& reduced_flat, int64_t offset) {
  // [Note: plain host copies] `slot.add_(g)` adds one IEEE sum per element (ATen's fused
  // multiply-add by an alpha of 1 rounds the same), so the loop below gives the same bits.
  if (!plain_host_pair(reduced_flat, shard_)) return false;
  at::Tensor& slot = shard_.mutable_grad();
  const int64_t n = shard_.numel();
  if (slot.defined()) check_grad_shape(slot, shard_, name_, "shard");
  if (!slot.defined()) {
    slot = at::empty(shard_.sizes(), shard_.options().requires_grad(false));
    copy_elements(slot, 0, reduced_flat, offset, n);
    shard_grad_created_ = true;
    return true;
  }
  if (!plain_host_pair(slot, shard_)) return false;
  const auto add = [&](auto* dst, const auto* src) {
    for (int64_t k = 0; k < n; ++k) dst[k] += src[k];
  };
  switch (shard_.scalar_type()) {
    case at::kFloat:
      add(slot.data_ptr<float>(), reduced_flat.data_ptr<float>() + offset);
      break;
    case at::kDouble:
      add(slot.data_ptr<double>(), reduced_flat.data_ptr<double>() + offset);
      break;
    default:
      return false;  // bf16, half: ATen's kernel (it accumulates in float)
  }
  slot.unsafeGetTensorImpl()->bump_version();  // as add_ would
  shard_grad_created_ = false;
  return true;
}

}  // namespace fsdp::detail
