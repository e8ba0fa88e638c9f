// Python bindings of a static pair's data path (transfer/pair.py): one call per send or receive,
// with the GIL released, on UCX (SlotSender, SlotReceiver) or on a same-host mapping written by
// the caller's thread (DirectWindow, wait_word, receive_slot). They only bind.
#include "bindings.hpp"

namespace rdmaflow::bindings {

namespace {

// SlotSender::send with the GIL released.
py::tuple slot_send(SlotSender& s, uint64_t k, int64_t local_offset, double timeout,
                    const Channel::Rider* rider) {
  size_t lo = check_offset(local_offset, "local_offset");
  std::pair<WaitStatus, Future> r;
  {
    py::gil_scoped_release nogil;
    r = s.send(k, lo, timeout, rider);
  }
  return status_and_future(r);
}

}  // namespace

void bind_pairs(py::module_& m) {
  py::class_<SlotSender, std::shared_ptr<SlotSender>>(
      m, "SlotSender",
      "A static pair's sends over UCX into host slots with all but the transfer's number and "
      "source fixed (Channel.slot_sender). Not thread-safe.")
      .def(
          "send",
          [](SlotSender& s, uint64_t k, int64_t local_offset, double timeout) {
            return slot_send(s, k, local_offset, timeout, nullptr);
          },
          py::arg("k"), py::arg("local_offset"), py::arg("timeout"),
          "Transfer k (>= 1) from local_offset of the local region into slot (k - 1) % depth, in "
          "one call with the GIL released: waits until the ack word is >= k - depth and below "
          "closed_value (driving the worker; bounded by timeout), then posts write_flagged. "
          "Returns (code, future): (0, the write's future), or before posting anything (1 "
          "timeout, 2 peer failed, 3 receiver closed; None).")
      .def(
          "send_with_rider",
          [](SlotSender& s, uint64_t k, int64_t local_offset, double timeout,
             const std::shared_ptr<RemoteRegion>& rider_remote, int64_t rider_offset,
             uint64_t rider_value, int64_t rider_remote_offset) {
            Channel::Rider rider = checked_rider(rider_remote, rider_offset, rider_value, rider_remote_offset);
            return slot_send(s, k, local_offset, timeout, rider_or_null(rider));
          },
          py::arg("k"), py::arg("local_offset"), py::arg("timeout"), py::arg("rider_remote_region"),
          py::arg("rider_offset"), py::arg("rider_value"), py::arg("rider_remote_offset"),
          "send() with a rider (write_flagged's): a second word for the same peer. A separate "
          "method, not optional arguments of send: pybind11's defaults cost a small send more "
          "than the call itself.");

  py::class_<SlotReceiver, std::shared_ptr<SlotReceiver>>(
      m, "SlotReceiver",
      "A pair's receives with all but the transfer's number and the ack it owes fixed "
      "(Channel.slot_receiver). Not thread-safe.")
      .def(
          "recv",
          [](SlotReceiver& r, uint64_t k, uint64_t ack_value, int64_t ack_offset, double timeout) {
            size_t ao = check_offset(ack_offset, "ack_offset");
            std::pair<WaitStatus, Future> res;
            {
              py::gil_scoped_release nogil;
              res = r.recv(k, ack_value, ao, timeout);
            }
            return status_and_future(res);
          },
          py::arg("k"), py::arg("ack_value"), py::arg("ack_offset"), py::arg("timeout"),
          "Transfer k (>= 1), in one call with the GIL released: hands back transfer ack_value "
          "first (0: none; over UCX a write from ack_offset of the local region), then waits "
          "for k's flag (driving the worker over UCX; bounded by timeout) and checks it and "
          "the sender's generation. Returns (code, the ack's future or None); codes as "
          "receive_slot's.");

  py::class_<DirectWindow, std::shared_ptr<DirectWindow>>(
      m, "DirectWindow",
      "A same-host peer's region mapped here and written by the caller's own thread: a call "
      "returns when its stores are done; data written before store_word() is visible to a "
      "reader that loads that word with acquire semantics.")
      .def_property_readonly("nbytes", &DirectWindow::length)
      .def_property_readonly("address", &DirectWindow::address,
                             "Where the peer's region is mapped in this process, valid while this "
                             "window lives: loads from it read the peer's memory in place.")
      .def(
          "write",
          [](DirectWindow& w, int64_t offset, uintptr_t address, int64_t nbytes) {
            size_t o = check_offset(offset, "offset");
            size_t n = check_offset(nbytes, "nbytes");
            py::gil_scoped_release nogil;
            w.write(o, reinterpret_cast<const void*>(address), n);
          },
          py::arg("offset"), py::arg("address"), py::arg("nbytes"),
          "Copies nbytes from address (this process's memory) to the peer's region at offset.")
      .def(
          "store_word",
          [](DirectWindow& w, int64_t offset, uint64_t value) {
            w.store_word(check_offset(offset, "offset"), value);
          },
          py::arg("offset"), py::arg("value"), "A release store of an 8-byte word at offset.")
      .def(
          "send_slot",
          [](DirectWindow& w, uintptr_t ack_address, int64_t need, uint64_t closed_value,
             int64_t data_offset, uintptr_t source, int64_t nbytes, int64_t flag_offset,
             uint64_t seq, double timeout, int64_t header_offset, uintptr_t header,
             int64_t header_nbytes) {
            size_t d = check_offset(data_offset, "data_offset");
            size_t n = check_offset(nbytes, "nbytes");
            size_t f = check_offset(flag_offset, "flag_offset");
            size_t ho = check_offset(header_offset, "header_offset");
            size_t hn = check_offset(header_nbytes, "header_nbytes");
            py::gil_scoped_release nogil;
            return int(w.send_slot(ack_address, need, closed_value, d,
                                   reinterpret_cast<const void*>(source), n, f, seq, timeout, ho,
                                   reinterpret_cast<const void*>(header), hn));
          },
          py::arg("ack_address"), py::arg("need"), py::arg("closed_value"),
          py::arg("data_offset"), py::arg("source"), py::arg("nbytes"), py::arg("flag_offset"),
          py::arg("seq"), py::arg("timeout"), py::arg("header_offset") = 0, py::arg("header") = 0,
          py::arg("header_nbytes") = 0,
          "A static or bounded pair's send: waits for ack >= need, copies the header (a size "
          "record) and the data, stores seq into the flag. "
          "Returns a WaitStatus code (0 sent; 1 timeout, 2 peer failed, 3 receiver closed: "
          "nothing written).");

  m.def(
      "wait_word",
      [](uintptr_t address, uint64_t value, double timeout, const std::shared_ptr<Channel>& peer,
         bool drive) {
        py::gil_scoped_release nogil;
        return int(wait_word(address, value, timeout, peer.get(), drive));
      },
      py::arg("address"), py::arg("value"), py::arg("timeout"), py::arg("peer") = py::none(),
      py::arg("drive") = false,
      "Waits until the 8-byte word at address is >= value, watching peer (and progressing its "
      "worker with drive). Returns a WaitStatus code (0 ok, 1 timeout, 2 peer failed).");

  m.def(
      "receive_slot",
      [](uintptr_t flag_address, uint64_t seq, uintptr_t ctl_address, uint64_t generation,
         const std::shared_ptr<Channel>& peer, double timeout,
         const std::shared_ptr<DirectWindow>& ack, int64_t ack_offset, uint64_t ack_value,
         bool drive) {
        size_t ao = check_offset(ack_offset, "ack_offset");
        py::gil_scoped_release nogil;
        return int(receive_slot(flag_address, seq, ctl_address, generation, peer.get(), timeout,
                                ack.get(), ao, ack_value, drive));
      },
      py::arg("flag_address"), py::arg("seq"), py::arg("ctl_address"), py::arg("generation"),
      py::arg("peer"), py::arg("timeout"), py::arg("ack") = py::none(), py::arg("ack_offset") = 0,
      py::arg("ack_value") = 0, py::arg("drive") = false,
      "A receiver's recv of transfer seq: the ack through `ack` (None: none here), the wait on "
      "the flag (progressing the peer channel's worker with drive), the checks. Returns a WaitStatus code (0 ok, 1 timeout, 2 peer failed, "
      "4 another sender, 5 a later transfer in the flag).");
}

}  // namespace rdmaflow::bindings
