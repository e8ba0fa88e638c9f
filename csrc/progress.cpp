// ProgressThread: one completion queue, i.e. a ucp_worker and the thread that progresses it.
// Other threads hand it closures (post); it runs them in order, progresses UCX, flushes the
// endpoints that took WRITEs, and sleeps on the worker's wakeup fd when idle (unless
// busy_poll). An Op's future completes here, on this thread, exactly once.
#include <algorithm>
#include <mutex>
#include <set>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "internal.hpp"

namespace rdmaflow {

namespace {
// A worker in UCX's serialized mode and its wakeup fd; throws on failure.
void make_worker(Device* dev, ucp_context_h ctx, ucp_worker_h* w, int* efd) {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  NewTcpSockets tcp(dev->tcp_congestion_set());  // the tcp listener's accepted connections
  ucs_status_t st = ucp_worker_create(ctx, &wp, w);
  tcp.apply();
  if (st != UCS_OK)
    throw Error(ErrorKind::Generic, "ucp_worker_create failed: " + ucs_error(st));
  st = ucp_worker_get_efd(*w, efd);
  if (st != UCS_OK) {
    ucp_worker_destroy(*w);
    *w = nullptr;
    throw Error(ErrorKind::Generic, "ucp_worker_get_efd failed: " + ucs_error(st));
  }
}
}  // namespace

ProgressThread::ProgressThread(Device* dev, int idx, ucp_context_h ctx) : dev_(dev), idx_(idx) {
  make_worker(dev, ctx, &w_, &efd_);
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
  ucs_status_t st = ucp_worker_query(w_, &attr);
  if (st != UCS_OK) {
    ucp_worker_destroy(w_);
    throw Error(ErrorKind::Generic, "ucp_worker_query failed: " + ucs_error(st));
  }
  addr_.assign(reinterpret_cast<const char*>(attr.address), attr.address_length);
  ucp_worker_release_address(w_, attr.address);
  if (idx == 0) {
    try {
      make_worker(dev, ctx, &cw_, &cefd_);
    } catch (...) {
      ucp_worker_destroy(w_);
      throw;
    }
  }
  park_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (park_fd_ < 0) {
    if (cw_) ucp_worker_destroy(cw_);
    ucp_worker_destroy(w_);
    throw Error(ErrorKind::Generic, "eventfd failed");
  }
}

namespace {
// Every started progress thread of the process, for unpark_all. Never destroyed: a device
// may be closed after static destructors ran, at interpreter exit.
struct Started {
  std::mutex m;
  std::set<ProgressThread*> threads;
};
Started& started() {
  static Started* s = new Started;
  return *s;
}
// How many progress threads are parked: a waiter that finds none skips the registry's mutex.
std::atomic<int> g_parked{0};
// How many threads block relying on the progress threads (ProgressThread::Relying).
std::atomic<int> g_relying{0};
}  // namespace

ProgressThread::~ProgressThread() {
  {
    std::lock_guard<std::mutex> lk(started().m);
    started().threads.erase(this);
  }
  if (thr_.joinable()) stop();
  if (cw_) ucp_worker_destroy(cw_);
  if (w_) ucp_worker_destroy(w_);
  if (park_fd_ >= 0) close(park_fd_);
}

void ProgressThread::start() {
  thr_ = std::thread([this] { loop(); });
  std::lock_guard<std::mutex> lk(started().m);
  started().threads.insert(this);
}

ProgressThread::Relying::Relying() {
  g_relying.fetch_add(1, std::memory_order_seq_cst);
  unpark_all();
}

ProgressThread::Relying::~Relying() { g_relying.fetch_sub(1, std::memory_order_seq_cst); }

void ProgressThread::unpark_all() {
  if (g_parked.load(std::memory_order_seq_cst) == 0) return;
  std::lock_guard<std::mutex> lk(started().m);
  for (ProgressThread* t : started().threads)
    if (t->parked_.load(std::memory_order_seq_cst)) t->unpark();
}

bool ProgressThread::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lk(qm_);
    if (!accepting_) return false;
    q_.push_back(std::move(fn));
    qsize_.fetch_add(1, std::memory_order_seq_cst);
  }
  wake();
  return true;
}

