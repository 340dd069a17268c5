// AdaptiveSpin: how long one waiter spins before it sleeps on its futex,
// learned from the gaps it actually sees (or fixed, when set so).
//
// Data flow: a waiter (the main process in wait_done/wait_full, a worker in
// wait_command/Doorbell::wait) asks budget_ns() before each wait, spins for
// that long, then sleeps; after the wait it reports what happened to learn().
// Each waiter owns its AdaptiveSpin (process-local memory, never shared), so
// no atomics: only the thread that waits on the object may call it.
//
// The rule is that of guest halt-polling (Linux's haltpoll cpuidle governor)
// and glibc's adaptive mutex, applied to the gap between "started waiting"
// and "ready":
//   - ready while spinning: the budget drifts (1/8 per wait) toward twice
//     the gap, so it follows the gaps down as well as up;
//   - slept, and the gap was within the cap: spinning would have caught it,
//     so the budget grows to cover 1.5x that gap (at least doubling);
//   - slept through a gap longer than the cap: shrink (halve), and drop to 0
//     after a timeout or a gap far beyond the cap (the vector env is idle,
//     the user is doing something else): an idle waiter burns no core.
// Why spin at all, and the measurements: docs/design/waiting.md.
#pragma once

#include <algorithm>
#include <cstdint>

namespace shmvec {

// What one wait saw, for AdaptiveSpin::learn().
struct WaitOutcome {
  int64_t waited_ns = 0;  // from the start of the wait to ready (or timeout)
  bool slept = false;     // it went to sleep on the futex at least once
  bool timed_out = false;
};

class AdaptiveSpin {
 public:
  // Smallest budget a grow step sets: below ~10 us the clock reads and
  // yields of the spin loop (every ~3 us) cost more than they catch.
  static constexpr int64_t kMinGrowNs = 10'000;
  // A gap beyond this many caps means idle: stop spinning at once.
  static constexpr int64_t kIdleCaps = 4;

  // The longest spin (0: never spin). adaptive: the budget learns from the
  // gaps seen, starting at min(cap, 50 us); otherwise every wait spins cap_ns.
  void set(int64_t cap_ns, bool adaptive) noexcept {
    cap_ns_ = std::max<int64_t>(cap_ns, 0);
    adaptive_ = adaptive;
    budget_ns_ = adaptive ? std::min<int64_t>(cap_ns_, 50'000) : cap_ns_;
  }
  int64_t cap_ns() const noexcept { return cap_ns_; }
  int64_t budget_ns() const noexcept { return budget_ns_; }

  void learn(const WaitOutcome& o) noexcept {
    if (!adaptive_ || cap_ns_ == 0) return;
    if (o.timed_out || o.waited_ns > kIdleCaps * cap_ns_) {
      budget_ns_ = 0;
    } else if (!o.slept) {
      const int64_t target = std::min(cap_ns_, 2 * o.waited_ns);
      budget_ns_ += (target - budget_ns_) / 8;
    } else if (o.waited_ns <= cap_ns_) {
      const int64_t grown =
          std::max({2 * budget_ns_, o.waited_ns + o.waited_ns / 2, kMinGrowNs});
      budget_ns_ = std::min(cap_ns_, grown);
    } else {
      budget_ns_ /= 2;
    }
  }

 private:
  int64_t cap_ns_ = 0;
  bool adaptive_ = false;
  int64_t budget_ns_ = 0;
};

}  // namespace shmvec
