// The core's internal types, shared by its .cpp files and never seen by the bindings.
//
// Threading rule: every UCX call on a worker is made by whoever drives it, holding its
// ProgressThread's worker lock (UCX's serialized mode): the progress thread each loop, a caller
// posting data-path work when the worker is free (post_inline), or a receiver progressing
// it while it waits (progress_now). Otherwise threads hand the progress thread closures through
// post() and wake it with ucp_worker_signal. Fields marked "progress thread" are touched only
// under that lock.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "rdmaflow.hpp"

#include <sys/socket.h>

namespace rdmaflow {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Throws OutOfBounds unless [off, off + n) lies inside a region of `length` bytes (`which`:
// "local" or "remote", for the message).
inline void check_inside(size_t off, size_t n, size_t length, const char* which) {
  if (off > length || n > length - off)
    throw Error(ErrorKind::OutOfBounds, std::string(which) + " range [" + std::to_string(off) +
                                            ", " + std::to_string(off + n) +
                                            ") is outside the " + which + " region of " +
                                            std::to_string(length) + " bytes");
}

// support.cpp
void random_bytes(void* out, size_t n);
// Has whole active messages `id` arriving on worker w handed to cb(arg, ...).
void set_am_handler(ucp_worker_h w, uint16_t id, ucp_am_recv_callback_t cb, void* arg);
// Closes ep (forcibly when force); a request UCX returns is appended to reqs, or freed when
// reqs is null.
void close_endpoint(ucp_ep_h ep, bool force, std::vector<ucs_status_ptr_t>* reqs);

// address.cpp
std::pair<std::string, std::string> split_endpoint(const std::string& ep);
sockaddr_storage resolve(const std::string& ep, socklen_t* len, bool passive);
// The endpoint peers reach a listener at: the configured host (the hostname when it is a
// wildcard) and the port the listener was given.
std::string listening_endpoint(const std::string& configured, const sockaddr_storage& bound);

// flagged.cpp
// write_flagged's paths on ep, from one ucp_ep_query. by_message: the message path
// (FlaggedWrites::Auto: every lane is tcp). one_stream: Auto and a single lane that is tcp, one
// connection whose bytes the target's UCX applies in the order they were sent.
struct EndpointPaths {
  bool by_message, one_stream;
  bool sockets_only;  // every lane is tcp: a post hands buffers to the kernel and copies nothing
};
EndpointPaths flagged_paths(FlaggedWrites mode, ucp_ep_h ep);

// tcp_congestion.cpp (resolve_tcp_congestion: rdmaflow.hpp)
// Gives cc (none when empty) to the TCP sockets opened between construction and apply().
class NewTcpSockets {
 public:
  explicit NewTcpSockets(const std::string& cc);
  void apply();

 private:
  std::string cc_;
  std::map<unsigned long, int> before_;  // socket inode -> fd, before the call
};

// same_host.cpp
// Whether UCX_TLS leaves shared-memory transports on.
bool tls_allow_shared_memory();
// This boot's id (empty when unknown): same-host peers are those with the same one.
std::string read_boot_id();

// Memory backing a region; outlives the region's registration while tensors view it.
struct RegionMemory {
  void* addr = nullptr;
  size_t length = 0;
  bool owned = false;  // mmap'ed by us
  int fd = -1;         // memfd of a shared region, reachable by same-host peers
  uint64_t st_dev = 0, st_ino = 0;
  ~RegionMemory();
};

// A same-host peer's shared region mapped into this process.
struct Mapping {
  void* base = nullptr;
  size_t length = 0;
  ~Mapping();
};

// Makes same-host copies: streamed or cached by size, large ones split over helper threads
// (none when copy_threads is 1).
class CopyPool {
 public:
  explicit CopyPool(int helpers);
  ~CopyPool();
  // Copies n bytes and returns when every part is done and visible to other threads.
  void copy(void* dst, const void* src, size_t n);

 private:
  struct Batch;
  struct Part {
    char* dst;
    const char* src;
    size_t n;
    bool stream;  // non-temporal stores (decided on the whole copy's size)
    Batch* batch;
  };
  void loop();
  std::vector<std::thread> threads_;
  std::mutex m_;
  std::condition_variable cv_;
  std::vector<Part> q_;
  bool stop_ = false;
};

// A connected (or connecting) peer device, shared by its channels.
struct Peer {
  std::string endpoint;
  uint64_t uuid = 0;
  int num_workers = 0;
  std::vector<std::string> worker_addrs;
  Link* link = nullptr;  // progress thread 0 only
  enum State { Connecting, Ready, Failed } state = Connecting;
  std::string error;
  bool auth_failed = false;
  std::mutex m;
  std::condition_variable cv;
  std::map<int, std::shared_ptr<Channel>> channels;
  std::set<uint64_t> validated;  // region ids validated with the owner
};

// Completes `fut` once `parts` futures have completed, whichever threads complete them: ok if
// every part was, else with the first error counted in (future.cpp).
class FutureJoin {
 public:
  FutureJoin(Future fut, int parts) : fut_(std::move(fut)), left_(parts) {}
  // Counts f in; returns true for the last part, whose call completed fut.
  bool part_done(const Future& f);

 private:
  Future fut_;
  std::atomic<int> left_;
  std::mutex m_;
  ErrorKind kind_ = ErrorKind::Generic;
  std::string error_;
};

// One memcpy as the progress thread runs it (channel.cpp).
struct Channel::Path {
  size_t local_off, remote_off, n;
  bool write;
  // The same-host path: true when it took op (copied, or cancelled by close()).
  bool same_host(ProgressThread* t, Op* op) const;
  // The UCX path: a put (which also waits for its flush) or a get.
  void ucx(ProgressThread* t, Op* op) const;
  static void sent(void* req, ucs_status_t st, void* user);
};

// One posted memcpy or flush, from posting until UCX calls back for the last time.
struct Op {
  Future fut;
  int pending = 1;
  bool finished = false;  // future completed
  ucs_status_t status = UCS_OK;
  bool rma = false;  // went through UCX (counted in ch->rma_pending_)
  std::shared_ptr<MemRegion> local;
  std::shared_ptr<Channel> ch;
  std::shared_ptr<RemoteRegion> remote;
  // Either side is GPU memory: UCX alone may touch it (no same-host mapping, no message path).
  bool gpu() const { return local->cuda_device() >= 0 || (remote && remote->cuda_device >= 0); }
};

// One completion queue: a ucp_worker and the thread that progresses it.
class ProgressThread {
 public:
  ProgressThread(Device* dev, int idx, ucp_context_h ctx);
  ~ProgressThread();
  void start();
  void stop();  // closes endpoints, fails what is left, joins the thread
  bool post(std::function<void()> fn);  // false once the thread has stopped
  // Data-path work (fence, flush, memcpys of at most 64 KiB, or 1 MiB over sockets alone:
  // Channel::post_data): runs fn on the caller's thread
  // when no one drives the worker and nothing is queued, so a transfer leaves without waiting
  // for the progress thread to wake; else post(fn). The caller must hold no core lock.
  // With carry: if carry is not done once fn and a drive of the worker have run (a large put the
  // socket did not take whole), the caller drives on for up to kCarryDriveUs, then wakes the
  // progress thread to carry it on.
  bool post_inline(std::function<void()> fn, const FutureState* carry = nullptr);
  // Progresses the worker on the caller's thread unless someone else drives it: a waiting
  // receiver applies incoming puts itself (tcp) instead of waiting for the progress thread.
  // Returns whether that did anything (ran a command, or UCX progressed an event).
  bool progress_now();
  // A driving waiter whose wait was long (a large transfer) leaves the worker to this thread: the
  // recent drive is forgotten and the thread woken, so that what is still arriving (the next
  // transfer) is received while the caller computes, not when it next waits.
  void hand_back();
  // A thread that blocks without driving (on a future, on a word without drive) holds one of
  // these while it blocks: it wakes every parked progress thread of the process, whose
  // completion the thread now relies on, and keeps them from parking for a recent driver
  // (progress.cpp, park) until it is done.
  struct Relying {
    Relying();
    ~Relying();
  };
  // Threads waiting on a word while they drive this worker (wait_word with drive): while there
  // are any, the progress thread parks instead of waking on UCX's events, so that each message
  // wakes one thread, not two. Shared so that a channel can count itself after the thread is gone.
  const std::shared_ptr<Drivers>& drivers() const { return drivers_; }
  ucp_worker_h handle() const { return w_; }
  // Thread 0's second worker, which only makes the control links' endpoints (Link): each goes to
  // a peer's worker 0, which makes none back to it. So every pair of workers that a control link
  // joins has endpoints made by one side only; an endpoint made from each side between one pair
  // of workers makes UCX 1.22's tcp transport take one tcp connection over with the other's, and
  // a link reset at random followed (docs/architecture.md, "The control link"). Null on other
  // threads; driven, armed and polled with w_ under the same worker lock.
  ucp_worker_h control_handle() const { return cw_; }
  const std::string& address() const { return addr_; }
  int index() const { return idx_; }
  Device* device() const { return dev_; }

  // Progress-thread only.
  void track(Op* op) { inflight_.insert(op); }
  // Notes one of op's completions; the last one completes the future and deletes op.
  void op_note(Op* op, ucs_status_t st);
  void mark_dirty(Channel* ch);
  // A flush of ch completed with st: it covered ops and the channel's first `messages` flagged
  // messages not yet covered (Channel::am_pending_).
  void flushed(Channel* ch, int messages, const std::vector<Op*>& ops, ucs_status_t st);
  // ch has words waiting for their data (Channel::deferred_): each drive posts the ready ones.
  void note_deferred(Channel* ch);
  void add_channel(const std::shared_ptr<Channel>& ch) { channels_.push_back(ch); }
  std::vector<std::shared_ptr<Channel>>& channels() { return channels_; }
  // Data endpoints to peers' workers, one per (peer device uuid, qp): made by the channel
  // (Channel::ensure_ep), or made ahead of it when the peer opens its channel of that qp
  // (OPEN_CHANNEL: Device::answer_open_channel), for the channel to adopt. Made ahead because
  // UCX's tcp transport (1.22) crashes a process that creates an endpoint to a peer while a put
  // of that peer's is arriving on the connection the peer opened to it: the new endpoint takes
  // the connection over, but not the put in progress (docs/architecture.md, "Opening a channel").
  bool has_data_ep(uint64_t uuid, int qp) const { return data_eps_.count({uuid, qp}) != 0; }
  // Makes the endpoint for (uuid, qp) ahead of its channel; false and why if UCX refuses.
  bool prepare_data_ep(uint64_t uuid, int qp, const std::string& worker_addr, std::string* why);
  // The endpoint made ahead for (uuid, qp), now ch's; null if there is none (ch makes its own and
  // notes it with note_data_ep).
  ucp_ep_h adopt_data_ep(uint64_t uuid, int qp, const std::shared_ptr<Channel>& ch);
  void note_data_ep(uint64_t uuid, int qp) { data_eps_.emplace(std::make_pair(uuid, qp), nullptr); }
  // ucp_ep_create to a peer's worker, in the data endpoints' error mode (Config::data_error_handling).
  ucs_status_t create_data_ep(const std::string& worker_addr, ucp_err_handler_cb_t cb, void* arg,
                              ucp_ep_h* ep);

 private:
  void loop();
  // Sleeps, without UCX's wakeup fd, until a command is posted or a look (every park_ns_,
  // adaptive: progress.cpp) finds no waiter driving.
  void park();
  static void unpark_all();  // wakes every parked progress thread of the process (Relying)
  // A caller's thread drove the worker within kRecentNs (Drivers::touch), and no thread blocks
  // relying on this one.
  bool driven_recently() const;
  // Wakes the thread if it sleeps or parks (after a command was queued).
  void wake();
  void unpark();  // signals the park eventfd
  // One round of driving the worker, with the lock held: commands, flushes, UCX progress.
  bool drive();
  bool run_commands();
  void flush_dirty();
  void post_deferred();  // Channel::post_ready_words on each channel with deferred words
  void op_done(Op* op);
  void close_all();
  struct PreparedEp {  // an endpoint made ahead of its channel: its error handler's argument
    ucp_ep_h ep = nullptr;  // until adopted
    bool failed = false;    // UCX reported an error before it was adopted
    std::weak_ptr<Channel> ch;  // once adopted
  };
  static void on_prepared_ep_error(void* arg, ucp_ep_h ep, ucs_status_t st);
  // Progress-thread only; null for an endpoint its channel made.
  std::map<std::pair<uint64_t, int>, std::unique_ptr<PreparedEp>> data_eps_;
  Device* dev_;
  int idx_;
  ucp_worker_h w_ = nullptr;
  int efd_ = -1;
  ucp_worker_h cw_ = nullptr;  // thread 0: the control worker (control_handle)
  int cefd_ = -1;
  std::string addr_;
  std::thread thr_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> parked_{false};
  int park_fd_ = -1;  // eventfd that wakes a parked thread
  long park_ns_ = 0;  // how long a park sleeps before it looks again (park(); this thread only)
  std::shared_ptr<Drivers> drivers_ = std::make_shared<Drivers>();
  std::mutex wm_;                     // the worker lock
  bool stopped_ = false;              // under wm_: the worker takes no more work
  static thread_local const ProgressThread* driving_;  // the worker this thread drives, if any
  std::mutex qm_;
  bool accepting_ = true;
  std::vector<std::function<void()>> q_;
  std::atomic<size_t> qsize_{0};
  std::vector<Channel*> dirty_;
  std::vector<Channel*> deferred_;  // channels with words waiting for their data
  std::unordered_set<Op*> inflight_;
  std::vector<std::shared_ptr<Channel>> channels_;
};

// A control connection (side RPC) to or from a peer device, made once the handshake ended:
// our endpoint, from our control worker to the peer's worker 0, carries what we send; the
// peer's, from its control worker to our worker 0, what we receive (ProgressThread::
// control_handle). Progress thread 0 only.
struct Link {
  Device* dev = nullptr;
  ucp_ep_h ep = nullptr;
  bool client = false;           // we connected (peer set) or accepted
  std::shared_ptr<Peer> peer;    // client side
  bool dead = false;
  uint64_t token = 0;         // our messages' header names it (Device::links_'s key)
  uint64_t remote_token = 0;  // the peer's, put in what we send
  uint64_t remote_uuid = 0;
  std::string remote_endpoint;
};

// The handshake listener and the thread that runs every handshake, accepted and opened
// (handshake.cpp).
class Handshaker {
 public:
  // Binds and listens on ss (Invalid when the address is in use); start() runs the thread.
  Handshaker(Device* dev, const sockaddr_storage& ss, socklen_t slen);
  ~Handshaker();
  void start();
  void stop();  // closes every handshake connection; their peers fail
  const sockaddr_storage& bound() const { return bound_; }
  double timeout() const { return timeout_; }
  // Starts the handshake with p at ss; p ends Ready (Device::open_link) or Failed.
  void connect(const std::shared_ptr<Peer>& p, const sockaddr_storage& ss, socklen_t slen);

 private:
  struct Conn;
  void open(const std::shared_ptr<Peer>& p, const sockaddr_storage& ss, socklen_t slen, int tries,
            Clock::time_point deadline);
  void loop();
  void wake();
  void accept_all(std::vector<std::unique_ptr<Conn>>& conns, Clock::time_point* pause);
  bool step(Conn& c, short revents);
  bool server_frame(Conn& c, uint32_t type, const std::string& payload);
  bool client_frame(Conn& c, uint32_t type, const std::string& payload);
  bool lost(Conn& c);
  bool malformed(Conn& c);
  void fail_peer(Conn& c, const std::string& why, bool auth);
  void refuse(const char* why);  // counts an accepted connection closed unauthenticated
  void report(bool flush);       // the rate-limited line on stderr
  Device* dev_;
  int lfd_ = -1, wake_fd_ = -1;
  sockaddr_storage bound_{};
  double timeout_ = 5.0;
  std::thread thread_;
  std::mutex m_;
  bool stop_ = false;
  std::vector<std::unique_ptr<Conn>> incoming_;  // under m_: opened by connect()
  // The handshake thread's only.
  std::map<std::string, size_t> refused_;
  bool reported_once_ = false;
  Clock::time_point last_report_{};
};

// One outstanding side-RPC request, completed by the reply, the link's failure or a timeout.
struct Rpc {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  bool ok = false;
  ErrorKind kind = ErrorKind::Generic;
  std::string reply;
};

// A request handed to progress thread 0, with the id its reply will carry.
struct Device::Request {
  uint64_t id = 0;
  std::shared_ptr<Rpc> rpc;
};

}  // namespace rdmaflow
