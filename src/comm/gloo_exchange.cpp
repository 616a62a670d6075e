#include "gloo_exchange.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include <algorithm>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "../util/checksum.h"

namespace fsdp::detail {

namespace {
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// Elements per chunk of a block of n: chunks of at most kMaxChunkBytes, at most kTagsPerJob of
// them, all but the last of one size.
int64_t chunk_numel(int64_t n, int64_t element_size) {
  const int64_t bytes = n * element_size;
  const int64_t wanted = (bytes + GlooExchange::kMaxChunkBytes - 1) / GlooExchange::kMaxChunkBytes;
  const int64_t count = std::clamp<int64_t>(wanted, 1, GlooExchange::kMaxPieces);
  return std::max<int64_t>(1, (n + count - 1) / count);
}

enum JobKind : int64_t { kAllGather = 1, kBlockExchange = 2 };
const char* kind_name(int64_t k) {
  return k == kAllGather ? "an all-gather" : k == kBlockExchange ? "a reduce-scatter" : "?";
}

// A job's header: its kind, the bytes and pieces this rank sends, and a digest of the sizes the
// job has on every rank (`sizes`: the same list on ranks that agree). Ranks agree when all but the
// bytes match (uneven shards send different bytes).
at::Tensor header(JobKind kind, int64_t bytes, int64_t pieces, const std::vector<int64_t>& sizes) {
  at::Tensor h = at::empty({4}, at::kLong);
  auto* p = h.data_ptr<int64_t>();
  p[0] = kind;
  p[1] = bytes;
  p[2] = pieces;
  p[3] = static_cast<int64_t>(checksum_bytes(sizes.data(), sizes.size() * sizeof(int64_t)) >> 1);
  return h;
}
}  // namespace

void GlooExchange::agree_on_header(const at::Tensor& mine, int tag_base,
                                   std::chrono::milliseconds timeout) {
  const at::Tensor theirs = at::empty({world_, kHeaderWords}, at::kLong);
  std::vector<WorkPtr> works;
  for (int d = 1; d < world_; ++d) {
    const int from = (rank_ - d + world_) % world_, to = (rank_ + d) % world_;
    std::vector<at::Tensor> in{theirs[from]}, out{mine};
    works.push_back(pg_->recv(in, from, tag_base));
    works.push_back(pg_->send(out, to, tag_base));
  }
  for (auto& w : works) w->wait(timeout);
  const auto* m = mine.data_ptr<int64_t>();
  for (int j = 0; j < world_; ++j) {
    if (j == rank_) continue;
    const auto* t = theirs[j].data_ptr<int64_t>();
    if (t[0] == m[0] && t[2] == m[2] && t[3] == m[3]) continue;  // the bytes may differ
    throw CommError(detail::cat(
        "TCP exchange: rank ", j, "'s collective #", jobs_, " on this lane is ", kind_name(t[0]),
        " sending ", t[1], " bytes in ", t[2], " pieces, where rank ", rank_, "'s is ",
        kind_name(m[0]), " sending ", m[1], " bytes in ", m[2], " pieces",
        t[0] == m[0] && t[1] == m[1] ? " of other sizes" : "",
        ": the ranks issued different collectives or sizes (every rank must issue the same "
        "collectives in the same order)"));
  }
}

GlooExchange::GlooExchange(c10::intrusive_ptr<c10d::ProcessGroup> pg, int tag_offset)
    : pg_(std::move(pg)), rank_(pg_->getRank()), world_(pg_->getSize()), tag_offset_(tag_offset) {}

int GlooExchange::next_tag_base() {
  constexpr uint32_t kJobsPerRange = kTagRange / kTagsPerJob;
  return tag_offset_ + static_cast<int>(jobs_++ % kJobsPerRange) * kTagsPerJob;
}

void GlooExchange::all_gather(const std::vector<std::vector<at::Tensor>>& into,
                              const std::vector<at::Tensor>& pieces,
                              std::chrono::milliseconds timeout) {
  const int tag_base = next_tag_base();
  std::vector<int64_t> sizes;  // every rank's pieces, this rank's own from `pieces`
  int64_t bytes = 0;
  for (int j = 0; j < world_; ++j)
    for (size_t i = 0; i < pieces.size(); ++i)
      sizes.push_back(j == rank_ ? pieces[i].numel() : into[j][i].numel());
  for (const auto& p : pieces) bytes += static_cast<int64_t>(p.nbytes());
  agree_on_header(header(kAllGather, bytes, static_cast<int64_t>(pieces.size()), sizes), tag_base,
                  timeout);
  std::vector<WorkPtr> works;
  for (int d = 1; d < world_; ++d) {  // from r-1, r-2, ... and to r+1, r+2, ...: no common first
    const int from = (rank_ - d + world_) % world_, to = (rank_ + d) % world_;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const int tag = tag_base + 1 + static_cast<int>(i);
      if (into[from][i].numel() > 0) {
        std::vector<at::Tensor> t{into[from][i]};
        works.push_back(pg_->recv(t, from, tag));
      }
      if (pieces[i].numel() > 0) {
        std::vector<at::Tensor> t{pieces[i]};
        works.push_back(pg_->send(t, to, tag));
      }
    }
  }
  for (auto& w : works) w->wait(timeout);
}

