// Two "hosts" on one machine for the tests: two network namespaces joined by a veth pair,
// 10.99.0.1 (namespace a) and 10.99.0.2 (namespace b). Needs root (ip netns).
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "harness.h"

namespace fsdp::testing {

// Runs `ip args...`; returns "" on success, else the command and its output.
inline std::string ip(std::vector<std::string> args) {
  args.insert(args.begin(), "ip");
  auto r = run_process(args, std::chrono::seconds(10));
  if (r.exit_code == 0) return "";
  std::string cmd;
  for (const auto& a : args) cmd += a + " ";
  return cmd + ": " + r.output;
}

// Namespaces named after `id` (the test's pid): created by create(), deleted with the object.
struct Namespaces {
  std::string a, b, va, vb;
  explicit Namespaces(int id)
      : a("fsdpA" + std::to_string(id)),
        b("fsdpB" + std::to_string(id)),
        va("fva" + std::to_string(id % 100000)),
        vb("fvb" + std::to_string(id % 100000)) {}
  std::string create() {
    for (auto cmd : std::vector<std::vector<std::string>>{
             {"netns", "add", a},
             {"netns", "add", b},
             {"link", "add", va, "type", "veth", "peer", "name", vb},
             {"link", "set", va, "netns", a},
             {"link", "set", vb, "netns", b},
             {"-n", a, "addr", "add", "10.99.0.1/24", "dev", va},
             {"-n", b, "addr", "add", "10.99.0.2/24", "dev", vb},
             {"-n", a, "link", "set", "lo", "up"},
             {"-n", b, "link", "set", "lo", "up"},
             {"-n", a, "link", "set", va, "up"},
             {"-n", b, "link", "set", vb, "up"}}) {
      if (auto e = ip(cmd); !e.empty()) return e;
    }
    return "";
  }
  ~Namespaces() {
    ip({"netns", "del", a});
    ip({"netns", "del", b});
  }
};

}  // namespace fsdp::testing
