#include "sweeps.h"

#include <fsdp/error.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <iomanip>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>

#include "stats.h"
#include "train_bench.h"

namespace fsdp::bench {
namespace {

using nlohmann::ordered_json;
using json = nlohmann::ordered_json;  // keys in the order the runs print them

// The JSON object lines of `lines` that carry a "mode", by mode (the last one wins).
std::map<std::string, json> by_mode(const std::vector<std::string>& lines) {
  std::map<std::string, json> out;
  for (const auto& l : lines) {
    auto j = json::parse(l, nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.contains("mode")) out[j["mode"]] = j;
  }
  return out;
}

// Runs one mode; its JSON line, or a null json when the run failed or printed none.
json run_one(const Launch& launch, int nproc, const std::vector<std::string>& args,
             std::ostream& err, const std::string& what) {
  std::vector<std::string> lines;
  const int rc = launch(nproc, args, lines);
  auto modes = by_mode(lines);
  if (rc != 0 || modes.empty()) {
    err << "fsdp-bench: " << what << " failed (exit status " << rc << ")\n";
    return json();
  }
  return modes.begin()->second;
}

// Peak resident set per rank of a run, the model's construction included.
double process_peak_mb(const json& j) {
  double p = j.value("peak_rss_mb", 0.0);
  return std::max(p, j.value("peak_rss_build_mb", 0.0));
}

}  // namespace

std::vector<double> load_average() {
  std::ifstream in("/proc/loadavg");
  std::vector<double> v(3, -1.0);
  in >> v[0] >> v[1] >> v[2];
  return v;
}

// ---------------------------------------------------------------------------------------------
// --compare
// ---------------------------------------------------------------------------------------------
namespace {

// Per group and step, what sharding adds to the step: microseconds above the C++ floor (`local`)
// for fsdp and for PyTorch's FSDP2, and, where PyTorch's own unwrapped model ran (torch-local),
// FSDP2 above that Python floor (which leaves out what the Python model itself costs). Groups:
// one per block and the root.
void add_overheads(std::map<std::string, json>& modes,
                   const std::function<void(const std::string&, double)>& add) {
  if (!modes.count("fsdp") || !modes.count("local")) return;
  const double groups = modes["fsdp"]["layers"].get<double>() + 1;
  auto us_above = [&](const std::string& m, const std::string& floor) {
    return (modes[m]["step_s_median"].get<double>() - modes[floor]["step_s_median"].get<double>()) /
           groups * 1e6;
  };
  const double fsdp = us_above("fsdp", "local");
  add("fsdp_us_per_group_above_local", fsdp);
  if (!modes.count("fsdp2")) return;
  const double fsdp2 = us_above("fsdp2", "local");
  add("fsdp2_us_per_group_above_local", fsdp2);
  add("fsdp_overhead_over_fsdp2", fsdp / fsdp2);
  if (!modes.count("torch-local")) return;
  const double own = us_above("fsdp2", "torch-local");
  add("fsdp2_us_per_group_above_torch_local", own);
  add("torch_local_over_local", modes["torch-local"]["step_s_median"].get<double>() /
                                    modes["local"]["step_s_median"].get<double>());
  add("fsdp_overhead_over_fsdp2_own", fsdp / own);
}

}  // namespace

std::string summarize_rounds(const std::vector<std::vector<std::string>>& rounds,
                             std::ostream& warnings) {
  FSDP_CHECK(!rounds.empty(), "--compare: no rounds to summarize");
  // Ratio name -> one value per round; for the ratios against the Python peer, per round it ran.
  std::vector<std::pair<std::string, std::vector<double>>> ratios;
  auto add = [&](const std::string& name, double v) {
    auto it = std::find_if(ratios.begin(), ratios.end(), [&](auto& r) { return r.first == name; });
    if (it == ratios.end()) it = ratios.insert(ratios.end(), {name, {}});
    it->second.push_back(v);
  };
  bool ok = true;
  ordered_json first;
  std::string mixed_precision = "none", verify = "on", quantize_gather = "none",
              quantize_reduce = "none";
  for (const auto& lines : rounds) {
    std::vector<std::string> ours;
    std::map<std::string, json> modes = by_mode(lines);
    for (const auto& m : compare_modes()) ours.push_back(modes.count(m) ? modes[m].dump() : "");
    // This round's ratios and checks, in summarize_compare's key order.
    auto s = ordered_json::parse(summarize_compare(ours, warnings));
    if (first.is_null()) first = s;
    ok = ok && s["checks_passed"].get<bool>();
    for (const auto& [key, value] : s.items())
      if (key.find("_over_") != std::string::npos) add(key, value.get<double>());
    // Verified collectives' own time in fsdp's step, measured directly (less noisy than the ratio
    // of two runs' steps).
    add("verify_share_of_step", modes["fsdp"].value("verify_share_of_step", 0.0));
    mixed_precision = modes["fsdp"].value("mixed_precision", "none");
    verify = modes["fsdp"].value("verify_collectives", "on");
    quantize_gather = modes["fsdp"].value("quantize_gather", "none");
    quantize_reduce = modes["fsdp"].value("quantize_reduce", "none");
    // The Python peers (bench/torch_ddp.py): PyTorch's DDP against ddp, its FSDP2 against fsdp
    // (the same mixed precision). Each builds the same model from the same seed and trains on the
    // same batches: its step-1 loss equals its counterpart's (to the last bits where the kernels
    // are the same LibTorch's; 1e-5 still tells a model drawn otherwise, ~3e-3 away, apart).
    auto same_first_loss = [&](const std::string& name, const std::string& ours) {
      const double a = modes[name]["loss_step1"], b = modes[ours]["loss_step1"];
      if (std::abs(a - b) > 1e-5 * std::max(1.0, std::abs(b))) {
        ok = false;
        warnings << "fsdp-bench: WARNING: step-1 loss of " << name << " is " << a << ", of " << ours
                 << " " << b << "; bench/torch_ddp.py no longer builds the same model or batches\n";
      }
    };
    auto peer = [&](const std::string& name, const std::string& key, const std::string& ours) {
      if (!modes.count(name)) return;
      const json &p = modes[name], &o = modes[ours];
      const double peer_s = p["step_s_median"].get<double>();
      add("fsdp_over_" + key, modes["fsdp"]["step_s_median"].get<double>() / peer_s);
      add("noreshard_over_" + key, modes["fsdp-noreshard"]["step_s_median"].get<double>() / peer_s);
      if (ours == "ddp") add("ddp_over_" + key, o["step_s_median"].get<double>() / peer_s);
      add("fsdp_mem_over_" + key,
          modes["fsdp"]["train_memory_mb"].get<double>() / p["train_memory_mb"].get<double>());
      same_first_loss(name, ours);
    };
    peer("torch-ddp", "torch_ddp", "ddp");
    peer("fsdp2", "fsdp2", "fsdp");
    if (modes.count("torch-local")) same_first_loss("torch-local", "local");
    add_overheads(modes, add);
  }
  ordered_json s;
  s["summary"] = "compare";
  s["world"] = first["world"];
  s["preset"] = first["preset"];
  s["mixed_precision"] = mixed_precision;  // of fsdp, fsdp-noreshard and fsdp2; the others fp32
  s["verify_collectives"] = verify;        // of fsdp and fsdp-noreshard (fsdp-unverified: off)
  s["quantize_gather"] = quantize_gather;  // of the fsdp modes
  s["quantize_reduce"] = quantize_reduce;
  s["rounds"] = rounds.size();
  for (const auto& [name, values] : ratios) {
    s[name] = round_to(median(values), 1e4);
    s[name + "_range"] = {round_to(*std::min_element(values.begin(), values.end()), 1e4),
                          round_to(*std::max_element(values.begin(), values.end()), 1e4)};
  }
  s["checks_passed"] = ok;
  // The targets of issue 30, at every N, preset and precision (against PyTorch's DDP: N=2),
  // and issue 12's memory against ddp on --preset mem.
  ordered_json targets;
  auto target = [&](const char* key, const char* name, double bound) {
    if (s.contains(key)) targets[name] = s[key].get<double>() <= bound;
  };
  target("fsdp_over_fsdp2", "fsdp_over_fsdp2<=0.65", 0.65);
  target("fsdp_over_local", "fsdp_over_local<=1.05", 1.05);
  target("verify_over_unverified", "verify_over_unverified<=1.02", 1.02);
  if (s["world"] == 2) target("fsdp_over_torch_ddp", "fsdp_over_torch_ddp<=0.92", 0.92);
  target("fsdp_mem_over_fsdp2", "fsdp_mem_over_fsdp2<=0.75", 0.75);
  if (s["preset"] == "mem") target("fsdp_mem_over_ddp", "fsdp_mem_over_ddp<=0.60", 0.60);
  // Issue 50's: fsdp's time per group above the floor at most a twentieth of FSDP2's.
  if (s["preset"] == "overhead")
    target("fsdp_overhead_over_fsdp2", "fsdp_overhead_over_fsdp2<=0.05", 0.05);
  s["targets_met"] = targets;
  return s.dump();
}

int compare_rounds(const CompareSpec& spec, const ArgsFor& args_for, const Launch& launch,
                   const Launch& torch_launch, std::ostream& out, std::ostream& err) {
  FSDP_CHECK(spec.rounds >= 1, "--rounds must be at least 1, got ", spec.rounds);
  std::vector<std::string> order = compare_modes();
  if (spec.torch_ddp && torch_launch) order.push_back("torch-ddp");
  if (spec.fsdp2 && torch_launch) order.push_back("fsdp2");
  if (spec.torch_local && torch_launch) order.push_back("torch-local");
  auto is_peer = [](const std::string& m) {
    return m == "torch-ddp" || m == "fsdp2" || m == "torch-local";
  };
  const auto load_start = load_average();
  std::vector<std::vector<std::string>> rounds;
  for (int r = 0; r < spec.rounds; ++r) {
    std::vector<std::string> lines;
    // Rotate the order each round, so no mode always runs first (cold) or after the same one.
    for (size_t i = 0; i < order.size(); ++i) {
      const std::string& m = order[(i + r) % order.size()];
      err << "fsdp-bench: --compare round " << r + 1 << "/" << spec.rounds << ": " << m << "\n";
      std::vector<std::string> got;
      const int rc = (is_peer(m) ? torch_launch : launch)(spec.nproc, args_for(m, 0), got);
      if (rc != 0 && !is_peer(m)) {
        err << "fsdp-bench: --compare: mode " << m << " failed with exit status " << rc << "\n";
        return rc;
      }
      if (rc != 0)
        err << "fsdp-bench: --compare: the Python peer " << m << " failed (exit status " << rc
            << (rc == 3 ? ": no torch 2.15 with FSDP2 there, see above" : "")
            << "); its ratios (fsdp_over_"
            << (m == "fsdp2"         ? "fsdp2"
                : m == "torch-local" ? "torch_local"
                                     : "torch_ddp")
            << ", ...) are left out of this round\n";
      for (const auto& l : got) out << l << "\n" << std::flush;
      lines.insert(lines.end(), got.begin(), got.end());
    }
    rounds.push_back(std::move(lines));
  }
  auto o = ordered_json::parse(summarize_rounds(rounds, err));
  const auto load_end = load_average();
  o["loadavg_start"] = load_start;
  o["loadavg_end"] = load_end;
  out << o.dump() << std::endl;
  return 0;
}

// ---------------------------------------------------------------------------------------------
// --memory-scaling
// ---------------------------------------------------------------------------------------------
int memory_scaling(const std::vector<int>& worlds, const ArgsFor& args_for, const Launch& launch,
                   std::ostream& out, std::ostream& err) {
  const auto load_start = load_average();
  ordered_json rows = ordered_json::array();
  std::ostringstream table;
  table << "| N | fsdp MB | ddp MB | 16P/N MB | fsdp/ddp |\n|---|---|---|---|---|\n";
  int64_t params = 0;
  for (size_t i = 0; i < worlds.size(); ++i) {
    const int n = worlds[i];
    std::map<std::string, json> got;
    // Alternate which mode goes first at each N.
    for (const char* m : i % 2 ? std::vector<const char*>{"fsdp", "ddp"}
                               : std::vector<const char*>{"ddp", "fsdp"}) {
      got[m] = run_one(launch, n, args_for(m, 0), err, detail::cat(m, " at N=", n));
      if (got[m].is_null()) return 1;
      out << got[m].dump() << "\n" << std::flush;
    }
    params = got["fsdp"]["params"].get<int64_t>();
    const double f = got["fsdp"]["peak_rss_mb"], d = got["ddp"]["peak_rss_mb"];
    const double states = 16.0 * static_cast<double>(params) / n / (1 << 20);
    rows.push_back({{"world", n},
                    {"fsdp_mb", f},
                    {"ddp_mb", d},
                    {"states_16p_over_n_mb", round_to(states, 10)},
                    {"fsdp_over_ddp", round_to(f / d, 1e3)},
                    {"fsdp_over_states", round_to(f / states, 1e3)}});
    table << "| " << n << " | " << std::fixed << std::setprecision(0) << f << " | " << d << " | "
          << states << " | " << std::setprecision(2) << f / d << " |\n";
  }
  out << table.str() << std::flush;
  ordered_json s;
  s["summary"] = "memory-scaling";
  s["params"] = params;
  s["rows"] = rows;
  s["loadavg_start"] = load_start;
  s["loadavg_end"] = load_average();
  out << s.dump() << std::endl;
  return 0;
}

// ---------------------------------------------------------------------------------------------
// --max-model
// ---------------------------------------------------------------------------------------------
int max_model(int nproc, double memory_mb, const ArgsFor& args_for, const Launch& launch,
              std::ostream& out, std::ostream& err) {
  FSDP_CHECK(memory_mb > 0, "--max-model needs --memory-mb M > 0 (the per-rank budget in MB)");
  const auto load_start = load_average();
  ordered_json s;
  s["summary"] = "max-model";
  s["world"] = nproc;
  s["memory_mb"] = memory_mb;
  std::map<std::string, int64_t> best_params;
  for (const char* mode : {"ddp", "fsdp"}) {
    std::map<int64_t, json> probes;  // layers -> line
    auto probe = [&](int64_t layers) -> const json& {
      auto it = probes.find(layers);
      if (it != probes.end()) return it->second;
      json j = run_one(launch, nproc, args_for(mode, layers), err,
                       detail::cat(mode, " with ", layers, " layers"));
      FSDP_CHECK(!j.is_null(), "--max-model: the ", mode, " run with ", layers,
                 " layers failed; see the messages above (out of memory?)");
      out << j.dump() << "\n" << std::flush;
      return probes[layers] = j;
    };
    auto fits = [&](int64_t layers) { return process_peak_mb(probe(layers)) <= memory_mb; };
    int64_t best = 0;
    if (fits(1)) {
      // Peak grows linearly with depth: predict from two probes, then step to the boundary.
      const double m1 = process_peak_mb(probe(1)), m2 = process_peak_mb(probe(2));
      const double per_layer = std::max(m2 - m1, 1.0);
      int64_t guess = std::max<int64_t>(1, static_cast<int64_t>((memory_mb - m1) / per_layer) + 1);
      guess = std::min<int64_t>(guess, 512);  // a runaway prediction would take hours
      while (guess > 1 && !fits(guess)) --guess;
      while (fits(guess + 1)) ++guess;
      best = guess;
    }
    ordered_json r;
    r["layers"] = best;
    if (best > 0) {
      const json& j = probe(best);
      r["params"] = j["params"];
      r["peak_rss_mb"] = process_peak_mb(j);
      best_params[mode] = j["params"].get<int64_t>();
    } else {
      r["params"] = 0;
      r["note"] = "one layer does not fit the budget";
    }
    r["probes"] = probes.size();
    s[mode] = r;
  }
  if (best_params["ddp"] > 0)
    s["fsdp_params_over_ddp"] =
        round_to(static_cast<double>(best_params["fsdp"]) / best_params["ddp"], 100);
  s["loadavg_start"] = load_start;
  s["loadavg_end"] = load_average();
  out << s.dump() << std::endl;
  return 0;
}

}  // namespace fsdp::bench
