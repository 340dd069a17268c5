// Native tests of the C++ core (futex, Segment, StepBarrier, ResultRing,
// Doorbell), without Python, so that they can run under AddressSanitizer,
// UndefinedBehaviorSanitizer and ThreadSanitizer (dev/sanitize.sh).
//
// The concurrent scenarios run their peers either as threads of this process
// (what ThreadSanitizer can check: it does not see through memory shared
// between processes) or as fork()ed processes that attach the segment at a
// different address (what the real engine does; ASan checks every child).
// Each scenario carries plain (non-atomic) payload next to the futex words, so
// that a missing release/acquire shows up as a data race under TSan and as a
// wrong value otherwise.
//
// Usage: shmvec_core_test [--quick] [--no-fork]. Exit status 0 when every check
// passed; the first failed check prints its line and aborts.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "barrier.h"
#include "futex.h"
#include "result_ring.h"
#include "segment.h"
#include "wait_policy.h"

namespace shmvec {
namespace {

// Aborts (so that a sanitizer build prints the stack) with the failed condition.
#define CHECK(cond) ((cond) ? void(0) : check_failed(__FILE__, __LINE__, #cond))

[[noreturn]] void check_failed(const char* file, int line, const char* what) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s (pid %d)\n", file, line, what,
               int(getpid()));
  std::fflush(stderr);
  std::abort();
}

constexpr int64_t kMs = 1000000;
constexpr int64_t kSec = 1000 * kMs;
// Every wait in a scenario is bounded: a lost wake-up is a failed check after
// this long, never a hang. Generous because TSan slows everything ~10x.
constexpr int64_t kWaitLimit = 10 * kSec;

enum class Peers { kThreads, kProcesses };

// Starts peer(i) for i in [0, n) as threads, or as fork()ed children (forked
// before any thread exists), runs main_side() in this thread, then waits for
// the peers; a child must exit 0.
void run_with_peers(Peers how, int n, const std::function<void(int)>& peer,
                    const std::function<void()>& main_side) {
  if (how == Peers::kThreads) {
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i) threads.emplace_back(peer, i);
    main_side();
    for (auto& t : threads) t.join();
    return;
  }
  std::fflush(nullptr);  // or the children print the parent's buffered output again
  std::vector<pid_t> pids;
  for (int i = 0; i < n; ++i) {
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // a failed check in main ends the children
      peer(i);
      std::fflush(nullptr);
      _exit(0);  // not exit(): the parent's atexit handlers are not ours to run
    }
    pids.push_back(pid);
  }
  main_side();
  for (pid_t pid : pids) {
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "child %d ended with status 0x%x\n", int(pid), status);
    }
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
}

// ------------------------------------------------------------------ futex

void test_futex() {
  std::atomic<uint32_t> word{0};
  // The kernel compares first: a word that no longer holds `expected`.
  CHECK(futex_wait(&word, 1, kSec) == FutexResult::kValueChanged);
  // A timeout is honoured and is not shorter than asked.
  int64_t t0 = monotonic_ns();
  CHECK(futex_wait(&word, 0, 20 * kMs) == FutexResult::kTimedOut);
  CHECK(monotonic_ns() - t0 >= 20 * kMs);
  CHECK(futex_wait(&word, 0, 0) == FutexResult::kTimedOut);
  CHECK(futex_wake(&word, INT_MAX) == 0);  // nobody waits

  // A sleeper is woken by a store + wake; the wake reports it.
  std::atomic<int> woken{0};
  std::thread sleeper([&] {
    while (word.load(std::memory_order_acquire) == 0) {
      FutexResult r = futex_wait(&word, 0, kWaitLimit);
      CHECK(r != FutexResult::kError && r != FutexResult::kTimedOut);
    }
    woken.store(1);
  });
  int reported = 0;
  // Give the sleeper time to reach futex_wait, then wake it.
  for (int i = 0; i < 200 && reported == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (i == 50) word.store(1, std::memory_order_release);
    if (i >= 50) reported += futex_wake(&word, 1);
  }
  sleeper.join();
  CHECK(woken.load() == 1);
  CHECK(reported <= 1);

  // An unaligned word is an error, not a crash (EINVAL -> kError).
  alignas(8) static uint8_t bytes[8] = {};
  auto* unaligned = reinterpret_cast<std::atomic<uint32_t>*>(bytes + 1);
  CHECK(futex_wait(unaligned, 0, kMs) == FutexResult::kError);
  CHECK(futex_wake(unaligned, 1) == -1);
}

