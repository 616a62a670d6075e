// GlooExchange: the Exchange over the process group's point-to-point send/recv (Gloo over TCP),
// for ranks on different hosts or where shared memory is not wanted (FSDP_TRANSPORT=tcp).
//
// All-gather: each rank's pieces go to every peer and land straight in their places, with no
// temporary (Gloo's allgather gathers into a buffer as large as the output, then copies out).
// Block exchange: each rank's block for rank j travels to j in chunks (every send posted up front,
// receives at most kWindowChunks chunks ahead); chunk k is handed to the consumer once it has
// arrived from every rank, so the sums overlap the transfer of the following chunks. The receive
// window (kWindowChunks x (N - 1) chunks, a few MiB) is kept from job to job.
//
// Every job opens with a 32-byte header to each peer (what it is, its bytes and pieces, a digest of
// every rank's sizes) and posts its data only once the peers' headers match: ranks that issued
// different collectives or sizes fail by name on every rank, where Gloo's TCP pair would abort the
// process on a message longer than its receive. One small message per peer and job.
//
// Tags: every job takes the next kTagsPerJob tags from this exchange's range, [tag_offset,
// tag_offset + kTagRange): the header's, then one per piece or chunk; exchanges sharing one
// process group need disjoint ranges.
#pragma once

#include "exchange.h"

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace fsdp::detail {

class GlooExchange final : public Exchange {
 public:
  static constexpr int kTagRange = 1 << 30;
  static constexpr int kMaxPieces = 4096;  // the most pieces of one all-gather, chunks of a block
  static constexpr int kTagsPerJob = kMaxPieces + 1;  // the header's and one per piece
  // A block travels in chunks of at most kMaxChunkBytes (a smaller one whole): a message per
  // chunk and peer, so smaller chunks cost more than their overlap saves on two cores.
  static constexpr int64_t kMaxChunkBytes = 1 << 20;
  static constexpr int64_t kWindowChunks = 4;

  GlooExchange(c10::intrusive_ptr<c10d::ProcessGroup> pg, int tag_offset);
  void all_gather(const std::vector<std::vector<at::Tensor>>& into,
                  const std::vector<at::Tensor>& pieces,
                  std::chrono::milliseconds timeout) override;
  void exchange_blocks(const at::Tensor& input, int64_t n, const ChunkConsumer& consume,
                       std::chrono::milliseconds timeout) override;

 private:
  int next_tag_base();
  // Exchanges `mine` (kHeaderWords int64: kind, bytes, pieces, digest) with every peer on
  // `tag_base` and throws fsdp::CommError naming the first peer whose header differs.
  static constexpr int kHeaderWords = 4;
  void agree_on_header(const at::Tensor& mine, int tag_base, std::chrono::milliseconds timeout);

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int rank_, world_;
  int tag_offset_;
  uint32_t jobs_ = 0;  // jobs run: the tag space of the next one
  at::Tensor window_;  // the block exchange's receive window, reused from job to job
};

}  // namespace fsdp::detail
