#include "shm_segment.h"

#include <fcntl.h>
#include <fsdp/error.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>

#include "failure.h"

namespace fsdp::detail::shm {

namespace {
constexpr uint64_t kMagic = 0x66736470'73686d31ull;  // "fsdpshm1"
}  // namespace

int64_t data_offset(int world) {
  const int64_t meta = sizeof(Header) + static_cast<int64_t>(world) * sizeof(Channel);
  return (meta + 4095) / 4096 * 4096;
}
int64_t segment_bytes(int world) { return data_offset(world) + world * kSlots * kSlotBytes; }

namespace {
std::string errno_text(const char* call) { return cat(call, ": ", std::strerror(errno)); }
}  // namespace

// Which shared-memory and network world this process lives in: ranks agreeing on it share
// /dev/shm, and are on one host as their addresses see it (two network namespaces on one machine
// are two hosts to the TCP path, and stay so here).
std::string identity() {
  auto link = [](const char* path) {
    char buf[256] = {0};
    const ssize_t n = ::readlink(path, buf, sizeof buf - 1);
    return n > 0 ? std::string(buf, n) : std::string("?");
  };
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return cat(this_host(), " boot ", boot, " ", link("/proc/self/ns/net"), " ",
             link("/proc/self/ns/mnt"));
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::milliseconds limit) {
  timespec ts{static_cast<time_t>(limit.count() / 1000),
              static_cast<long>((limit.count() % 1000) * 1000000)};
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

Segment::~Segment() {
  if (base) ::munmap(base, bytes);
  unlink();
}
void Segment::unlink() {
  if (linked) ::shm_unlink(name.c_str());
  linked = false;
}
void Segment::map(int fd, std::string* why) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *why = errno_text("mmap");
  } else {
    base = static_cast<char*>(p);
  }
}
std::unique_ptr<Segment> Segment::create(int rank, int world, uint64_t nonce, std::string* why) {
  static std::atomic<int> made{0};
  auto s = std::make_unique<Segment>();
  s->name = cat("/fsdp-", ::getpid(), "-", made++, "-", std::hex, nonce);
  s->world = world;
  s->bytes = segment_bytes(world);
  const int fd = ::shm_open(s->name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    *why = errno_text("shm_open");
    return nullptr;
  }
  s->linked = true;
  // Reserved now: a full /dev/shm fails here, not as a SIGBUS when a slot is first written.
  const int err = ::posix_fallocate(fd, 0, s->bytes);
  if (err == 0) {
    s->map(fd, why);
  } else {
    *why = cat("reserving ", s->bytes, " bytes in /dev/shm: ", std::strerror(err));
  }
  ::close(fd);
  if (!s->base) return nullptr;
  auto* h = new (s->base) Header{};
  h->magic = kMagic;
  h->nonce = nonce;
  h->world = world;
  h->owner = rank;
  for (int j = 0; j < world; ++j) new (s->channel(j)) Channel{};
  return s;
}

std::unique_ptr<Segment> Segment::open(const std::string& name, int owner, int world,
                                       uint64_t nonce, std::string* why) {
  auto s = std::make_unique<Segment>();
  s->name = name;
  s->world = world;
  s->bytes = segment_bytes(world);
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    *why = errno_text("shm_open");
    return nullptr;
  }
  struct stat st {};
  if (::fstat(fd, &st) == 0 && st.st_size == s->bytes) {
    s->map(fd, why);
  } else {
    *why = cat("segment ", name, " has the wrong size");
  }
  ::close(fd);
  if (!s->base) return nullptr;
  const Header* h = s->header();
  if (h->magic != kMagic || h->nonce != nonce || h->owner != owner || h->world != world) {
    *why = cat("segment ", name, " is not rank ", owner, "'s");
    return nullptr;
  }
  return s;
}

}  // namespace fsdp::detail::shm