// ---------------------------------------------------------------- segment

int count_open_fds() {
  int n = 0;
  for (int fd = 0; fd < 4096; ++fd) {
    if (fcntl(fd, F_GETFD) != -1) ++n;
  }
  return n;
}

void test_segment() {
  const int fds_before = count_open_fds();
  {
    Segment seg = Segment::create(8192);
    CHECK(seg.size() == 8192 && seg.fd() >= 0 && seg.data() != nullptr);
    CHECK(seg.header().magic == kSegmentMagic);
    CHECK(seg.header().version == kSegmentVersion);
    CHECK(seg.header().total_size == 8192);
    CHECK(seg.header().creator_pid == uint32_t(getpid()));
    for (size_t i = sizeof(SegmentHeader); i < seg.size(); ++i) CHECK(seg.data()[i] == 0);

    // A second mapping of the same pages, at another address.
    Segment view = Segment::attach(seg.fd());
    CHECK(view.fd() == -1 && view.size() == 8192 && view.data() != seg.data());
    seg.data()[100] = 42;
    CHECK(view.data()[100] == 42);
    view.data()[8191] = 7;
    CHECK(seg.data()[8191] == 7);

    // Moves hand the mapping over; the moved-from object owns nothing.
    Segment moved(std::move(view));
    CHECK(view.data() == nullptr && moved.data()[100] == 42);
    view = std::move(moved);
    CHECK(moved.data() == nullptr && view.data()[8191] == 7);
    view.close();
    view.close();  // idempotent
    CHECK(view.data() == nullptr && view.size() == 0);

    // close_fd keeps the mapping.
    seg.close_fd();
    seg.close_fd();
    CHECK(seg.fd() == -1 && seg.data()[100] == 42);
  }
  CHECK(count_open_fds() == fds_before);  // no fd leaked by create/attach/close

  bool threw = false;
  try {
    Segment::create(sizeof(SegmentHeader) - 1);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);

  threw = false;
  try {
    Segment::attach(-1);
  } catch (const std::system_error& e) {
    threw = e.code().value() == EBADF;
  }
  CHECK(threw);

  // A memfd that is not a segment: the right size, a wrong header.
  int fd = open_memfd("not-shmvec");
  CHECK(fd >= 0);
  CHECK(ftruncate(fd, 4096) == 0);
  auto attach_throws = [](int segment_fd) {
    try {
      Segment::attach(segment_fd);
    } catch (const std::runtime_error&) {
      return true;
    }
    return false;
  };
  CHECK(attach_throws(fd));
  CHECK(ftruncate(fd, 8) == 0);  // smaller than a header
  CHECK(attach_throws(fd));
  ::close(fd);
  // The failed attaches unmapped and closed what they opened.
  CHECK(count_open_fds() == fds_before);
}

// -------------------------------------------------------------- barrier

constexpr uint32_t kCmdWork = 1;
constexpr uint32_t kCmdStop = 2;
constexpr int kMaxWorkers = 8;

// How a scenario's waiters spin (each sets it on its own objects).
struct SpinCase {
  int64_t cap_ns;
  bool adaptive;
};

// What the barrier scenario puts in the segment after the header.
struct BarrierArea {
  BarrierWords words;
  int64_t action[kMaxWorkers];  // plain: written by main before post()
  int64_t result[kMaxWorkers];  // plain: written by worker i before arrive()
};

