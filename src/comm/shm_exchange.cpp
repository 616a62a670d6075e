#include "shm_exchange.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <fsdp/error.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <new>
#include <random>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "failure.h"
#include "shm_segment.h"

namespace fsdp::detail {

struct ShmPart {  // one contiguous piece of a stream
  char* ptr;
  int64_t bytes;
};

namespace {

using shm::Channel;
using shm::Header;
using shm::kSlotBytes;
using shm::kSlots;
using shm::SlotTag;
// An idle rank wakes at least this often to check its peers' processes and its deadline.
constexpr auto kTick = std::chrono::milliseconds(20);

// Copies between a stream's parts and one slot, from the stream position `at`.
using Part = ShmPart;
void copy_parts(const std::vector<Part>& parts, int64_t at, char* slot, int64_t len, bool out) {
  for (const Part& p : parts) {
    if (len == 0) return;
    if (at >= p.bytes) {
      at -= p.bytes;
      continue;
    }
    const int64_t n = std::min(len, p.bytes - at);
    if (out) {
      std::memcpy(slot, p.ptr + at, n);
    } else {
      std::memcpy(p.ptr + at, slot, n);
    }
    slot += n;
    len -= n;
    at = 0;
  }
}

std::vector<Part> parts_of(const std::vector<at::Tensor>& ts) {
  std::vector<Part> parts;
  for (const auto& t : ts)
    if (t.numel() > 0)
      parts.push_back(
          {static_cast<char*>(t.data_ptr()), t.numel() * static_cast<int64_t>(t.element_size())});
  return parts;
}

int64_t total_of(const std::vector<Part>& parts) {
  int64_t n = 0;
  for (const Part& p : parts) n += p.bytes;
  return n;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Rendezvous
// ---------------------------------------------------------------------------------------------
ShmExchange::ShmExchange(int rank, int world) : rank_(rank), world_(world) {}
ShmExchange::~ShmExchange() = default;

namespace {
// Every rank's value of `key`/`r`, each wait bounded by `timeout`.
std::vector<std::string> gather_keys(c10d::Store& store, const std::string& key, int world,
                                     std::chrono::milliseconds timeout) {
  std::vector<std::string> keys, values;
  for (int r = 0; r < world; ++r) keys.push_back(cat(key, "/", r));
  try {
    store.wait(keys, timeout);
  } catch (const std::exception& e) {
    throw CommError(cat("shared-memory rendezvous '", key, "': not every rank arrived within ",
                        timeout.count(), " ms (", e.what(), ")"));
  }
  for (const auto& k : keys) {
    const auto v = store.get(k);
    values.emplace_back(v.begin(), v.end());
  }
  return values;
}

void set_key(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}
}  // namespace

std::unique_ptr<ShmExchange> ShmExchange::connect(c10d::Store& store, const std::string& key,
                                                  int rank, int world, bool required,
                                                  std::chrono::milliseconds timeout) {
  if (world < 2) return nullptr;
  // A generation per rank: the same key may be connected again on one store (a communicator
  // rebuilt under the same name); ranks make their transports in the same order.
  const std::string base =
      cat("fsdp-shm/", key, "#", store.add(cat("fsdp-shm/", key, "/gen/", rank), 1));
  std::random_device rd;
  const uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  std::unique_ptr<ShmExchange> t(new ShmExchange(rank, world));
  t->seg_.resize(world);
  t->pid_.assign(world, 0);
  std::string why;
  t->seg_[rank] = shm::Segment::create(rank, world, nonce, &why);
  const std::string me = shm::identity();
  set_key(store, cat(base, "/info/", rank),
          t->seg_[rank] ? cat("ok\n", me, "\n", t->seg_[rank]->name, "\n", ::getpid(), "\n", nonce)
                        : cat("fail\n", me, "\n", why));
  // Round 1: every rank sees every rank's identity and segment, so all decide alike.
  std::string refusal;  // why not, the same on every rank
  bool elsewhere = false;
  const auto infos = gather_keys(store, cat(base, "/info"), world, timeout);
  std::vector<std::vector<std::string>> fields;
  for (int r = 0; r < world; ++r) {
    fields.push_back(lines(infos[r]));
    const auto& f = fields.back();
    if (f.size() < 3 || (f[0] == "ok" && f.size() < 5)) {
      if (refusal.empty()) refusal = cat("rank ", r, " published no usable segment");
    } else if (f[1] != me) {
      elsewhere = true;
      if (refusal.empty()) refusal = cat("rank ", r, " is on another host (", f[1], ")");
    } else if (f[0] != "ok" && refusal.empty()) {
      refusal = cat("rank ", r, ": ", f[2]);
    }
  }
  // Round 2: each rank maps every peer's segment and says whether it could.
  if (refusal.empty()) {
    std::string mine = "ok";
    for (int r = 0; r < world && mine == "ok"; ++r) {
      if (r == rank) continue;
      t->pid_[r] = std::stoll(fields[r][3]);
      t->seg_[r] = shm::Segment::open(fields[r][2], r, world, std::stoull(fields[r][4]), &why);
      if (!t->seg_[r]) mine = cat("rank ", rank, " could not map rank ", r, "'s segment: ", why);
    }
    set_key(store, cat(base, "/mapped/", rank), mine);
    const auto mapped = gather_keys(store, cat(base, "/mapped"), world, timeout);
    for (const auto& m : mapped)
      if (m != "ok" && refusal.empty()) refusal = m;
  }
  // Every rank has mapped every segment it will use (or gave up): no name is needed any more.
  if (t->seg_[rank]) t->seg_[rank]->unlink();
  if (refusal.empty()) return t;
  if (required)
    throw Error(cat("FSDP_TRANSPORT=shm: the shared-memory transport cannot connect the ", world,
                    " ranks of '", key, "' (", refusal,
                    "); unset FSDP_TRANSPORT (auto) or set FSDP_TRANSPORT=tcp"));
  if (!elsewhere) {  // braces: TORCH_WARN_ONCE expands to an if
    TORCH_WARN_ONCE(
        "fsdp: the ranks share this host but the shared-memory transport cannot "
        "connect them (",
        refusal,
        "); collectives go over TCP (slower). Set FSDP_TRANSPORT=tcp to choose TCP "
        "and silence this.");
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Streams
// ---------------------------------------------------------------------------------------------
struct ShmExchange::Stream {
  int peer = 0;
  uint64_t seq = 0;
  std::vector<Part> parts;
  int64_t total = 0, done = 0;
  bool finished() const { return done == total; }
};

uint32_t ShmExchange::bell() const { return seg_[rank_]->header()->bell.load(); }

void ShmExchange::ring(int peer) {
  Header* h = seg_[peer]->header();
  h->bell.fetch_add(1);
  if (h->sleeping.load()) shm::futex_wake(&h->bell);
}

bool ShmExchange::send_some(Stream& s) {
  Channel* ch = seg_[rank_]->channel(s.peer);
  bool moved = false;
  while (!s.finished()) {
    const uint64_t head = ch->head.load(std::memory_order_relaxed);
    if (head - ch->tail.load(std::memory_order_acquire) >= static_cast<uint64_t>(kSlots)) break;
    const int64_t len = std::min(kSlotBytes, s.total - s.done);
    copy_parts(s.parts, s.done, seg_[rank_]->slot(s.peer, head), len, true);
    ch->tags[head % kSlots] = SlotTag{s.seq, static_cast<uint64_t>(s.total),
                                      static_cast<uint64_t>(s.done), static_cast<uint64_t>(len)};
    ch->head.store(head + 1, std::memory_order_release);
    s.done += len;
    moved = true;
  }
  if (moved) ring(s.peer);
  return moved;
}

namespace {
// The slot a consumer reads next from `ch`, or nullptr while the producer has not filled it;
// throws when it belongs to another job or stream than the consumer expects.
const SlotTag* next_slot(Channel* ch, uint64_t seq, int64_t total, int64_t done, int peer,
                         int self) {
  const uint64_t tail = ch->tail.load(std::memory_order_relaxed);
  if (ch->head.load(std::memory_order_acquire) == tail) return nullptr;
  const SlotTag* tag = &ch->tags[tail % kSlots];
  if (tag->seq != seq || tag->total != static_cast<uint64_t>(total) ||
      tag->offset != static_cast<uint64_t>(done))
    throw CommError(cat("shared-memory exchange: rank ", peer, " sent bytes ", tag->offset, "..",
                        tag->offset + tag->len, " of a ", tag->total,
                        "-byte stream of its collective #", tag->seq + 1,
                        " on this lane, where rank ", self, " expects bytes from ", done, " of a ",
                        total, "-byte stream of its collective #", seq + 1,
                        ": the ranks issued different collectives or sizes (every rank must "
                        "issue the same collectives in the same order)"));
  return tag;
}
}  // namespace

void ShmExchange::idle(uint32_t seen, const std::vector<int>& waiting_for,
                       std::chrono::steady_clock::time_point deadline,
                       std::chrono::milliseconds timeout) {
  if (aborted_)
    throw CommError("shared-memory exchange: the communicator was destroyed mid-collective");
  const auto now = std::chrono::steady_clock::now();
  if (now - last_check_ >= kTick) {  // a /proc read per peer: not on every idle turn
    last_check_ = now;
    for (int r : waiting_for)
      if (!process_alive(pid_[r]))
        throw CommError(cat("shared-memory exchange: rank ", r, " (pid ", pid_[r],
                            ") exited mid-collective: connection closed by peer"));
  }
  if (now >= deadline)
    throw CommError(cat("shared-memory exchange timed out: no data moved for ", timeout.count(),
                        " ms while waiting for ", rank_list(waiting_for)));
  Header* h = seg_[rank_]->header();
  // A peer that is running usually rings within microseconds: watch the bell that long before
  // paying for a sleep and a wake-up (tens of microseconds each on a busy core). Between looks
  // the core goes to whatever else may run on it: where ranks outnumber cores, that is the peer
  // this rank waits for (fsdp-bench --preset overhead at N=4 on two cores: 0.137-0.141 s per
  // step, against 0.148-0.153 with a pause instruction between looks; N=2 unchanged, 2026-12-06).
  const auto spin_end = now + patience_.spin;
  while (std::chrono::steady_clock::now() < spin_end) {
    if (h->bell.load() != seen) return;
    std::this_thread::yield();
  }
  h->sleeping.store(1);
  shm::futex_wait(&h->bell, seen, kTick);
  h->sleeping.store(0);
}

// A job's progress: kept across calls when it yields.
struct ShmExchange::Job {
  uint64_t seq = 0;
  std::vector<Stream> out;  // this rank's streams to its peers
  std::vector<Stream> in;   // all-gather: the peers' streams into their places
  int64_t chunk = 0;        // block exchange: the next chunk to consume
  std::chrono::steady_clock::time_point deadline;  // moved on by every step that moves data
  bool started = false;                            // the caller has made its streams
};

std::unique_ptr<ShmExchange::Job> ShmExchange::resume_or_start(std::chrono::milliseconds timeout) {
  if (suspended_) return std::move(suspended_);
  auto job = std::make_unique<Job>();
  job->seq = jobs_++;
  job->deadline = std::chrono::steady_clock::now() + timeout;
  return job;
}

void ShmExchange::drive(std::unique_ptr<Job> job,
                        const std::function<Progress(Job&, std::vector<int>&)>& receive,
                        std::chrono::milliseconds timeout) {
  std::vector<int> waiting;  // the ranks this rank still needs, for the messages of idle()
  for (;;) {
    const uint32_t seen = bell();  // before looking: a ring after this wakes the sleep below
    waiting.clear();
    bool moved = false, sent = true;
    for (auto& s : job->out) {
      moved |= send_some(s);
      if (s.finished()) continue;
      sent = false;
      waiting.push_back(s.peer);
    }
    const Progress in = receive(*job, waiting);
    if (sent && in.done) return;
    if (moved || in.moved) {
      job->deadline = std::chrono::steady_clock::now() + timeout;
      continue;
    }
    // Nothing moves now: under yield (or past `until`) the job waits in suspended_ for the next
    // call.
    if (patience_.yield || std::chrono::steady_clock::now() >= patience_.until) {
      if (aborted_)
        throw CommError("shared-memory exchange: the communicator was destroyed mid-collective");
      suspended_ = std::move(job);
      throw Yielded{};
    }
    std::sort(waiting.begin(), waiting.end());
    waiting.erase(std::unique(waiting.begin(), waiting.end()), waiting.end());
    idle(seen, waiting, job->deadline, timeout);
  }
}

void ShmExchange::all_gather(const std::vector<std::vector<at::Tensor>>& into,
                             const std::vector<at::Tensor>& pieces,
                             std::chrono::milliseconds timeout) {
  auto job = resume_or_start(timeout);
  if (!job->started) {
    job->started = true;
    const std::vector<Part> mine = parts_of(pieces);
    for (int d = 1; d < world_; ++d) {  // to r+1, r+2, ...: no common first peer
      const int j = (rank_ + d) % world_;
      job->out.push_back({j, job->seq, mine, total_of(mine)});
      auto theirs = parts_of(into[j]);
      job->in.push_back({j, job->seq, theirs, total_of(theirs)});
    }
  }
  // Copies every slot that has arrived into its places.
  auto receive = [this](Job& job, std::vector<int>& waiting) {
    Progress p{false, true};
    for (auto& s : job.in) {
      Channel* ch = seg_[s.peer]->channel(rank_);
      bool got = false;
      while (!s.finished()) {
        const SlotTag* tag = next_slot(ch, job.seq, s.total, s.done, s.peer, rank_);
        if (!tag) break;
        const uint64_t tail = ch->tail.load(std::memory_order_relaxed);
        copy_parts(s.parts, s.done, seg_[s.peer]->slot(rank_, tail), tag->len, false);
        s.done += tag->len;
        ch->tail.store(tail + 1, std::memory_order_release);
        got = true;
      }
      if (got) ring(s.peer);
      p.moved |= got;
      if (!s.finished()) {
        p.done = false;
        waiting.push_back(s.peer);
      }
    }
    return p;
  };
  drive(std::move(job), receive, timeout);
}

void ShmExchange::exchange_blocks(const at::Tensor& input, int64_t n, const ChunkConsumer& consume,
                                  std::chrono::milliseconds timeout) {
  auto job = resume_or_start(timeout);
  const int64_t es = input.element_size();
  const int64_t chunk = kSlotBytes / es, chunks = (n + chunk - 1) / chunk;
  if (!job->started) {
    job->started = true;
    for (int d = 1; d < world_; ++d) {
      const int j = (rank_ + d) % world_;
      job->out.push_back({j, job->seq, parts_of({input.narrow(0, j * n, n)}), n * es});
    }
  }
  std::vector<at::Tensor> rows(world_);
  // Consumes the next chunk once every peer's slot for it has arrived: one chunk per call, so
  // that drive() refills the peers' channels between sums. (Summing every chunk that had arrived
  // before sending again left the peers without data: idle 5-8 ms of a 13 ms job at N=2, 64 MiB;
  // 0.5 ms after.)
  auto receive = [&](Job& job, std::vector<int>& waiting) {
    int64_t& k = job.chunk;
    if (k == chunks) return Progress{false, true};
    const int64_t off = k * chunk, len = std::min(chunk, n - off);
    for (int j = 0; j < world_; ++j) {
      if (j == rank_) {
        rows[j] = input.narrow(0, rank_ * n + off, len);
        continue;
      }
      Channel* ch = seg_[j]->channel(rank_);
      if (!next_slot(ch, job.seq, n * es, off * es, j, rank_)) {
        waiting.push_back(j);
        return Progress{false, false};
      }
      rows[j] = at::from_blob(seg_[j]->slot(rank_, ch->tail.load(std::memory_order_relaxed)), {len},
                              input.options());
    }
    consume(off, rows);
    for (int j = 0; j < world_; ++j) {
      if (j == rank_) continue;
      Channel* ch = seg_[j]->channel(rank_);
      ch->tail.store(ch->tail.load(std::memory_order_relaxed) + 1, std::memory_order_release);
      ring(j);
    }
    ++k;
    return Progress{true, k == chunks};
  };
  drive(std::move(job), receive, timeout);
}

}  // namespace fsdp::detail
