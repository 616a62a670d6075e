#include "comm_bench.h"

#include <ATen/ATen.h>
#include <fsdp/communicator.h>
#include <fsdp/error.h>
#include <fsdp/init.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "stats.h"
#include "sweeps.h"

namespace fsdp::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Buffers of one (op, size) case, allocated and first touched once, reused by every iteration.
struct Case {
  std::string op;
  int64_t shard = 0;  // elements per rank: all-gather input, reduce-scatter output
  at::Tensor in, out;
};

int64_t case_bytes(const Case& c, int ws) {
  return c.op == "all_reduce" ? c.in.numel() * 4 : c.shard * ws * 4;
}

double busbw_factor(const std::string& op, int ws) {
  if (ws == 1) return 1.0;  // nothing moves; report algorithm bandwidth
  return op == "all_reduce" ? 2.0 * (ws - 1) / ws : static_cast<double>(ws - 1) / ws;
}

// Inputs whose results are exact in fp32, so the check is equality:
//   all_gather:     in_r[i] = r * 1000 + i % 997        -> out = concat over r
//   reduce_scatter: in_r[j] = r + j % 251               -> out[i] = sum_r r + N * ((rank n + i) %
//   251) all_reduce:     in_r[j] = r + j % 251 (in place)    -> sum_r r + N * (j % 251)
at::Tensor pattern(int64_t n, int64_t modulus, double base) {
  return at::arange(n, at::kLong).remainder_(modulus).to(at::kFloat).add_(base);
}

Work issue(Communicator& comm, Case& c) {
  if (c.op == "all_gather") return comm.all_gather(c.out, c.in);
  if (c.op == "reduce_scatter") return comm.reduce_scatter(c.out, c.in, ReduceOp::kSum);
  return comm.all_reduce(c.in, ReduceOp::kSum);
}

void check_once(Communicator& comm, Case& c) {
  const int ws = comm.size(), r = comm.rank();
  const double rank_sum = ws * (ws - 1) / 2.0;
  at::Tensor expected, got;
  if (c.op == "all_gather") {
    c.in.copy_(pattern(c.shard, 997, r * 1000.0));
    std::vector<at::Tensor> parts;
    for (int q = 0; q < ws; ++q) parts.push_back(pattern(c.shard, 997, q * 1000.0));
    expected = at::cat(parts);
    got = c.out;
  } else if (c.op == "reduce_scatter") {
    c.in.copy_(pattern(c.in.numel(), 251, r));
    expected =
        pattern(c.in.numel(), 251, 0).narrow(0, r * c.shard, c.shard).mul_(ws).add_(rank_sum);
    got = c.out;
  } else {
    c.in.copy_(pattern(c.in.numel(), 251, r));
    expected = pattern(c.in.numel(), 251, 0).mul_(ws).add_(rank_sum);
    got = c.in;
  }
  issue(comm, c).wait();
  FSDP_CHECK(at::equal(got, expected), "comm bench: ", c.op, " of ", case_bytes(c, ws),
             " bytes on ", ws, " ranks returned a wrong result on rank ", r,
             "; run the comm tests (ctest -L comm) to narrow it down");
  if (c.op == "all_reduce") c.in.zero_();  // timed all-reduces then keep summing zeros
}

double round4(double x) { return std::round(x * 1e4) / 1e4; }

// Buffers of `op` for a whole buffer of about `bytes` (ws shards of fp32).
Case make_case(const std::string& op, int64_t bytes, int ws) {
  Case c;
  c.op = op;
  c.shard = std::max<int64_t>(1, bytes / 4 / ws);
  if (op == "all_gather") {
    c.in = at::zeros({c.shard}, at::kFloat);
    c.out = at::zeros({c.shard * ws}, at::kFloat);
  } else if (op == "reduce_scatter") {
    c.in = at::zeros({c.shard * ws}, at::kFloat);
    c.out = at::zeros({c.shard}, at::kFloat);
  } else {
    c.in = at::zeros({c.shard * ws}, at::kFloat);
  }
  return c;
}

}  // namespace

