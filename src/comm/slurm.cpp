#include "slurm.h"

#include <fsdp/error.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>

namespace fsdp::detail {
namespace {

const char* const kSetMasterAddr =
    "set MASTER_ADDR to the host of rank 0 (e.g. export MASTER_ADDR=$(scontrol show hostnames "
    "\"$SLURM_JOB_NODELIST\" | head -n 1))";

bool is_name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_';
}

// One malformed-list error: the variable, its value, what is wrong where (`pos`, npos for the
// whole list), and the fix.
[[noreturn]] void bad_list(const std::string& variable, const std::string& list, size_t pos,
                           const std::string& what) {
  const std::string where = pos == std::string::npos ? ""
                            : pos < list.size()      ? cat(" at character ", pos + 1)
                                                     : " at the end";
  throw Error(cat(variable, "='", list, "' is not a valid Slurm host list: ", what, where, "; ",
                  kSetMasterAddr));
}

// A parser over one host list; `pos_` only moves forward.
class HostlistParser {
 public:
  HostlistParser(const std::string& list, const std::string& variable)
      : list_(list), variable_(variable) {}

  std::vector<std::string> parse() {
    if (list_.empty()) fail(std::string::npos, "it is empty");
    std::vector<std::string> hosts;
    for (;;) {
      expression(hosts);
      if (pos_ == list_.size()) return hosts;
      if (list_[pos_] != ',') fail(pos_, cat("unexpected '", list_[pos_], "'"));
      ++pos_;
    }
  }

 private:
  [[noreturn]] void fail(size_t pos, const std::string& what) {
    bad_list(variable_, list_, pos, what);
  }

  // One name with any number of bracket groups, e.g. "rack[1-2]-n[01-04]": appended to `hosts`
  // as the product of its groups, leftmost slowest.
  void expression(std::vector<std::string>& hosts) {
    const size_t start = pos_;
    std::vector<std::string> names{""};
    while (pos_ < list_.size() && list_[pos_] != ',') {
      const char c = list_[pos_];
      if (c == '[') {
        const auto group = bracket_group();
        std::vector<std::string> product;
        for (const auto& n : names) {
          for (const auto& g : group) {
            if (hosts.size() + product.size() >= kMaxSlurmHosts)
              fail(start, cat("it names more than ", kMaxSlurmHosts, " hosts"));
            product.push_back(n + g);
          }
        }
        names = std::move(product);
      } else if (c == ']') {
        fail(pos_, "']' without '['");
      } else if (is_name_char(c)) {
        for (auto& n : names) n += c;
        ++pos_;
      } else {
        fail(pos_, cat("unexpected '", c, "' (names use letters, digits, '.', '-' and '_')"));
      }
    }
    if (pos_ == start) fail(pos_, "empty host name");
    hosts.insert(hosts.end(), names.begin(), names.end());
  }

  // "[lo-hi,n,...]": the numbers it stands for, each zero-padded to the width of its range's low
  // end. On entry pos_ is at '['.
  std::vector<std::string> bracket_group() {
    const size_t open = pos_++;
    std::vector<std::string> out;
    for (;;) {
      if (pos_ == list_.size()) fail(open, "'[' without ']'");
      const size_t lo_at = pos_;
      const std::string lo = digits();
      if (lo.empty()) fail(pos_, "expected a number");
      std::string hi = lo;
      if (pos_ < list_.size() && list_[pos_] == '-') {
        ++pos_;
        hi = digits();
        if (hi.empty()) fail(pos_, "expected the number that ends the range");
      }
      const uint64_t a = number(lo, lo_at), b = number(hi, lo_at);
      if (a > b) fail(lo_at, cat("range ", lo, "-", hi, " runs backwards"));
      if (b - a >= kMaxSlurmHosts) fail(lo_at, cat("range ", lo, "-", hi, " is too long"));
      for (uint64_t v = a; v <= b; ++v) {
        std::string s = std::to_string(v);
        if (s.size() < lo.size()) s.insert(0, lo.size() - s.size(), '0');
        out.push_back(std::move(s));
        if (out.size() > kMaxSlurmHosts)
          fail(open, cat("it names more than ", kMaxSlurmHosts, " hosts"));
      }
      if (pos_ == list_.size()) fail(open, "'[' without ']'");
      if (list_[pos_] == ']') break;
      if (list_[pos_] != ',') fail(pos_, cat("unexpected '", list_[pos_], "' in brackets"));
      ++pos_;
    }
    ++pos_;  // ']'
    return out;
  }

