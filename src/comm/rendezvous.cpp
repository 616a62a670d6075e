#include <fsdp/error.h>
#include <fsdp/init.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "address.h"
#include "compat.h"
#include "failure.h"
#include "launcher_watch.h"
#include "mesh_connect.h"
#include "rendezvous_keys.h"
#include "signals.h"
#include "slurm.h"
#include "util/env.h"

namespace fsdp {
namespace {

// The one rendezvous error, whichever stage failed: the store connection, the check-in of all
// ranks, or the process group's connections to its peers.
std::string rendezvous_error(const RendezvousInfo& info, std::chrono::milliseconds timeout,
                             const char* stage, std::string what) {
  what = what.substr(0, what.find('\n'));
  while (!what.empty() && (what.back() == '.' || what.back() == ' ')) what.pop_back();
  // Under srun the address and port may be derived (slurm.h): say from what, since rank 0 may
  // not run on the first node (srun --distribution=arbitrary) or another job may hold the port.
  std::string derived;
  auto is_derived = [](const std::string& from) { return from.rfind("SLURM_", 0) == 0; };
  if (is_derived(info.master_addr_from))
    derived += detail::cat(" MASTER_ADDR was not set: ", info.master_addr, " is the first host of ",
                           info.master_addr_from, ".");
  if (is_derived(info.master_port_from))
    derived += detail::cat(" MASTER_PORT was not set: ", info.master_port, " is derived from ",
                           info.master_port_from, ".");
  return detail::cat("rendezvous failed for rank ", info.rank, " of ", info.world_size, " at ",
                     info.master_addr, ":", info.master_port, " within ", timeout.count() / 1000.0,
                     " s (", stage, "): ", what, ". Check that all ", info.world_size,
                     " ranks were started with the same MASTER_ADDR/MASTER_PORT and that rank 0 is "
                     "reachable (raise the limit with FSDP_TIMEOUT_S).",
                     derived);
}

// "host\npid\nworld size": who claimed a rank, or the job's size (job_key).
std::vector<uint8_t> claim_token(const RendezvousInfo& info) {
  const std::string t = detail::cat(detail::this_host(), "\n", ::getpid(), "\n", info.world_size);
  return std::vector<uint8_t>(t.begin(), t.end());
}

// [Note: a foreign job at the rendezvous] Two jobs given the same MASTER_ADDR:MASTER_PORT: the
// second job's rank 0 cannot serve the port, but its other ranks reach the first job's store and
// used to join it (then failed 30 s later in a shared-memory error naming neither). Each rank
// therefore claims its number with compareSet, which exactly one process wins, and the first rank
// to arrive records the job's world size, which every later one compares with its own: a rank
// number already held by another process, or another world size, is another job's store.
void claim_rank(c10d::Store& store, const RendezvousInfo& info) {
  const auto mine = claim_token(info);
  const auto held = store.compareSet(detail::arrived_key(info.rank), {}, mine);
  const auto job = store.compareSet(detail::job_key(), {}, mine);
  auto field = [](const std::vector<uint8_t>& token, int i) {
    std::string s(token.begin(), token.end());
    for (; i > 0; --i) s = s.substr(std::min(s.size(), s.find('\n') + 1));
    return s.substr(0, s.find('\n'));
  };
  const std::string where = detail::cat(info.master_addr, ":", info.master_port);
  const std::string fix =
      detail::cat("; the store at ", where,
                  " belongs to another job (or this rank was started twice): give each job its own "
                  "MASTER_PORT (",
                  info.master_port_from, "), e.g. a free port");
  if (held != mine) {
    throw CommError(detail::cat("rendezvous failed for rank ", info.rank, " of ", info.world_size,
                                " at ", where, ": rank ", info.rank,
                                " has already joined this store as pid ", field(held, 1), " on ",
                                field(held, 0), " (of a job of ", field(held, 2), " ranks)", fix));
  }
  if (field(job, 2) != std::to_string(info.world_size)) {
    throw CommError(detail::cat("rendezvous failed for rank ", info.rank, " of ", info.world_size,
                                " at ", where, ": this store serves a job of ", field(job, 2),
                                " ranks (its first rank to arrive was pid ", field(job, 1), " on ",
                                field(job, 0), "), not ", info.world_size, fix));
  }
}

// Every rank checks in on the store and waits until all have, so a missing rank is reported as
// such (by number) on every rank that did join, after `timeout`, before any process group is built.
void wait_for_all(c10d::Store& store, const RendezvousInfo& info, std::chrono::milliseconds timeout,
                  std::chrono::steady_clock::time_point deadline) {
  try {
    claim_rank(store, info);
    int64_t joined = store.add(detail::joined_key(), 1);
    while (joined < info.world_size) {
      if (std::chrono::steady_clock::now() >= deadline) {
        const auto missing = detail::ranks_without_key(store, info.world_size, detail::arrived_key);
        std::string names;
        for (int r : missing) names += detail::cat(names.empty() ? "" : ", ", r);
        throw CommError(rendezvous_error(
            info, timeout, "waiting for the other ranks",
            detail::cat("only ", joined, " of ", info.world_size, " ranks joined (missing ",
                        missing.size() == 1 ? "rank " : "ranks ", names, ")")));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      joined = store.add(detail::joined_key(), 0);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    // Rank 0 serves the store: when it gives up first (its deadline passed, naming the missing
    // ranks) or dies, the others see only a broken connection.
    if (info.rank != 0 && !info.agent_store)
      what =
          detail::cat("lost the store (", what,
                      "): rank 0, which serves it, gave up or died; its message names the cause");
    throw CommError(rendezvous_error(info, timeout, "waiting for the other ranks", what));
  }
}

// Every rank publishes who it is (host, advertised address, pid) and reads everyone's: failure
// messages name the rank behind a dead process or an address. All ranks have joined already.
std::vector<PeerInfo> exchange_peers(c10d::Store& store, const RendezvousInfo& info,
                                     const std::string& address, std::chrono::milliseconds timeout,
                                     std::chrono::steady_clock::time_point deadline) {
  const auto& key = detail::peer_key;
  const std::string mine = detail::cat(detail::this_host(), "\n", address, "\n", ::getpid());
  std::vector<PeerInfo> peers(info.world_size);
  try {
    store.set(key(info.rank), std::vector<uint8_t>(mine.begin(), mine.end()));
    std::vector<std::string> keys;
    for (int r = 0; r < info.world_size; ++r) keys.push_back(key(r));
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    store.wait(keys, std::max(left, std::chrono::milliseconds(1)));
    for (int r = 0; r < info.world_size; ++r) {
      auto bytes = store.get(keys[r]);
      std::string text(bytes.begin(), bytes.end());
      const auto a = text.find('\n'), b = text.find('\n', a + 1);
      peers[r].rank = r;
      peers[r].host = text.substr(0, a);
      peers[r].address = text.substr(a + 1, b - a - 1);
      peers[r].pid = std::atoll(text.substr(b + 1).c_str());
    }
  } catch (const std::exception& e) {
    throw CommError(rendezvous_error(info, timeout, "exchanging the ranks' addresses", e.what()));
  }
  return peers;
}

}  // namespace

RendezvousInfo parse_rendezvous_env(const std::function<const char*(const char*)>& getenv_fn) {
  auto env = [&](const char* k) { return detail::env_value(k, getenv_fn); };
  struct Source {
    const char* name;
    const char* rank;
    const char* size;
    const char* local;
  };
  const Source sources[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
      {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
  };
  RendezvousInfo info;
  for (const auto& s : sources) {
    if (!env(s.rank) && !env(s.size)) continue;
    // The Slurm variables of an allocation are not those of a task (slurm.h).
    if (std::string(s.name) == "slurm" && !detail::is_slurm_task(env)) continue;
    FSDP_CHECK(env(s.rank) && env(s.size), s.name, " launch detected but ",
               env(s.rank) ? s.size : s.rank, " is not set; set both ", s.rank, " and ", s.size);
    info.source = s.name;
    info.world_size = detail::parse_env_int(s.size, env(s.size), 1, 1 << 20);
    info.rank = detail::parse_env_int(s.rank, env(s.rank), 0, 1 << 20);
    FSDP_CHECK(info.rank < info.world_size, s.rank, "=", info.rank, " must be less than ", s.size,
               "=", info.world_size);
    info.local_rank = env(s.local) ? detail::parse_env_int(s.local, env(s.local), 0, 1 << 20) : 0;
    break;
  }
  // srun sets ranks but no rendezvous address: derive it from the job (slurm.h) unless given.
  const bool from_srun = info.source == "slurm" && info.world_size > 1;
  if (const char* a = env("MASTER_ADDR")) {
    info.master_addr = a;
    info.master_addr_from = "MASTER_ADDR";
  } else if (from_srun) {
    auto host = detail::slurm_master_addr(env);
    info.master_addr = std::move(host.host);
    info.master_addr_from = std::move(host.from);
  } else {
    FSDP_CHECK(info.world_size == 1, "world size ", info.world_size, " (from ", info.source,
               ") needs MASTER_ADDR: set it to the address of rank 0's host (127.0.0.1 for one "
               "machine)");
  }
  if (const char* p = env("MASTER_PORT")) {
    info.master_port = detail::parse_env_int("MASTER_PORT", p, 1, 65535);
    info.master_port_from = "MASTER_PORT";
  } else if (auto port = from_srun ? detail::slurm_master_port(env) : std::nullopt) {
    info.master_port = port->port;
    info.master_port_from = std::move(port->from);
  }
  // torchrun (static rendezvous) serves the store itself; PyTorch's own env:// handler compares
  // the value with "True" exactly.
  if (const char* a = env("TORCHELASTIC_USE_AGENT_STORE"))
    info.agent_store = std::string(a) == "True";
  info.elastic_agent = info.source == "torchrun" && env("TORCHELASTIC_RUN_ID") != nullptr;
  if (const char* c = env("TORCHELASTIC_RESTART_COUNT"))
    info.restart_count = detail::parse_env_int("TORCHELASTIC_RESTART_COUNT", c, 0, 1 << 20);
  return info;
}

std::chrono::milliseconds resolve_timeout(const std::optional<std::chrono::milliseconds>& t) {
  if (t) {
    FSDP_CHECK(t->count() > 0, "timeout must be positive, got ", t->count(), " ms");
    return *t;
  }
  if (auto s = detail::env_positive("FSDP_TIMEOUT_S", "seconds"))
    return std::chrono::milliseconds(static_cast<int64_t>(*s * 1000));
  return std::chrono::seconds(300);
}

std::shared_ptr<Communicator> init_process_group(const InitOptions& options) {
  const RendezvousInfo info = parse_rendezvous_env();
  const auto timeout = resolve_timeout(options.timeout);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::string backend = compat::resolve_backend(options.backend);
  detail::ignore_sigpipe();
  if (options.stop_when_launcher_exits) detail::watch_launcher(info);
  detail::ExitOnSignal interruptible(options.exit_on_signal_during_rendezvous &&
                                     info.world_size > 1);
  c10::intrusive_ptr<c10d::Store> store;
  std::string bind_host = "127.0.0.1";
  std::vector<PeerInfo> peers;
  if (info.world_size == 1) {
    store = c10::make_intrusive<c10d::HashStore>();
  } else {
    bind_host = detail::advertised_address(info.master_addr);
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(info.master_port);
    o.isServer = info.rank == 0 && !info.agent_store;
    o.numWorkers = info.world_size;
    o.waitWorkers = false;  // 1.13 stops waiting for missing workers silently; see wait_for_all
    o.timeout = timeout;
    try {
      store = compat::make_tcp_store(info.master_addr, o);
    } catch (const std::exception& e) {
      std::string what = e.what();
      if (o.isServer && (what.find("ddress already in use") != std::string::npos ||
                         what.find("EADDRINUSE") != std::string::npos))
        what = detail::cat("port ", info.master_port,
                           " is already in use on this host (another "
                           "job, or a process that has not exited yet): give this job its own "
                           "MASTER_PORT");
      throw CommError(rendezvous_error(info, timeout, "connecting to the store", what));
    }
    if (info.agent_store) {
      // One key space per attempt: a restarted job must not see the previous attempt's keys.
      store = c10::make_intrusive<c10d::PrefixStore>(
          detail::cat("/worker/attempt_", info.restart_count), store);
    }
    wait_for_all(*store, info, timeout, deadline);
    peers = exchange_peers(*store, info, bind_host, timeout, deadline);
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("fsdp", store);
  auto pg = detail::connect_mesh(prefixed, info, timeout, deadline, backend, bind_host, peers);
  return std::make_shared<Communicator>(pg, prefixed, backend, timeout, "world", bind_host,
                                        std::move(peers));
}

}  // namespace fsdp
