// The shared memory under ShmExchange: one segment per rank and exchange, its layout (a header
// with the owner's doorbell, one channel of kSlots slots per peer) and the futex calls the
// doorbell uses. shm_exchange.h says how the exchange uses them.
// Thread-safety: a segment is mapped and unmapped by one thread; the shared words are atomics.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace fsdp::detail::shm {

constexpr int64_t kSlotBytes = 256 << 10;  // a multiple of every element size
constexpr int64_t kSlots = 4;              // per channel: 1 MiB per peer per exchange

struct alignas(64) Header {
  uint64_t magic;
  uint64_t nonce;
  int32_t world;
  int32_t owner;
  alignas(64) std::atomic<uint32_t> bell;  // rung by a peer that filled or freed a slot for owner
  std::atomic<uint32_t> sleeping;          // 1 while the owner sleeps on bell
};

struct SlotTag {    // what a filled slot holds
  uint64_t seq;     // the job
  uint64_t total;   // bytes of the whole stream
  uint64_t offset;  // of this piece in the stream
  uint64_t len;     // bytes in this slot
};

struct alignas(64) Channel {               // owner -> one peer
  alignas(64) std::atomic<uint64_t> head;  // slots filled, written by the owner
  alignas(64) std::atomic<uint64_t> tail;  // slots consumed, written by the peer
  alignas(64) SlotTag tags[kSlots];
};

static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "atomics shared between processes must be lock-free");

// The offset of the slots in a segment for `world` ranks, and the segment's size.
int64_t data_offset(int world);
int64_t segment_bytes(int world);

// Which shared-memory and network world this process lives in: ranks agreeing on it share
// /dev/shm, and are on one host as their addresses see it (two network namespaces on one machine
// are two hosts to the TCP path, and stay so here).
std::string identity();

// Sleeps while *word == seen, at most `limit`; wakes one sleeper of *word.
void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::milliseconds limit);
void futex_wake(std::atomic<uint32_t>* word);

// One rank's segment, mapped in this process.
struct Segment {
  std::string name;
  char* base = nullptr;
  int64_t bytes = 0;
  int world = 0;
  bool linked = false;  // this process created it and has not unlinked it yet

  ~Segment();
  void unlink();
  void map(int fd, std::string* why);
  Header* header() const { return reinterpret_cast<Header*>(base); }
  Channel* channel(int peer) const {
    return reinterpret_cast<Channel*>(base + sizeof(Header)) + peer;
  }
  char* slot(int peer, uint64_t n) const {
    return base + data_offset(world) +
           (peer * kSlots + static_cast<int64_t>(n % kSlots)) * kSlotBytes;
  }
  // A new segment of this rank's, or the reason it could not be made.
  static std::unique_ptr<Segment> create(int rank, int world, uint64_t nonce, std::string* why);
  // A peer's segment, or the reason it could not be mapped.
  static std::unique_ptr<Segment> open(const std::string& name, int owner, int world,
                                       uint64_t nonce, std::string* why);
};

}  // namespace fsdp::detail::shm
