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

namespace {

int64_t row_numel(const IndexEntry& e) {
  int64_t n = 1;
  for (size_t i = 1; i < e.global_shape.size(); ++i) n *= e.global_shape[i];
  return n;
}

}  // namespace

CheckpointReader::CheckpointReader(std::string dir) : dir_(std::move(dir)) {
  std::string path = dir_ + "/" + kIndexFile;
  if (!fs::exists(path)) {
    throw Error(cat("checkpoint '", dir_, "' has no ", kIndexFile,
                    ": the save did not complete; load the previous checkpoint (latest() skips "
                    "incomplete ones)"));
  }
  index_ = parse_index(st::read_text(path, kMaxIndexBytes), path);
}

st::File& CheckpointReader::file(int rank) {
  auto& f = files_[rank];
  if (!f) {
    const auto& fe = index_.files.at(rank);
    f = st::File::open_verified(dir_ + "/" + fe.name, fe.sums);
  }
  return *f;
}

void CheckpointReader::fill_rows(const IndexEntry& e, const at::Tensor& dst, int64_t row_offset) {
  int64_t n = dst.dim() == 0 ? 1 : dst.size(0);
  for (const auto& p : e.pieces) {
    int64_t lo = std::max(row_offset, p.row_begin), hi = std::min(row_offset + n, p.row_end);
    if (lo >= hi) continue;
    st::File& f = file(p.rank);
    check_piece(f, e, p);
    at::Tensor src = st::read_rows(f, e.name, lo - p.row_begin, hi - p.row_begin);
    at::NoGradGuard no_grad;
    dst.view({-1})
        .narrow(0, (lo - row_offset) * row_numel(e), (hi - lo) * row_numel(e))
        .copy_(src.view({-1}));
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
    want[0] = p.row_end - p.row_begin;
  }
  if (m.dtype != e.dtype || m.shape != want) {
    throw Error(cat("checkpoint file '", f.path(), "': tensor '", e.name, "' is ", m.dtype, " ",
                    shape_str(m.shape), ", the index says ", e.dtype, " ", shape_str(want),
                    "; the file does not belong to this index - restore the checkpoint"));
  }
}

}  // namespace fsdp::checkpoint::internal