void ProgressThread::wake() {
  if (sleeping_.load(std::memory_order_seq_cst)) ucp_worker_signal(w_);
  if (parked_.load(std::memory_order_seq_cst)) unpark();
}

void ProgressThread::unpark() {
  uint64_t one = 1;
  ssize_t r = write(park_fd_, &one, sizeof one);
  (void)r;  // the counter is full only if the thread was woken already
}

thread_local const ProgressThread* ProgressThread::driving_ = nullptr;

namespace {
// Marks the current thread as the driver of a worker while the worker lock is held.
struct Driving {
  explicit Driving(const ProgressThread*& slot, const ProgressThread* t) : slot_(slot) { slot_ = t; }
  ~Driving() { slot_ = nullptr; }
  const ProgressThread*& slot_;
};
}  // namespace

namespace {
// How long post_inline drives on for a carried post before it hands it to the progress thread.
constexpr double kCarryDriveUs = 200;
}  // namespace

bool ProgressThread::post_inline(std::function<void()> fn, const FutureState* carry) {
  if (!dev_->config().inline_posts || driving_ != nullptr || !wm_.try_lock()) return post(std::move(fn));
  std::unique_lock<std::mutex> held(wm_, std::adopt_lock);
  {
    std::lock_guard<std::mutex> lk(qm_);
    if (!accepting_ || stopped_) return false;
    // Commands queued before fn run before it; the caller does not run them (they may be large
    // copies): fn joins the queue behind them.
    if (!q_.empty()) {
      held.unlock();
      q_.push_back(std::move(fn));
      qsize_.fetch_add(1, std::memory_order_seq_cst);
      wake();
      return true;
    }
  }
  {
    Driving d(driving_, this);
    fn();
    drive();
    // What the socket did not take yet usually drains within microseconds (the peer reads as it
    // arrives): drive on for a while rather than wake the progress thread, a third runnable
    // thread on a small machine.
    if (carry && !carry->done()) {
      const auto t0 = Clock::now();
      while (!carry->done() && seconds_since(t0) * 1e6 < kCarryDriveUs) drive();
    }
  }
  if (carry && !carry->done()) {  // this thread's to carry on: no recent driver keeps it parked
    dev_->carried_posts_.fetch_add(1, std::memory_order_relaxed);
    drivers_->forget();
    wake();
    return true;
  }
  drivers_->touch();  // a caller drove the worker: as recent as a waiter that left now
  // The progress thread is not woken: what was started here completes on the next driving of
  // the worker, by a waiter or by the progress thread, which the worker's wakeup fd (armed
  // before it slept) wakes when the peer answers. On two cores a wake-up per transfer costs
  // more than it saves.
  return true;
}

bool ProgressThread::progress_now() {
  if (driving_ != nullptr || !wm_.try_lock()) return false;
  std::unique_lock<std::mutex> held(wm_, std::adopt_lock);
  if (stopped_) return false;
  Driving d(driving_, this);
  bool did = drive();
  drivers_->touch();
  return did;
}

void ProgressThread::hand_back() {
  drivers_->forget();
  wake();
}

bool ProgressThread::drive() {
  dev_->cuda_thread_context();  // UCX's CUDA transports call the driver on this thread
  bool did = run_commands();
  flush_dirty();
  unsigned n = 0;
  while (ucp_worker_progress(w_) != 0) ++n;
  if (cw_)
    while (ucp_worker_progress(cw_) != 0) ++n;
  post_deferred();
  flush_dirty();
  return did || n;
}

void ProgressThread::note_deferred(Channel* ch) {
  if (!ch->deferred_listed_) {
    ch->deferred_listed_ = true;
    deferred_.push_back(ch);
  }
}

void ProgressThread::post_deferred() {
  if (deferred_.empty()) return;
  std::vector<Channel*> chans;
  chans.swap(deferred_);
  for (Channel* ch : chans) {
    ch->deferred_listed_ = false;
    ch->post_ready_words(this);
    if (!ch->deferred_.empty()) note_deferred(ch);
  }
}

bool ProgressThread::run_commands() {
  if (qsize_.load(std::memory_order_seq_cst) == 0) return false;
  std::vector<std::function<void()>> batch;
  {
    std::lock_guard<std::mutex> lk(qm_);
    batch.swap(q_);
    qsize_.store(0, std::memory_order_seq_cst);
  }
  // A command handed to this thread (a large WRITE, or one that found the worker busy) is this
  // thread's to carry through: no recent driver sends it back to park until a caller drives again.
  if (!batch.empty()) drivers_->forget();
  for (auto& fn : batch) fn();
  return !batch.empty();
}

