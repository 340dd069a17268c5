#include "segment.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

namespace shmvec {

namespace {

[[noreturn]] void throw_errno(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}

void* map_shared(int fd, size_t size) {
  void* addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) throw_errno("mmap of the shmvec segment");
  return addr;
}

void write_header(void* addr, size_t size) {
  auto* header = static_cast<SegmentHeader*>(addr);
  header->magic = kSegmentMagic;
  header->version = kSegmentVersion;
  header->header_size = sizeof(SegmentHeader);
  header->total_size = size;
  header->creator_pid = uint32_t(getpid());
}

}  // namespace

// The kernel's value (linux/memfd.h); glibc's <sys/mman.h> has it from 2.27 on.
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif

int open_memfd(const char* name) {
  return int(syscall(__NR_memfd_create, name, MFD_CLOEXEC));
}

Segment Segment::create(size_t size) {
  if (size < sizeof(SegmentHeader)) {
    throw std::invalid_argument("segment smaller than its header");
  }
  int fd = open_memfd("shmvec");
  if (fd < 0) throw_errno("memfd_create");
  if (ftruncate(fd, off_t(size)) != 0) {
    int saved = errno;
    ::close(fd);
    errno = saved;
    throw_errno("ftruncate of the shmvec segment");
  }
  void* addr;
  try {
    addr = map_shared(fd, size);
  } catch (...) {
    ::close(fd);
    throw;
  }
  write_header(addr, size);
  return Segment(addr, size, fd);
}

Segment Segment::create_private(size_t size) {
  if (size < sizeof(SegmentHeader)) {
    throw std::invalid_argument("segment smaller than its header");
  }
  void* addr =
      mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (addr == MAP_FAILED) throw_errno("mmap of a private shmvec segment");
  write_header(addr, size);
  return Segment(addr, size, -1);
}

Segment Segment::attach(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) throw_errno("fstat of the shmvec segment fd");
  size_t size = size_t(st.st_size);
  if (size < sizeof(SegmentHeader)) {
    throw std::runtime_error("fd " + std::to_string(fd) +
                             " is too small to be a shmvec segment");
  }
  void* addr = map_shared(fd, size);
  Segment segment(addr, size, -1);
  const SegmentHeader& h = segment.header();
  if (h.magic != kSegmentMagic || h.version != kSegmentVersion ||
      h.header_size != sizeof(SegmentHeader) || h.total_size != size) {
    throw std::runtime_error(
        "fd " + std::to_string(fd) +
        " is not a shmvec segment of this version (magic, version or size "
        "mismatch)");
  }
  return segment;
}

Segment::Segment(Segment&& other) noexcept
    : addr_(std::exchange(other.addr_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      fd_(std::exchange(other.fd_, -1)) {}

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    close();
    addr_ = std::exchange(other.addr_, nullptr);
    size_ = std::exchange(other.size_, 0);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

Segment::~Segment() { close(); }

void Segment::close() {
  if (addr_ != nullptr) munmap(addr_, size_);  // only fails on a bad range
  if (fd_ >= 0) ::close(fd_);
  addr_ = nullptr;
  size_ = 0;
  fd_ = -1;
}

void Segment::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace shmvec
