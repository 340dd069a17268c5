#include "barrier.h"

#include <signal.h>

#include <cerrno>
#include <climits>

namespace shmvec {
namespace {

// How the words name a CPU: 1 + the calling thread's CPU (0: unknown).
uint32_t cpu_word() noexcept { return static_cast<uint32_t>(sched_getcpu() + 1); }

}  // namespace

void StepBarrier::post(uint32_t kind, uint32_t arg) noexcept {
  w_->done.value.store(0, std::memory_order_relaxed);
  w_->messages.value.store(0, std::memory_order_relaxed);
  w_->command_kind.value.store(kind, std::memory_order_relaxed);
  w_->command_arg.value.store(arg, std::memory_order_relaxed);
  // seq_cst: orders the bump before the read of worker_sleepers (see
  // spin_then_sleep), and releases the command words and the action slab.
  w_->generation.value.fetch_add(1, std::memory_order_seq_cst);
  if (w_->worker_sleepers.value.load(std::memory_order_seq_cst) != 0) {
    futex_wake(&w_->generation.value, INT_MAX);
  }
}

WaitStatus StepBarrier::wait_done(int64_t spin_ns, int64_t timeout_ns) noexcept {
  const uint32_t target = num_workers_;
  // Stored only when it changes: workers read the word at every wait.
  const uint32_t cpu = cpu_word();
  if (w_->main_cpu.value.load(std::memory_order_relaxed) != cpu) {
    w_->main_cpu.value.store(cpu, std::memory_order_relaxed);
  }
  return adaptive_wait(
      w_->done.value, w_->main_sleeping.value,
      [target](uint32_t done) { return done >= target; }, spin_, spin_ns, timeout_ns);
}

uint32_t StepBarrier::arrived() const noexcept {
  return w_->done.value.load(std::memory_order_acquire);
}

// A worker waiting for a command on the CPU main sleeps on: while it spins it
// is main's neighbour, and wakes main as soon as the round it arrived in is
// done (arrive() leaves that to it). One neighbour at a time.
class MainNeighbour {
 public:
  MainNeighbour(StepBarrier* barrier, uint32_t round) noexcept : b_(barrier), round_(round) {
    const uint32_t cpu = b_->w_->main_cpu.value.load(std::memory_order_relaxed);
    if (cpu == 0 || cpu != cpu_word()) return;
    uint32_t none = 0;
    active_ = b_->w_->main_neighbour.value.compare_exchange_strong(none, b_->pid_,
                                                                   std::memory_order_seq_cst);
  }
  void poll() noexcept {
    if (active_) wake_main_if_done();
  }
  // seq_cst: this store, then the read of `done` (arrive() stores `done`,
  // then reads main_neighbour): either the last arrival sees no neighbour
  // and wakes main itself, or this worker sees the arrival.
  void stop() noexcept {
    if (!active_) return;
    active_ = false;
    b_->w_->main_neighbour.value.store(0, std::memory_order_seq_cst);
    wake_main_if_done();
  }

 private:
  void wake_main_if_done() noexcept {
    if (b_->w_->done.value.load(std::memory_order_seq_cst) >= b_->num_workers_ &&
        b_->w_->main_sleeping.value.load(std::memory_order_seq_cst) != 0) {
      if (b_->wake_main(round_)) {
        b_->w_->neighbour_wakes.value.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  StepBarrier* b_;
  uint32_t round_;
  bool active_ = false;
};

WaitStatus StepBarrier::wait_command(uint32_t last_generation, int64_t spin_ns,
                                     int64_t timeout_ns, Command* out) noexcept {
  MainNeighbour neighbour(this, last_generation);
  WaitStatus status = adaptive_wait(
      w_->generation.value, w_->worker_sleepers.value,
      [last_generation](uint32_t g) { return g != last_generation; }, spin_, spin_ns,
      timeout_ns, neighbour);
  neighbour.stop();
  if (status == WaitStatus::kReady) {
    // The acquire load in spin_then_sleep saw the bump, so these relaxed
    // loads see the words stored before it.
    out->generation = w_->generation.value.load(std::memory_order_acquire);
    out->kind = w_->command_kind.value.load(std::memory_order_relaxed);
    out->arg = w_->command_arg.value.load(std::memory_order_relaxed);
  }
  return status;
}

void StepBarrier::arrive(bool message) noexcept {
  // The round this arrival belongs to, read before it counts: once the round
  // is done main may end it by itself (it read `done` before it slept, or its
  // wait timed out) and post the next, whose wake-up a claim made under the
  // new number would then swallow.
  const uint32_t round = w_->generation.value.load(std::memory_order_relaxed);
  // Released by the seq_cst fetch_add below, acquired with `done` by main.
  if (message) w_->messages.value.fetch_add(1, std::memory_order_relaxed);
  uint32_t now = w_->done.value.fetch_add(1, std::memory_order_seq_cst) + 1;
  if (now != num_workers_ || w_->main_sleeping.value.load(std::memory_order_seq_cst) == 0) {
    return;
  }
  const uint32_t cpu = w_->main_cpu.value.load(std::memory_order_relaxed);
  const uint32_t neighbour = w_->main_neighbour.value.load(std::memory_order_seq_cst);
  if (neighbour != 0 && cpu != cpu_word()) {
    // Until the neighbour took the wake-up over, or main woke by itself (it
    // then sees `done` before it sleeps again: see spin_then_sleep).
    const int64_t start = monotonic_ns();
    for (uint32_t i = 1; w_->main_wake_claim.value.load(std::memory_order_acquire) != round; ++i) {
      cpu_relax();
      if (w_->main_sleeping.value.load(std::memory_order_seq_cst) == 0) return;
      if ((i & 15) == 0 && monotonic_ns() - start >= neighbour_wait_ns_) {
        // A neighbour that died while it spun would make every such round wait.
        uint32_t dead = neighbour;
        if (kill(static_cast<pid_t>(neighbour), 0) != 0 && errno == ESRCH) {
          w_->main_neighbour.value.compare_exchange_strong(dead, 0, std::memory_order_seq_cst);
        }
        break;
      }
    }
  }
  wake_main(round);
}

bool StepBarrier::wake_main(uint32_t round) noexcept {
  uint32_t claimed = w_->main_wake_claim.value.load(std::memory_order_relaxed);
  if (claimed == round || !w_->main_wake_claim.value.compare_exchange_strong(
                              claimed, round, std::memory_order_acq_rel)) {
    return false;
  }
  futex_wake(&w_->done.value, 1);
  return true;
}

}  // namespace shmvec
