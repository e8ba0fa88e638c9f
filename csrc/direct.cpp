// The direct path of transfer pairs: a same-host peer's shared region written by the caller's
// own thread (DirectWindow), and a receiver's whole recv as one call (receive_slot). Nothing
// here goes through a progress thread: on one host a transfer is a copy into the mapped slot
// and a release store of its flag, which the receiver's acquire load pairs with.
#include <cstring>

#include "internal.hpp"

namespace rdmaflow {

std::shared_ptr<DirectWindow> Channel::direct_window(const std::shared_ptr<RemoteRegion>& remote) {
  auto dev = open_device();
  if (!remote) throw Error(ErrorKind::Invalid, "remote region is None");
  check_peer_region(*dev, *remote);
  if (failed_.load()) throw Error(ErrorKind::Peer, error());
  dev->ensure_validated(peer_, *remote);
  auto m = dev->map_remote(*remote);
  if (!m) return nullptr;
  auto w = std::make_shared<DirectWindow>();
  w->dev_ = dev;
  w->ch_ = shared_from_this();
  w->remote_ = remote;
  w->map_ = std::move(m);
  return w;
}

size_t DirectWindow::length() const { return remote_->length; }

uintptr_t DirectWindow::address() const { return reinterpret_cast<uintptr_t>(map_->base); }

void DirectWindow::check_bounds(size_t off, size_t n) const {
  check_inside(off, n, remote_->length, "remote");
}

std::shared_ptr<Device> DirectWindow::check_live() const {
  auto dev = dev_.lock();
  if (!dev || dev->closed()) throw Error(ErrorKind::Closed, "device is closed");
  if (ch_->failed()) throw Error(ErrorKind::Peer, ch_->error());
  if (dev->revoked(remote_->owner_uuid, remote_->region_id))
    throw Error(ErrorKind::Region, "remote region " + std::to_string(remote_->region_id) +
                                       " was freed by its owner at " + remote_->owner_endpoint);
  return dev;
}

void DirectWindow::check_word(size_t off) const {
  check_bounds(off, 8);
  if (off & 7) throw Error(ErrorKind::Invalid, "a word's offset must be 8-byte aligned, got " + std::to_string(off));
}

void DirectWindow::copy(Device& dev, size_t off, const void* src, size_t n) {
  if (n == 0) return;
  // copy_mapped fences non-temporal stores, so a later release store orders after them.
  dev.copy_mapped(static_cast<char*>(map_->base) + off, src, n);
  dev.mapped_ops_.fetch_add(1, std::memory_order_relaxed);
}

void DirectWindow::store(size_t off, uint64_t v) {
  __atomic_store_n(reinterpret_cast<uint64_t*>(static_cast<char*>(map_->base) + off), v,
                   __ATOMIC_RELEASE);
}

void DirectWindow::write(size_t off, const void* src, size_t n) {
  check_bounds(off, n);
  copy(*check_live(), off, src, n);
}

void DirectWindow::store_word(size_t off, uint64_t v) {
  check_word(off);
  check_live();
  store(off, v);
}

WaitStatus DirectWindow::send_slot(uintptr_t ack_addr, int64_t need, uint64_t closed_value,
                                   size_t data_off, const void* src, size_t n, size_t flag_off,
                                   uint64_t k, double timeout_s, size_t header_off,
                                   const void* header, size_t header_n) {
  check_bounds(data_off, n);
  check_bounds(header_off, header_n);
  check_word(flag_off);
  WaitStatus st = wait_credit(ack_addr, need, closed_value, timeout_s, ch_.get(), false);
  if (st != WaitStatus::Ok) return st;
  auto dev = check_live();  // once for the header, the data and the flag
  copy(*dev, header_off, header, header_n);
  copy(*dev, data_off, src, n);
  store(flag_off, k);
  return WaitStatus::Ok;
}

WaitStatus receive_slot(uintptr_t flag_addr, uint64_t k, uintptr_t ctl_addr, uint64_t generation,
                        const Channel* peer, double timeout_s, DirectWindow* ack, size_t ack_off,
                        uint64_t ack_value, bool drive) {
  if (ack) ack->store_word(ack_off, ack_value);
  WaitStatus st = wait_word(flag_addr, k, timeout_s, peer, drive);
  if (st != WaitStatus::Ok) return st;
  if (__atomic_load_n(reinterpret_cast<const uint64_t*>(ctl_addr), __ATOMIC_ACQUIRE) != generation)
    return WaitStatus::OtherSender;
  if (__atomic_load_n(reinterpret_cast<const uint64_t*>(flag_addr), __ATOMIC_ACQUIRE) != k)
    return WaitStatus::Mismatch;
  return WaitStatus::Ok;
}

}  // namespace rdmaflow
