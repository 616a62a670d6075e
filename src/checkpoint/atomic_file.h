// Atomic, durable file writes: the one implementation used by the checkpoint writer, the index and
// (for the trainer) any file that must never be seen half-written. Torch-free.
//
// Protocol: the bytes go to "<path>.tmp.<pid>" in the same directory, which is fsynced, closed and
// renamed over <path>, then the directory is fsynced. A failure removes the temporary and throws
// fsdp::Error naming the file, what failed and what to check; <path> is then untouched. A process
// killed mid-write leaves its "<path>.tmp.<pid>"; remove_stale_temporaries() clears those.
//
// Thread-safety: reentrant; two writers of the same path in one process race on the temporary.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp {

// Writes through `body(fd, tmp_path)` (which writes with write_all) and commits as above.
void atomic_write(const std::string& path,
                  const std::function<void(int fd, const std::string& tmp_path)>& body);
// atomic_write of a whole string.
void write_text_atomic(const std::string& path, const std::string& text);
// Writes all `len` bytes to `fd`, retrying on EINTR; throws naming `path` (disk full, ...).
void write_all(int fd, const void* data, uint64_t len, const std::string& path);
// fsync of a directory, so that a rename in it survives a power loss.
void fsync_dir(const std::string& dir);

// The temporary atomic_write() uses for `path` in this process.
std::string temporary_path(const std::string& path);
// Removes the "<name>.tmp.<pid>" files directly in `dir` whose pid is not a live process on this
// host (killed writers); returns their paths. A live pid's file is kept (a write in progress).
// REQUIRES: no writer on another host shares `dir` (pids are per host).
std::vector<std::string> remove_stale_temporaries(const std::string& dir);

}  // namespace fsdp
