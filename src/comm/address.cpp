#include "address.h"

#include <arpa/inet.h>
#include <fsdp/error.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>

#include "util/env.h"

namespace fsdp::detail {

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

std::string interface_address(const std::string& name, const std::string& variable) {
  ifaddrs* list = nullptr;
  FSDP_CHECK(::getifaddrs(&list) == 0, "cannot list network interfaces for ", variable, "=", name,
             ": ", std::strerror(errno));
  std::string found;
  std::set<std::string> available;
  for (ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET) continue;
    char buf[INET_ADDRSTRLEN] = {0};
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf, sizeof buf);
    available.insert(cat(a->ifa_name, " (", buf, ")"));
    if (found.empty() && name == a->ifa_name) found = buf;
  }
  ::freeifaddrs(list);
  if (found.empty()) {
    std::string names;
    for (const auto& n : available) names += (names.empty() ? "" : ", ") + n;
    throw Error(cat(variable, "=", name, " names no interface with an IPv4 address on this host; ",
                    "interfaces here: ", names.empty() ? "none" : names,
                    ". Set it to the interface on the network the other ranks' hosts share"));
  }
  return found;
}

std::string route_address(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), "9", &hints, &res);
  FSDP_CHECK(rc == 0 && res, "MASTER_ADDR=", host, " cannot be resolved (", ::gai_strerror(rc),
             "); set it to rank 0's IP address or a name every host resolves");
  std::string out, error;
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    error = std::strerror(errno);
  } else if (::connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
    error = std::strerror(errno);  // no route: connect() of UDP sends nothing, it picks the route
  } else {
    sockaddr_in self{};
    socklen_t len = sizeof self;
    char buf[INET_ADDRSTRLEN] = {0};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &len) == 0 &&
        ::inet_ntop(AF_INET, &self.sin_addr, buf, sizeof buf)) {
      out = buf;
    } else {
      error = std::strerror(errno);
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  FSDP_CHECK(!out.empty(), "no local interface routes to MASTER_ADDR=", host, " (", error,
             "); check the network, or name the interface with FSDP_SOCKET_IFNAME");
  return out;
}

std::string advertised_address(const std::string& master_addr,
                               const std::function<const char*(const char*)>& getenv_fn) {
  auto env = [&](const char* k) { return detail::env_value(k, getenv_fn); };
  for (const char* var : {"FSDP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    if (const char* name = env(var)) return interface_address(name, var);
  }
  if (is_loopback(master_addr)) return "127.0.0.1";
  return route_address(master_addr);
}

}  // namespace fsdp::detail
