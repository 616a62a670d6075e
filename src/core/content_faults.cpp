#include "core/content_faults.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>

#include <atomic>

namespace fsdp::detail::content_faults {
namespace {
Fault g_active;  // only a test's inject() changes it
std::atomic<int64_t> g_flips{0};
}  // namespace

int64_t flips() { return g_flips.load(); }

const Fault& active() { return g_active; }
void inject(const Fault& f) { g_active = f; }

int64_t flip(const Fault& f, const std::vector<at::Tensor>& pieces) {
  int64_t total = 0;
  for (const auto& p : pieces) total += p.numel();
  if (total == 0) return -1;
  const int64_t element = ((f.element % total) + total) % total;
  int64_t at = 0;
  for (const auto& p : pieces) {
    if (element < at + p.numel()) {
      FSDP_CHECK(p.is_cpu() && p.is_contiguous(),
                 "internal: content faults flip bits of contiguous CPU payloads only");
      const int64_t size = static_cast<int64_t>(p.element_size());
      const int bit = ((f.bit % (8 * size)) + 8 * size) % (8 * static_cast<int>(size));
      // Little-endian: bit k of the element is bit k % 8 of its byte k / 8.
      auto* bytes = static_cast<uint8_t*>(p.data_ptr()) + (element - at) * size + bit / 8;
      *bytes ^= static_cast<uint8_t>(1u << (bit % 8));
      g_flips.fetch_add(1);
      return element;
    }
    at += p.numel();
  }
  return -1;
}

}  // namespace fsdp::detail::content_faults