int run_comm_bench(const CommBenchOptions& options) {
  FSDP_CHECK(options.min_bytes > 0 && options.max_bytes >= options.min_bytes && options.step > 1,
             "comm bench: sizes ", options.min_bytes, "..", options.max_bytes, " step ",
             options.step, " are invalid; need 0 < min <= max and step > 1");
  for (const auto& op : options.ops)
    FSDP_CHECK(op == "all_gather" || op == "reduce_scatter" || op == "all_reduce",
               "comm bench: unknown op '", op,
               "'; expected all_gather, reduce_scatter or all_reduce");
  auto comm = init_process_group();
  const int ws = comm->size(), rank = comm->rank();
  if (rank == 0)
    std::cerr << "fsdp-bench --comm: " << ws << " rank(s), backend " << comm->backend()
              << ", fp32, sizes " << options.min_bytes << ".." << options.max_bytes << " bytes\n";

  for (int64_t bytes = options.min_bytes; bytes <= options.max_bytes; bytes *= options.step) {
    // Every op at this size, its iterations interleaved with the other ops' (op A, op B, op A, ...)
    // so that load on a shared machine hits all of them alike; paired ratios per iteration below.
    std::vector<Case> cases;
    for (const auto& op : options.ops) cases.push_back(make_case(op, bytes, ws));
    const int64_t actual = case_bytes(cases[0], ws);
    const int iters = options.iters > 0
                          ? options.iters
                          : static_cast<int>(std::clamp<int64_t>((256ll << 20) / actual, 20, 50));
    for (auto& c : cases) {
      check_once(*comm, c);
      for (int i = 0; i < options.warmup; ++i) issue(*comm, c).wait();
    }
    // Per iteration: line the ranks up, then time issue..wait. The slowest rank sets the time.
    auto times = at::empty({static_cast<int64_t>(cases.size()), iters}, at::kDouble);
    for (int i = 0; i < iters; ++i)
      for (size_t k = 0; k < cases.size(); ++k) {
        comm->barrier().wait();
        auto t0 = Clock::now();
        issue(*comm, cases[k]).wait();
        times[k][i] = std::chrono::duration<double>(Clock::now() - t0).count();
      }
    auto all = at::empty({ws * times.numel()}, at::kDouble);
    comm->all_gather(all, times.view({-1})).wait();
    auto slowest = std::get<0>(all.view({ws, -1}).max(0)).view({-1, iters});
    if (rank != 0) continue;
    std::map<std::string, std::vector<double>> bus;  // op -> bus bandwidth per iteration
    for (size_t k = 0; k < cases.size(); ++k) {
      const auto& c = cases[k];
      const double f = busbw_factor(c.op, ws);
      std::vector<double>& bw = bus[c.op];
      for (int i = 0; i < iters; ++i) bw.push_back(actual / slowest[k][i].item<double>() / 1e9 * f);
      const double med = median(bw);
      nlohmann::ordered_json j;
      j["op"] = c.op;
      j["bytes"] = actual;
      j["world"] = ws;
      j["busbw_gbps_median"] = round4(med);
      j["busbw_gbps_min"] = round4(*std::min_element(bw.begin(), bw.end()));
      j["busbw_gbps_max"] = round4(*std::max_element(bw.begin(), bw.end()));
      j["algbw_gbps_median"] = round4(med / f);
      j["time_ms_median"] = round4(actual / (med / f) / 1e6);
      j["iters"] = iters;
      j["dtype"] = "float32";
      j["transport"] = c.op == "all_reduce" ? "collective" : to_string(comm->transport());
      j["checked"] = true;
      std::cout << j.dump() << std::endl;
    }
    if (bus.count("all_gather") && bus.count("reduce_scatter")) {
      // Reduce-scatter over all-gather bus bandwidth, paired iteration by iteration.
      std::vector<double> ratio;
      for (int i = 0; i < iters; ++i)
        ratio.push_back(bus["reduce_scatter"][i] / bus["all_gather"][i]);
      nlohmann::ordered_json j;
      j["ratio"] = "reduce_scatter_over_all_gather";
      j["bytes"] = actual;
      j["world"] = ws;
      j["busbw_ratio_median"] = round4(median(ratio));
      j["busbw_ratio_min"] = round4(*std::min_element(ratio.begin(), ratio.end()));
      j["busbw_ratio_max"] = round4(*std::max_element(ratio.begin(), ratio.end()));
      j["loadavg_1m"] = load_average()[0];
      std::cout << j.dump() << std::endl;
    }
  }
  comm->barrier().wait();
  return 0;
}

}  // namespace fsdp::bench