void barrier_worker(BarrierArea* area, int index, int num_workers, SpinCase spin) {
  StepBarrier barrier(&area->words, uint32_t(num_workers));
  barrier.set_spin(spin.cap_ns, spin.adaptive);
  uint32_t last = 0;
  for (uint32_t expected_arg = 0;; ++expected_arg) {
    Command cmd{};
    WaitStatus s = barrier.wait_command(last, kWaitLimit, &cmd);
    CHECK(s == WaitStatus::kReady);
    CHECK(cmd.generation == last + 1);  // main posts only after a full round
    last = cmd.generation;
    if (cmd.kind == kCmdStop) return;
    CHECK(cmd.kind == kCmdWork && cmd.arg == expected_arg);
    CHECK(area->action[index] == int64_t(cmd.arg) * 3 + index);
    area->result[index] = area->action[index] * 2;
    barrier.arrive();
  }
}

// One main and `num_workers` workers run `rounds` generations; every round
// checks that all workers arrived (no lost wake-up either way: a lost one is
// a kTimedOut) and saw this round's actions, and that main sees their results.
void test_barrier(Peers how, int num_workers, SpinCase spin, uint32_t rounds) {
  CHECK(num_workers <= kMaxWorkers);
  Segment seg = Segment::create(sizeof(SegmentHeader) + sizeof(BarrierArea) + 64);
  auto* area = new (seg.data() + 64) BarrierArea;  // the segment is zero-filled
  StepBarrier barrier(&area->words, uint32_t(num_workers));
  barrier.set_spin(spin.cap_ns, spin.adaptive);
  const int fd = seg.fd();

  auto main_side = [&] {
    for (uint32_t r = 0; r < rounds; ++r) {
      for (int i = 0; i < num_workers; ++i) area->action[i] = int64_t(r) * 3 + i;
      barrier.post(kCmdWork, r);
      WaitStatus s = barrier.wait_done(kWaitLimit);
      if (s != WaitStatus::kReady) {
        std::fprintf(stderr, "round %u: %u of %d arrived\n", r, barrier.arrived(),
                     num_workers);
      }
      CHECK(s == WaitStatus::kReady);
      CHECK(barrier.arrived() == uint32_t(num_workers));
      for (int i = 0; i < num_workers; ++i) {
        CHECK(area->result[i] == (int64_t(r) * 3 + i) * 2);
      }
    }
    barrier.post(kCmdStop, 0);
  };
  auto peer = [&](int i) {
    if (how == Peers::kThreads) {
      barrier_worker(area, i, num_workers, spin);
    } else {
      // A worker process maps the segment itself, as shmvec's workers do.
      Segment mine = Segment::attach(fd);
      barrier_worker(reinterpret_cast<BarrierArea*>(mine.data() + 64), i, num_workers,
                     spin);
    }
  };
  run_with_peers(how, num_workers, peer, main_side);
  CHECK(barrier.generation() == rounds + 1);
}

void test_barrier_timeouts() {
  Segment seg = Segment::create(4096);
  auto* words = new (seg.data() + 64) BarrierWords;
  StepBarrier barrier(words, 2);
  barrier.post(kCmdWork, 0);
  int64_t t0 = monotonic_ns();
  CHECK(barrier.wait_done(20 * kMs) == WaitStatus::kTimedOut);
  CHECK(monotonic_ns() - t0 >= 20 * kMs);
  barrier.arrive();  // one of two: still pending
  CHECK(barrier.arrived() == 1);
  barrier.set_spin(100000, false);  // a timeout shorter than the spin ends it too
  CHECK(barrier.wait_done(10 * kMs) == WaitStatus::kTimedOut);
  barrier.arrive();
  CHECK(barrier.wait_done(0) == WaitStatus::kReady);
  // A worker that saw the current generation waits in vain.
  Command cmd{};
  CHECK(barrier.wait_command(barrier.generation(), 10 * kMs, &cmd) ==
        WaitStatus::kTimedOut);
  CHECK(barrier.wait_command(barrier.generation() - 1, 0, &cmd) == WaitStatus::kReady);
  CHECK(cmd.generation == 1 && cmd.kind == kCmdWork && cmd.arg == 0);
}

// ---------------------------------------------------------- doorbell

