// Python bindings of the core (rdmaflow.hpp): they only bind. Blocking calls release the GIL;
// completion callbacks never run on a progress thread: they are queued and run by one Python
// thread (run_callbacks). Options are keyword arguments.
#include <cmath>
#include <condition_variable>
#include <deque>

#include "bindings.hpp"

namespace py = pybind11;
using namespace rdmaflow;

// Declared, and said what they do, in bindings.hpp.
namespace rdmaflow::bindings {

size_t check_offset(int64_t v, const char* what) {
  if (v < 0)
    throw Error(ErrorKind::OutOfBounds, std::string(what) + " must not be negative, got " +
                                            std::to_string(v));
  return size_t(v);
}

Channel::Rider checked_rider(const std::shared_ptr<RemoteRegion>& rider_remote, int64_t rider_offset,
                             uint64_t rider_value, int64_t rider_remote_offset) {
  if (!rider_remote) return {};
  return {rider_remote, check_offset(rider_offset, "rider_offset"),
          check_offset(rider_remote_offset, "rider_remote_offset"), rider_value};
}

const Channel::Rider* rider_or_null(const Channel::Rider& r) { return r.remote ? &r : nullptr; }

py::tuple status_and_future(const std::pair<WaitStatus, Future>& r) {
  return py::make_tuple(int(r.first), r.second ? py::cast(r.second) : py::none());
}

}  // namespace rdmaflow::bindings

using namespace rdmaflow::bindings;

namespace {

PyObject* exc_base = nullptr;
PyObject* exc_bounds = nullptr;
PyObject* exc_peer = nullptr;
PyObject* exc_auth = nullptr;
PyObject* exc_region = nullptr;
PyObject* exc_closed = nullptr;
PyObject* exc_timeout = nullptr;
PyObject* exc_invalid = nullptr;
PyObject* exc_full = nullptr;

PyObject* exc_for(ErrorKind k) {
  switch (k) {
    case ErrorKind::OutOfBounds: return exc_bounds;
    case ErrorKind::Peer: return exc_peer;
    case ErrorKind::Auth: return exc_auth;
    case ErrorKind::Region: return exc_region;
    case ErrorKind::Closed: return exc_closed;
    case ErrorKind::Timeout: return exc_timeout;
    case ErrorKind::Invalid: return exc_invalid;
    case ErrorKind::Full: return exc_full;
    default: return exc_base;
  }
}

PyObject* new_exc(py::module_& m, const char* name, std::initializer_list<PyObject*> bases,
                  const char* doc) {
  py::tuple t(bases.size());
  size_t i = 0;
  for (PyObject* b : bases) t[i++] = py::reinterpret_borrow<py::object>(b);
  std::string full = std::string("rdmaflow.") + name;
  PyObject* e = PyErr_NewExceptionWithDoc(full.c_str(), doc, t.ptr(), nullptr);
  if (!e) throw py::error_already_set();
  m.add_object(name, py::reinterpret_borrow<py::object>(e));
  return e;
}

// Completion callbacks waiting for the Python thread that runs them.
struct CallbackQueue {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::pair<PyObject*, Future>> q;
};
CallbackQueue& callbacks() {
  static CallbackQueue* q = new CallbackQueue;  // never destroyed: threads may outlive statics
  return *q;
}

Callback make_callback(const py::object& cb) {
  if (cb.is_none()) return nullptr;
  if (!PyCallable_Check(cb.ptr()))
    throw Error(ErrorKind::Invalid, "callback must be callable or None");
  PyObject* fn = cb.ptr();
  Py_INCREF(fn);  // released by run_callbacks after the call
  return [fn](const Future& f) {
    auto& q = callbacks();
    {
      std::lock_guard<std::mutex> lk(q.m);
      q.q.emplace_back(fn, f);
    }
    q.cv.notify_one();
  };
}

void run_callbacks() {
  auto& q = callbacks();
  for (;;) {
    std::pair<PyObject*, Future> item;
    {
      py::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lk(q.m);
      q.cv.wait(lk, [&] { return !q.q.empty(); });
      item = std::move(q.q.front());
      q.q.pop_front();
    }
    PyObject* fn = item.first;
    try {
      py::reinterpret_borrow<py::object>(fn)(item.second);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("rdmaflow completion callback");
    } catch (std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      PyErr_WriteUnraisable(fn);
    }
    Py_DECREF(fn);
  }
}

std::string gpu_buffer_error(const MemRegion& r) {
  return "region " + std::to_string(r.id()) + " is GPU memory (CUDA device " +
         std::to_string(r.cuda_device()) + "): it has no host buffer; use region.tensor()";
}

// A direction or a byte string from Python: pybind11's own casters refused a wrong type with
// a TypeError and a signature dump; an InvalidArgumentError names the argument, as for offsets.
Direction direction_arg(py::handle v) {
  if (!py::isinstance<Direction>(v))
    throw Error(ErrorKind::Invalid, "direction must be rdmaflow.WRITE or rdmaflow.READ, got " +
                                        std::string(py::str(py::repr(v))));
  return v.cast<Direction>();
}

// bytes, or any other buffer of bytes (bytearray, memoryview); never a str (its encoding would
// be a guess) nor an int (bytes(n) is n zeros).
std::string bytes_arg(py::handle v, const char* what) {
  if (PyBytes_Check(v.ptr())) return std::string(py::reinterpret_borrow<py::bytes>(v));
  if (!PyUnicode_Check(v.ptr()) && PyObject_CheckBuffer(v.ptr())) {
    auto b = py::reinterpret_steal<py::bytes>(PyBytes_FromObject(v.ptr()));
    if (!b) throw py::error_already_set();
    return std::string(b);
  }
  throw Error(ErrorKind::Invalid, std::string(what) + " must be bytes, got " +
                                      std::string(py::str(py::type::handle_of(v).attr("__name__"))));
}

// A public call's offset or size from Python, checked as check_offset does: an int or anything
// with __index__ (numpy's integers); pybind11's own caster would take True as 1 and say of 2.5
// only that no overload matched.
size_t offset_arg(py::handle v, const char* what) {
  auto invalid = [&] {
    return Error(ErrorKind::Invalid, std::string(what) + " must be an integer, got " +
                                         std::string(py::str(py::repr(v))));
  };
  if (PyBool_Check(v.ptr())) throw invalid();
  // Nor is a bool tensor, whose __index__ gives 0 or 1 (an int is looked at no further).
  if (!PyLong_CheckExact(v.ptr()) && py::hasattr(v, "dtype") &&
      std::string(py::str(v.attr("dtype"))) == "torch.bool")
    throw invalid();
  py::object i = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
  if (!i) {
    PyErr_Clear();
    throw invalid();
  }
  int overflow = 0;
  long long n = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow > 0)
    throw Error(ErrorKind::OutOfBounds, std::string(what) + " must be below 2**63, got " +
                                            std::string(py::str(i)));
  if (overflow < 0 || n < 0)
    throw Error(ErrorKind::OutOfBounds, std::string(what) + " must not be negative, got " +
                                            std::string(py::str(i)));
  return size_t(n);
}

