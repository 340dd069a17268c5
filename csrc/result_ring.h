// The async engine's two primitives: a result ring that workers fill in
// arrival order, and a doorbell per worker.
//
// Data flow (batch_size < num_envs):
//   main:    writes actions of some envs and their env commands (one byte
//            per env, shmvec/protocol.py), and rings the doorbell of each
//            worker that owns one of them
//   worker:  wait() on its doorbell; steps each env with a new action; for
//            each, claim() the next row of the ring, writes the results and
//            the env id there, and publish()es the row; the publish that
//            fills a slot wakes the main process
//   main:    wait_full(slot) returns once the slot's batch_size rows are
//            published; reads them; release(slot) hands the slot back
//
// A batch of fewer rows (recv(partial=True), when only n < batch_size envs
// run): their n claims are the first rows of the current slot, so main pad()s
// the slot with the batch_size - n rows no worker will claim, waits for it to
// fill as usual (the last real publish wakes it), reads the n rows and skip()s
// the claim counter past the padding before it gives any env a new command.
//
// A batch of the rows in so far (recv(take_ready=True) after its timeout):
// main close()s the slot it waits on, moving the claim counter from its
// current value, inside the slot, to the slot's end in one compare-exchange,
// so that the rows claimed so far are the batch and every later claim is a
// row of the next slot; it pad()s the rows no worker will claim and waits for
// the claimed ones as usual (each publish follows its claim at once).
//
// The ring never overruns while num_slots * batch_size >= num_envs +
// batch_size (why: docs/design/protocol.md, "The result ring").
//
// Who may call what: claim/publish any worker, concurrently; wait_full,
// release, filled, pad, unpad, skip and close the main process; ring the main
// process; wait the doorbell's worker.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "barrier.h"

namespace shmvec {

struct alignas(64) RingHeader {
  std::atomic<uint64_t> claimed;  // rows claimed so far (never wraps in practice)
  char pad0[64 - sizeof(std::atomic<uint64_t>)];
  PaddedWord main_sleeping;  // main inside futex_wait on some `filled`
  PaddedWord main_handoff;   // nonzero: the worker that wakes main yields (set_handoff)
};

struct RowRef {
  uint32_t slot;
  uint32_t row;
};

class ResultRing {
 public:
  // `words`: a RingHeader followed by num_slots PaddedWords (bytes()).
  ResultRing(void* words, uint32_t num_slots, uint32_t batch_size) noexcept
      : header_(static_cast<RingHeader*>(words)),
        filled_(reinterpret_cast<PaddedWord*>(static_cast<RingHeader*>(words) + 1)),
        num_slots_(num_slots),
        batch_size_(batch_size) {}

  static size_t bytes(uint32_t num_slots) {
    return sizeof(RingHeader) + size_t(num_slots) * sizeof(PaddedWord);
  }

  // [worker] The next free row, in arrival order.
  RowRef claim() noexcept;
  // [worker] Makes a claimed row's results visible; the last row of a slot
  // wakes the main process (and yields, if main asked: set_handoff).
  void publish(uint32_t slot) noexcept;
  // [main] Whether the worker that wakes main should then yield its core, so
  // that main, if the scheduler put it there, runs at once instead of after
  // that worker's next envs.
  void set_handoff(bool on) noexcept;
  // [main] Waits until `slot` holds batch_size published rows.
  WaitStatus wait_full(uint32_t slot, int64_t timeout_ns) noexcept;
  // [main] How wait_full spins (csrc/wait_policy.h). Default: no spin.
  void set_spin(int64_t cap_ns, bool adaptive) noexcept { spin_.set(cap_ns, adaptive); }
  // [main] Rows of `slot` published so far.
  uint32_t filled(uint32_t slot) const noexcept;
  // [main] Rows claimed so far, all slots and laps together.
  uint64_t claimed() const noexcept;
  // [main] Hands a consumed slot back to the workers.
  void release(uint32_t slot) noexcept;
  // [main] Counts `rows` rows of `slot` as published although no worker will
  // write them: the rows past the last claim of the envs still running, for a
  // batch of fewer rows. The publish of the last real row then fills the slot.
  void pad(uint32_t slot, uint32_t rows) noexcept;
  // [main] Takes back pad()'s rows of a slot main did not consume (its wait
  // timed out): the slot then counts only the rows workers published.
  void unpad(uint32_t slot, uint32_t rows) noexcept;
  // [main] Moves the claim counter past `rows` padded rows. Only while no
  // worker can claim: every running env's row is published and no env has a
  // new command, so the next claim is the first row of the next slot.
  void skip(uint32_t rows) noexcept;
  // [main] Closes the slot whose first row is claim number `first` to
  // further claims, if some but not all of its rows are claimed: returns the
  // rows claimed in it (0: none, and nothing changed; batch_size: all of
  // them, and nothing changed). Later claims go to the next slot.
  uint32_t close(uint64_t first) noexcept;

 private:
  RingHeader* header_;
  PaddedWord* filled_;
  uint32_t num_slots_;
  uint32_t batch_size_;
  AdaptiveSpin spin_;  // the main process's, in wait_full
};

// A counter that one worker sleeps on and the main process rings.
struct alignas(64) DoorbellWords {
  PaddedWord rings;
  PaddedWord sleepers;
};

class Doorbell {
 public:
  explicit Doorbell(DoorbellWords* words) noexcept : w_(words) {}
  // [main] Wakes the worker (a syscall only if it sleeps).
  void ring() noexcept;
  // [worker] Waits for a ring count other than `last`; returns the count
  // seen in *out.
  WaitStatus wait(uint32_t last, int64_t timeout_ns, uint32_t* out) noexcept;
  // [worker] How wait spins (csrc/wait_policy.h). Default: no spin.
  void set_spin(int64_t cap_ns, bool adaptive) noexcept { spin_.set(cap_ns, adaptive); }

 private:
  DoorbellWords* w_;
  AdaptiveSpin spin_;  // the worker's, in wait
};

}  // namespace shmvec
