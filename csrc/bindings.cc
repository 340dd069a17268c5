// Python bindings of the C++ core (module shmvec._core). The only file that
// includes pybind11. Every call that can block releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/prctl.h>

#include <csignal>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <system_error>

#include "barrier.h"
#include "frame_reader.h"
#include "futex.h"
#include "result_ring.h"
#include "segment.h"

namespace py = pybind11;
using shmvec::BarrierWords;
using shmvec::Command;
using shmvec::Segment;
using shmvec::StepBarrier;
using shmvec::WaitStatus;

namespace {

// A word of the segment at `offset`, checked to lie inside it and be aligned.
std::atomic<uint32_t>* word_at(const Segment& segment, size_t offset) {
  if (segment.data() == nullptr) throw std::runtime_error("segment is closed");
  if (offset % 4 != 0 || offset + 4 > segment.size()) {
    throw py::value_error("offset " + std::to_string(offset) +
                          " is not an aligned word inside the segment");
  }
  return reinterpret_cast<std::atomic<uint32_t>*>(segment.data() + offset);
}

constexpr const char* kSetSpinDoc =
    "How this process's waits on the object spin before they sleep: up to cap_ns, "
    "learning from the gaps seen if adaptive (csrc/wait_policy.h). Default: no spin.";

// set_spin of the waiter (barrier, ring or doorbell) that a bound object holds.
template <class Py, class Waiter>
auto set_spin_of(Waiter Py::*waiter) {
  return [waiter](Py& self, int64_t cap_ns, bool adaptive) {
    (self.*waiter).set_spin(cap_ns, adaptive);
  };
}

void check_wait(WaitStatus status) {
  if (status == WaitStatus::kError) {
    throw std::system_error(errno, std::generic_category(), "futex wait");
  }
}

// Words of `size` bytes at `offset` inside the segment, checked.
uint8_t* words_at(Segment& seg, size_t offset, size_t size) {
  if (offset % 64 != 0 || offset + size > seg.size()) {
    throw py::value_error("words out of the segment or not on a cache line");
  }
  return seg.data() + offset;
}

// StepBarrier that keeps a reference to the Python Segment owning its words.
struct PyBarrier {
  PyBarrier(py::object segment_obj, size_t offset, uint32_t num_workers)
      : segment(std::move(segment_obj)),
        barrier(reinterpret_cast<BarrierWords*>(
                    words_at(segment.cast<Segment&>(), offset, sizeof(BarrierWords))),
                num_workers) {}
  py::object segment;
  StepBarrier barrier;
};

struct PyRing {
  PyRing(py::object segment_obj, size_t offset, uint32_t num_slots, uint32_t batch_size)
      : segment(std::move(segment_obj)),
        ring(words_at(segment.cast<Segment&>(), offset,
                      shmvec::ResultRing::bytes(num_slots)),
             num_slots, batch_size) {
    if (batch_size == 0 || num_slots == 0) throw py::value_error("empty ring");
  }
  py::object segment;
  shmvec::ResultRing ring;
};

struct PyDoorbell {
  PyDoorbell(py::object segment_obj, size_t offset)
      : segment(std::move(segment_obj)),
        bell(reinterpret_cast<shmvec::DoorbellWords*>(
            words_at(segment.cast<Segment&>(), offset, sizeof(shmvec::DoorbellWords)))) {}
  py::object segment;
  shmvec::Doorbell bell;
};

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "shmvec's C++ core: shared segment, futexes and the step barrier.";

