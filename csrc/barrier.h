// StepBarrier: one command at a time from the main process to N workers.
//
// Data flow (one round):
//   main:    post(kind, arg)      resets `done`, publishes the command, bumps
//                                 `generation` and wakes sleeping workers
//   workers: wait_command(...)    see the new generation, read (kind, arg)
//            ... do the work, write results into the segment ...
//            arrive(message)      release their writes (and count themselves
//                                 in `messages` if a pickled message follows);
//                                 the last of the N arrivals wakes the main
//                                 process
//   main:    wait_done(...)       returns once all N have arrived; every
//                                 write a worker made before arrive() is
//                                 visible
//
// The words live in the shared segment (BarrierWords, one cache line each so
// that workers spinning on `generation` do not slow the `done` counter).
// Who may call what: post() and wait_done() only the main process, one
// thread at a time; wait_command() and arrive() each worker, once a round.
//
// Waiting: a bounded spin, then a futex sleep (why: docs/design/waiting.md).
// Each process's object spins as its set_spin() says (csrc/wait_policy.h;
// shmvec/spin.py picks the caps).
#pragma once

#include <sched.h>

#include <atomic>
#include <cstdint>

#include "futex.h"
#include "wait_policy.h"

namespace shmvec {

struct alignas(64) PaddedWord {
  std::atomic<uint32_t> value;
  char pad[64 - sizeof(std::atomic<uint32_t>)];
};

struct alignas(64) BarrierWords {
  PaddedWord generation;       // futex: bumped by post(); workers sleep on it
  PaddedWord worker_sleepers;  // workers inside futex_wait on `generation`
  PaddedWord done;             // futex: arrivals this round; main sleeps on it
  PaddedWord main_sleeping;    // 1 while main is inside futex_wait on `done`
  PaddedWord command_kind;     // written before `generation` is bumped
  PaddedWord command_arg;
  PaddedWord messages;  // workers whose pickled message follows this round
};

enum class WaitStatus { kReady = 0, kTimedOut = 1, kError = 2 };

struct Command {
  uint32_t generation;
  uint32_t kind;
  uint32_t arg;
};

class StepBarrier {
 public:
  // `words` points into the segment; `num_workers` arrivals end a round.
  StepBarrier(BarrierWords* words, uint32_t num_workers) noexcept
      : w_(words), num_workers_(num_workers) {}

  // [main] Starts a round. The previous round must have completed.
  void post(uint32_t kind, uint32_t arg) noexcept;
  // [main] Waits for all arrivals of the current round; timeout_ns < 0 waits
  // for ever. kTimedOut leaves the round pending (call again to keep waiting).
  WaitStatus wait_done(int64_t timeout_ns) noexcept;
  // [main] Arrivals so far in the current round.
  uint32_t arrived() const noexcept;
  // [main] Workers that arrived with message=true this round: when 0, the
  // main process need not look at any worker's own words.
  uint32_t messages() const noexcept {
    return w_->messages.value.load(std::memory_order_acquire);
  }
  // [any] The current generation, without waiting.
  uint32_t generation() const noexcept {
    return w_->generation.value.load(std::memory_order_acquire);
  }

  // [worker] Waits for a generation other than `last_generation`.
  WaitStatus wait_command(uint32_t last_generation, int64_t timeout_ns,
                          Command* out) noexcept;
  // [waiter] How this object's waits spin: up to cap_ns, learning from the
  // gaps seen if adaptive (csrc/wait_policy.h). Default: no spin.
  void set_spin(int64_t cap_ns, bool adaptive) noexcept { spin_.set(cap_ns, adaptive); }
  // [worker] Ends this worker's part of the round; `message`: a pickled
  // message of this round follows on the worker's pipe. The last arrival
  // wakes a sleeping main process.
  void arrive(bool message = false) noexcept;

 private:
  BarrierWords* w_;
  uint32_t num_workers_;
  // The spin of whoever waits on this object: main in wait_done, a worker in
  // wait_command (each process has its own StepBarrier over the words).
  AdaptiveSpin spin_;
};

// Waits until ready(word) holds: spins for up to spin_ns, then sleeps on the
// futex, counting itself in `sleepers` so that wakers can skip the syscall
// when nobody sleeps. A waker must store to `word` (seq_cst) *then* read
// `sleepers`; this function increments `sleepers` *then* re-reads `word`, so
// at least one side sees the other (no lost wake-up). `o` records what the
// wait saw, for AdaptiveSpin::learn().
template <class Ready>
WaitStatus spin_then_sleep(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleepers,
                           Ready ready, int64_t spin_ns, int64_t timeout_ns,
                           WaitOutcome& o) noexcept {
  o = WaitOutcome{};
  if (ready(word.load(std::memory_order_acquire))) return WaitStatus::kReady;
  const int64_t start = monotonic_ns();
  if (spin_ns > 0) {
    // Every 64 pauses (~3 us): read the clock (~20 ns) and sched_yield(), so
    // that a spinner hands its core to a runnable peer (a no-op otherwise).
    for (uint32_t i = 1;; ++i) {
      cpu_relax();
      if (ready(word.load(std::memory_order_acquire))) {
        o.waited_ns = monotonic_ns() - start;
        return WaitStatus::kReady;
      }
      if ((i & 63) == 0) {
        if (monotonic_ns() - start >= spin_ns) break;
        sched_yield();
      }
    }
  }
  o.slept = true;
  for (;;) {
    int64_t remaining = -1;
    if (timeout_ns >= 0) {
      remaining = timeout_ns - (monotonic_ns() - start);
      if (remaining <= 0) {
        o.waited_ns = monotonic_ns() - start;
        o.timed_out = true;
        return WaitStatus::kTimedOut;
      }
    }
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t seen = word.load(std::memory_order_seq_cst);
    FutexResult r = FutexResult::kValueChanged;
    if (!ready(seen)) r = futex_wait(&word, seen, remaining);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (ready(word.load(std::memory_order_acquire))) {
      o.waited_ns = monotonic_ns() - start;
      return WaitStatus::kReady;
    }
    if (r == FutexResult::kError) return WaitStatus::kError;
    // kWoken / kValueChanged / kInterrupted / kTimedOut: loop re-checks the
    // deadline, so a timeout that raced with a wake-up is not lost either.
  }
}

// Every waiter's wait: spin_then_sleep with the spin `spin` allows, then
// `spin` learns from it.
template <class Ready>
WaitStatus adaptive_wait(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleepers,
                         Ready ready, AdaptiveSpin& spin, int64_t timeout_ns) noexcept {
  WaitOutcome outcome;
  WaitStatus status =
      spin_then_sleep(word, sleepers, ready, spin.budget_ns(), timeout_ns, outcome);
  spin.learn(outcome);
  return status;
}

}  // namespace shmvec