  std::string digits() {
    const size_t start = pos_;
    while (pos_ < list_.size() && std::isdigit(static_cast<unsigned char>(list_[pos_]))) ++pos_;
    return list_.substr(start, pos_ - start);
  }

  uint64_t number(const std::string& s, size_t at) {
    if (s.size() > 18) fail(at, cat("number ", s, " is too large"));
    return std::strtoull(s.c_str(), nullptr, 10);
  }

  const std::string& list_;
  const std::string& variable_;
  size_t pos_ = 0;
};

// A non-negative decimal integer, or an error naming the variable and `fix`.
uint64_t parse_id(const char* name, const char* value, const char* fix) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(value, &end, 10);
  FSDP_CHECK(end != value && *end == '\0' && errno == 0 && value[0] != '-', name, "='", value,
             "' is not a Slurm id (a non-negative integer); ", fix);
  return v;
}

}  // namespace

std::vector<std::string> expand_slurm_hostlist(const std::string& list,
                                               const std::string& variable) {
  return HostlistParser(list, variable).parse();
}

int slurm_port(uint64_t job_id, uint64_t step_id) {
  // Unsigned arithmetic wraps modulo 2^64, a multiple of kSlurmPortCount: the formula holds for
  // every id, including Slurm's special step ids near 2^32.
  const uint64_t slot = uint64_t{kSlurmStepsPerJob} * job_id + step_id;
  return kSlurmPortBase + static_cast<int>(slot % kSlurmPortCount);
}

SlurmHost slurm_master_addr(const EnvLookup& env) {
  for (const char* var : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    if (const char* list = env(var)) return {expand_slurm_hostlist(list, var).front(), var};
  }
  throw Error(
      cat("ranks started by srun need the host of rank 0, but none of "
          "SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST is set and neither is "
          "MASTER_ADDR; ",
          kSetMasterAddr));
}

std::optional<SlurmPort> slurm_master_port(const EnvLookup& env) {
  const char* job = env("SLURM_JOB_ID");
  if (!job) return std::nullopt;
  const char* fix = "set MASTER_PORT to a free port, the same on every rank";
  const uint64_t job_id = parse_id("SLURM_JOB_ID", job, fix);
  const char* step = env("SLURM_STEP_ID");
  const uint64_t step_id = step ? parse_id("SLURM_STEP_ID", step, fix) : 0;
  return SlurmPort{slurm_port(job_id, step_id),
                   step ? "SLURM_JOB_ID and SLURM_STEP_ID" : "SLURM_JOB_ID"};
}

bool is_slurm_task(const EnvLookup& env) {
  const char* procid = env("SLURM_PROCID");
  const char* ntasks = env("SLURM_NTASKS");
  if (procid && env("SLURM_STEP_ID")) return true;
  char* end = nullptr;
  const long n = ntasks ? std::strtol(ntasks, &end, 10) : 0;
  if (ntasks && (*end != '\0' || end == ntasks)) return true;  // its parser names the bad value
  if (n <= 1) return false;
  const char* where = procid ? "SLURM_STEP_ID is not set: this process inherited SLURM_PROCID and "
                               "SLURM_NTASKS from a batch script"
                             : "SLURM_PROCID is not set: this process runs in the allocation "
                               "(a salloc shell)";
  throw Error(cat("SLURM_NTASKS=", n, " but ", where, " instead of being one of ", n,
                  " tasks started by srun. Start one process per task with srun (e.g. srun "
                  "build/bin/fsdp-train in the sbatch script or salloc shell), or unset "
                  "SLURM_NTASKS for a single process"));
}

}  // namespace fsdp::detail
