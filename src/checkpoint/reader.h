// Reading a checkpoint directory: its index, and the pieces of its tensors from the rank files,
// each file opened once and verified against the index's checksums. Internal to the checkpoint
// code. Thread-safety: one reader per thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/checkpoint.h>
#include <fsdp/safetensors_torch.h>

#include <map>
#include <memory>
#include <string>

namespace fsdp::checkpoint::internal {

class CheckpointReader {
 public:
  // Parses `dir`'s index; throws when it has none (an interrupted save) or it is invalid.
  explicit CheckpointReader(std::string dir);
  const Index& index() const { return index_; }
  const std::string& dir() const { return dir_; }

  // The rank file of `rank`, opened (and verified) on first use.
  safetensors::File& file(int rank);

  // Copies the global slice [offset, offset + n) of dim `dim` of `e` into dst (the global shape
  // with n at `dim`; [n] for a 0-d tensor), whichever dim the checkpoint split `e` on.
  void fill(const IndexEntry& e, const at::Tensor& dst, int64_t dim, int64_t offset);

  // Checks every piece of `e` against its file's header before anything is allocated for it, so
  // an index claiming a huge shape cannot make the reader allocate more than the files hold.
  void check_pieces(const IndexEntry& e);

  // A replicated tensor (e.g. an Adam step count), read whole from the first rank holding it.
  at::Tensor read_replicated(const IndexEntry& e);

 private:
  // The file's own header must agree with the index about this piece.
  void check_piece(safetensors::File& f, const IndexEntry& e, const IndexEntry::Piece& p);

  std::string dir_;
  Index index_;
  std::map<int, std::unique_ptr<safetensors::File>> files_;
};

}  // namespace fsdp::checkpoint::internal