// write_flagged's offsets and rider, checked (OutOfBounds: a negative one).
struct FlaggedArgs {
  size_t lo, ro, n, wo, wro;
  Channel::Rider rider;  // rider.remote null: none
  FlaggedArgs(int64_t local_offset, int64_t remote_offset, int64_t nbytes, int64_t word_offset,
              int64_t word_remote_offset, const std::shared_ptr<RemoteRegion>& rider_remote,
              int64_t rider_offset, uint64_t rider_value, int64_t rider_remote_offset)
      : lo(check_offset(local_offset, "local_offset")),
        ro(check_offset(remote_offset, "remote_offset")),
        n(check_offset(nbytes, "nbytes")),
        wo(check_offset(word_offset, "word_offset")),
        wro(check_offset(word_remote_offset, "word_remote_offset")),
        rider(checked_rider(rider_remote, rider_offset, rider_value, rider_remote_offset)) {}
};

// A wait's timeout from Python, in the core's terms (below 0: no limit): None and infinity
// are no limit, a negative is a look that does not wait, NaN is refused (it would never expire).
// A timeout argument as seconds (-1: none), checked as the Python layers check theirs: None or
// a real number; NaN, a bool or a string is refused (pybind11 took True as 1 s, "x" as a TypeError).
double wait_seconds(const py::object& timeout) {
  if (timeout.is_none()) return -1.0;
  if (py::isinstance<py::bool_>(timeout) || py::isinstance<py::str>(timeout) ||
      py::isinstance<py::bytes>(timeout) || !PyNumber_Check(timeout.ptr()))
    throw Error(ErrorKind::Invalid, "timeout must be a number of seconds or None, got " +
                                        py::repr(timeout).cast<std::string>());
  const double t = timeout.cast<double>();
  if (std::isnan(t)) throw Error(ErrorKind::Invalid, "timeout must be a number of seconds or None, got nan");
  if (std::isinf(t) && t > 0) return -1.0;
  return std::max(t, 0.0);
}

