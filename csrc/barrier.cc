#include "barrier.h"

#include <climits>

namespace shmvec {

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

WaitStatus StepBarrier::wait_done(int64_t timeout_ns) noexcept {
  const uint32_t target = num_workers_;
  return adaptive_wait(
      w_->done.value, w_->main_sleeping.value,
      [target](uint32_t done) { return done >= target; }, spin_, timeout_ns);
}

uint32_t StepBarrier::arrived() const noexcept {
  return w_->done.value.load(std::memory_order_acquire);
}

WaitStatus StepBarrier::wait_command(uint32_t last_generation, int64_t timeout_ns,
                                     Command* out) noexcept {
  WaitStatus status = adaptive_wait(
      w_->generation.value, w_->worker_sleepers.value,
      [last_generation](uint32_t g) { return g != last_generation; }, spin_, timeout_ns);
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
  // Released by the seq_cst fetch_add below, acquired with `done` by main.
  if (message) w_->messages.value.fetch_add(1, std::memory_order_relaxed);
  // seq_cst: this count, then the read of main_sleeping (see spin_then_sleep).
  const uint32_t now = w_->done.value.fetch_add(1, std::memory_order_seq_cst) + 1;
  if (now == num_workers_ &&
      w_->main_sleeping.value.load(std::memory_order_seq_cst) != 0) {
    futex_wake(&w_->done.value, 1);
  }
}

}  // namespace shmvec