void GlooExchange::exchange_blocks(const at::Tensor& input, int64_t n, const ChunkConsumer& consume,
                                   std::chrono::milliseconds timeout) {
  const int tag_base = next_tag_base();
  agree_on_header(header(kBlockExchange, static_cast<int64_t>(input.nbytes()), world_,
                         {n, static_cast<int64_t>(input.scalar_type())}),
                  tag_base, timeout);
  if (n == 0) return;
  const int ws = world_, r = rank_;
  const int64_t chunk = chunk_numel(n, input.element_size());
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t window = std::min<int64_t>(chunks, kWindowChunks);
  auto len_of = [&](int64_t k) { return std::min(chunk, n - k * chunk); };
  // Chunk k from every other rank lands in slot k % window: (N - 1, chunk), rows in rank order
  // without this rank's own. A slot is received into again (chunk k + window) once chunk k is
  // consumed. The window is kept (a fresh one per job cost a page fault per 4 KiB).
  const int64_t need = window * (ws - 1) * chunk;
  if (!window_.defined() || window_.scalar_type() != input.scalar_type() || window_.numel() < need)
    window_ = at::empty({need}, input.options());
  const at::Tensor slots = window_.narrow(0, 0, need).view({window, ws - 1, chunk});
  auto landing = [&](int64_t k, int j) {
    return slots[k % window][j < r ? j : j - 1].narrow(0, 0, len_of(k));
  };
  auto mine_for = [&](int j, int64_t k) { return input.narrow(0, j * n + k * chunk, len_of(k)); };

  // recvs[k * ws + j]: chunk k from rank j, posted `window` chunks ahead. Sends are all posted up
  // front (Gloo moves a send once its receive is posted), to r+1, r+2, ...: no common first peer.
  std::vector<WorkPtr> recvs(chunks * ws), sends;
  auto post_recvs = [&](int64_t k) {
    for (int j = 0; j < ws; ++j) {
      if (j == r) continue;
      std::vector<at::Tensor> t{landing(k, j)};
      recvs[k * ws + j] = pg_->recv(t, j, tag_base + 1 + static_cast<int>(k));
    }
  };
  for (int64_t k = 0; k < window; ++k) post_recvs(k);
  for (int64_t k = 0; k < chunks; ++k)
    for (int i = 1; i < ws; ++i) {
      const int j = (r + i) % ws;
      std::vector<at::Tensor> t{mine_for(j, k)};
      sends.push_back(pg_->send(t, j, tag_base + 1 + static_cast<int>(k)));
    }
  std::vector<at::Tensor> rows(ws);
  for (int64_t k = 0; k < chunks; ++k) {
    for (int j = 0; j < ws; ++j) {
      if (j != r) recvs[k * ws + j]->wait(timeout);
      rows[j] = j == r ? mine_for(r, k) : landing(k, j);
    }
    consume(k * chunk, rows);
    if (k + window < chunks) post_recvs(k + window);
  }
  for (auto& w : sends) w->wait(timeout);
}

}  // namespace fsdp::detail
