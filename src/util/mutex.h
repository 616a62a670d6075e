// A mutex and its scoped lock that clang's thread-safety analysis understands (-Wthread-safety,
// `make thread-safety`): members marked FSDP_GUARDED_BY(mu) may be touched only with mu held,
// functions marked FSDP_REQUIRES(mu) only be called with it held. Other compilers see a plain
// std::mutex and no attributes.
#pragma once

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#if defined(__clang__)
#define FSDP_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define FSDP_THREAD_ANNOTATION(x)
#endif

#define FSDP_CAPABILITY(x) FSDP_THREAD_ANNOTATION(capability(x))
#define FSDP_SCOPED_CAPABILITY FSDP_THREAD_ANNOTATION(scoped_lockable)
#define FSDP_GUARDED_BY(x) FSDP_THREAD_ANNOTATION(guarded_by(x))
#define FSDP_PT_GUARDED_BY(x) FSDP_THREAD_ANNOTATION(pt_guarded_by(x))
#define FSDP_REQUIRES(...) FSDP_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define FSDP_EXCLUDES(...) FSDP_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define FSDP_ACQUIRE(...) FSDP_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define FSDP_RELEASE(...) FSDP_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define FSDP_RETURN_CAPABILITY(x) FSDP_THREAD_ANNOTATION(lock_returned(x))
#define FSDP_NO_THREAD_SAFETY_ANALYSIS FSDP_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace fsdp::detail {

class FSDP_CAPABILITY("mutex") Mutex {
 public:
  void lock() FSDP_ACQUIRE() { mu_.lock(); }
  void unlock() FSDP_RELEASE() { mu_.unlock(); }
  // For std::condition_variable, which needs the std::mutex itself.
  std::mutex& native() { return mu_; }
  // Tells the analysis that the caller holds this mutex where it cannot see the lock (a callback
  // that its caller runs under it); checks nothing at run time.
  void assert_held() const FSDP_THREAD_ANNOTATION(assert_capability(this)) {}

 private:
  std::mutex mu_;
};

// A Mutex for entry points that must not nest: locking it again on the thread that holds it
// throws std::logic_error (which names the mutex) instead of deadlocking, so a call path that
// re-enters shows up as an error in tests rather than a hang in a training run.
class FSDP_CAPABILITY("mutex") EntryMutex {
 public:
  explicit EntryMutex(const char* name) : name_(name) {}
  void lock() FSDP_ACQUIRE() {
    if (owner_.load(std::memory_order_relaxed) == std::this_thread::get_id())
      throw std::logic_error(std::string("internal error: ") + name_ +
                             " was entered again on the thread that holds it");
    mu_.lock();
    owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  }
  void unlock() FSDP_RELEASE() {
    owner_.store(std::thread::id(), std::memory_order_relaxed);
    mu_.unlock();
  }

 private:
  std::mutex mu_;
  std::atomic<std::thread::id> owner_{};
  const char* name_;
};

template <class M>
class FSDP_SCOPED_CAPABILITY BasicMutexLock {
 public:
  explicit BasicMutexLock(M& mu) FSDP_ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~BasicMutexLock() FSDP_RELEASE() { mu_.unlock(); }
  BasicMutexLock(const BasicMutexLock&) = delete;
  BasicMutexLock& operator=(const BasicMutexLock&) = delete;

 private:
  M& mu_;
};
using MutexLock = BasicMutexLock<Mutex>;
using EntryLock = BasicMutexLock<EntryMutex>;

}  // namespace fsdp::detail