  // A refused syscall (memfd_create, mmap, futex) is an OSError with its errno,
  // so that Python can tell it from a bug.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::system_error& e) {
      py::object error = py::reinterpret_steal<py::object>(
          PyObject_CallFunction(PyExc_OSError, "is", e.code().value(), e.what()));
      PyErr_SetObject(PyExc_OSError, error.ptr());
    }
  });

  py::class_<Segment>(m, "Segment", py::buffer_protocol(), R"doc(
A shared-memory segment (anonymous memfd, mapped MAP_SHARED).

The mapping lives as long as this object and every memoryview/ndarray made
from it; `close_fd()` only drops the fd.
)doc")
      .def_static("create", &Segment::create, py::arg("size"),
                  "Creates a zero-filled segment of `size` bytes.")
      .def_static("create_private", &Segment::create_private, py::arg("size"),
                  "A segment private to this process (no fd), for the serial fallback.")
      .def_static("attach", &Segment::attach, py::arg("fd"),
                  "Maps the segment behind `fd` and checks its header.")
      .def_property_readonly("size", &Segment::size)
      .def_property_readonly("fd", &Segment::fd)
      .def_property_readonly("address",
                             [](const Segment& s) { return uintptr_t(s.data()); })
      .def_property_readonly("creator_pid",
                             [](const Segment& s) { return s.header().creator_pid; })
      .def("close_fd", &Segment::close_fd)
      .def_buffer([](Segment& s) {
        return py::buffer_info(s.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {s.size()}, {1});
      });

  py::class_<PyBarrier>(m, "StepBarrier", R"doc(
One command at a time from the main process to `num_workers` workers; see
csrc/barrier.h for the protocol. Times are in nanoseconds; a negative
timeout waits for ever.
)doc")
      .def(py::init<py::object, size_t, uint32_t>(), py::arg("segment"),
           py::arg("offset"), py::arg("num_workers"))
      .def_property_readonly_static("nbytes",
                                    [](py::object) { return sizeof(BarrierWords); })
      .def(
          "post",
          [](PyBarrier& b, uint32_t kind, uint32_t arg) { b.barrier.post(kind, arg); },
          py::arg("kind"), py::arg("arg") = 0)
      .def(
          "wait_done",
          [](PyBarrier& b, int64_t timeout_ns) {
            WaitStatus s;
            {
              py::gil_scoped_release release;
              s = b.barrier.wait_done(timeout_ns);
            }
            check_wait(s);
            return s == WaitStatus::kReady;
          },
          py::arg("timeout_ns"), "True once every worker arrived, False on timeout.")
      .def("set_spin", set_spin_of(&PyBarrier::barrier), py::arg("cap_ns"),
           py::arg("adaptive"), kSetSpinDoc)
      .def("arrived", [](PyBarrier& b) { return b.barrier.arrived(); })
      .def(
          "messages", [](PyBarrier& b) { return b.barrier.messages(); },
          "Workers that arrived with message=True this round.")
      .def_property_readonly("generation",
                             [](PyBarrier& b) { return b.barrier.generation(); })
      .def(
          "wait_command",
          [](PyBarrier& b, uint32_t last_generation, int64_t timeout_ns) -> py::object {
            Command c{};
            WaitStatus s;
            {
              py::gil_scoped_release release;
              s = b.barrier.wait_command(last_generation, timeout_ns, &c);
            }
            check_wait(s);
            if (s != WaitStatus::kReady) return py::none();
            return py::make_tuple(c.generation, c.kind, c.arg);
          },
          py::arg("last_generation"), py::arg("timeout_ns"),
          "(generation, kind, arg) of the next command, or None on timeout.")
      .def(
          "arrive", [](PyBarrier& b, bool message) { b.barrier.arrive(message); },
          py::arg("message") = false);

  py::class_<PyRing>(m, "ResultRing", R"doc(
The async engine's result ring (csrc/result_ring.h): workers claim rows in
arrival order; the main process waits for a slot to fill. claim/publish are
exposed for tests; the workers call them from Cython.
)doc")
      .def(py::init<py::object, size_t, uint32_t, uint32_t>(), py::arg("segment"),
           py::arg("offset"), py::arg("num_slots"), py::arg("batch_size"))
      .def_static("nbytes", &shmvec::ResultRing::bytes, py::arg("num_slots"))
      .def("claim",
           [](PyRing& r) {
             shmvec::RowRef ref = r.ring.claim();
             return py::make_tuple(ref.slot, ref.row);
           })
      .def(
          "publish", [](PyRing& r, uint32_t slot) { r.ring.publish(slot); },
          py::arg("slot"))
      .def(
          "wait_full",
          [](PyRing& r, uint32_t slot, int64_t timeout_ns) {
            WaitStatus s;
            {
              py::gil_scoped_release release;
              s = r.ring.wait_full(slot, timeout_ns);
            }
            check_wait(s);
            return s == WaitStatus::kReady;
          },
          py::arg("slot"), py::arg("timeout_ns"),
          "True once the slot is full, False on timeout.")
      .def("set_spin", set_spin_of(&PyRing::ring), py::arg("cap_ns"), py::arg("adaptive"),
           kSetSpinDoc)
      .def("filled", [](PyRing& r, uint32_t slot) { return r.ring.filled(slot); })
      .def("claimed", [](PyRing& r) { return r.ring.claimed(); })
      .def("release", [](PyRing& r, uint32_t slot) { r.ring.release(slot); })
      .def(
          "pad", [](PyRing& r, uint32_t slot, uint32_t rows) { r.ring.pad(slot, rows); },
          py::arg("slot"), py::arg("rows"),
          "Counts `rows` rows of `slot` as published though no worker writes them.")
      .def(
          "unpad",
          [](PyRing& r, uint32_t slot, uint32_t rows) { r.ring.unpad(slot, rows); },
          py::arg("slot"), py::arg("rows"),
          "Takes back pad()'s rows of an unconsumed slot.")
      .def(
          "skip", [](PyRing& r, uint32_t rows) { r.ring.skip(rows); }, py::arg("rows"),
          "Moves the claim counter past `rows` padded rows (no worker may claim now).")
      .def(
          "close", [](PyRing& r, uint64_t first) { return r.ring.close(first); },
          py::arg("first"),
          "Closes the slot whose first row is claim `first` to further claims if some but "
          "not all of its rows are claimed; returns the rows claimed in it.")
      .def(
          "set_handoff", [](PyRing& r, bool on) { r.ring.set_handoff(on); },
          py::arg("on"), "Whether the worker that wakes main then yields its core.");

  py::class_<PyDoorbell>(m, "Doorbell", "A worker's doorbell (csrc/result_ring.h).")
      .def(py::init<py::object, size_t>(), py::arg("segment"), py::arg("offset"))
      .def_property_readonly_static(
          "nbytes", [](py::object) { return sizeof(shmvec::DoorbellWords); })
      .def("ring", [](PyDoorbell& d) { d.bell.ring(); })
      .def(
          "wait",
          [](PyDoorbell& d, uint32_t last, int64_t timeout_ns) -> py::object {
            uint32_t seen = 0;
            WaitStatus s;
            {
              py::gil_scoped_release release;
              s = d.bell.wait(last, timeout_ns, &seen);
            }
            check_wait(s);
            if (s != WaitStatus::kReady) return py::none();
            return py::int_(seen);
          },
          py::arg("last"), py::arg("timeout_ns"))
      .def("set_spin", set_spin_of(&PyDoorbell::bell), py::arg("cap_ns"),
           py::arg("adaptive"), kSetSpinDoc);

  py::class_<shmvec::FrameReader>(m, "FrameReader", R"doc(
One thread reading the frames of many sockets (csrc/frame_reader.h): a frame is a
13-byte header (payload length u64, kind u8, rows u32) and its payload; ``wait``
returns once the frames in hold the rows asked for, one is not a rows frame (kind 1)
or a socket ended.)doc")
      .def(py::init<>())
      .def("add", &shmvec::FrameReader::add, py::arg("fd"), py::arg("slot"),
           "Reads socket `fd` (a dup of it) as slot `slot`.")
      .def("remove", &shmvec::FrameReader::remove, py::arg("slot"),
           "Stops reading slot `slot`; drops its frames not yet taken.")
      .def(
          "wait",
          [](shmvec::FrameReader& r, uint32_t rows, int64_t timeout_ns) {
            std::vector<int64_t> ended;
            std::vector<shmvec::Frame> frames;
            {
              py::gil_scoped_release release;
              frames = r.wait(rows, timeout_ns, &ended);
            }
            py::list out(frames.size());
            for (size_t i = 0; i < frames.size(); ++i) {
              auto& f = frames[i];
              out[i] = py::make_tuple(f.slot, f.kind, py::bytes(f.payload));
            }
            return py::make_tuple(out, py::cast(ended));
          },
          py::arg("rows"), py::arg("timeout_ns"),
          "Waits up to `timeout_ns` (< 0: no limit) for frames of `rows` rows, a frame "
          "of another kind or a socket's end: ([(slot, kind, payload)], [ended slots]).")
      .def("close", &shmvec::FrameReader::close, "Stops the thread (idempotent).");

  // Raw word operations, for tests of the futex layer across processes.
  m.def(
      "futex_wait",
      [](const Segment& s, size_t offset, uint32_t expected, int64_t timeout_ns) {
        auto* w = word_at(s, offset);
        shmvec::FutexResult r;
        {
          py::gil_scoped_release release;
          r = shmvec::futex_wait(w, expected, timeout_ns);
        }
        switch (r) {
          case shmvec::FutexResult::kWoken:
            return std::string("woken");
          case shmvec::FutexResult::kValueChanged:
            return std::string("value_changed");
          case shmvec::FutexResult::kTimedOut:
            return std::string("timed_out");
          case shmvec::FutexResult::kInterrupted:
            return std::string("interrupted");
          default:
            throw std::system_error(errno, std::generic_category(), "futex_wait");
        }
      },
      py::arg("segment"), py::arg("offset"), py::arg("expected"), py::arg("timeout_ns"));
  m.def(
      "futex_wake",
      [](const Segment& s, size_t offset, int count) {
        int n = shmvec::futex_wake(word_at(s, offset), count);
        if (n < 0) throw std::system_error(errno, std::generic_category(), "futex_wake");
        return n;
      },
      py::arg("segment"), py::arg("offset"), py::arg("count"));
  m.def(
      "atomic_load",
      [](const Segment& s, size_t offset) { return word_at(s, offset)->load(); },
      py::arg("segment"), py::arg("offset"));
  m.def(
      "atomic_store",
      [](const Segment& s, size_t offset, uint32_t v) { word_at(s, offset)->store(v); },
      py::arg("segment"), py::arg("offset"), py::arg("value"));
  m.def(
      "atomic_fetch_add",
      [](const Segment& s, size_t offset, uint32_t v) {
        return word_at(s, offset)->fetch_add(v);
      },
      py::arg("segment"), py::arg("offset"), py::arg("value"));
  m.def("monotonic_ns", &shmvec::monotonic_ns);
  m.def(
      "set_parent_death_signal",
      [](int sig) {
        if (prctl(PR_SET_PDEATHSIG, sig) != 0) {
          throw std::system_error(errno, std::generic_category(),
                                  "prctl(PR_SET_PDEATHSIG)");
        }
      },
      py::arg("signal"),
      "Asks the kernel to send `signal` to this process when its parent dies.");
}
