// Channels (queue pairs): making one, and the operations posted on it. memcpy checks its
// arguments on the caller's thread, then runs on the channel's progress thread through one of
// two paths: the same-host mapping (one CPU copy) or UCX (a put or get, plus an endpoint flush
// for a WRITE). Ordering follows UCX's documented semantics: operations on one endpoint are
// ordered only by ucp_worker_fence, and a put is visible at the target once a flush covering
// it completes (ucp_put_nbx, ucp_ep_flush_nbx).
#include <tuple>

#include "internal.hpp"
#include "wire.hpp"

namespace rdmaflow {

namespace {
// Completes op with st now: no other completion of it is pending.
void finish_now(ProgressThread* t, Op* op, ucs_status_t st) {
  op->pending = 1;
  t->op_note(op, st);
}
}  // namespace

void Channel::Path::sent(void* req, ucs_status_t st, void* user) {
  Op* op = static_cast<Op*>(user);
  op->ch->thread_->op_note(op, st);
  ucp_request_free(req);
}

bool Channel::Path::same_host(ProgressThread* t, Op* op) const {
  Channel* ch = op->ch.get();
  // Only when no UCX operation of this channel is outstanding, so that fences keep ordering
  // mapped and UCX operations; never for GPU memory, which a CPU copy cannot reach.
  if (ch->rma_pending_ != 0 || ch->failed() || op->gpu()) return false;
  Device* dev = t->device();
  if (dev->closed()) {  // close() cancels what has not started
    finish_now(t, op, UCS_ERR_CANCELED);
    return true;
  }
  Mapping* m = ch->mapping_for(*op->remote);
  if (!m) return false;
  if (ch->am_pending_ != 0) {  // a message may still be on its way: flush, and take UCX's path
    if (ch->am_unflushed_ != 0) t->mark_dirty(ch);
    return false;
  }
  char* l = reinterpret_cast<char*>(op->local->addr_) + local_off;
  char* r = static_cast<char*>(m->base) + remote_off;
  if (write)
    dev->copy_mapped(r, l, n);
  else
    dev->copy_mapped(l, r, n);
  dev->mapped_ops_.fetch_add(1, std::memory_order_relaxed);
  finish_now(t, op, UCS_OK);
  return true;
}

void Channel::Path::ucx(ProgressThread* t, Op* op) const {
  Channel* ch = op->ch.get();
  op->pending = write ? 2 : 1;  // a WRITE also waits for its flush
  if (!ch->ensure_ep()) {
    finish_now(t, op, UCS_ERR_CONNECTION_RESET);
    return;
  }
  ucp_rkey_h rk = ch->rkey_for(*op->remote);
  if (!rk) {
    finish_now(t, op, UCS_ERR_INVALID_PARAM);
    return;
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = sent;
  p.user_data = op;
  if (op->local->memh_) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = op->local->memh_;
  }
  void* laddr = reinterpret_cast<char*>(op->local->addr_) + local_off;
  uint64_t raddr = op->remote->addr + remote_off;
  op->rma = true;
  ++ch->rma_pending_;
  t->device()->ucx_ops_.fetch_add(1, std::memory_order_relaxed);
  ucs_status_ptr_t sp = write ? ucp_put_nbx(ch->ep_, laddr, n, raddr, rk, &p)
                              : ucp_get_nbx(ch->ep_, laddr, n, raddr, rk, &p);
  if (UCS_PTR_IS_ERR(sp)) {
    finish_now(t, op, UCS_PTR_STATUS(sp));
    return;
  }
  if (write) {
    ch->unflushed_.push_back(op);
    t->mark_dirty(ch);
  }
  if (sp == nullptr) t->op_note(op, UCS_OK);
}

// ---------------------------------------------------------------------------------------------
std::shared_ptr<Channel> Device::channel(const std::string& remote_endpoint, int qp_idx) {
  check_open();
  if (qp_idx < 0 || qp_idx >= cfg_.qps_per_peer)
    throw Error(ErrorKind::OutOfBounds, "qp_idx " + std::to_string(qp_idx) +
                                            " is outside [0, " +
                                            std::to_string(cfg_.qps_per_peer) + ")");
  return channel_at(connect(remote_endpoint), qp_idx);
}

std::shared_ptr<Channel> Device::channel_at(const std::shared_ptr<Peer>& p, int qp_idx) {
  check_open();
  std::shared_ptr<Channel> ch;
  {
    std::lock_guard<std::mutex> lk(p->m);
    auto it = p->channels.find(qp_idx);
    if (it != p->channels.end()) {
      ch = it->second;
    } else {
      ch = std::make_shared<Channel>();
      ch->dev_ = weak_from_this();
      ch->peer_ = p;
      ch->qp_ = qp_idx;
      // Figure 4 of Xue et al.: a peer's queue pairs are spread round-robin over the CQs.
      ch->thread_ = threads_[size_t(qp_idx) % threads_.size()].get();
      ch->drivers_ = ch->thread_->drivers();
      ch->remote_thread_ = qp_idx % p->num_workers;
      p->channels[qp_idx] = ch;
    }
  }
  open_channel(p, ch);
  return ch;
}

// Opening a channel (docs/architecture.md, "Opening a channel"): this device's endpoint to the
// peer's worker first, on the channel's thread; then OPEN_CHANNEL, which has the peer make its
// endpoint of the same qp back to this worker, unless it has one. Only then does anything travel
// on the channel, so neither side creates a data endpoint to the other while a put of the other's
// is arriving (ProgressThread::data_eps_ says why that matters).
void Device::open_channel(const std::shared_ptr<Peer>& p, const std::shared_ptr<Channel>& ch) {
  std::lock_guard<std::mutex> lk(ch->open_m_);
  if (ch->opened_) return;
  auto made = std::make_shared<FutureState>();
  if (!ch->thread_->post([ch, made] {
        if (ch->ensure_ep())
          made->complete_ok();
        else
          made->complete_error(ErrorKind::Peer, ch->error());
      }))
    throw Error(ErrorKind::Closed, "device is closed");
  if (!made->wait(cfg_.rpc_timeout))
    throw Error(ErrorKind::Timeout, "timed out after " + seconds_text(cfg_.rpc_timeout) +
                                        " s creating an endpoint to " + p->endpoint);
  if (!made->ok()) throw Error(made->error_kind(), made->error());
  Writer w;
  w.u32(uint32_t(ch->qp_));
  w.str(ch->thread_->address());
  const std::string what = "channel " + std::to_string(ch->qp_) + " to " + p->endpoint;
  call(p->link, OPEN_CHANNEL, w.s, "connection is closed", cfg_.rpc_timeout, "opening " + what,
       ErrorKind::Peer, [&](const std::string& why) { return "cannot open " + what + ": " + why; });
  ch->opened_ = true;
}

// The peer's side of OPEN_CHANNEL (progress thread 0): its worker for qp makes the endpoint back
// to the opener's worker, unless one exists (the peer opened that channel first, or made it
// ahead already), and thread 0 answers.
void Device::answer_open_channel(Link* l, uint64_t req, uint32_t qp, const std::string& worker_addr) {
  ProgressThread* t = threads_[qp % threads_.size()].get();
  const uint64_t uuid = l->remote_uuid;
  ProgressThread* t0 = threads_[0].get();
  t->post([this, t, t0, l, req, uuid, qp, worker_addr] {
    std::string why;
    const bool ok = t->prepare_data_ep(uuid, int(qp), worker_addr, &why);
    Writer w;
    w.u32(ok);
    w.str(why);
    t0->post([this, l, req, payload = w.s] { send_ctrl(l, OPEN_CHANNEL_REPLY, req, payload); });
  });
}

bool Channel::progress_now() const {
  auto dev = dev_.lock();
  return dev && !dev->closed() && thread_->progress_now();
}

void Channel::hand_back() const {
  auto dev = dev_.lock();
  if (dev && !dev->closed()) thread_->hand_back();
}

std::string Channel::remote_endpoint() const { return peer_->endpoint; }

std::string Channel::error() const {
  std::lock_guard<std::mutex> lk(m_);
  return error_;
}

void Channel::fail(const std::string& why) {
  std::lock_guard<std::mutex> lk(m_);
  if (!failed_.load()) {
    error_ = why;
    failed_.store(true);
  }
}

std::shared_ptr<Device> Channel::open_device() const {
  auto dev = dev_.lock();
  if (!dev) throw Error(ErrorKind::Closed, "device is closed");
  dev->check_open();
  return dev;
}

std::shared_ptr<Device> Channel::check_range(const std::shared_ptr<MemRegion>& local,
                                             size_t local_off,
                                             const std::shared_ptr<RemoteRegion>& remote,
                                             size_t remote_off, size_t n) {
  auto dev = open_device();
  if (!local) throw Error(ErrorKind::Invalid, "local region is None");
  if (!remote) throw Error(ErrorKind::Invalid, "remote region is None");
  if (local->dev_.lock() != dev)
    throw Error(ErrorKind::Invalid, "local region " + std::to_string(local->id()) +
                                        " belongs to another device");
  if (local->freed())
    throw Error(ErrorKind::Region, "local region " + std::to_string(local->id()) + " was freed");
  check_inside(local_off, n, local->length(), "local");
  check_peer_region(*dev, *remote);
  check_inside(remote_off, n, remote->length, "remote");
  if (dev->revoked(remote->owner_uuid, remote->region_id))
    throw Error(ErrorKind::Region, "remote region " + std::to_string(remote->region_id) +
                                       " was freed by its owner at " + remote->owner_endpoint);
  if (failed_.load()) throw Error(ErrorKind::Peer, error());
  dev->ensure_validated(peer_, *remote);
  return dev;
}

void Channel::check_peer_region(Device& dev, RemoteRegion& remote) const {
  dev.verify_remote(remote);
  if (remote.owner_uuid != peer_->uuid)
    throw Error(ErrorKind::Invalid, "remote region is owned by the device at " +
                                        remote.owner_endpoint +
                                        ", but this channel connects to " + peer_->endpoint);
}

Op* Channel::make_op(const Future& fut, const std::shared_ptr<MemRegion>& local,
                     const std::shared_ptr<RemoteRegion>& remote) {
  Op* op = new Op;
  op->fut = fut;
  op->local = local;
  op->remote = remote;
  op->ch = shared_from_this();
  local->inflight_.fetch_add(1);
  return op;
}

namespace {
// Posts of at most this many bytes may run on the caller's thread (post_inline). A larger copy
// (through a same-host mapping, or cma) would make memcpy synchronous and take the caller's
// thread for milliseconds; it goes to the progress thread and memcpy stays asynchronous.
constexpr size_t kInlineMaxBytes = size_t(64) << 10;
// Over sockets alone a post copies nothing on the caller's thread (the kernel takes the buffer),
// so posts up to this size run there too, and the progress thread carries what the socket could
// not take yet (post_inline's carry).
constexpr size_t kInlineSocketMaxBytes = size_t(1) << 20;
}  // namespace

bool Channel::post_data(size_t n, const Future& fut, std::function<void()> task) {
  if (n <= kInlineMaxBytes) return thread_->post_inline(std::move(task));
  if (n <= kInlineSocketMaxBytes && sockets_only_.load(std::memory_order_relaxed))
    return thread_->post_inline(std::move(task), fut.get());
  return thread_->post(std::move(task));
}

void Channel::unpost(Op* op) {
  op->local->inflight_.fetch_sub(1);
  delete op;
}

Future Channel::memcpy(const std::shared_ptr<MemRegion>& local, size_t local_off,
                       const std::shared_ptr<RemoteRegion>& remote, size_t remote_off, size_t n,
                       Direction dir, Callback cb) {
  check_range(local, local_off, remote, remote_off, n);
  auto fut = std::make_shared<FutureState>();
  fut->on_complete = std::move(cb);
  if (n == 0) {
    fut->complete_ok();
    return fut;
  }
  Op* op = make_op(fut, local, remote);
  ProgressThread* t = thread_;
  Path path{local_off, remote_off, n, dir == Direction::Write};
  auto task = [op, t, path]() {
    t->track(op);
    if (!path.same_host(t, op)) path.ucx(t, op);
  };
  if (!post_data(n, fut, std::move(task))) {
    unpost(op);
    throw Error(ErrorKind::Closed, "device is closed");
  }
  return fut;
}

Future Channel::write_flagged(const std::shared_ptr<MemRegion>& local, size_t local_off,
                              const std::shared_ptr<RemoteRegion>& remote, size_t remote_off,
                              size_t n, size_t word_local_off, uint64_t value,
                              size_t word_remote_off, Callback cb, const Rider* rider,
                              const std::shared_ptr<MemRegion>& word_local_region,
                              const std::shared_ptr<RemoteRegion>& word_remote_region,
                              bool stripe) {
  auto dev = check_range(local, local_off, remote, remote_off, n);
  const std::shared_ptr<MemRegion>& wl = word_local_region ? word_local_region : local;
  const std::shared_ptr<RemoteRegion>& wr = word_remote_region ? word_remote_region : remote;
  if (wl != local || wr != remote) {
    check_range(wl, word_local_off, wr, word_remote_off, 8);
  } else {
    check_inside(word_local_off, 8, local->length(), "local");  // the rest is checked above
    check_inside(word_remote_off, 8, remote->length, "remote");
  }
  // Flags and metadata stay in host memory, where the receiving CPU polls them (Xue et al. §3.5).
  if (wl->cuda_device() >= 0 || wr->cuda_device >= 0)
    throw Error(ErrorKind::Invalid, std::string("the flag word's ") +
                                        (wl->cuda_device() >= 0 ? "local" : "remote") +
                                        " region is GPU memory; a flag lives in host memory");
  if (rider) {
    check_range(wl, rider->local_off, rider->remote, rider->remote_off, 8);
    if (rider->remote->cuda_device >= 0)
      throw Error(ErrorKind::Invalid, "the rider's remote region is GPU memory; a word lives in host memory");
    if (rider->local_off == word_local_off)
      throw Error(ErrorKind::Invalid, "the rider's source word is the write's own word");
  }
  std::shared_ptr<Channel> far = stripe ? stripe_partner(*dev, n, *local, *remote) : nullptr;
  // The caller's future completes when every part has: ok only if all are.
  auto fut = std::make_shared<FutureState>();
  fut->on_complete = std::move(cb);
  auto parts = std::make_shared<FutureJoin>(fut, (n ? 2 : 1) + (rider ? 1 : 0) + (far ? 1 : 0));
  auto part = [&](const std::shared_ptr<MemRegion>& l, const std::shared_ptr<RemoteRegion>& r) {
    auto f = std::make_shared<FutureState>();
    f->on_complete = [parts](const Future& done) { parts->part_done(done); };
    return std::make_pair(f, make_op(f, l, r));
  };
  Op* data = nullptr;
  Future data_fut;
  if (n) std::tie(data_fut, data) = part(local, remote);
  // Striped (stripe.cpp): this channel puts the first near_n bytes and `far` the rest; the word
  // waits for data_fut, which is then both halves' flushes.
  size_t near_n = n;
  Op* far_op = nullptr;
  if (far) std::tie(near_n, far_op) = stripe_halves(*far, n, local, remote, parts, data_fut);
  Op* word = part(wl, wr).second;
  RiderPost rp;
  if (rider) {
    rp = {part(wl, rider->remote).second, *rider};
    __atomic_store_n(reinterpret_cast<uint64_t*>(wl->addr_ + rider->local_off), rider->value,
                     __ATOMIC_RELEASE);
  }
  __atomic_store_n(reinterpret_cast<uint64_t*>(wl->addr_ + word_local_off), value,
                   __ATOMIC_RELEASE);
  ProgressThread* t = thread_;
  // The far half first, so that both threads start at once.
  if (far_op && !post_far_half(*far, far_op, local_off + near_n, remote_off + near_n, n - near_n)) {
    for (Op* op : {data, word, rp.op})
      if (op) unpost(op);
    throw Error(ErrorKind::Closed, "device is closed");
  }
  Path data_path{local_off, remote_off, near_n, true};
  Path word_path{word_local_off, word_remote_off, 8, true};
  const bool striped = far_op != nullptr;
  auto task = [data, data_fut, word, t, data_path, word_path, value, rp, striped]() {
    t->track(word);
    if (data) t->track(data);
    if (rp.op) t->track(rp.op);
    if (post_flagged(t, data, data_fut, word, data_path, word_path, value, rp.op ? &rp : nullptr,
                     striped) ||
        !rp.op)
      return;
    post_flagged(t, nullptr, nullptr, rp.op, Path{0, 0, 0, true},
                 Path{rp.rider.local_off, rp.rider.remote_off, 8, true}, rp.rider.value, nullptr);
  };
  if (!post_data(near_n, fut, std::move(task))) {
    // The far half, if posted, is cancelled by close(); its part completes a future no one has.
    if (striped) striped_flagged_.fetch_add(1, std::memory_order_release);
    for (Op* op : {data, word, rp.op})
      if (op) unpost(op);
    throw Error(ErrorKind::Closed, "device is closed");
  }
  return fut;
}

std::pair<WaitStatus, Future> Channel::send_slot(uintptr_t ack_addr, int64_t need,
                                                 uint64_t closed_value, double timeout_s,
                                                 const std::shared_ptr<MemRegion>& local,
                                                 size_t local_off,
                                                 const std::shared_ptr<RemoteRegion>& remote,
                                                 size_t remote_off, size_t n, size_t word_local_off,
                                                 uint64_t value, size_t word_remote_off,
                                                 const Rider* rider) {
  WaitStatus st = wait_credit(ack_addr, need, closed_value, timeout_s, this, true);
  if (st != WaitStatus::Ok) return {st, nullptr};
  return {WaitStatus::Ok, write_flagged(local, local_off, remote, remote_off, n, word_local_off, value,
                                        word_remote_off, nullptr, rider, nullptr, nullptr, true)};
}

SlotSender::SlotSender(std::shared_ptr<Channel> ch, uintptr_t ack_addr, uint64_t closed_value,
                       std::shared_ptr<MemRegion> local, std::shared_ptr<RemoteRegion> remote,
                       size_t nbytes, std::vector<size_t> slot_offsets,
                       std::vector<size_t> word_offsets, std::vector<size_t> word_remote_offsets)
    : ch_(std::move(ch)),
      ack_addr_(ack_addr),
      closed_value_(closed_value),
      local_(std::move(local)),
      remote_(std::move(remote)),
      nbytes_(nbytes),
      slot_at_(std::move(slot_offsets)),
      word_at_(std::move(word_offsets)),
      word_remote_at_(std::move(word_remote_offsets)) {
  if (!ch_ || !local_ || !remote_ || slot_at_.empty() || word_at_.size() != slot_at_.size() ||
      word_remote_at_.size() != slot_at_.size())
    throw Error(ErrorKind::Invalid,
                "a slot sender needs a channel, both regions and one slot offset, word offset and "
                "remote word offset per slot");
}

std::pair<WaitStatus, Future> SlotSender::send(uint64_t k, size_t local_off, double timeout_s,
                                               const Channel::Rider* rider) {
  if (k == 0 || k > uint64_t(INT64_MAX)) throw Error(ErrorKind::Invalid, "transfer numbers start at 1");
  const size_t depth = slot_at_.size(), j = (k - 1) % depth;
  return ch_->send_slot(ack_addr_, int64_t(k) - int64_t(depth), closed_value_, timeout_s, local_,
                        local_off, remote_, slot_at_[j], nbytes_, word_at_[j], k, word_remote_at_[j],
                        rider);
}

std::pair<WaitStatus, Future> Channel::ack_and_receive(const std::shared_ptr<MemRegion>& local,
                                                       size_t ack_local_off,
                                                       const std::shared_ptr<RemoteRegion>& remote,
                                                       size_t ack_remote_off, uint64_t ack_value,
                                                       uintptr_t flag_addr, uint64_t k,
                                                       uintptr_t ctl_addr, uint64_t generation,
                                                       double timeout_s, bool drive) {
  Future ack = write_flagged(local, ack_local_off, remote, ack_remote_off, 0, ack_local_off, ack_value,
                             ack_remote_off, nullptr);
  return {receive_slot(flag_addr, k, ctl_addr, generation, this, timeout_s, nullptr, 0, 0, drive), ack};
}

SlotReceiver::SlotReceiver(std::shared_ptr<Channel> ch, std::shared_ptr<DirectWindow> window,
                           std::shared_ptr<MemRegion> local, std::shared_ptr<RemoteRegion> remote,
                           size_t ack_remote_off, std::vector<uintptr_t> flag_addrs,
                           uintptr_t ctl_addr, uint64_t generation)
    : ch_(std::move(ch)),
      window_(std::move(window)),
      local_(std::move(local)),
      remote_(std::move(remote)),
      ack_remote_off_(ack_remote_off),
      flag_at_(std::move(flag_addrs)),
      ctl_addr_(ctl_addr),
      generation_(generation) {
  if (!ch_ || flag_at_.empty() || !ctl_addr_ || (!window_ && (!local_ || !remote_)))
    throw Error(ErrorKind::Invalid,
                "a slot receiver needs a channel, one flag address per slot, the control word "
                "and, without a window, both regions");
  for (uintptr_t a : flag_at_)
    if (!a || a % 8) throw Error(ErrorKind::Invalid, "a flag address is null or not 8-byte aligned");
}

std::pair<WaitStatus, Future> SlotReceiver::recv(uint64_t k, uint64_t ack_value, size_t ack_local_off,
                                                 double timeout_s) {
  if (k == 0 || k > uint64_t(INT64_MAX)) throw Error(ErrorKind::Invalid, "transfer numbers start at 1");
  const uintptr_t flag = flag_at_[(k - 1) % flag_at_.size()];
  const bool drive = !window_;  // over UCX the sender's writes are applied by this side's progress
  if (ack_value && !window_)
    return ch_->ack_and_receive(local_, ack_local_off, remote_, ack_remote_off_, ack_value, flag, k,
                                ctl_addr_, generation_, timeout_s, drive);
  DirectWindow* ack = ack_value ? window_.get() : nullptr;  // a store of 0 would take credits back
  return {receive_slot(flag, k, ctl_addr_, generation_, ch_.get(), timeout_s, ack, ack_remote_off_,
                       ack_value, drive),
          nullptr};
}

bool Channel::post_flagged(ProgressThread* t, Op* data, const Future& data_fut, Op* word,
                           const Path& data_path, const Path& word_path, uint64_t value,
                           const RiderPost* rider, bool striped) {
  Channel* ch = word->ch.get();
  bool behind = !ch->deferred_.empty();  // an earlier word still waits: this one waits too
  bool mapped = data && !striped && data_path.same_host(t, data);
  if (!mapped && !behind && !striped &&
      send_flagged_message(t, data, word, data_path.local_off, data_path.remote_off, data_path.n,
                           word_path.remote_off, value, rider))
    return true;
  const bool put_data = data && !mapped;
  if (put_data) data_path.ucx(t, data);
  // One tcp connection: the word follows the data (not GPU data, which UCX may stage through
  // its own protocol rather than the stream's order).
  if (put_data && ch->one_stream_ && !behind && !data->gpu() && !striped) {
    t->device()->stream_words_.fetch_add(1, std::memory_order_relaxed);
    word_path.ucx(t, word);
    return false;
  }
  if (put_data || behind) {
    // The word is put once the data's flush (and every earlier word) has completed
    // (post_ready_words), not behind a fence: UCX's strong fence holds every later operation
    // of the worker back until everything before it has completed (docs/transfer.md).
    ch->deferred_.push_back({word, word_path.local_off, word_path.remote_off,
                             put_data ? data_fut : nullptr, put_data && striped});
    t->note_deferred(ch);
    return false;
  }
  // The word never lands before the data, nor before what the channel posted earlier (mapped
  // copies are ordered by running in order; one tcp connection by its stream). A word alone
  // behind UCX operations still in flight waits in the deferred queue for a flush requested
  // now, which covers them, instead of behind UCX's strong fence: that fence spins in
  // ucp_worker_progress until they complete, which on a core shared with the peer is until the
  // scheduler preempts it (docs/benchmarks.md).
  if (!ch->one_stream_ && (ch->rma_pending_ != 0 || ch->am_pending_ != 0)) {
    ch->deferred_.push_back({word, word_path.local_off, word_path.remote_off, ch->flush_barrier(t)});
    t->note_deferred(ch);
    return false;
  }
  if (!word_path.same_host(t, word)) word_path.ucx(t, word);
  return false;
}

Future Channel::flush_barrier(ProgressThread* t, Future fut) {
  if (!fut) fut = std::make_shared<FutureState>();
  Op* op = new Op;
  op->fut = fut;
  op->ch = shared_from_this();
  t->track(op);
  op->pending = 1;
  if (!ensure_ep()) {
    t->op_note(op, UCS_ERR_CONNECTION_RESET);
    return fut;
  }
  unflushed_.push_back(op);  // completed by the next flush of this endpoint (flush_dirty)
  t->mark_dirty(this);
  return fut;
}

void Channel::pop_deferred() {
  if (deferred_.front().striped) striped_flagged_.fetch_add(1, std::memory_order_release);
  deferred_.pop_front();
}

void Channel::post_ready_words(ProgressThread* t, bool now) {
  while (!deferred_.empty()) {
    DeferredWord& d = deferred_.front();
    bool waiting = d.data && !d.data->done();  // its data's flush is pending
    // A striped write's second half is on another worker, which no fence of this one orders:
    // its word waits for both flushes even here (fence() and flush() drain them first).
    if (waiting && (!now || d.striped)) return;
    Op* word = d.word;
    Path path{d.local_off, d.remote_off, 8, true};
    bool failed = d.data && d.data->done() && !d.data->ok();
    pop_deferred();
    if (failed) {
      finish_now(t, word, UCS_ERR_CANCELED);  // the flagged write's future carries the data's error
    } else if (now) {
      ucp_worker_fence(t->handle());  // behind its data and the words before it
      if (!path.same_host(t, word)) path.ucx(t, word);
    } else if (!path.same_host(t, word)) {
      // seq_cst, and before rkey_for reads revocations_: whoever has seen the revocation taken
      // in and then finds this count unmoved knows that the word will not be put.
      if (d.data) t->device()->flushed_words_.fetch_add(1);
      path.ucx(t, word);  // its data and every earlier word are visible: no fence needed
    }
  }
}

void Channel::fence() {
  drain_striped(*open_device());
  ProgressThread* t = thread_;
  // Words still waiting for their data go first, each behind a fence, so that what follows
  // the fence lands after them too (a push's flag before the pull request behind it).
  if (!t->post_inline([t, ch = shared_from_this()] {
        ch->post_ready_words(t, true);
        // One tcp connection orders everything on it: UCX's strong fence would only wait.
        if (!ch->one_stream_) ucp_worker_fence(t->handle());
      }))
    throw Error(ErrorKind::Closed, "device is closed");
}

Future Channel::flush(Callback cb) {
  drain_striped(*open_device());
  if (failed_.load()) throw Error(ErrorKind::Peer, error());
  auto fut = std::make_shared<FutureState>();
  fut->on_complete = std::move(cb);
  ProgressThread* t = thread_;
  if (!t->post_inline([fut, t, ch = shared_from_this()] {
        ch->post_ready_words(t, true);  // the flush covers the words still waiting for their data
        ch->flush_barrier(t, fut);
      }))
    throw Error(ErrorKind::Closed, "device is closed");
  return fut;
}

void Channel::on_ep_error(void* arg, ucp_ep_h, ucs_status_t st) {
  Channel* ch = static_cast<Channel*>(arg);
  if (auto d = ch->dev_.lock()) d->on_data_ep_error(ch, st);
}

bool Channel::ensure_ep() {
  if (ep_) return true;
  if (failed_.load()) return false;
  ep_ = thread_->adopt_data_ep(peer_->uuid, qp_, shared_from_this());
  if (!ep_) {
    ucs_status_t st =
        thread_->create_data_ep(peer_->worker_addrs[remote_thread_], on_ep_error, this, &ep_);
    if (st != UCS_OK) {
      fail("cannot create a UCX endpoint to " + peer_->endpoint + ": " + ucs_error(st));
      return false;
    }
    thread_->note_data_ep(peer_->uuid, qp_);
  }
  auto dev = dev_.lock();
  const EndpointPaths paths =
      flagged_paths(dev ? dev->config().flagged_writes : FlaggedWrites::Put, ep_);
  flagged_by_message_ = paths.by_message;
  one_stream_ = paths.one_stream;
  sockets_only_ = paths.sockets_only;
  thread_->add_channel(shared_from_this());
  return true;
}

ucp_rkey_h Channel::rkey_for(const RemoteRegion& r) {
  // Revoked: what was accepted before the revocation but posted only now (a word deferred
  // behind its data's flush, a queued command) must not reach the region once its owner may
  // have reused the memory; the operation fails instead (Device::op_error_message says why).
  // answer_revoke's drop_rkey, queued to this thread, would come later than the revocation
  // itself: the rkeys of regions revoked since the last look go as soon as it moves, so that
  // nothing is posted to a region once this device has taken its revocation in.
  Device* device = thread_->device();
  const uint64_t revocations = device->revocations_.load();
  if (revocations != seen_revocations_) {
    seen_revocations_ = revocations;
    std::vector<uint64_t> gone;
    for (auto& kv : rkeys_)
      if (device->revoked(peer_->uuid, kv.first)) gone.push_back(kv.first);
    for (uint64_t id : gone) drop_rkey(id);
  }
  auto it = rkeys_.find(r.region_id);
  if (it != rkeys_.end()) return it->second;
  auto dev = dev_.lock();
  if (dev && dev->revoked(r.owner_uuid, r.region_id)) return nullptr;
  if (r.cuda_device >= 0) {  // unpacking opens the peer's CUDA IPC handle: a context is needed
    try {
      if (dev) dev->use_cuda_device(0);  // device 0 unless this device uses another GPU already
    } catch (const Error&) {
      return nullptr;  // no driver here: the operation fails
    }
  }
  ucp_rkey_h rk = nullptr;
  ucs_status_t st = ucp_ep_rkey_unpack(ep_, r.rkey.data(), &rk);
  if (st != UCS_OK) return nullptr;
  rkeys_[r.region_id] = rk;
  return rk;
}

Mapping* Channel::mapping_for(const RemoteRegion& r) {
  auto it = mappings_.find(r.region_id);
  if (it != mappings_.end()) return it->second.get();
  auto dev = dev_.lock();
  auto m = dev ? dev->map_remote(r) : nullptr;
  mappings_[r.region_id] = m;
  return m.get();
}

void Channel::drop_rkey(uint64_t region_id) {
  mappings_.erase(region_id);
  auto it = rkeys_.find(region_id);
  if (it == rkeys_.end()) return;
  ucp_rkey_destroy(it->second);
  rkeys_.erase(it);
}

std::vector<ucs_status_ptr_t> Channel::close_ep(bool force) {
  std::vector<ucs_status_ptr_t> reqs;
  // Words still waiting for their data go with the endpoint (their data is cancelled with it).
  const ucs_status_t st = failed() ? UCS_ERR_CONNECTION_RESET : UCS_ERR_CANCELED;
  while (!deferred_.empty()) {
    finish_now(thread_, deferred_.front().word, st);
    pop_deferred();
  }
  for (auto& kv : rkeys_) ucp_rkey_destroy(kv.second);
  rkeys_.clear();
  mappings_.clear();
  if (!ep_) return reqs;
  close_endpoint(ep_, force, &reqs);
  ep_ = nullptr;
  return reqs;
}

}  // namespace rdmaflow
