#include "futex.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <ctime>

namespace shmvec {

static_assert(sizeof(std::atomic<uint32_t>) == 4, "futex words are 32 bits");
static_assert(std::atomic<uint32_t>::is_always_lock_free,
              "futex words must be plain memory");

int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

FutexResult futex_wait(std::atomic<uint32_t>* word, uint32_t expected,
                       int64_t timeout_ns) {
  timespec ts;
  timespec* tsp = nullptr;
  if (timeout_ns >= 0) {
    ts.tv_sec = timeout_ns / 1000000000LL;
    ts.tv_nsec = timeout_ns % 1000000000LL;
    tsp = &ts;  // FUTEX_WAIT takes a relative CLOCK_MONOTONIC timeout
  }
  long rc = syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected,
                    tsp, nullptr, 0);
  if (rc == 0) return FutexResult::kWoken;
  switch (errno) {
    case EAGAIN:
      return FutexResult::kValueChanged;
    case ETIMEDOUT:
      return FutexResult::kTimedOut;
    case EINTR:
      return FutexResult::kInterrupted;
    default:
      return FutexResult::kError;
  }
}

int futex_wake(std::atomic<uint32_t>* word, int count) {
  long rc = syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, count,
                    nullptr, nullptr, 0);
  return rc < 0 ? -1 : int(rc);
}

}  // namespace shmvec