struct PingPongArea {
  DoorbellWords to_peer;
  DoorbellWords to_main;
  int64_t payload;  // plain: handed back and forth
};

// Main rings the peer, the peer rings back; `rounds` hand-offs each way with
// a payload that each side increments (a lost ring is a kTimedOut).
void test_doorbell(Peers how, SpinCase spin, uint32_t rounds) {
  Segment seg = Segment::create(4096);
  auto* area = new (seg.data() + 64) PingPongArea;
  const int fd = seg.fd();
  auto main_side = [&] {
    Doorbell to_peer(&area->to_peer), to_main(&area->to_main);
    to_main.set_spin(spin.cap_ns, spin.adaptive);
    uint32_t seen = 0;
    for (uint32_t r = 0; r < rounds; ++r) {
      area->payload = 2 * int64_t(r);
      to_peer.ring();
      WaitStatus s = to_main.wait(seen, kWaitLimit, &seen);
      CHECK(s == WaitStatus::kReady);
      CHECK(seen == r + 1);
      CHECK(area->payload == 2 * int64_t(r) + 1);
    }
  };
  auto pong = [&](PingPongArea* a) {
    Doorbell to_peer(&a->to_peer), to_main(&a->to_main);
    to_peer.set_spin(spin.cap_ns, spin.adaptive);
    uint32_t seen = 0;
    for (uint32_t r = 0; r < rounds; ++r) {
      WaitStatus s = to_peer.wait(seen, kWaitLimit, &seen);
      CHECK(s == WaitStatus::kReady);
      CHECK(seen == r + 1);
      CHECK(a->payload == 2 * int64_t(r));
      a->payload += 1;
      to_main.ring();
    }
  };
  auto peer = [&](int) {
    if (how == Peers::kThreads) {
      pong(area);
    } else {
      Segment mine = Segment::attach(fd);
      pong(reinterpret_cast<PingPongArea*>(mine.data() + 64));
    }
  };
  run_with_peers(how, 1, peer, main_side);

  // Nobody rings: a timeout, and *out is the count seen.
  Doorbell bell(&area->to_peer);
  uint32_t out = 12345;
  CHECK(bell.wait(rounds, 10 * kMs, &out) == WaitStatus::kTimedOut);
  CHECK(out == rounds);
}

// ------------------------------------------------------------ result ring

constexpr uint32_t kRingEnvs = 48;
constexpr uint32_t kRingBatch = 8;
// num_slots * batch >= num_envs + batch (see result_ring.h): 7 * 8 >= 56.
constexpr uint32_t kRingSlots = (kRingEnvs + kRingBatch + kRingBatch - 1) / kRingBatch;

struct RingRow {
  uint32_t env;
  uint32_t seq;
  int64_t result;
};

// The async engine in miniature: main sends each env one action at a time
// (an action word and a sequence number, then the owner's doorbell); workers
// "step" an env by computing a function of its action, claim a row, fill it
// and publish it; main waits for each full slot in turn, checks its rows and
// answers those envs with their next action. With `partial`, main answers only
// enough envs to keep a running cap that drops below the batch now and then:
// a batch of the fewer running envs pads its slot, and skips the padding.
// With `close`, main waits a few microseconds for a full slot and otherwise
// closes it (recv(take_ready=True)): the rows claimed so far are its batch.
struct RingArea {
  alignas(64) uint8_t ring_words[sizeof(RingHeader) + kRingSlots * sizeof(PaddedWord)];
  DoorbellWords bells[kMaxWorkers];
  std::atomic<uint32_t> stop;
  std::atomic<uint32_t> action_seq[kRingEnvs];  // release: the action is written
  int64_t action[kRingEnvs];                    // plain: main -> the env's worker
  RingRow rows[kRingSlots][kRingBatch];         // plain: the claimer -> main
};