void ProgressThread::mark_dirty(Channel* ch) {
  if (!ch->dirty_) {
    ch->dirty_ = true;
    dirty_.push_back(ch);
  }
}

namespace {
struct FlushBatch {
  ProgressThread* thread;
  std::shared_ptr<Channel> ch;
  int messages;  // flagged messages it covers
  std::vector<Op*> ops;
  void done(ucs_status_t st) {
    thread->flushed(ch.get(), messages, ops, st);
    delete this;
  }
};
void flush_cb(void* req, ucs_status_t st, void* user) {
  static_cast<FlushBatch*>(user)->done(st);
  ucp_request_free(req);
}
}  // namespace

void ProgressThread::flushed(Channel* ch, int messages, const std::vector<Op*>& ops,
                             ucs_status_t st) {
  ch->am_pending_ -= messages;
  for (Op* op : ops) op_note(op, st);
}

void ProgressThread::flush_dirty() {
  // One flush per endpoint covers every WRITE posted on it since the last one.
  while (!dirty_.empty()) {
    std::vector<Channel*> chans;
    chans.swap(dirty_);
    for (Channel* ch : chans) {
      ch->dirty_ = false;
      auto* b = new FlushBatch{this, ch->shared_from_this(), ch->am_unflushed_, {}};
      ch->am_unflushed_ = 0;
      b->ops.swap(ch->unflushed_);
      if (!ch->ep_) {
        b->done(UCS_ERR_CONNECTION_RESET);
        continue;
      }
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      p.cb.send = flush_cb;
      p.user_data = b;
      ucs_status_ptr_t sp = ucp_ep_flush_nbx(ch->ep_, &p);
      if (sp == nullptr || UCS_PTR_IS_ERR(sp)) b->done(sp ? UCS_PTR_STATUS(sp) : UCS_OK);
    }
  }
}

void ProgressThread::op_note(Op* op, ucs_status_t st) {
  if (st != UCS_OK && op->status == UCS_OK) op->status = st;
  if (--op->pending > 0) return;
  if (!op->finished) op_done(op);
  delete op;
}

void ProgressThread::op_done(Op* op) {
  // Completes the future; the Op itself lives on until UCX has no more callbacks for it.
  op->finished = true;
  inflight_.erase(op);
  if (op->rma && op->ch) --op->ch->rma_pending_;
  if (op->local) op->local->inflight_.fetch_sub(1);
  if (op->status == UCS_OK) {
    op->fut->complete_ok();
  } else {
    ErrorKind k;
    std::string msg = dev_->op_error_message(op, op->status, &k);
    op->fut->complete_error(k, msg);
  }
}

void ProgressThread::loop() {
  const auto& cfg = dev_->config();
  auto idle_since = Clock::now();
  for (;;) {
    // A waiter drives the worker and nothing is queued for this thread: the waiter sees what
    // arrives first, and a drive here would only take the worker lock (and a core) from it.
    if (drivers_->count.load() > 0 && qsize_.load(std::memory_order_seq_cst) == 0 && !stop_.load()) {
      park();
      continue;
    }
    bool did;
    {
      std::lock_guard<std::mutex> held(wm_);
      Driving d(driving_, this);
      did = drive();
      if (!did && stop_.load() && qsize_.load() == 0) {
        stopped_ = true;
        break;
      }
    }
    if (did) {
      idle_since = Clock::now();
      // With a waiter driving (or one moments ago) this thread has done what was queued for
      // it; what arrives next is the waiter's. Staying awake, it would take the worker lock
      // from the waiter and the posts with it.
      if (drivers_->count.load() == 0 && !driven_recently()) continue;
    }
    // A waiter driving the worker sees what arrives before this thread could: spinning (or
    // sleeping on the wakeup fd) beside it would only take its core, even with busy_poll. So does
    // one that left moments ago (a stream's waits, between the caller's own work), unless a
    // thread blocks relying on this one.
    if (drivers_->count.load() > 0 || driven_recently()) {
      park();  // idle_since stays: after the park, straight back to parking or sleeping
      continue;
    }
    if (cfg.busy_poll) continue;
    if (seconds_since(idle_since) * 1e6 < cfg.spin_us) continue;
    // Sleep on the wakeup fd until UCX has an event or another thread posts work.
    ucs_status_t st;
    {
      std::lock_guard<std::mutex> held(wm_);
      dev_->cuda_thread_context();  // arming queries CUDA events (cuda_copy)
      st = ucp_worker_arm(w_);
      if (st == UCS_OK && cw_) st = ucp_worker_arm(cw_);
    }
    if (st == UCS_ERR_BUSY) continue;
    sleeping_.store(true, std::memory_order_seq_cst);
    if (qsize_.load(std::memory_order_seq_cst) == 0 && !stop_.load()) {
      pollfd pfd[2] = {{efd_, POLLIN, 0}, {cefd_, POLLIN, 0}};
      poll(pfd, cw_ ? 2 : 1, 100);
    }
    sleeping_.store(false, std::memory_order_seq_cst);
    idle_since = Clock::now();
  }
}

