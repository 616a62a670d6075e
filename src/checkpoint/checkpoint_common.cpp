#include "checkpoint/checkpoint_common.h"

#include <fsdp/fully_shard.h>

#include "comm/communicator_impl.h"

namespace fsdp::checkpoint::internal {

using fsdp::detail::cat;

void refuse_elastic(const FSDPModule& root, const char* what) {
  const auto& replicas = root.replicate_communicator();
  FSDP_CHECK(!replicas || !replicas->impl().loss, what,
             ": the model's replicas are elastic (fsdp/elastic.h), and checkpoints of elastic "
             "replicas are not supported yet (which replica writes, and whether its write "
             "completed, would be decided over a lane that a replica's death stands in for); a "
             "replica that dies is replaced from a survivor's state instead");
}

std::string step_dir_name(int64_t step) {
  std::string s = std::to_string(step);
  if (s.size() < 8) s.insert(0, 8 - s.size(), '0');
  return "step_" + s;
}

std::string join(const std::vector<std::string>& names, size_t max) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < max; ++i)
    s += (i ? ", " : "") + ("'" + names[i] + "'");
  if (names.size() > max) s += cat(", ... (", names.size() - max, " more)");
  return s;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

bool is_buffer_entry(const IndexEntry& e) {
  return e.replicated && e.name.find("::") == std::string::npos;
}

}  // namespace fsdp::checkpoint::internal
