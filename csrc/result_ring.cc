#include "result_ring.h"

#include <sched.h>

#include <climits>

namespace shmvec {

RowRef ResultRing::claim() noexcept {
  // acq_rel, not relaxed: the chain of claims orders main's reads of a row
  // before the writes of the worker that reuses it one lap later
  // (docs/design/protocol.md; TSan checks it in csrc/tests/core_test.cc).
  uint64_t n = header_->claimed.fetch_add(1, std::memory_order_acq_rel);
  return RowRef{uint32_t((n / batch_size_) % num_slots_), uint32_t(n % batch_size_)};
}

void ResultRing::publish(uint32_t slot) noexcept {
  // seq_cst: releases the row's results, and orders the add before the read
  // of main_sleeping (see spin_then_sleep).
  uint32_t now = filled_[slot].value.fetch_add(1, std::memory_order_seq_cst) + 1;
  if (now == batch_size_ &&
      header_->main_sleeping.value.load(std::memory_order_seq_cst) != 0) {
    futex_wake(&filled_[slot].value, 1);
    if (header_->main_handoff.value.load(std::memory_order_relaxed) != 0) {
      sched_yield();
    }
  }
}

WaitStatus ResultRing::wait_full(uint32_t slot, int64_t timeout_ns) noexcept {
  const uint32_t target = batch_size_;
  return adaptive_wait(
      filled_[slot].value, header_->main_sleeping.value,
      [target](uint32_t filled) { return filled >= target; }, spin_, timeout_ns);
}

void ResultRing::set_handoff(bool on) noexcept {
  header_->main_handoff.value.store(on ? 1 : 0, std::memory_order_relaxed);
}

uint32_t ResultRing::filled(uint32_t slot) const noexcept {
  return filled_[slot].value.load(std::memory_order_acquire);
}

uint64_t ResultRing::claimed() const noexcept {
  return header_->claimed.load(std::memory_order_acquire);
}

void ResultRing::release(uint32_t slot) noexcept {
  filled_[slot].value.store(0, std::memory_order_release);
}

void ResultRing::pad(uint32_t slot, uint32_t rows) noexcept {
  // seq_cst, as publish: if the workers' last publish comes after this add, it
  // is the one that sees batch_size and wakes main.
  filled_[slot].value.fetch_add(rows, std::memory_order_seq_cst);
}

void ResultRing::unpad(uint32_t slot, uint32_t rows) noexcept {
  filled_[slot].value.fetch_sub(rows, std::memory_order_seq_cst);
}

void ResultRing::skip(uint32_t rows) noexcept {
  // acq_rel: one link of the chain of claims, as claim's.
  header_->claimed.fetch_add(rows, std::memory_order_acq_rel);
}

uint32_t ResultRing::close(uint64_t first) noexcept {
  const uint64_t end = first + batch_size_;
  uint64_t n = header_->claimed.load(std::memory_order_acquire);
  while (n > first && n < end) {
    // acq_rel: one link of the chain of claims, as claim's; a claim between
    // the load and here fails the exchange, which then retries with its count.
    if (header_->claimed.compare_exchange_weak(n, end, std::memory_order_acq_rel,
                                               std::memory_order_acquire)) {
      return uint32_t(n - first);
    }
  }
  return n <= first ? 0 : batch_size_;
}

void Doorbell::ring() noexcept {
  w_->rings.value.fetch_add(1, std::memory_order_seq_cst);
  if (w_->sleepers.value.load(std::memory_order_seq_cst) != 0) {
    futex_wake(&w_->rings.value, 1);
  }
}

WaitStatus Doorbell::wait(uint32_t last, int64_t timeout_ns, uint32_t* out) noexcept {
  WaitStatus status = adaptive_wait(
      w_->rings.value, w_->sleepers.value,
      [last](uint32_t rings) { return rings != last; }, spin_, timeout_ns);
  *out = w_->rings.value.load(std::memory_order_acquire);
  return status;
}

}  // namespace shmvec
