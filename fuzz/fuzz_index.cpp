// libFuzzer target: the checkpoint index parser (index.json is untrusted). A parsed index must
// serialise and parse again to the same content (no validator/serialiser disagreement).
// Build and run: scripts/fuzz.sh (docs/checkpoint.md).
#include <fsdp/checkpoint_index.h>
#include <fsdp/error.h>

#include <cstdint>
#include <cstdlib>
#include <string>

namespace ck = fsdp::checkpoint;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  ck::Index idx;
  try {
    idx = ck::parse_index(text, "fuzz-index");
  } catch (const fsdp::Error&) {
    return 0;
  }
  std::string again = ck::index_to_json(idx);
  ck::Index back;
  try {
    back = ck::parse_index(again, "fuzz-index-roundtrip");
  } catch (const fsdp::Error&) {
    std::abort();  // we wrote something our own parser rejects
  }
  if (ck::index_to_json(back) != again) std::abort();
  for (const auto& f : back.files) {
    if (f.name.find('/') != std::string::npos) std::abort();  // never a path outside the directory
  }
  return 0;
}