void ring_worker(RingArea* area, int index, int num_workers, SpinCase spin) {
  ResultRing ring(area->ring_words, kRingSlots, kRingBatch);
  Doorbell bell(&area->bells[index]);
  bell.set_spin(spin.cap_ns, spin.adaptive);
  const uint32_t per_worker = kRingEnvs / uint32_t(num_workers);
  const uint32_t first = uint32_t(index) * per_worker;
  std::vector<uint32_t> done_seq(per_worker, 0);
  uint32_t rings = 0;
  for (;;) {
    WaitStatus s = bell.wait(rings, kWaitLimit, &rings);
    CHECK(s == WaitStatus::kReady);
    if (area->stop.load(std::memory_order_acquire) != 0) return;
    for (uint32_t k = 0; k < per_worker; ++k) {
      const uint32_t env = first + k;
      const uint32_t seq = area->action_seq[env].load(std::memory_order_acquire);
      if (seq == done_seq[k]) continue;
      CHECK(seq == done_seq[k] + 1);  // one action at a time per env
      done_seq[k] = seq;
      RowRef ref = ring.claim();
      CHECK(ref.slot < kRingSlots && ref.row < kRingBatch);
      RingRow& row = area->rows[ref.slot][ref.row];
      row.env = env;
      row.seq = seq;
      row.result = area->action[env] * 2 + 1;
      ring.publish(ref.slot);
    }
  }
}

void test_ring(Peers how, int num_workers, SpinCase spin, uint32_t batches,
               bool partial = false, bool close = false) {
  CHECK(num_workers <= kMaxWorkers && kRingEnvs % uint32_t(num_workers) == 0);
  Segment seg = Segment::create(64 + sizeof(RingArea));
  auto* area = new (seg.data() + 64) RingArea;
  const int fd = seg.fd();
  const uint32_t per_worker = kRingEnvs / uint32_t(num_workers);

  auto main_side = [&] {
    ResultRing ring(area->ring_words, kRingSlots, kRingBatch);
    ring.set_spin(spin.cap_ns, spin.adaptive);
    std::vector<uint32_t> sent(kRingEnvs, 0), received(kRingEnvs, 0);
    auto send = [&](const std::vector<uint32_t>& envs) {
      std::vector<bool> wake(num_workers, false);
      for (uint32_t env : envs) {
        area->action[env] = int64_t(env) * 1000 + sent[env];
        area->action_seq[env].store(++sent[env], std::memory_order_release);
        wake[env / per_worker] = true;
      }
      for (int w = 0; w < num_workers; ++w) {
        if (wake[w]) Doorbell(&area->bells[w]).ring();
      }
    };
    std::vector<uint32_t> idle(kRingEnvs);
    for (uint32_t e = 0; e < kRingEnvs; ++e) idle[e] = e;
    send(idle);
    idle.clear();
    uint32_t running = kRingEnvs;
    uint64_t total = 0;
    uint64_t first = 0;  // the claim number of the slot's first row
    uint32_t closed = 0;
    for (uint32_t b = 0; b < batches; ++b) {
      const uint32_t slot = b % kRingSlots;
      // Like recv(): the previous slot goes back only when the next is asked for.
      if (b > 0) ring.release((b - 1) % kRingSlots);
      uint32_t rows = std::min(running, kRingBatch);
      CHECK(rows > 0);
      if (rows < kRingBatch) ring.pad(slot, kRingBatch - rows);
      bool skipped = false;
      // Every other slot: as soon as a row is claimed, close, racing the
      // claims of the rest; the others: short waits, each followed by a close.
      const int64_t deadline = monotonic_ns() + kWaitLimit;
      while (close && b % 2 && ring.claimed() == first) CHECK(monotonic_ns() < deadline);
      while (close && ring.wait_full(slot, b % 2 ? 0 : 2000 + int64_t(b % 7) * 3000) !=
                          WaitStatus::kReady) {
        const uint32_t claimed = ring.close(first);
        CHECK(claimed <= rows);
        if (claimed == 0) continue;
        if (claimed < rows) {
          ring.pad(slot, rows - claimed);
          rows = claimed;
          ++closed;
        }
        // A claim now is the next slot's first row; the rows claimed here are
        // published right after their claims.
        skipped = true;
        CHECK(ring.claimed() >= first + kRingBatch);
        break;
      }
      WaitStatus s = ring.wait_full(slot, kWaitLimit);
      if (s != WaitStatus::kReady) {
        std::fprintf(stderr, "batch %u: slot %u has %u of %u rows\n", b, slot,
                     ring.filled(slot), kRingBatch);
      }
      CHECK(s == WaitStatus::kReady);
      CHECK(ring.filled(slot) == kRingBatch);
      // Every running env has published: none claims until main sends again.
      if (rows < kRingBatch && !skipped) {
        ring.skip(kRingBatch - rows);
        CHECK(ring.claimed() == first + kRingBatch);
      }
      first += kRingBatch;
      std::vector<bool> in_batch(kRingEnvs, false);
      for (uint32_t r = 0; r < rows; ++r) {
        const RingRow& row = area->rows[slot][r];
        CHECK(row.env < kRingEnvs);
        CHECK(!in_batch[row.env]);  // a row claimed twice would show as a duplicate
        in_batch[row.env] = true;
        CHECK(row.seq == sent[row.env]);  // the answer to the last action sent
        CHECK(row.result == (int64_t(row.env) * 1000 + row.seq - 1) * 2 + 1);
        ++received[row.env];
        idle.push_back(row.env);
      }
      running -= rows;
      total += rows;
      // Without `partial`, every env that came back goes again; with it, at
      // most up to a cap that cycles through values below and above the batch.
      const uint32_t cap = partial && (b / 4) % 2 ? 1 + b % (kRingBatch - 1) : kRingEnvs;
      const uint32_t room = cap > running ? cap - running : 0;
      const uint32_t go = std::min(uint32_t(idle.size()), room);
      std::vector<uint32_t> envs(idle.end() - go, idle.end());
      idle.resize(idle.size() - go);
      send(envs);
      running += go;
    }
    // Every result came exactly once: an env has one action in flight, or none.
    uint64_t counted = 0;
    for (uint32_t e = 0; e < kRingEnvs; ++e) {
      CHECK(received[e] + 1 == sent[e] || received[e] == sent[e]);
      counted += received[e];
    }
    CHECK(counted == total && running + idle.size() == kRingEnvs);
    CHECK(partial || close || total == uint64_t(batches) * kRingBatch);
    if (close) std::printf("    %u of %u slots closed early\n", closed, batches);
    area->stop.store(1, std::memory_order_release);
    for (int w = 0; w < num_workers; ++w) Doorbell(&area->bells[w]).ring();
  };
  auto peer = [&](int i) {
    if (how == Peers::kThreads) {
      ring_worker(area, i, num_workers, spin);
    } else {
      Segment mine = Segment::attach(fd);
      ring_worker(reinterpret_cast<RingArea*>(mine.data() + 64), i, num_workers, spin);
    }
  };
  run_with_peers(how, num_workers, peer, main_side);
}

