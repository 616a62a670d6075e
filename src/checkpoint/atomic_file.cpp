#include "checkpoint/atomic_file.h"

#include <fcntl.h>
#include <fsdp/error.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

namespace fsdp {

using detail::cat;

namespace {

std::string errno_text() { return std::strerror(errno); }

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw Error(cat("'", path, "': ", what));
}

std::string dir_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// The pid of a "<name>.tmp.<pid>" file name, or -1.
long temporary_pid(const std::string& name) {
  const auto at = name.rfind(".tmp.");
  if (at == std::string::npos || at == 0) return -1;
  const std::string digits = name.substr(at + 5);
  if (digits.empty() || digits.size() > 9 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  return std::stol(digits);
}

bool process_alive(long pid) { return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM; }

}  // namespace

void write_all(int fd, const void* data, uint64_t len, const std::string& path) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (len > 0) {
    ssize_t n = ::write(fd, p, std::min<uint64_t>(len, 1ull << 30));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(path, cat("write failed: ", errno_text(), " (disk full or read-only?)"));
    p += n;
    len -= static_cast<uint64_t>(n);
  }
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail(dir, cat("cannot open directory to fsync it: ", errno_text()));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) {
    errno = err;
    fail(dir, cat("fsync of the directory failed: ", errno_text()));
  }
}

std::string temporary_path(const std::string& path) { return cat(path, ".tmp.", ::getpid()); }

void atomic_write(const std::string& path,
                  const std::function<void(int fd, const std::string& tmp_path)>& body) {
  const std::string tmp = temporary_path(path);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    fail(tmp, cat("cannot create: ", errno_text(), "; check the directory exists and is writable"));
  try {
    body(fd, tmp);
    if (::fsync(fd) != 0) fail(tmp, cat("fsync failed: ", errno_text()));
    int rc = ::close(fd);
    fd = -1;
    if (rc != 0) fail(tmp, cat("close failed: ", errno_text()));
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      fail(path, cat("rename from '", tmp, "' failed: ", errno_text()));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_dir(dir_of(path));
}

void write_text_atomic(const std::string& path, const std::string& text) {
  atomic_write(
      path, [&](int fd, const std::string& tmp) { write_all(fd, text.data(), text.size(), tmp); });
}

std::vector<std::string> remove_stale_temporaries(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> removed;
  std::error_code ec;
  for (const auto& ent : fs::directory_iterator(dir, ec)) {
    const long pid = temporary_pid(ent.path().filename().string());
    if (pid <= 0 || process_alive(pid) || !ent.is_regular_file(ec)) continue;
    if (fs::remove(ent.path(), ec)) removed.push_back(ent.path().string());
  }
  return removed;
}

}  // namespace fsdp