namespace {
// A parked progress thread looks every park_ns_ whether a waiter still drives the worker. Each
// look is a wake-up, which on a virtual machine's two cores costs a round trip tens of us, so
// the period adapts: it doubles (to kMaxParkNs) each time a look finds a waiter still driving,
// and halves (to kMinParkNs) each time it finds none (none now, and none within kRecentNs). UCX
// events that arrive after the last driving waiter left wait at most kRecentNs plus one period:
// kMinParkNs in a process that mostly computes, up to kMaxParkNs in one that mostly waits (and
// so comes back to drive within microseconds).
constexpr long kMinParkNs = 500'000;
constexpr long kMaxParkNs = 16'000'000;
// A caller's thread that drove the worker within kRecentNs (a waiter that left, an inline post,
// progress_now: Drivers::touch) counts as driving it: a look parks again for the same period (no
// doubling: an event after the last drive waits at most kRecentNs plus one period), and a thread
// that woke parks once it has done its work. In a stream the waits are separated by the caller's
// own work (a reduction, the next send's Python), and a thread that woke for such a gap would
// take a core and the worker lock from it, then wake on each message until the next wait.
constexpr int64_t kRecentNs = 1'000'000;
}  // namespace

bool ProgressThread::driven_recently() const {
  return g_relying.load(std::memory_order_seq_cst) == 0 &&
         Drivers::now_ns() - drivers_->left_ns.load(std::memory_order_relaxed) <= kRecentNs;
}

void ProgressThread::park() {
  parked_.store(true, std::memory_order_seq_cst);
  g_parked.fetch_add(1, std::memory_order_seq_cst);
  if (park_ns_ == 0) park_ns_ = kMinParkNs;
  while (qsize_.load(std::memory_order_seq_cst) == 0 && !stop_.load()) {
    pollfd pfd{park_fd_, POLLIN, 0};
    timespec ts{0, park_ns_};
    if (ppoll(&pfd, 1, &ts, nullptr) != 0) break;  // a command, or stop
    if (drivers_->count.load() == 0) {
      if (!driven_recently()) {
        park_ns_ = std::max(park_ns_ / 2, kMinParkNs);
        break;
      }
      continue;  // between two waits: the same period again, so that no more than one passes
    }
    park_ns_ = std::min(park_ns_ * 2, kMaxParkNs);
  }
  g_parked.fetch_sub(1, std::memory_order_seq_cst);
  parked_.store(false, std::memory_order_seq_cst);
  uint64_t drained;
  ssize_t r = read(park_fd_, &drained, sizeof drained);
  (void)r;  // EAGAIN when nothing woke it
}

void ProgressThread::stop() {
  if (!thr_.joinable()) return;
  {
    std::lock_guard<std::mutex> lk(qm_);
    if (accepting_) {
      q_.push_back([this] { close_all(); });  // the last command
      qsize_.fetch_add(1);
      accepting_ = false;
    }
  }
  stop_.store(true);
  ucp_worker_signal(w_);
  unpark();
  thr_.join();
  // Whatever UCX did not complete fails here, after the thread is gone. The Ops stay allocated:
  // ucp_worker_destroy may still call back for requests it purges.
  std::vector<Op*> left(inflight_.begin(), inflight_.end());
  for (Op* op : left) {
    if (op->status == UCS_OK) op->status = UCS_ERR_CANCELED;
    op_done(op);
  }
  for (auto& ch : channels_) ch->unflushed_.clear();
  channels_.clear();
}

