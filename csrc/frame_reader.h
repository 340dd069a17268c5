// FrameReader: one thread that reads the frames of many stream sockets (a
// ClusterVectorEnv's channels, shmvec/ray/channel.py) and hands them to one waiter
// only once it has the rows the waiter asked for, so that a driver receiving a row
// or two per message from each of many node agents wakes once per batch, not once
// per message.
//
// A frame is a 13-byte header (payload length u64, kind u8, rows u32; little-endian)
// and its payload. Frames of kind 1 (rows) count towards a wait; any other kind, and
// a socket's end (EOF or an error), end a wait at once.
//
// Thread safety: every method may be called from any thread; `wait` from one at a
// time. The reader reads each socket through a dup of its descriptor with
// MSG_DONTWAIT, so the caller's descriptor keeps its blocking mode and may be
// written meanwhile.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace shmvec {

struct Frame {
  int64_t slot;
  uint8_t kind;
  uint32_t rows;
  std::string payload;
};

class FrameReader {
 public:
  static constexpr size_t kHeaderBytes = 13;
  static constexpr uint8_t kRowsKind = 1;

  FrameReader();  // starts the thread; std::system_error if it cannot
  ~FrameReader();
  FrameReader(const FrameReader&) = delete;
  FrameReader& operator=(const FrameReader&) = delete;

  // Reads `fd` (a dup of it) as slot `slot`; std::invalid_argument if `slot` is read.
  void add(int fd, int64_t slot);
  // Stops reading slot `slot` and drops its frames not yet taken (no-op if unknown).
  void remove(int64_t slot);
  // Waits up to `timeout_ns` (< 0: no limit) until the frames in hold `rows` rows,
  // or one of them is not a rows frame, or a slot ended; then takes every frame in
  // and every slot that ended since the last wait (in `ended`, in order).
  std::vector<Frame> wait(uint32_t rows, int64_t timeout_ns, std::vector<int64_t>* ended);
  // Stops the thread and stops reading every slot (idempotent).
  void close();

 private:
  struct Source {
    int fd;
    uint64_t tag;  // epoll's data: this source's (slot, generation), stale events skipped
    std::string buffer;
  };

  void run();
  void read_source(int64_t slot, Source& source);  // under mutex_
  void drop(int64_t slot);                          // under mutex_
  bool ready() const;                               // under mutex_

  int epoll_fd_ = -1;
  int stop_fd_ = -1;  // an eventfd: the thread's stop signal
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<int64_t, Source> sources_;
  std::map<uint64_t, int64_t> tags_;  // tag -> slot
  std::deque<Frame> frames_;
  std::vector<int64_t> ended_;
  uint64_t rows_in_ = 0;   // rows of the frames in frames_
  bool urgent_ = false;    // frames_ holds a frame that is not a rows frame
  uint32_t wanted_ = 0;    // what the waiter waits for (0: nobody waits)
  uint64_t next_tag_ = 1;
  bool closed_ = false;
};

}  // namespace shmvec
