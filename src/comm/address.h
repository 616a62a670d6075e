// The address a rank advertises to its peers (Gloo's listening address). Gloo's default resolves
// the hostname, which Debian's /etc/hosts maps to 127.0.1.1: a rank on another host can never
// reach that. Internal to src/comm. Thread-safety: reentrant.
#pragma once

#include <functional>
#include <string>

namespace fsdp::detail {

// FSDP_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME: that interface's IPv4 address (an error names the
// variable and lists the interfaces that have one). Else 127.0.0.1 when `master_addr` is loopback,
// else the local address of the interface that routes to `master_addr` (a UDP socket connected to
// it, read back with getsockname: no packet is sent).
std::string advertised_address(const std::string& master_addr,
                               const std::function<const char*(const char*)>& getenv_fn = nullptr);

// The IPv4 address of interface `name`; throws naming `variable` and the available interfaces.
std::string interface_address(const std::string& name, const std::string& variable);

// The local address used to reach `host` (resolved with getaddrinfo); throws naming it.
std::string route_address(const std::string& host);

bool is_loopback(const std::string& host);

}  // namespace fsdp::detail