void run_case(const char* name, const std::function<void()>& body) {
  const int64_t t0 = monotonic_ns();
  body();
  std::printf("ok  %-28s %8.1f ms\n", name, double(monotonic_ns() - t0) / 1e6);
  std::fflush(stdout);
}

// The learning rule of AdaptiveSpin (csrc/wait_policy.h), step by step.
void test_adaptive_spin() {
  constexpr int64_t kUs = 1000;
  AdaptiveSpin never;
  never.set(0, true);
  never.learn(WaitOutcome{100 * kUs, true, false});
  CHECK(never.budget_ns() == 0);  // cap 0: never spins, whatever it sees

  AdaptiveSpin a;
  a.set(200 * kUs, true);
  CHECK(a.budget_ns() == 50 * kUs);              // starts at the fixed spin it replaced
  a.learn(WaitOutcome{120 * kUs, true, false});  // slept through a gap within the cap
  CHECK(a.budget_ns() == 180 * kUs);             // grown to 1.5x that gap
  a.learn(WaitOutcome{190 * kUs, true, false});
  CHECK(a.budget_ns() == 200 * kUs);  // never past the cap
  for (int i = 0; i < 100; ++i) a.learn(WaitOutcome{20 * kUs, false, false});
  CHECK(a.budget_ns() < 45 * kUs && a.budget_ns() >= 40 * kUs);  // drifted to ~2x gaps
  a.learn(WaitOutcome{500 * kUs, true, false});                  // beyond the cap: halve
  CHECK(a.budget_ns() < 23 * kUs);
  a.learn(WaitOutcome{5 * kUs, true, false});  // a short gap slept through: regrow
  CHECK(a.budget_ns() >= AdaptiveSpin::kMinGrowNs);
  a.learn(WaitOutcome{250 * kMs, true, true});  // idle (a timeout): stop spinning
  CHECK(a.budget_ns() == 0);
  a.learn(WaitOutcome{30 * kUs, true, false});
  CHECK(a.budget_ns() == 45 * kUs);  // and back when the rounds resume

  a.set(100 * kUs, true);  // a new cap restarts it
  CHECK(a.cap_ns() == 100 * kUs && a.budget_ns() == 50 * kUs);
  AdaptiveSpin fixed;  // fixed: every wait spins the cap, whatever it sees
  fixed.set(7 * kUs, false);
  fixed.learn(WaitOutcome{250 * kMs, true, true});
  CHECK(fixed.budget_ns() == 7 * kUs);
}

}  // namespace
}  // namespace shmvec

