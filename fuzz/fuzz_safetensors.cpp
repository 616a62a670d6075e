// libFuzzer target: the safetensors header parser and the range reader on untrusted bytes.
// Input: a whole file. Every successful parse must yield offsets inside the input (each tensor's
// bytes are copied out of the exact-size input buffer, so ASan reports any out-of-bounds range),
// and File::open on the same bytes (through a memfd) must agree with the in-memory parse.
// Build and run: scripts/fuzz.sh (docs/checkpoint.md).
#include <fsdp/error.h>
#include <fsdp/safetensors.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace st = fsdp::safetensors;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static int fd = memfd_create("fuzz_safetensors", 0);
  bool parsed = false;
  st::Header h;
  try {
    h = st::parse_header(data, size, size, "fuzz-input");
    parsed = true;
  } catch (const fsdp::Error&) {
  }
  if (parsed) {
    std::vector<uint8_t> buf;
    for (const auto& t : h.tensors) {
      int64_t rows = t.rows();
      for (auto [b, e] : {std::pair<int64_t, int64_t>{0, rows}, {rows / 2, rows}, {0, rows / 3}}) {
        auto r = st::row_range(h, t, b, e, "fuzz-input");
        if (r.end > size || r.begin > r.end) std::abort();  // a validated range left the input
        buf.resize(r.end - r.begin);
        if (!buf.empty()) std::memcpy(buf.data(), data + r.begin, buf.size());
      }
    }
  }
  // The file path: same verdict as the in-memory parse.
  if (fd >= 0 && ftruncate(fd, 0) == 0 && pwrite(fd, data, size, 0) == static_cast<ssize_t>(size)) {
    bool opened = false;
    try {
      auto f = st::File::open("/proc/self/fd/" + std::to_string(fd));
      opened = true;
      for (const auto& t : f->header().tensors) {
        std::vector<uint8_t> out(t.bytes());
        f->read_all(t.name, out.data(), out.size());
        if (t.bytes() &&
            std::memcmp(out.data(), data + f->header().data_start + t.begin, t.bytes()))
          std::abort();
      }
    } catch (const fsdp::Error&) {
    }
    if (opened != parsed) std::abort();
  }
  return 0;
}
