#include "core/faults.h"

namespace fsdp::detail::faults {
namespace {
Faults g_active;  // only a test's inject() changes it
}  // namespace

const Faults& active() { return g_active; }
void inject(const Faults& f) { g_active = f; }

}  // namespace fsdp::detail::faults
