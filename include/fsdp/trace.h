// Per-process timeline of spans, written as Chrome trace JSON (opens in Perfetto and
// chrome://tracing). Off by default; when off, recording costs one relaxed atomic load.
//
// fsdp-cpp records: each group's forward and backward compute ("compute" track), every all-gather
// and reduce-scatter from issue to completion (one track per communication lane), every wait on
// the calling thread's track, and the calling thread's copies into and out of communication
// buffers (category "copy": copy-in of shards, packing of gradients, copy-out of results). Programs
// add their own spans (the optimizer step) with Span.
// Thread-safety: all functions may be called from any thread.
#pragma once

#include <cstdint>
#include <string>

namespace fsdp::trace {

void enable(bool on);
bool enabled();
int64_t now_us();  // microseconds on a monotonic clock

// A finished span on `track` (a named row of the timeline).
void complete(const std::string& name, const std::string& category, int64_t start_us,
              int64_t duration_us, const std::string& track = "compute");

// RAII span on `track`.
class Span {
 public:
  Span(std::string name, std::string category, std::string track = "compute");
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  std::string name_, category_, track_;
  int64_t start_ = -1;
};

// Writes everything recorded so far as {"traceEvents": [...]} with pid = rank; returns the number
// of events. Throws fsdp::Error when the file cannot be written.
size_t write_chrome_json(const std::string& path, int rank);
void clear();

}  // namespace fsdp::trace
