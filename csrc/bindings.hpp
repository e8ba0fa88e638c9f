// What the bindings' files share (bindings.cpp binds the core, bindings_pairs.cpp a static
// pair's one-call sends and receives): pybind11 with the same casters in every file, and the
// argument checks both use. Never seen by the core.
#pragma once

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <utility>

#include "rdmaflow.hpp"

namespace rdmaflow::bindings {

namespace py = pybind11;

// v as an offset or size; OutOfBounds naming `what` when it is negative.
size_t check_offset(int64_t v, const char* what);
// A rider from Python's four arguments, its offsets checked; rider_remote null: none (remote
// stays null and the offsets are not looked at).
Channel::Rider checked_rider(const std::shared_ptr<RemoteRegion>& rider_remote, int64_t rider_offset,
                             uint64_t rider_value, int64_t rider_remote_offset);
// What the core takes for a rider: null where there is none.
const Channel::Rider* rider_or_null(const Channel::Rider& r);
// (code, future or None) of a send or a receive.
py::tuple status_and_future(const std::pair<WaitStatus, Future>& r);

// SlotSender, SlotReceiver, DirectWindow, wait_word and receive_slot (bindings_pairs.cpp).
void bind_pairs(py::module_& m);

}  // namespace rdmaflow::bindings
