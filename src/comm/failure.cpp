#include "failure.h"

#include <fsdp/error.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <regex>

namespace fsdp::detail {
namespace {

bool has(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

std::string seconds(double s) {
  std::ostringstream os;
  os.precision(s < 10 ? 2 : 3);
  os << s;
  return os.str();
}

// A timeout's suspects: the ranks that did not arrive (the census), with the state of those of
// this host, or, without a census, the peers of this host in an abnormal state, as "rank 2 (pid 7
// on h) did not arrive: its process is stopped (...)"; "" when the census is missing and no local
// peer is in such a state.
std::string hung_ranks(const std::vector<PeerInfo>& peers, int self, const Census* census,
                       const std::function<std::string(int64_t)>& state,
                       std::chrono::milliseconds timeout) {
  const auto state_of = state ? state : process_state;
  const std::string host = this_host();
  std::vector<std::string> named;
  for (size_t i = 0; i < peers.size(); ++i) {
    const PeerInfo& p = peers[i];
    if (static_cast<int>(i) == self) continue;
    const bool counted = census && census->complete;
    const bool absent = counted && std::find(census->absent.begin(), census->absent.end(),
                                             static_cast<int>(i)) != census->absent.end();
    // A rank that reported is waiting in a collective: its state at this instant (a moment in
    // uninterruptible sleep, say) says nothing about the hang.
    if (counted && !absent) continue;
    const std::string st = p.host == host ? state_of(p.pid) : std::string();
    if (!absent && st.empty()) continue;
    named.push_back(cat("rank ", p.rank, " (pid ", p.pid, " on ", p.host, ") did not arrive",
                        st.empty() ? std::string() : ": " + st));
  }
  std::string out;
  for (size_t i = 0; i < named.size(); ++i) out += (i ? "; " : "") + named[i];
  if (!out.empty()) {
    if (census && census->complete)
      out += cat(" (every other rank reported waiting within ",
                 seconds(census_grace(timeout).count() / 1000.0), " s)");
    return out;
  }
  if (census && census->complete && census->absent.empty())
    return "every rank reached a collective of this communicator, so they issued different "
           "collectives (or a collective's data did not get through)";
  if (census && !census->complete && !peers.empty())
    return cat("the store did not answer either, so rank ", peers[0].rank, " (pid ", peers[0].pid,
               " on ", peers[0].host,
               "), which serves it unless a launcher's agent does, is likely hung");
  return {};
}

// Whether a peer process of this host is stopped, traced or in uninterruptible sleep.
bool local_peer_stuck(const std::vector<PeerInfo>& peers, int self,
                      const std::function<std::string(int64_t)>& state) {
  const auto state_of = state ? state : process_state;
  const std::string host = this_host();
  for (size_t i = 0; i < peers.size(); ++i)
    if (static_cast<int>(i) != self && peers[i].host == host && !state_of(peers[i].pid).empty())
      return true;
  return false;
}

}  // namespace

bool process_alive(int64_t pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  // A zombie has exited; only its parent has not reaped it yet (a launcher between two polls).
  std::ifstream stat(cat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return true;  // no /proc (or not ours to read): it exists
  const auto close = line.rfind(')');          // the state follows the command name in parentheses
  return close == std::string::npos || close + 2 >= line.size() ||
         (line[close + 2] != 'Z' && line[close + 2] != 'X');
}

std::string this_host() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

FailureKind classify_failure(const std::string& cause) {
  if (has(cause, "Connection closed by peer") || has(cause, "closed by peer"))
    return FailureKind::kPeerClosed;
  if (has(cause, "Connection reset") || has(cause, "Broken pipe") || has(cause, "EPIPE") ||
      has(cause, "ECONNRESET"))
    return FailureKind::kReset;
  if (has(cause, "Timed out") || has(cause, "timed out") || has(cause, "Timeout") ||
      has(cause, "timeout"))
    return FailureKind::kTimeout;
  return FailureKind::kOther;
}

Suspects suspect_ranks(const std::string& cause, const std::vector<PeerInfo>& peers, int self,
                       const std::function<bool(int64_t pid)>& alive) {
  const auto is_alive = alive ? alive : process_alive;
  const std::string host = this_host();
  // `self` is this rank's index among `peers` (its rank in the communicator); the peers carry
  // world ranks, which differ from the index in a subgroup.
  std::vector<int> dead, by_address;
  for (size_t i = 0; i < peers.size(); ++i) {
    const PeerInfo& p = peers[i];
    if (static_cast<int>(i) != self && p.host == host && p.pid > 0 && !is_alive(p.pid))
      dead.push_back(p.rank);
  }
  if (!dead.empty()) return {dead, true};
  // Gloo names the remote end of the failed connection as "[address]:port".
  std::smatch m;
  if (std::regex_search(cause, m, std::regex("\\[([0-9A-Fa-f.:]+)\\]:[0-9]+"))) {
    for (size_t i = 0; i < peers.size(); ++i)
      if (static_cast<int>(i) != self && peers[i].address == m[1].str())
        by_address.push_back(peers[i].rank);
  }
  return {by_address, false};
}

bool wants_census(const std::string& cause, const std::vector<PeerInfo>& peers, int self) {
  switch (classify_failure(cause)) {
    case FailureKind::kTimeout:
      return true;
    case FailureKind::kPeerClosed:
    case FailureKind::kReset:  // a communicator without peers (an elastic lane) names nobody
      return !peers.empty() && !suspect_ranks(cause, peers, self, nullptr).exited;
    case FailureKind::kOther:
      return false;
  }
  return false;
}

std::string describe_failure(const std::string& what, const std::string& cause, double elapsed_s,
                             std::chrono::milliseconds timeout, const std::vector<PeerInfo>& peers,
                             int self, const std::function<bool(int64_t pid)>& alive,
                             const Census* census,
                             const std::function<std::string(int64_t pid)>& state) {
  FailureKind kind = classify_failure(cause);
  const Suspects suspects = suspect_ranks(cause, peers, self, alive);
  // A peer whose own wait timed out closes its connections. With no peer process of this host
  // exited, this rank's "closed by peer" is that timeout when a peer reported its timeout in the
  // census, or, where the store did not answer, when a peer of this host is stopped or stuck (a
  // stopped process closes nothing).
  bool by_timeout = false;
  std::vector<int> timed_out;  // the peers that reported it; empty when unknown
  if ((kind == FailureKind::kPeerClosed || kind == FailureKind::kReset) && !suspects.exited &&
      census) {
    timed_out = census->timed_out;
    by_timeout = census->complete ? !timed_out.empty() : local_peer_stuck(peers, self, state);
  }
  if (by_timeout) kind = FailureKind::kTimeout;
  const auto& ranks = by_timeout ? std::vector<int>{} : suspects.ranks;
  const bool one = ranks.size() == 1;
  std::string who;  // "rank 1 (pid 7 on h)", "ranks 1, 2", "one of ranks 0, 1"
  if (one) {
    who = rank_list(ranks);
    for (const auto& p : peers)
      if (p.rank == ranks[0]) who += cat(" (pid ", p.pid, " on ", p.host, ")");
  } else if (!ranks.empty()) {
    who = (suspects.exited ? "" : "one of ") + rank_list(ranks);
  }
  const char* verb = one || !suspects.exited ? " has" : " have";
  const std::string limit = cat(seconds(timeout.count() / 1000.0), " s");
  std::string out;
  switch (kind) {
    case FailureKind::kPeerClosed:
    case FailureKind::kReset:
      out =
          cat(what, " failed after ", seconds(elapsed_s), " s: ",
              kind == FailureKind::kReset ? "the connection was reset"
                                          : "the peer closed the "
                                            "connection",
              ranks.empty() ? std::string(" (a peer rank's process exited or was killed)")
                            : cat("; ", who, verb, " exited"),
              ". Check ", ranks.empty() ? std::string("the other ranks'") : rank_list(ranks) + "'s",
              " output for the error that stopped it; no message there means it was killed (the "
              "OOM killer: dmesg; a launcher or scheduler limit).");
      break;
    case FailureKind::kTimeout: {
      const std::string hung =
          ranks.empty() && census ? hung_ranks(peers, self, census, state, timeout) : std::string();
      const std::string here = cat(" (here after ", seconds(elapsed_s), " s)");
      const std::string how =
          !by_timeout ? std::string("no peer connection failed")
          : timed_out.empty()
              ? cat("a peer closed its connections", here,
                    ", as a rank does when its own wait times out; no peer process of this host "
                    "has exited")
              : cat(rank_list(timed_out), " timed out waiting for it and closed ",
                    timed_out.size() == 1 ? "its" : "their", " connections", here,
                    "; no peer process of this host has exited");
      out = cat(what, " did not complete within ", limit, ": ", how, ", ",
                !ranks.empty()  ? cat(who, verb, " exited without closing its connections")
                : !hung.empty() ? "and " + hung
                                : std::string("so a peer rank is hung, slower than the limit, "
                                              "unreachable (the network between the hosts), or "
                                              "issued a different collective"),
                ". Every rank must issue the same collectives in the same order; check the other "
                "ranks' output, and raise the limit with FSDP_TIMEOUT_S if a step legitimately "
                "takes longer.");
      break;
    }
    case FailureKind::kOther:
      out = cat(what, " failed after ", seconds(elapsed_s), " s (limit ", limit, ")",
                ranks.empty() ? std::string() : cat("; ", who, verb, " exited"),
                ". Check every rank's output; a peer may have died or issued a different "
                "collective (every rank must issue the same collectives in the same order).");
      break;
  }
  return cat(out, " [", cause, "]");
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

}  // namespace fsdp::detail
