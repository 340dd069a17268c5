// One shared-memory segment: an anonymous memfd mapped MAP_SHARED.
//
// Data flow: the main process creates the segment (which writes the header)
// and hands its fd to each worker process; a worker attaches (maps the same
// pages and checks the header) and closes its copy of the fd at once. A memfd
// has no name in /dev/shm, so nothing is left behind on any exit, SIGKILL
// included: the pages go away with the last mapping.
//
// Everything after the header is laid out by the caller (shmvec/layout.py):
// control words, action slab, result ring.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shmvec {

constexpr uint64_t kSegmentMagic = 0x3130564d48534dULL;  // "MSHMV01" little-endian
constexpr uint32_t kSegmentVersion = 2;
constexpr size_t kCacheLine = 64;

// The first bytes of every segment.
struct SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t header_size;  // sizeof(SegmentHeader), to catch layout drift
  uint64_t total_size;   // bytes mapped, header included
  uint32_t creator_pid;  // the main process: workers watch it
  uint32_t reserved[9];
};
static_assert(sizeof(SegmentHeader) == kCacheLine, "header is one line");

// memfd_create(name, MFD_CLOEXEC) through the system call itself: glibc
// declares memfd_create only from 2.27, and the wheels are built against
// glibc 2.17 (manylinux2014). The call is in every kernel from Linux 3.17
// (RHEL/CentOS 7.3). Returns the fd, or -1 with errno set (ENOSYS on an older
// kernel). Any thread may call it.
int open_memfd(const char* name);

class Segment {
 public:
  // Creates and maps a zero-filled segment of `size` bytes (header included).
  // Throws std::system_error when the kernel refuses (no memfd, no memory).
  static Segment create(size_t size);
  // The same, mapped MAP_PRIVATE | MAP_ANONYMOUS with no fd: for envs that all
  // run in the main process (the serial fallback), where nothing is shared.
  static Segment create_private(size_t size);
  // Maps the segment behind `fd` (which the caller keeps owning) and checks
  // its header. Throws std::system_error or std::runtime_error.
  static Segment attach(int fd);

  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  // Unmaps the memory and closes the fd (if owned). Idempotent. Callers
  // must know that no view of the memory is still in use.
  void close();
  // Closes the fd only: the mapping stays valid. Idempotent.
  void close_fd();

  uint8_t* data() const { return static_cast<uint8_t*>(addr_); }
  size_t size() const { return size_; }
  int fd() const { return fd_; }  // -1 when attached or closed
  const SegmentHeader& header() const {
    return *static_cast<const SegmentHeader*>(addr_);
  }

 private:
  Segment(void* addr, size_t size, int fd) : addr_(addr), size_(size), fd_(fd) {}
  void* addr_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

}  // namespace shmvec
