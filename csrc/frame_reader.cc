#include "frame_reader.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <system_error>

namespace shmvec {

namespace {

constexpr size_t kReadBytes = 1 << 16;  // one recv at most
constexpr int kEvents = 64;             // events one epoll_wait returns at most

[[noreturn]] void fail(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}

uint64_t little_endian(const char* bytes, int n) {
  uint64_t value = 0;
  for (int i = n - 1; i >= 0; --i) value = (value << 8) | static_cast<uint8_t>(bytes[i]);
  return value;
}

}  // namespace

FrameReader::FrameReader() {
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) fail("epoll_create1");
  stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (stop_fd_ < 0) {
    ::close(epoll_fd_);
    fail("eventfd");
  }
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.u64 = 0;  // tag 0: the stop signal
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, stop_fd_, &event) != 0) {
    ::close(stop_fd_);
    ::close(epoll_fd_);
    fail("epoll_ctl");
  }
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "shmvec-frames");
    run();
  });
}

FrameReader::~FrameReader() { close(); }

void FrameReader::add(int fd, int64_t slot) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw std::invalid_argument("the frame reader is closed");
  if (sources_.count(slot)) {
    throw std::invalid_argument("slot " + std::to_string(slot) + " is read already");
  }
  int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) fail("dup");
  uint64_t tag = next_tag_++;
  epoll_event event{};
  event.events = EPOLLIN | EPOLLRDHUP;
  event.data.u64 = tag;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, own, &event) != 0) {
    int error = errno;
    ::close(own);
    errno = error;
    fail("epoll_ctl");
  }
  sources_[slot] = Source{own, tag, std::string()};
  tags_[tag] = slot;
}

void FrameReader::remove(int64_t slot) {
  std::lock_guard<std::mutex> lock(mutex_);
  drop(slot);
  std::deque<Frame> kept;
  uint64_t rows = 0;
  bool urgent = false;
  for (auto& frame : frames_) {
    if (frame.slot == slot) continue;
    rows += frame.rows;
    urgent = urgent || frame.kind != kRowsKind;
    kept.push_back(std::move(frame));
  }
  frames_.swap(kept);
  rows_in_ = rows;
  urgent_ = urgent;
  for (auto it = ended_.begin(); it != ended_.end();) {
    it = *it == slot ? ended_.erase(it) : it + 1;
  }
}

void FrameReader::drop(int64_t slot) {
  auto it = sources_.find(slot);
  if (it == sources_.end()) return;
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, it->second.fd, nullptr);
  ::close(it->second.fd);
  tags_.erase(it->second.tag);
  sources_.erase(it);
}

bool FrameReader::ready() const {
  return urgent_ || !ended_.empty() || (wanted_ && rows_in_ >= wanted_);
}

std::vector<Frame> FrameReader::wait(uint32_t rows, int64_t timeout_ns,
                                     std::vector<int64_t>* ended) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (closed_) throw std::runtime_error("the frame reader is closed");
  wanted_ = rows ? rows : 1;
  auto done = [this] { return ready() || closed_; };
  if (timeout_ns < 0) {
    cv_.wait(lock, done);
  } else {
    cv_.wait_for(lock, std::chrono::nanoseconds(timeout_ns), done);
  }
  wanted_ = 0;
  std::vector<Frame> out(std::make_move_iterator(frames_.begin()),
                         std::make_move_iterator(frames_.end()));
  frames_.clear();
  rows_in_ = 0;
  urgent_ = false;
  ended->swap(ended_);
  ended_.clear();
  return out;
}

void FrameReader::run() {
  epoll_event events[kEvents];
  while (true) {
    int n = epoll_wait(epoll_fd_, events, kEvents, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      std::lock_guard<std::mutex> lock(mutex_);
      closed_ = true;  // cannot go on: every wait returns at once
      cv_.notify_all();
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    bool was_ready = ready();
    for (int i = 0; i < n; ++i) {
      uint64_t tag = events[i].data.u64;
      if (tag == 0) return;  // close(): the stop signal
      auto found = tags_.find(tag);
      if (found == tags_.end()) continue;  // removed since epoll_wait returned
      int64_t slot = found->second;
      read_source(slot, sources_.at(slot));
    }
    if (!was_ready && ready()) cv_.notify_all();
  }
}

void FrameReader::read_source(int64_t slot, Source& source) {
  std::string& buffer = source.buffer;
  bool end = false;
  while (true) {  // straight into the buffer's tail: one copy on the way to a frame
    size_t had = buffer.size();
    buffer.resize(had + kReadBytes);
    ssize_t got = recv(source.fd, &buffer[had], kReadBytes, MSG_DONTWAIT);
    buffer.resize(had + (got > 0 ? static_cast<size_t>(got) : 0));
    if (got > 0) {
      if (static_cast<size_t>(got) < kReadBytes) break;  // nothing more now
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    end = true;  // EOF, or the connection failed
    break;
  }
  size_t start = 0;
  while (buffer.size() - start >= kHeaderBytes) {
    const char* header = buffer.data() + start;
    uint64_t size = little_endian(header, 8);
    if (buffer.size() - start - kHeaderBytes < size) break;
    Frame frame{slot, static_cast<uint8_t>(header[8]),
                static_cast<uint32_t>(little_endian(header + 9, 4)),
                buffer.substr(start + kHeaderBytes, size)};
    rows_in_ += frame.rows;
    urgent_ = urgent_ || frame.kind != kRowsKind;
    frames_.push_back(std::move(frame));
    start += kHeaderBytes + size;
  }
  buffer.erase(0, start);
  if (end) {
    ended_.push_back(slot);
    drop(slot);  // source is gone after this
  }
}

void FrameReader::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_ && !thread_.joinable()) return;
    closed_ = true;
  }
  uint64_t one = 1;
  if (stop_fd_ >= 0) (void)!::write(stop_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  while (!sources_.empty()) drop(sources_.begin()->first);
  cv_.notify_all();
  if (stop_fd_ >= 0) ::close(stop_fd_);
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  stop_fd_ = epoll_fd_ = -1;
}

}  // namespace shmvec
