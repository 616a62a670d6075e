#include "checkpoint/reader.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <filesystem>

#include "checkpoint/checkpoint_common.h"

namespace fsdp::checkpoint::internal {

namespace fs = std::filesystem;
namespace st = fsdp::safetensors;
using fsdp::detail::cat;

CheckpointReader::CheckpointReader(std::string dir) : dir_(std::move(dir)) {
  std::string path = dir_ + "/" + kIndexFile;
  if (!fs::exists(path)) {
    throw Error(cat("checkpoint '", dir_, "' has no ", kIndexFile,
                    ": the save did not complete; load the previous checkpoint (latest() skips "
                    "incomplete ones)"));
  }
  index_ = parse_index(st::read_text(path, kMaxIndexBytes), path);
  check_index_step(index_, dir_);
}

st::File& CheckpointReader::file(int rank) {
  auto& f = files_[rank];
  if (!f) {
    const auto& fe = index_.files.at(rank);
    f = st::File::open_verified(dir_ + "/" + fe.name, fe.sums);
  }
  return *f;
}

void CheckpointReader::fill(const IndexEntry& e, const at::Tensor& dst, int64_t dim,
                            int64_t offset) {
  const at::Tensor out = dst.dim() == 0 ? dst.reshape({1}) : dst;
  const int64_t n = out.size(dim);
  at::NoGradGuard no_grad;
  for (const auto& p : e.pieces) {
    if (dim == e.dim) {  // the same split: the overlap of two ranges of one dim
      const int64_t lo = std::max(offset, p.row_begin), hi = std::min(offset + n, p.row_end);
      if (lo >= hi) continue;
      st::File& f = file(p.rank);
      check_piece(f, e, p);
      at::Tensor part = out.narrow(dim, lo - offset, hi - lo);
      at::Tensor src = dim == 0  // dim 0: only the rows needed, read in place
                           ? st::read_rows(f, e.name, lo - p.row_begin, hi - p.row_begin)
                           : st::read_tensor(f, e.name).narrow(dim, lo - p.row_begin, hi - lo);
      part.copy_(src.reshape(part.sizes()));
    } else {  // the piece is whole on `dim`, dst whole on e.dim: each holds a part of the other
      st::File& f = file(p.rank);
      check_piece(f, e, p);
      out.narrow(e.dim, p.row_begin, p.row_end - p.row_begin)
          .copy_(st::read_tensor(f, e.name).narrow(dim, offset, n));
    }
  }
}

void CheckpointReader::check_pieces(const IndexEntry& e) {
  for (const auto& p : e.pieces) check_piece(file(p.rank), e, p);
}

at::Tensor CheckpointReader::read_replicated(const IndexEntry& e) {
  st::File& f = file(e.pieces.at(0).rank);
  check_piece(f, e, e.pieces[0]);
  return st::read_tensor(f, e.name);
}

void CheckpointReader::check_piece(st::File& f, const IndexEntry& e, const IndexEntry::Piece& p) {
  const st::TensorMeta& m = f.tensor(e.name);
  std::vector<int64_t> want = e.global_shape;
  if (!e.replicated) {
    if (want.empty()) want = {1};
    want[e.dim] = p.row_end - p.row_begin;
  }
  if (m.dtype != e.dtype || m.shape != want) {
    throw Error(cat("checkpoint file '", f.path(), "': tensor '", e.name, "' is ", m.dtype, " ",
                    shape_str(m.shape), ", the index says ", e.dtype, " ", shape_str(want),
                    "; the file does not belong to this index - restore the checkpoint"));
  }
}

}  // namespace fsdp::checkpoint::internal
