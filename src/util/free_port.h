// A TCP port for a store or launcher to listen on, chosen where nothing else takes it by itself.
// Torch-free.
// Thread-safety: none needed (no shared state).
#pragma once

namespace fsdp::detail {

// A port on the loopback interface that is free now, drawn at random below the kernel's
// ephemeral range (/proc/sys/net/ipv4/ip_local_port_range). A port from that range (what binding
// port 0 returns) can be taken as the source port of any outgoing connection between this choice
// and the listener's bind; below it, only another explicit bind can take it. 0 when none of the
// candidates could be bound.
int free_loopback_port();

}  // namespace fsdp::detail
