#include "util/free_port.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <random>

namespace fsdp::detail {
namespace {

constexpr int kLowest = 10000;  // well above the ports services are configured on

// The first port of the kernel's ephemeral range (Linux's default when it cannot be read).
int ephemeral_low() {
  std::ifstream f("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0, high = 0;
  if (f >> low >> high && low > 0) return low;
  return 32768;
}

// Binds `port` on 127.0.0.1 (0: any) and releases it; the port bound, or 0.
int try_bind(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  return ok ? ntohs(a.sin_port) : 0;
}

}  // namespace

int free_loopback_port() {
  const int high = ephemeral_low() - 1;
  if (high > kLowest + 1000) {
    std::mt19937 rng(std::random_device{}());
    std::uniform_int_distribution<int> pick(kLowest, high);
    for (int attempt = 0; attempt < 64; ++attempt)
      if (const int port = try_bind(pick(rng))) return port;
  }
  return try_bind(0);  // no room below the range (a tuned host): any free port
}

}  // namespace fsdp::detail
