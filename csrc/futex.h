// Thin wrappers around the Linux futex syscall on 32-bit words that live in
// memory shared between processes.
//
// The words are used through std::atomic<uint32_t>; the futexes are *shared*
// (no FUTEX_PRIVATE_FLAG) because the waiter and the waker are different
// processes mapping the same memfd. Any thread of any process may call these.
#pragma once

#include <atomic>
#include <cstdint>

namespace shmvec {

enum class FutexResult {
  kWoken,         // woken by futex_wake (or spuriously): re-check the word
  kValueChanged,  // the word no longer held `expected` when the kernel looked
  kTimedOut,      // the timeout elapsed
  kInterrupted,   // a signal arrived (EINTR): re-check and, if needed, retry
  kError,         // any other errno (EFAULT, EINVAL, ENOSYS): a bug or a sandbox
};

// Sleeps while *word == expected, for at most timeout_ns (< 0: no limit).
FutexResult futex_wait(std::atomic<uint32_t>* word, uint32_t expected,
                       int64_t timeout_ns);

// Wakes up to `count` waiters of `word`; returns how many were woken, or -1
// on error (the errno is left in errno).
int futex_wake(std::atomic<uint32_t>* word, int count);

// CLOCK_MONOTONIC in nanoseconds.
int64_t monotonic_ns();

// One iteration of a busy-wait: a PAUSE on x86 so that the sibling
// hyper-thread and the memory bus are not hammered.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace shmvec