// Waits in short slices so that Ctrl-C reaches Python while a transfer is pending.
bool wait_future(const Future& f, double timeout) {
  if (f->done()) return true;  // the common case, a send's earlier transfer: no GIL hand-off
  auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    double slice = 0.05;
    if (timeout >= 0) {
      double left =
          timeout - std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (left <= 0) return f->done();
      slice = std::min(slice, left);
    }
    bool done;
    {
      py::gil_scoped_release nogil;
      done = f->wait(slice);
    }
    if (done) return true;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

// Waits for f, at most timeout seconds (None: no limit); TimeoutError if it is still pending.
void wait_completed(const Future& f, const py::object& timeout) {
  const double t = wait_seconds(timeout);
  if (!wait_future(f, t))
    throw Error(ErrorKind::Timeout, "transfer did not complete within " + seconds_text(t) + " s");
}

// The error of a completed future, None if it succeeded.
py::object future_exception(const Future& f) {
  if (!f->done() || f->ok()) return py::none();
  py::object cls = py::reinterpret_borrow<py::object>(exc_for(f->error_kind()));
  return cls(f->error());
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "rdmaflow core: the RDMA device (Xue et al., EuroSys '19, Table 1) over UCX";

  exc_base = new_exc(m, "RdmaflowError", {PyExc_RuntimeError}, "Base of every rdmaflow error.");
  exc_bounds = new_exc(m, "OutOfBoundsError", {exc_base, PyExc_IndexError},
                       "An offset or length falls outside a region.");
  exc_peer = new_exc(m, "PeerError", {exc_base, PyExc_ConnectionError},
                     "A peer is unknown, unreachable or dead.");
  exc_auth = new_exc(m, "AuthError", {exc_peer},
                     "A peer does not share this job's secret.");
  exc_region = new_exc(m, "RegionError", {exc_base},
                       "A region was freed, or a descriptor is foreign or forged.");
  exc_closed = new_exc(m, "DeviceClosedError", {exc_base}, "The device is closed.");
  exc_timeout = new_exc(m, "TimeoutError", {exc_base, PyExc_TimeoutError},
                        "A bounded wait ran out.");
  exc_invalid = new_exc(m, "InvalidArgumentError", {exc_base, PyExc_ValueError},
                        "An argument or message is malformed.");
  exc_full = new_exc(m, "ArenaFullError", {exc_base, PyExc_MemoryError},
                     "The registered arena cannot fit an allocation.");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(exc_for(e.kind), e.what());
    }
  });

  py::enum_<Direction>(m, "Direction")
      .value("WRITE", Direction::Write)
      .value("READ", Direction::Read)
      .export_values();

  py::enum_<SameHost>(m, "SameHost",
                      "The same-host fast path: OFF, ON, or AUTO (on unless UCX_TLS rules out "
                      "shared-memory transports).")
      .value("OFF", SameHost::Off)
      .value("ON", SameHost::On)
      .value("AUTO", SameHost::Auto);

  py::enum_<FlaggedWrites>(m, "FlaggedWrites",
                           "How a transfer's data and flag travel over UCX: PUT (the data's put, then the flag's "
                           "once the data's flush completed), "
                           "MESSAGE (one active message the target applies in order), or AUTO "
                           "(MESSAGE on endpoints whose every lane is tcp, PUT elsewhere; on one tcp lane a write "
                           "above the message size puts its flag right behind its data).")
      .value("AUTO", FlaggedWrites::Auto)
      .value("PUT", FlaggedWrites::Put)
      .value("MESSAGE", FlaggedWrites::Message);

  m.def("ucx_version", &ucx_version, "Version of the UCX library in use.");
  m.def(
      "tcp_congestion_of",
      [](const std::string& wanted) { return resolve_tcp_congestion(wanted).effective; },
      py::arg("wanted"),
      "The congestion control a Device(tcp_congestion=wanted) gives UCX's tcp data sockets on "
      "this host (Device.tcp_congestion); raises like the Device for a name this process may not set.");
  m.def("cache_line_handoff_ns", &cache_line_handoff_ns, py::arg("cpu_a"), py::arg("cpu_b"),
        py::arg("seconds"), py::call_guard<py::gil_scoped_release>(),
        "Nanoseconds one cache line takes to move between two cpus, averaged over `seconds` of two "
        "pinned threads handing it back and forth (the benchmarks' host probe). Blocks for about "
        "`seconds`; InvalidArgumentError for a cpu this process may not run on.");
  m.def(
      "_hmac_sha256",
      [](py::bytes key, py::bytes msg) {
        return py::bytes(hmac_sha256_bytes(std::string(key), std::string(msg)));
      },
      py::arg("key"), py::arg("msg"),
      "HMAC-SHA256 of msg under key, as the handshake and descriptors compute it (for tests).");
  m.def("run_callbacks", &run_callbacks,
        "Runs completion callbacks forever; called by one daemon thread.");

  py::class_<FutureState, Future>(m, "Future",
                                  "Completion of an asynchronous memcpy or flush.")
      .def("done", &FutureState::done)
      .def(
          "wait",
          [](const Future& f, const py::object& timeout) {
            return wait_future(f, wait_seconds(timeout));
          },
          py::arg("timeout") = py::none(),
          "Waits until done or timeout seconds pass; returns done().")
      .def(
          "result",
          [](const Future& f, const py::object& timeout) {
            wait_completed(f, timeout);
            if (!f->ok()) throw Error(f->error_kind(), f->error());
          },
          py::arg("timeout") = py::none(),
          "Waits for completion; raises the transfer's error, if any.")
      .def(
          "exception",
          [](const Future& f, const py::object& timeout) {
            wait_completed(f, timeout);
            return future_exception(f);
          },
          py::arg("timeout") = py::none(),
          "Waits for completion, as result() does (and concurrent.futures' exception()); returns "
          "the error the transfer failed with, or None if it succeeded.");

  py::class_<MemRegion, std::shared_ptr<MemRegion>>(m, "MemRegion", py::buffer_protocol(),
                                                     py::dynamic_attr(),
                                                     "Registered memory a peer can reach.")
      .def_property_readonly("id", &MemRegion::id)
      .def_property_readonly("address", &MemRegion::address)
      .def_property_readonly("nbytes", &MemRegion::length)
      .def_property_readonly("cuda_device", &MemRegion::cuda_device,
                             "The CUDA device ordinal of GPU memory; -1 for host memory.")
      .def_property_readonly("freed", &MemRegion::freed)
      .def(
          "descriptor",
          [](const MemRegion& r) {
            auto d = r.descriptor();
            return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
          },
          "Address, length, packed remote key and owner, MAC'd with the job secret.")
      .def(
          "free",
          [](MemRegion& r) {
            py::gil_scoped_release nogil;
            r.free();
          },
          "Revokes peers' access, waits for in-flight use and deregisters the memory. "
          "Tensors viewing the region keep its memory alive.")
      .def(
          "tensor",
          [](py::object self, py::object dtype, py::object shape, py::object offset) {
            // Views need torch, which the core does not link: the device layer makes them.
            return py::module_::import("rdmaflow._views").attr("region_tensor")(self, dtype, shape,
                                                                                offset);
          },
          py::arg("dtype"), py::arg("shape"), py::arg("offset") = 0,
          "A tensor of dtype and shape viewing the region at byte offset, with no copy; it "
          "keeps the region's memory alive.")
      .def_buffer([](MemRegion& r) {
        if (r.cuda_device() >= 0) throw Error(ErrorKind::Invalid, gpu_buffer_error(r));
        return py::buffer_info(reinterpret_cast<void*>(r.address()), 1,
                               py::format_descriptor<uint8_t>::format(), 1,
                               {py::ssize_t(r.length())}, {py::ssize_t(1)});
      });

  py::class_<RemoteRegion, std::shared_ptr<RemoteRegion>>(m, "RemoteRegion",
                                                         "A peer's region, from its descriptor.")
      .def_static(
          "from_descriptor",
          [](py::handle b) {
            return RemoteRegion::parse(bytes_arg(b, "a descriptor (MemRegion.descriptor, Device.lookup)"));
          },
          py::arg("descriptor"))
      .def_readonly("owner_endpoint", &RemoteRegion::owner_endpoint)
      .def_readonly("cuda_device", &RemoteRegion::cuda_device,
                    "The owner's CUDA device ordinal of GPU memory; -1 for host memory.")
      .def_readonly("region_id", &RemoteRegion::region_id)
      .def_readonly("address", &RemoteRegion::addr)
      .def_property_readonly("nbytes", [](const RemoteRegion& r) { return r.length; })
      .def("__repr__", [](const RemoteRegion& r) {
        return "<RemoteRegion " + std::to_string(r.region_id) + " of " + r.owner_endpoint +
               ", " + std::to_string(r.length) + " bytes>";
      });

  py::class_<Channel, std::shared_ptr<Channel>>(m, "Channel",
                                                "A queue pair to one peer (Xue et al. §3.1).")
      .def(
          "memcpy",
          [](Channel& ch, const std::shared_ptr<MemRegion>& local, py::handle local_offset,
             const std::shared_ptr<RemoteRegion>& remote, py::handle remote_offset, py::handle nbytes,
             py::handle direction_obj, py::object callback) {
            const Direction direction = direction_arg(direction_obj);
            size_t lo = offset_arg(local_offset, "local_offset");
            size_t ro = offset_arg(remote_offset, "remote_offset");
            size_t n = offset_arg(nbytes, "nbytes");
            Callback cb = make_callback(callback);
            try {
              return ch.memcpy(local, lo, remote, ro, n, direction, std::move(cb));
            } catch (...) {
              if (!callback.is_none()) Py_DECREF(callback.ptr());
              throw;
            }
          },
          py::arg("local_region"), py::arg("local_offset"), py::arg("remote_region"),
          py::arg("remote_offset"), py::arg("nbytes"), py::arg("direction"),
          py::arg("callback") = py::none(),
          "Asynchronous copy between a local and a remote region. The future completes when "
          "the data is visible at the destination.")
      .def("fence", &Channel::fence,
           "Orders the operations posted after it behind those posted before.")
      .def(
          "flush",
          [](Channel& ch, py::object callback) {
            Callback cb = make_callback(callback);
            try {
              return ch.flush(std::move(cb));
            } catch (...) {
              if (!callback.is_none()) Py_DECREF(callback.ptr());
              throw;
            }
          },
          py::arg("callback") = py::none(),
          "Completes when every WRITE posted before it is visible at the peer.")
      .def(
          "write_flagged",
          [](Channel& ch, const std::shared_ptr<MemRegion>& local, int64_t local_offset,
             const std::shared_ptr<RemoteRegion>& remote, int64_t remote_offset, int64_t nbytes,
             int64_t word_offset, uint64_t value, int64_t word_remote_offset, py::object callback,
             const std::shared_ptr<RemoteRegion>& rider_remote, int64_t rider_offset,
             uint64_t rider_value, int64_t rider_remote_offset,
             const std::shared_ptr<MemRegion>& word_local, const std::shared_ptr<RemoteRegion>& word_remote) {
            FlaggedArgs a(local_offset, remote_offset, nbytes, word_offset, word_remote_offset, rider_remote,
                          rider_offset, rider_value, rider_remote_offset);
            Callback cb = make_callback(callback);
            try {
              return ch.write_flagged(local, a.lo, remote, a.ro, a.n, a.wo, value, a.wro, std::move(cb),
                                      rider_or_null(a.rider), word_local, word_remote);
            } catch (...) {
              if (!callback.is_none()) Py_DECREF(callback.ptr());
              throw;
            }
          },
          py::arg("local_region"), py::arg("local_offset"), py::arg("remote_region"),
          py::arg("remote_offset"), py::arg("nbytes"), py::arg("word_offset"), py::arg("value"),
          py::arg("word_remote_offset"), py::arg("callback") = py::none(),
          py::arg("rider_remote_region") = nullptr, py::arg("rider_offset") = 0,
          py::arg("rider_value") = 0, py::arg("rider_remote_offset") = 0,
          py::arg("word_local_region") = nullptr, py::arg("word_remote_region") = nullptr,
          "One command: WRITE nbytes, then store value at local word_offset and WRITE "
          "it to word_remote_offset. The future completes when both are visible at the peer. "
          "A rider (rider_remote_region given) is a second word for the same peer: rider_value, "
          "stored first at local rider_offset, lands at rider_remote_offset of "
          "rider_remote_region: in the same message on the message path, stored just before "
          "the word; elsewhere as a word of its own right behind it. word_local_region and "
          "word_remote_region (default: the data's) hold the word and the rider's source: host "
          "memory, also for data in GPU memory.")
      .def(
          "slot_sender",
          [](Channel& ch, uintptr_t ack_address, uint64_t closed_value,
             const std::shared_ptr<MemRegion>& local, const std::shared_ptr<RemoteRegion>& remote,
             int64_t nbytes, const std::vector<int64_t>& slot_offsets,
             const std::vector<int64_t>& word_offsets, const std::vector<int64_t>& word_remote_offsets) {
            auto offsets = [](const std::vector<int64_t>& v, const char* what) {
              std::vector<size_t> out;
              for (int64_t o : v) out.push_back(check_offset(o, what));
              return out;
            };
            return std::make_shared<SlotSender>(
                ch.shared_from_this(), ack_address, closed_value, local, remote,
                check_offset(nbytes, "nbytes"), offsets(slot_offsets, "slot_offsets"),
                offsets(word_offsets, "word_offsets"), offsets(word_remote_offsets, "word_remote_offsets"));
          },
          py::arg("ack_address"), py::arg("closed_value"), py::arg("local_region"),
          py::arg("remote_region"), py::arg("nbytes"), py::arg("slot_offsets"),
          py::arg("word_offsets"), py::arg("word_remote_offsets"),
          "A static pair's sends over UCX into host slots (SlotSender), everything but the "
          "transfer's number, source and rider fixed: one slot offset (remote_region), word "
          "offset (local_region) and remote word offset per slot; their count is the depth.")
      .def(
          "slot_receiver",
          [](Channel& ch, const std::shared_ptr<DirectWindow>& window,
             const std::shared_ptr<MemRegion>& local, const std::shared_ptr<RemoteRegion>& remote,
             int64_t ack_remote_offset, const std::vector<uintptr_t>& flag_addresses,
             uintptr_t ctl_address, uint64_t generation) {
            return std::make_shared<SlotReceiver>(ch.shared_from_this(), window, local, remote,
                                                  check_offset(ack_remote_offset, "ack_remote_offset"),
                                                  flag_addresses, ctl_address, generation);
          },
          py::arg("window"), py::arg("local_region"), py::arg("remote_region"),
          py::arg("ack_remote_offset"), py::arg("flag_addresses"), py::arg("ctl_address"),
          py::arg("generation"),
          "A pair's receives from the sender at the other end of this channel (SlotReceiver), "
          "everything but the transfer's number and the ack it owes fixed: window (the sender's "
          "region mapped here, or None over UCX), this receiver's region, the sender's, its ack "
          "word's offset there, one flag address per slot (their count is the depth), the "
          "control word's address and the sender's generation in it.")
      .def_property_readonly("flagged_by_message", &Channel::flagged_by_message,
                             "Whether write_flagged of at most flagged_message_bytes takes the "
                             "message path (data, word and rider in one message); known once "
                             "the endpoint exists.")
      .def_property_readonly_static("flagged_message_bytes",
                                    [](py::object) { return Channel::flagged_message_bytes(); })
      .def_property_readonly_static("striped_write_bytes",
                                    [](py::object) { return Channel::striped_write_bytes(); },
                                    "The smallest static send over tcp that is split over two "
                                    "workers (both devices with num_cqs >= 2).")
      .def("progress_now", &Channel::progress_now, py::call_guard<py::gil_scoped_release>(),
           "Progresses the channel's worker once on the caller's thread, unless another thread "
           "drives it (completions it is owed run here instead of waking a progress thread). "
           "Returns whether that did anything.")
      .def("direct_window", &Channel::direct_window, py::arg("remote_region"),
           py::call_guard<py::gil_scoped_release>(),
           "The peer's region written by the caller's thread (same host, shared memory), or "
           "None where it cannot be mapped.")
      .def_property_readonly("qp_idx", &Channel::qp_idx)
      .def_property_readonly("remote_endpoint", &Channel::remote_endpoint)
      .def_property_readonly("failed", &Channel::failed)
      .def_property_readonly("error", &Channel::error,
                             "Why the channel failed, as UCX or the control link said ('' while "
                             "it has not).");

  bind_pairs(m);  // SlotSender, SlotReceiver, DirectWindow, wait_word, receive_slot

  m.def(
      "cuda_ipc_export",
      [](uintptr_t ptr, int ordinal) {
        auto e = cuda_ipc_export(ptr, ordinal);
        return py::make_tuple(py::bytes(e.first), e.second);
      },
      py::arg("address"), py::arg("cuda_device"),
      "(handle, offset): the CUDA IPC handle of the allocation holding GPU memory at address, "
      "and the address's offset in it.");
  m.def(
      "cuda_ipc_open",
      [](py::bytes handle, int ordinal) { return cuda_ipc_open(std::string(handle), ordinal); },
      py::arg("handle"), py::arg("cuda_device"), py::call_guard<py::gil_scoped_release>(),
      "The base address in this process of a peer's GPU allocation, from its CUDA IPC handle "
      "(opened once per handle; mapped until the process ends).");

  py::class_<Arena, std::shared_ptr<Arena>>(m, "Arena",
                                            "Allocator over one registered region.")
      .def(py::init<std::shared_ptr<MemRegion>, size_t>(), py::arg("region"),
           py::arg("alignment") = 256)
      .def_property_readonly("region", &Arena::region)
      .def_property_readonly("capacity", &Arena::capacity)
      .def_property_readonly("alignment", &Arena::alignment)
      .def_property_readonly("used", &Arena::used)
      .def_property_readonly("largest_free", &Arena::largest_free)
      .def_property_readonly("num_allocations", &Arena::num_allocations)
      .def_property_readonly("num_free_blocks", &Arena::num_free_blocks)
      .def(
          "allocate",
          [](std::shared_ptr<Arena> a, int64_t nbytes) {
            size_t n = check_offset(nbytes, "nbytes");
            auto b = std::make_shared<ArenaBlock>();
            b->offset = a->alloc(n);
            b->length = n;
            b->arena = a;
            return b;
          },
          py::arg("nbytes"), "A block of at least nbytes; freed when the block object dies.");

  py::class_<ArenaBlock, std::shared_ptr<ArenaBlock>>(m, "ArenaBlock", py::buffer_protocol())
      .def_readonly("offset", &ArenaBlock::offset)
      .def_readonly("nbytes", &ArenaBlock::length)
      .def_property_readonly("address",
                             [](const ArenaBlock& b) {
                               return b.arena->region()->address() + b.offset;
                             })
      .def_property_readonly(
          "__cuda_array_interface__",
          [](const ArenaBlock& b) {
            // A block of GPU memory as torch.as_tensor takes it: the tensor keeps the block.
            const MemRegion& r = *b.arena->region();
            if (r.cuda_device() < 0) throw py::attribute_error("a host block has no __cuda_array_interface__");
            py::dict d;
            d["shape"] = py::make_tuple(b.length);
            d["typestr"] = "|u1";
            d["data"] = py::make_tuple(r.address() + b.offset, false);
            d["version"] = 2;
            return d;
          })
      .def_buffer([](ArenaBlock& b) {
        if (b.arena->region()->cuda_device() >= 0)
          throw Error(ErrorKind::Invalid, gpu_buffer_error(*b.arena->region()));
        return py::buffer_info(
            reinterpret_cast<void*>(b.arena->region()->address() + b.offset), 1,
            py::format_descriptor<uint8_t>::format(), 1, {py::ssize_t(b.length)},
            {py::ssize_t(1)});
      });

  m.def(
      "wait_u64_at_least",
      [](uintptr_t addr, uint64_t value, const py::object& timeout) {
        double t = wait_seconds(timeout);
        // Short slices so Ctrl-C reaches Python during a long wait.
        auto t0 = std::chrono::steady_clock::now();
        for (;;) {
          double slice = 0.05;
          if (t >= 0) {
            double left =
                t - std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (left <= 0) slice = 0;
            else slice = std::min(slice, left);
          }
          bool ok;
          {
            py::gil_scoped_release nogil;
            ok = wait_u64_at_least(addr, value, slice);
          }
          if (ok) return true;
          if (t >= 0 && slice == 0) return false;
          if (PyErr_CheckSignals() != 0) throw py::error_already_set();
        }
      },
      py::arg("address"), py::arg("value"), py::arg("timeout") = py::none(),
      "Waits until the 8-byte word at address is >= value; False on timeout.");

  const DeviceConfig defaults;
  py::class_<Device, std::shared_ptr<Device>>(m, "Device", py::dynamic_attr(),
                                              "The RDMA device of Xue et al. §3.1.")
      .def(py::init([](const std::string& endpoint, int num_cqs, int qps_per_peer,
                       const std::string& secret, bool busy_poll, int spin_us,
                       double connect_timeout, double rpc_timeout, bool data_error_handling,
                       SameHost same_host, int copy_threads, bool inline_posts,
                       FlaggedWrites flagged_writes, const std::string& tcp_congestion,
                       const std::string& net_devices) {
             DeviceConfig c;
             c.endpoint = endpoint;
             c.num_cqs = num_cqs;
             c.qps_per_peer = qps_per_peer;
             c.secret = secret;
             c.busy_poll = busy_poll;
             c.spin_us = spin_us;
             c.connect_timeout = connect_timeout;
             c.rpc_timeout = rpc_timeout;
             c.data_error_handling = data_error_handling;
             c.same_host = same_host;
             c.copy_threads = copy_threads;
             c.inline_posts = inline_posts;
             c.flagged_writes = flagged_writes;
             c.tcp_congestion = tcp_congestion;
             c.net_devices = net_devices;
             py::gil_scoped_release nogil;
             return Device::create(c);
           }),
           py::arg("endpoint") = defaults.endpoint, py::kw_only(),
           py::arg("num_cqs") = defaults.num_cqs, py::arg("qps_per_peer") = defaults.qps_per_peer,
           py::arg("secret") = defaults.secret, py::arg("busy_poll") = defaults.busy_poll,
           py::arg("spin_us") = defaults.spin_us,
           py::arg("connect_timeout") = defaults.connect_timeout,
           py::arg("rpc_timeout") = defaults.rpc_timeout,
           py::arg("data_error_handling") = defaults.data_error_handling,
           py::arg("same_host") = defaults.same_host,
           py::arg("copy_threads") = defaults.copy_threads,
           py::arg("inline_posts") = defaults.inline_posts,
           py::arg("flagged_writes") = defaults.flagged_writes,
           py::arg("tcp_congestion") = defaults.tcp_congestion,
           py::arg("net_devices") = defaults.net_devices)
      .def_property_readonly("net_devices", &Device::net_devices,
                             "The network devices UCX may use (UCX_NET_DEVICES, else the "
                             "net_devices given); \"all\" when neither names any.")
      .def_property_readonly("endpoint", &Device::endpoint)
      .def_property_readonly("uuid", &Device::uuid)
      .def_property_readonly("num_cqs", &Device::num_cqs)
      .def_property_readonly("qps_per_peer",
                             [](const Device& d) { return d.config().qps_per_peer; })
      .def_property_readonly("busy_poll", [](const Device& d) { return d.config().busy_poll; })
      .def(
          "transfer_counts",
          [](const Device& d) {
            py::dict r;
            r["mapped"] = d.mapped_ops();
            r["ucx"] = d.ucx_ops();
            r["message"] = d.message_writes();
            r["dropped"] = d.dropped_writes();
            r["word_after_flush"] = d.flushed_words();
            r["word_in_stream"] = d.stream_words();
            r["striped"] = d.striped_writes();
            r["carried"] = d.carried_posts();
            return r;
          },
          "How many memcpys went through a same-host mapping and how many through UCX; how many "
          "flagged writes left as one message, and how many arriving ones were dropped (they "
          "named no live region of this device); of the flagged writes over puts, how many words "
          "were put once their data's flush completed, and how many right behind their data on "
          "one tcp connection; how many static sends were striped over two workers; how many "
          "posts run on the caller's thread handed what was left of them to the progress thread.")
      .def_property_readonly("copy_threads",
                             [](const Device& d) { return d.config().copy_threads; })
      .def_property_readonly("same_host_mapping", &Device::same_host_mapping,
                             "Whether regions from alloc_region() are shared memory that "
                             "same-host peers map (the same-host fast path).")
      .def_property_readonly("tcp_congestion", &Device::tcp_congestion,
                             "The congestion control UCX's tcp data sockets run: the one "
                             "tcp_congestion chose, or the system's.")
      .def_property_readonly("closed", &Device::closed)
      .def("close",
           [](Device& d) {
             py::gil_scoped_release nogil;
             d.close();
           })
      .def("alloc_region", &Device::alloc_region, py::arg("nbytes"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "register_memory",
          [](Device& d, uintptr_t address, size_t nbytes, int cuda_device) {
            return d.register_memory(address, nbytes, cuda_device);
          },
          py::arg("address"), py::arg("nbytes"), py::arg("cuda_device") = -1,
          py::call_guard<py::gil_scoped_release>(),
          "Registers memory the caller keeps alive: host memory, or GPU memory of CUDA device "
          "cuda_device (>= 0).")
      .def_property_readonly("cuda_supported", &Device::cuda_supported,
                             "Whether this UCX can register GPU memory (a CUDA transport is in "
                             "UCX_TLS).")
      .def("channel", &Device::channel, py::arg("remote_endpoint"), py::arg("qp_idx") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def(
          "publish",
          [](Device& d, const std::string& name, py::handle value) {
            d.publish(name, bytes_arg(value, "a published value"));
          },
          py::arg("name"), py::arg("value"))
      .def("unpublish", &Device::unpublish, py::arg("name"))
      .def(
          "lookup",
          [](Device& d, const std::string& ep, const std::string& name, double timeout,
             std::optional<py::bytes> claim) {
            std::string v, expected = claim ? std::string(*claim) : std::string();
            {
              py::gil_scoped_release nogil;
              v = d.lookup(ep, name, timeout, claim ? &expected : nullptr);
            }
            return py::bytes(v);
          },
          py::arg("remote_endpoint"), py::arg("name"), py::arg("timeout") = -1.0, py::arg("claim") = py::none(),
          "The value the device at remote_endpoint published under name (timeout < 0: rpc_timeout). "
          "claim: the value looked up before; the name is also claimed, once for its life, if it "
          "still holds that value (InvalidArgumentError otherwise, or once claimed).")
      .def("ucx_info", &Device::ucx_info);
}
