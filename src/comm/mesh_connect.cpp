#include "mesh_connect.h"

#include <fsdp/error.h>

#include <algorithm>
#include <future>
#include <optional>
#include <thread>

#include "compat.h"
#include "failure.h"

namespace fsdp::detail {
namespace {

std::string first_line(std::string s) {
  s = s.substr(0, s.find('\n'));
  while (!s.empty() && (s.back() == '.' || s.back() == ' ')) s.pop_back();
  return s;
}

// Runs fn() on a detached thread and waits for it until `until`: its result, its exception
// (rethrown), or nullopt when it is still running then (it goes on until it ends by itself).
template <class T, class F>
std::optional<T> run_until(F fn, std::chrono::steady_clock::time_point until) {
  auto promise = std::make_shared<std::promise<T>>();
  auto future = promise->get_future();
  std::thread([promise, fn = std::move(fn)]() mutable {
    try {
      promise->set_value(fn());
    } catch (...) {
      promise->set_exception(std::current_exception());
    }
  }).detach();
  if (future.wait_until(until) != std::future_status::ready) return std::nullopt;
  return future.get();
}

}  // namespace

std::string mesh_address_key(int rank) {
  // ProcessGroupGloo prefixes device i's keys with "i/"; Gloo's connectFullMesh publishes all of a
  // rank's pair addresses under its rank number.
  return "0/" + std::to_string(rank);
}

std::vector<int> ranks_without_key(c10d::Store& store, int world_size,
                                   const std::function<std::string(int)>& key) {
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r)
    if (!store.check({key(r)})) missing.push_back(r);
  return missing;
}

std::string mesh_connect_error(const RendezvousInfo& info, std::chrono::milliseconds timeout,
                               const std::vector<PeerInfo>& peers,
                               const std::vector<int>& unpublished, std::string cause) {
  const std::string head =
      cat("rendezvous failed for rank ", info.rank, " of ", info.world_size, " within ",
          timeout.count() / 1000.0, " s (connecting to its peers): ");
  if (!unpublished.empty()) {
    std::string who;
    for (int r : unpublished) {
      for (const auto& p : peers)
        if (p.rank == r && p.pid > 0)
          who += cat(who.empty() ? "" : ", ", "rank ", r, " is pid ", p.pid, " on ", p.host);
    }
    return cat(
        head, rank_list(unpublished), " did not connect: ", unpublished.size() == 1 ? "it" : "they",
        " reached the store but never published a connection address (", first_line(cause),
        "). Check that ", unpublished.size() == 1 ? "this process is" : "these processes are",
        " still running and not stopped or stuck before init_process_group",
        who.empty() ? "" : cat(" (", who, ")"),
        "; raise the limit with FSDP_TIMEOUT_S if a rank starts that late");
  }
  std::string addrs;
  for (const auto& p : peers)
    addrs += cat(addrs.empty() ? "" : ", ", "rank ", p.rank, " ", p.address, " (", p.host, ")");
  return cat(
      head, first_line(cause), ". Every rank reached the store at ", info.master_addr, ":",
      info.master_port,
      " and published its address, but not all connected to each other: check that each "
      "advertised address is reachable from the other hosts (",
      addrs,
      "), choose the interface with FSDP_SOCKET_IFNAME, let no firewall block the ports, and check "
      "that no rank is stopped");
}

// Rank 0's process serves the store, held by the caller's reference (and the abandoned connect's,
// which ends with Gloo's own timeout): once it throws, the store is gone, and a rank that reaches
// its deadline a little later (it began later) could no longer read which ranks did not connect.
// So every failing rank counts itself in once it has read them, and rank 0 waits, at most 3 s,
// until the ranks that published an address (`readers`, itself included) have.
void wait_for_census_readers(const c10::intrusive_ptr<c10d::Store>& store, int rank, int readers) {
  const std::string key = "connect_failure_census_read";
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  auto count = [&store, &key](int64_t add) {
    return run_until<int64_t>([store, key, add] { return store->add(key, add); },
                              std::chrono::steady_clock::now() + std::chrono::seconds(1));
  };
  try {
    if (!count(1) || rank != 0) return;
    while (std::chrono::steady_clock::now() < until) {
      const auto n = count(0);
      if (!n || *n >= readers) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const std::exception&) {
    // The store is unreachable: nothing to wait for.
  }
}

c10::intrusive_ptr<c10d::ProcessGroup> connect_mesh(
    const c10::intrusive_ptr<c10d::Store>& store, const RendezvousInfo& info,
    std::chrono::milliseconds timeout, std::chrono::steady_clock::time_point deadline,
    const std::string& backend, const std::string& bind_host, const std::vector<PeerInfo>& peers) {
  using PG = c10::intrusive_ptr<c10d::ProcessGroup>;
  const auto now = std::chrono::steady_clock::now();
  const auto until = std::max(
      deadline, now + std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(2)));
  const int rank = info.rank, size = info.world_size;
  std::string cause;
  try {
    auto pg = run_until<PG>(
        [=] { return compat::make_process_group(store, rank, size, timeout, backend, bind_host); },
        until);
    if (pg) return *pg;
    cause = cat("the connections were not complete at the deadline (", timeout.count() / 1000.0,
                " s after the rendezvous began)");
  } catch (const Error&) {
    throw;  // a bad backend or option: not a connection failure
  } catch (const std::exception& e) {
    cause = e.what();
  }
  if (size == 1) throw CommError(cat("creating the process group failed: ", first_line(cause)));
  // The store may hang (its server rank stopped): a second short bound.
  std::vector<int> unpublished;
  try {
    auto missing = run_until<std::vector<int>>(
        [store, size] { return ranks_without_key(*store, size, mesh_address_key); },
        std::chrono::steady_clock::now() + std::chrono::seconds(2));
    if (missing) unpublished = *missing;
  } catch (const std::exception&) {
    // The store is gone too: Gloo's cause is all there is.
  }
  wait_for_census_readers(store, rank, size - static_cast<int>(unpublished.size()));
  throw CommError(mesh_connect_error(info, timeout, peers, unpublished, cause));
}

}  // namespace fsdp::detail