int main(int argc, char** argv) {
  using namespace shmvec;
  bool quick = false, fork_cases = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--no-fork") == 0) fork_cases = false;
  }
  // Thousands of generations per scenario (ring: batches of 8 rows, so 4x);
  // --quick for the plain build's pytest.
  const uint32_t n = quick ? 500 : 5000;
  const SpinCase sleep{0, false};
  const SpinCase spin{20000, false};  // 20 us: both the spin and the sleep paths run
  const Peers threads = Peers::kThreads, procs = Peers::kProcesses;
  run_case("futex", test_futex);
  run_case("segment", test_segment);
  run_case("adaptive spin", test_adaptive_spin);
  run_case("barrier timeouts", test_barrier_timeouts);
  run_case("barrier threads x3, sleep", [&] { test_barrier(threads, 3, sleep, n); });
  run_case("barrier threads x4, spin", [&] { test_barrier(threads, 4, spin, n); });
  run_case("doorbell threads, sleep", [&] { test_doorbell(threads, sleep, n); });
  run_case("doorbell threads, spin", [&] { test_doorbell(threads, spin, n); });
  run_case("ring threads x3, sleep", [&] { test_ring(threads, 3, sleep, 4 * n); });
  run_case("ring threads x4, spin", [&] { test_ring(threads, 4, spin, 4 * n); });
  run_case("ring threads x3, partial", [&] { test_ring(threads, 3, spin, 4 * n, true); });
  run_case("ring threads x3, close", [&] { test_ring(threads, 3, sleep, 4 * n, true, true); });
  // Adaptive: budgets move between 0 and the cap.
  const SpinCase adaptive{200000, true};
  run_case("barrier threads x3, adaptive",
           [&] { test_barrier(threads, 3, adaptive, n); });
  run_case("doorbell threads, adaptive", [&] { test_doorbell(threads, adaptive, n); });
  run_case("ring threads x3, adaptive", [&] { test_ring(threads, 3, adaptive, 4 * n); });
  if (fork_cases) {
    run_case("barrier processes x3", [&] { test_barrier(procs, 3, sleep, n); });
    run_case("doorbell processes", [&] { test_doorbell(procs, sleep, n); });
    run_case("ring processes x2", [&] { test_ring(procs, 2, spin, 4 * n); });
    run_case("ring processes x2, partial",
             [&] { test_ring(procs, 2, spin, 4 * n, true); });
    run_case("ring processes x2, close",
             [&] { test_ring(procs, 2, sleep, 4 * n, true, true); });
    run_case("barrier processes x3, adaptive",
             [&] { test_barrier(procs, 3, adaptive, n); });
  }
  std::printf("all core tests passed\n");
  return 0;
}
