// A large static send over tcp, striped over two workers (docs/transfer.md, "Large sends over
// tcp are striped over two workers"): write_flagged(stripe=) puts the first half on this
// channel and the second on the channel of qp q ^ 1, which has another worker, progress thread
// and tcp connection on each side. The flag is put once both halves' flushes have completed:
// a fence of one worker orders nothing on another.
#include "internal.hpp"

namespace rdmaflow {

namespace {
// Writes of at least this many bytes are striped (docs/benchmarks.md: below it the second
// connection gained nothing, and 1 MiB lost its inline post).
constexpr size_t kStripeMinBytes = size_t(4) << 20;
}  // namespace

size_t Channel::striped_write_bytes() { return kStripeMinBytes; }

std::shared_ptr<Channel> Channel::stripe_partner(Device& dev, size_t n, const MemRegion& local,
                                                 const RemoteRegion& remote) {
  // Over loopback tcp on two cores, two connections each with its own thread on both sides
  // move a large write faster than one (docs/benchmarks.md); elsewhere one put is the transport's.
  if (n < kStripeMinBytes || !sockets_only_.load(std::memory_order_relaxed) ||
      dev.same_host_mapping() || local.cuda_device() >= 0 || remote.cuda_device >= 0 ||
      dev.num_cqs() < 2 || peer_->num_workers < 2)
    return nullptr;
  std::lock_guard<std::mutex> lk(stripe_m_);
  auto p = stripe_.lock();
  if (!p) {
    p = dev.channel_at(peer_, qp_ ^ 1);  // qp_ ± 1: another worker on both sides
    stripe_ = p;
  }
  return p->failed() ? nullptr : p;
}

std::pair<size_t, Op*> Channel::stripe_halves(Channel& far, size_t n,
                                              const std::shared_ptr<MemRegion>& local,
                                              const std::shared_ptr<RemoteRegion>& remote,
                                              const std::shared_ptr<FutureJoin>& parts,
                                              Future& data_fut) {
  const size_t near_n = ((n / 2) + 4095) & ~size_t(4095);
  auto both = std::make_shared<FutureState>();
  auto halves = std::make_shared<FutureJoin>(both, 2);
  data_fut->on_complete = [parts, halves](const Future& f) {
    parts->part_done(f);
    halves->part_done(f);
  };
  auto far_fut = std::make_shared<FutureState>();
  // The far half completes on far's thread: when it is the second, it wakes this channel's
  // thread with a command, whose drive puts the word that waits there (post_ready_words).
  far_fut->on_complete = [parts, halves, home = thread_](const Future& f) {
    parts->part_done(f);
    if (halves->part_done(f)) home->post([] {});
  };
  data_fut = both;
  return {near_n, far.make_op(far_fut, local, remote)};
}

bool Channel::post_far_half(Channel& far, Op* far_op, size_t local_off, size_t remote_off,
                            size_t n) {
  ProgressThread* ft = far.thread_;
  Path path{local_off, remote_off, n, true};
  if (!far.post_data(n, far_op->fut, [far_op, ft, path] {
        ft->track(far_op);
        path.ucx(ft, far_op);
      })) {
    unpost(far_op);
    return false;
  }
  striped_posted_.fetch_add(1, std::memory_order_relaxed);
  if (auto dev = dev_.lock()) dev->striped_writes_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void Channel::drain_striped(Device& dev) {
  const uint64_t posted = striped_posted_.load(std::memory_order_relaxed);
  if (striped_flagged_.load(std::memory_order_acquire) >= posted) return;
  // The caller drives this channel's worker while it waits, as a receiver does (wait.cpp).
  const double timeout = dev.config().rpc_timeout;
  const WaitStatus st = wait_word(reinterpret_cast<uintptr_t>(&striped_flagged_), posted, timeout, this, true);
  if (st == WaitStatus::PeerFailed) throw Error(ErrorKind::Peer, error());
  if (st != WaitStatus::Ok)
    throw Error(ErrorKind::Timeout, "timed out after " + seconds_text(timeout) +
                                        " s waiting for a striped write to " + peer_->endpoint +
                                        " to land before a fence or flush");
}

}  // namespace rdmaflow