// Closes every endpoint (thread 0: also the control links and the listener) so UCX cancels
// what is outstanding, and gives the cancellations a bounded time to arrive.
void ProgressThread::close_all() {
  std::vector<ucs_status_ptr_t> reqs;
  for (auto& ch : channels_) {
    auto r = ch->close_ep(true);
    reqs.insert(reqs.end(), r.begin(), r.end());
  }
  for (auto& kv : data_eps_)
    if (kv.second && kv.second->ep) {
      close_endpoint(kv.second->ep, true, &reqs);
      kv.second->ep = nullptr;
    }
  if (idx_ == 0) {
    auto r = dev_->close_links();
    reqs.insert(reqs.end(), r.begin(), r.end());
  }
  auto t0 = Clock::now();
  for (auto sp : reqs) {
    while (ucp_request_check_status(sp) == UCS_INPROGRESS && seconds_since(t0) < 2.0) {
      ucp_worker_progress(w_);
      if (cw_) ucp_worker_progress(cw_);
    }
    ucp_request_free(sp);
  }
  flush_dirty();
  for (int i = 0; i < 100; ++i) {
    ucp_worker_progress(w_);
    if (cw_) ucp_worker_progress(cw_);
  }
}

// ---------------------------------------------------------------------------------------------
// Data endpoints (internal.hpp, ProgressThread::data_eps_).

ucs_status_t ProgressThread::create_data_ep(const std::string& worker_addr, ucp_err_handler_cb_t cb,
                                            void* arg, ucp_ep_h* ep) {
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.address = reinterpret_cast<const ucp_address_t*>(worker_addr.data());
  // UCX's peer-failure mode costs TCP puts much of their bandwidth (docs/benchmarks.md), so
  // data endpoints run without it by default: a dead peer still fails their requests with a
  // connection error, and the control link (which has it) marks the channels failed.
  p.err_mode = dev_->config().data_error_handling ? UCP_ERR_HANDLING_MODE_PEER
                                                  : UCP_ERR_HANDLING_MODE_NONE;
  p.err_handler.cb = cb;
  p.err_handler.arg = arg;
  *ep = nullptr;
  NewTcpSockets tcp(dev_->tcp_congestion_set());  // UCX's tcp connect (blocking by default)
  ucs_status_t st = ucp_ep_create(w_, &p, ep);
  tcp.apply();
  if (st != UCS_OK) *ep = nullptr;
  return st;
}

bool ProgressThread::prepare_data_ep(uint64_t uuid, int qp, const std::string& worker_addr,
                                     std::string* why) {
  if (has_data_ep(uuid, qp)) return true;
  auto slot = std::make_unique<PreparedEp>();
  ucs_status_t st = create_data_ep(worker_addr, on_prepared_ep_error, slot.get(), &slot->ep);
  if (st != UCS_OK) {
    *why = "cannot create a UCX endpoint back to it: " + ucs_error(st);
    return false;
  }
  data_eps_[{uuid, qp}] = std::move(slot);
  return true;
}

ucp_ep_h ProgressThread::adopt_data_ep(uint64_t uuid, int qp, const std::shared_ptr<Channel>& ch) {
  auto it = data_eps_.find({uuid, qp});
  if (it == data_eps_.end() || !it->second || !it->second->ep) return nullptr;
  PreparedEp& slot = *it->second;
  ucp_ep_h ep = slot.ep;
  slot.ep = nullptr;
  if (slot.failed) {  // the channel makes a new one
    close_endpoint(ep, true, nullptr);
    return nullptr;
  }
  slot.ch = ch;
  return ep;
}

void ProgressThread::on_prepared_ep_error(void* arg, ucp_ep_h ep, ucs_status_t st) {
  auto* slot = static_cast<PreparedEp*>(arg);
  if (auto ch = slot->ch.lock())
    Channel::on_ep_error(ch.get(), ep, st);
  else
    slot->failed = true;
}

}  // namespace rdmaflow
