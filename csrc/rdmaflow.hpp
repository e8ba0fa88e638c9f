// rdmaflow: the RDMA "device" of Xue et al., "Fast Distributed Deep Learning over RDMA"
// (EuroSys '19, Table 1) over UCX's UCP API. The public C++ surface; the Python bindings see
// only this header (and the core's files are listed in docs/architecture.md).
//
// Contract:
//   Device       one ucp_context; num_cqs progress threads ("completion queues"), each with its
//                own ucp_worker; a tcp listener of its own for the handshake (handshake.cpp),
//                then a control link on thread 0 for the side RPC (publish/lookup).
//   MemRegion    local memory registered with UCX, host or GPU (cuda_device() >= 0); its
//                descriptor carries address, length, memory type, packed remote key and owner,
//                with a MAC made with the job secret. GPU memory never takes the same-host
//                mapping or the message path: only UCX touches it (cuda_ipc, cuda_copy, verbs
//                with GPUDirect), and a WRITE from it completes once UCX's copy has finished.
//   RemoteRegion a peer's region parsed from its descriptor; authenticated on first use.
//   Channel      (peer, qp_idx): operations posted on it run in order on worker
//                qp_idx % num_cqs (by its progress thread, or by the posting thread when the
//                worker is free), against the peer's worker qp_idx % peer_num_cqs. Opened
//                by its first Device::channel() call, which returns once both devices have
//                their UCX endpoint of that qp to each other.
//   DirectWindow a same-host peer's region written by the caller's own thread: no worker.
//   Future       completes exactly once, on the thread driving the worker:
//                  WRITE  when the data is visible at the destination (put + endpoint flush,
//                         or the same-host copy followed by a full fence);
//                  READ   when the data is in the local region;
//                  flush  when every WRITE posted on the channel before it is visible.
//                A failed future carries an ErrorKind and a message; close() fails every
//                pending future with Closed.
//   Errors       every call validates its arguments first and throws Error (kind + message)
//                before anything is sent; every wait is bounded by a timeout of DeviceConfig.
#pragma once

#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace rdmaflow {

enum class ErrorKind { Generic, OutOfBounds, Peer, Region, Closed, Timeout, Auth, Invalid, Full };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind k, const std::string& m) : std::runtime_error(m), kind(k) {}
  ErrorKind kind;
};

// Seconds as an error message says them: 2, 0.5, 2.75 (not 2.000000, nor 2 for 2.75).
inline std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

enum class Direction : int { Write = 0, Read = 1 };

// The same-host fast path: regions live in shared memory that a peer on the same host maps,
// so a memcpy to them is one CPU copy instead of a transport operation. Auto: on unless
// UCX_TLS rules out shared-memory transports.
enum class SameHost : int { Off = 0, On = 1, Auto = 2 };

// How Channel::write_flagged carries data + word over UCX (docs/transfer.md, "Flagged writes").
//   Put      put the data; put the word once the data's endpoint flush has completed.
//   Message  one active message whose handler at the target copies the data, then stores the
//            word with a release store: ordered by the target's CPU. Only on endpoints whose
//            every lane is tcp, Put elsewhere: there a completed endpoint flush means the
//            handler has run (the peer answers the flush in stream order), which fence() and
//            the same-host mapping rely on; on shared memory and RDMA a flush completes when
//            the message is delivered, before its handler runs. Fences and the flush rule
//            as on several lanes (no stream shortcut).
//   Auto     Message on endpoints whose every lane is tcp (whose puts the target's software
//            applies anyway) up to 512 KiB; above it, on an endpoint of one tcp lane (one
//            connection, applied in stream order), the word put right behind the data put;
//            Put elsewhere.
enum class FlaggedWrites : int { Auto = 0, Put = 1, Message = 2 };

// The congestion control UCX's tcp data sockets get: set ("" leaves the system's) and in effect.
struct TcpCongestion {
  std::string set, effective;
};
// DeviceConfig::tcp_congestion resolved on this host; throws Invalid when a named one cannot be
// set by this process.
TcpCongestion resolve_tcp_congestion(const std::string& wanted);

// Nanoseconds one cache line takes to move from cpu_a to cpu_b or back, averaged over `seconds`
// of two pinned threads handing it to each other (host_probe.cpp). Blocks for about `seconds`;
// throws Invalid for a cpu this process may not use, Timeout if the line stops moving.
double cache_line_handoff_ns(int cpu_a, int cpu_b, double seconds);

// The shortest job secret a device accepts, in bytes (docs/security.md, "The job secret").
constexpr size_t kMinSecretBytes = 16;
// Throws Invalid, saying how to make a good one, for a secret shorter than kMinSecretBytes or
// only whitespace.
void check_secret_strength(const std::string& secret);

struct DeviceConfig {
  std::string endpoint = "127.0.0.1:0";
  int num_cqs = 2;  // two workers: a large send over tcp is striped over both (Channel::write_flagged)
  int qps_per_peer = 1;
  std::string secret;
  bool busy_poll = false;
  int spin_us = 50;               // progress this long before sleeping on the wakeup fd
  double connect_timeout = 10.0;  // seconds
  double rpc_timeout = 10.0;      // seconds, side RPC and revocation
  bool data_error_handling = false;  // UCP_ERR_HANDLING_MODE_PEER on data endpoints too
  SameHost same_host = SameHost::Auto;
  // Threads that share one large mapped copy (the progress thread and copy_threads - 1
  // helpers, which sleep when idle): a single core cannot reach the memory bandwidth.
  int copy_threads = 1;
  // Data-path posts run on the caller's thread when the worker is free (ProgressThread::
  // post_inline); off: always handed to the progress thread.
  bool inline_posts = true;
  FlaggedWrites flagged_writes = FlaggedWrites::Auto;
  // The congestion control of UCX's tcp data sockets (tcp_congestion.cpp): "auto" (cubic, else
  // reno, where the system's is bbr, which paces; else the system's), "system", or a name
  // (tcp(7) TCP_CONGESTION; Invalid at construction when this process may not set it).
  std::string tcp_congestion = "auto";
  // UCX_NET_DEVICES for this device's UCX context where the environment sets none ("": UCX's
  // default, every device): the Python layer names the interface of the device's own address
  // (and the host's RDMA ports), so that UCX's tcp data ports listen there only.
  std::string net_devices;
};

// Completion state shared by the issuer and the progress thread.
class FutureState : public std::enable_shared_from_this<FutureState> {
 public:
  bool done() const { return state_.load(std::memory_order_acquire) != 0; }
  bool ok() const { return state_.load(std::memory_order_acquire) == 1; }
  // Waits up to timeout seconds (negative: forever); returns done().
  bool wait(double timeout_s);
  void complete_ok();
  void complete_error(ErrorKind k, const std::string& msg);
  ErrorKind error_kind() const { return kind_; }
  const std::string& error() const { return msg_; }
  // Runs once on the completing thread; must not block.
  std::function<void(const std::shared_ptr<FutureState>&)> on_complete;

 private:
  void finish(int s);
  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<int> state_{0};
  ErrorKind kind_ = ErrorKind::Generic;
  std::string msg_;
};
using Future = std::shared_ptr<FutureState>;
using Callback = std::function<void(const Future&)>;

// Internal types (internal.hpp); the public classes hold them only by pointer.
class Device;
class DirectWindow;
class ProgressThread;
class CopyPool;
class FutureJoin;
struct Link;
class Handshaker;
struct Mapping;
struct Op;
struct Peer;
struct RegionMemory;
struct Rpc;

// Local memory registered with UCX. Made by Device::alloc_region or register_memory.
class MemRegion {
 public:
  uint64_t id() const { return id_; }
  uintptr_t address() const { return addr_; }
  size_t length() const { return length_; }
  // The CUDA device ordinal of GPU memory; -1 for host memory.
  int cuda_device() const { return cuda_device_; }
  bool freed() const { return freed_.load(); }
  // Throws Region once freed.
  std::vector<uint8_t> descriptor() const;
  // Idempotent. Revokes remote access (every peer that validated the region acknowledges, or
  // rpc_timeout passes), waits for local in-flight operations, then deregisters. Memory a
  // silent peer may still write stays mapped until the device closes.
  void free();

 private:
  friend class Device;
  friend class Channel;
  friend class ProgressThread;
  std::weak_ptr<Device> dev_;
  std::shared_ptr<RegionMemory> mem_;
  uintptr_t addr_ = 0;
  size_t length_ = 0;
  ucp_mem_h memh_ = nullptr;
  uint64_t id_ = 0;
  int cuda_device_ = -1;
  std::vector<uint8_t> rkey_;
  std::vector<uint8_t> descriptor_;
  std::atomic<bool> freed_{false};
  std::atomic<int64_t> inflight_{0};
  std::mutex m_;
  std::set<Link*> holders_;  // peers that validated this region; told on free()
};

// A peer's region, parsed from its descriptor. Authenticated against the job secret on use.
class RemoteRegion {
 public:
  // Bounds-checked: a malformed descriptor throws Invalid, never reads out of bounds.
  static std::shared_ptr<RemoteRegion> parse(const std::string& bytes);
  uint64_t job_tag = 0, owner_uuid = 0, region_id = 0, addr = 0, length = 0;
  std::string owner_endpoint;
  std::vector<uint8_t> rkey;
  int cuda_device = -1;  // GPU memory on the owner's CUDA device of this ordinal; -1: host
  // Set when the owner's region is shared memory: where a same-host peer finds it.
  bool shared = false;
  std::string boot_id;
  uint32_t pid = 0, fd = 0;
  uint64_t st_dev = 0, st_ino = 0;
  std::string body;  // the MAC'd prefix
  uint8_t mac[16] = {0};
  std::atomic<int> verified{0};  // 0 unknown, 1 ok (for verified_for device)
  uint64_t verified_for = 0;
};

// The waiters driving one worker (wait_word with drive), and when a caller's thread last drove it
// (a waiter that left, a post or a progress_now on the caller's thread): while any waiter drives,
// or a caller drove it within the last millisecond (a process between two waits of a stream),
// the worker's progress thread stays parked (progress.cpp, park).
struct Drivers {
  std::atomic<int> count{0};
  std::atomic<int64_t> left_ns{0};  // steady_clock, when a caller's thread last drove the worker
  void enter() { count.fetch_add(1); }
  void leave() {
    touch();
    count.fetch_sub(1);
  }
  void touch() { left_ns.store(now_ns(), std::memory_order_relaxed); }
  void forget() { left_ns.store(0, std::memory_order_relaxed); }
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

// A queue pair to one peer (Xue et al. §3.1). Made by Device::channel.
enum class WaitStatus : int;  // below, with the waits

class Channel : public std::enable_shared_from_this<Channel> {
 public:
  // Copies n bytes between local[local_off..] and remote[remote_off..]. Throws (nothing
  // posted) on a bad range, a foreign or forged descriptor, a freed or revoked region, a
  // failed channel or a closed device. The future completes as stated at the top; cb runs
  // once on the completing thread.
  Future memcpy(const std::shared_ptr<MemRegion>& local, size_t local_off,
                const std::shared_ptr<RemoteRegion>& remote, size_t remote_off, size_t n,
                Direction dir, Callback cb);
  // Orders operations posted after it on this channel behind those posted before
  // (ucp_worker_fence; nothing on an endpoint that is one tcp connection, whose stream orders
  // them; mapped copies are ordered too, as they run in posting order), write_flagged words
  // still waiting for their data included.
  void fence();
  // Completes when every WRITE posted before it is visible at the peer (write_flagged words
  // still waiting for their data included).
  Future flush(Callback cb);
  // A transfer's post as one command to the progress thread: n bytes local[local_off..] ->
  // remote[remote_off..] (nothing when n is 0), then the 8-byte word `value`, stored first
  // into local[word_local_off] (its registered source, which no WRITE in flight may be using)
  // -> remote[word_remote_off]. The word lands after the data, after everything the channel
  // posted before the call, and after the word of every earlier write_flagged on the channel;
  // operations posted later may land before it, unless a fence() stands between. Over UCX
  // puts the word is put once the data's endpoint flush has completed, or right behind the
  // data on an endpoint that is one tcp connection (FlaggedWrites); a word alone (n == 0) on
  // another endpoint, while UCX operations of the channel are in flight, once a flush requested
  // at its post has completed (never behind UCX's strong fence, which would spin the posting
  // thread). The future completes when both are visible at the peer, or on the message path
  // (n of at most 512 KiB) when its messages have left: the word itself tells the peer. It
  // fails if either part failed.
  // Throws like memcpy for either range.
  //
  // The word may live in other regions than the data (word_local, word_remote; null: the data's):
  // GPU data with its flag in host memory (Xue et al. §3.5). A word is always host memory
  // (Invalid otherwise). Data in GPU memory takes the put path, its word put once the data's
  // flush has completed.
  //
  // stripe: where every lane is tcp, n is at least striped_write_bytes(), the data is host
  // memory with no same-host mapping, and both devices have two workers or more, the data's
  // second half is put on the channel of qp_idx ^ 1 (another worker on each side, so two
  // threads on each side move the bytes; that channel is opened by the first such write, which
  // then waits for it like Device::channel) and the word is put once both halves' flushes have
  // completed. A fence() or flush() of this channel first waits (driving the worker, bounded by
  // the device's rpc_timeout) until such words are put.
  //
  // A rider, when given, is a second word for the same peer (a receiver handing a slot back to
  // its sender on this channel, in the message of a transfer of its own): `value` is stored
  // first into local[local_off] (a registered source no WRITE in flight uses) and lands at
  // remote[remote_off] behind every earlier word of the channel: on the message path in the
  // same message, stored just before the write's own word (a peer that sees the word sees the
  // rider); elsewhere as a word-only write_flagged posted right behind this one. The future
  // completes when it has too. Its range is checked like the word's; its source is in the
  // word's local region.
  struct Rider {
    std::shared_ptr<RemoteRegion> remote;
    size_t local_off = 0, remote_off = 0;
    uint64_t value = 0;
  };
  Future write_flagged(const std::shared_ptr<MemRegion>& local, size_t local_off,
                       const std::shared_ptr<RemoteRegion>& remote, size_t remote_off, size_t n,
                       size_t word_local_off, uint64_t value, size_t word_remote_off,
                       Callback cb, const Rider* rider = nullptr,
                       const std::shared_ptr<MemRegion>& word_local = nullptr,
                       const std::shared_ptr<RemoteRegion>& word_remote = nullptr,
                       bool stripe = false);
  // One transfer of a static pair over UCX, on the caller's thread in one call: waits until the
  // word at ack_addr (this process's memory) is >= need (credits; need <= 0: none) and below
  // closed_value, progressing this channel's worker while it waits (over tcp the ack is applied
  // by this side's progress), then posts write_flagged(...) as above. The wait is bounded by
  // timeout_s (< 0: none). Returns Ok and the write's future, or, before posting anything and
  // with no future: Timeout (the call may be repeated), Closed (ack >= closed_value) or
  // PeerFailed. Throws like write_flagged. Any thread; a pair's sends are serialized by its
  // caller.
  std::pair<WaitStatus, Future> send_slot(uintptr_t ack_addr, int64_t need, uint64_t closed_value,
                                          double timeout_s, const std::shared_ptr<MemRegion>& local,
                                          size_t local_off, const std::shared_ptr<RemoteRegion>& remote,
                                          size_t remote_off, size_t n, size_t word_local_off,
                                          uint64_t value, size_t word_remote_off,
                                          const Rider* rider = nullptr);
  // A receiver's recv over UCX whose last transfer is owed an ack, in one call: posts the ack
  // (write_flagged of no data: ack_value stored at local[ack_local_off], WRITE to
  // remote[ack_remote_off], behind every earlier word of the channel), then receive_slot(flag_addr,
  // k, ctl_addr, generation, this channel, timeout_s, no window, drive) (below). Returns its
  // status and the ack's future (the source word may be reused once it completed). Throws like
  // write_flagged, having waited for nothing.
  std::pair<WaitStatus, Future> ack_and_receive(const std::shared_ptr<MemRegion>& local,
                                                size_t ack_local_off,
                                                const std::shared_ptr<RemoteRegion>& remote,
                                                size_t ack_remote_off, uint64_t ack_value,
                                                uintptr_t flag_addr, uint64_t k, uintptr_t ctl_addr,
                                                uint64_t generation, double timeout_s, bool drive);
  // The peer's region written by the caller's own thread (DirectWindow), when it is shared
  // memory on this host and the same-host path is on; null otherwise. Authenticates and
  // validates `remote` like memcpy (it may wait for the owner's answer).
  std::shared_ptr<DirectWindow> direct_window(const std::shared_ptr<RemoteRegion>& remote);
  // Progresses the channel's worker on the caller's thread unless another thread drives it:
  // over tcp a put is applied by the target's progress, so a waiting receiver applies it.
  // Returns whether that did anything (false also where another thread holds the worker).
  bool progress_now() const;
  // After a long driving wait: the worker goes back to its progress thread (ProgressThread::
  // hand_back).
  void hand_back() const;
  // A waiter that drives the worker counts itself in (+1) and out (-1) (ProgressThread::drivers).
  void count_driver(int d) const { d > 0 ? drivers_->enter() : drivers_->leave(); }
  // Whether write_flagged of at most flagged_message_bytes() takes the message path here (data,
  // word and rider in one message): known once the endpoint exists (any post made it).
  bool flagged_by_message() const { return flagged_by_message_.load(); }
  static size_t flagged_message_bytes();
  // The smallest write_flagged that stripe= splits over two workers.
  static size_t striped_write_bytes();
  int qp_idx() const { return qp_; }
  std::string remote_endpoint() const;
  bool failed() const { return failed_.load(); }
  std::string error() const;

 private:
  friend class Device;
  friend class ProgressThread;
  struct Path;  // the same-host and UCX paths of one posted memcpy (internal.hpp)
  // The device, or Closed.
  std::shared_ptr<Device> open_device() const;
  // memcpy's argument checks (throws); the device.
  std::shared_ptr<Device> check_range(const std::shared_ptr<MemRegion>& local, size_t local_off,
                                      const std::shared_ptr<RemoteRegion>& remote,
                                      size_t remote_off, size_t n);
  // Authenticates `remote` and checks that this channel's peer owns it (Auth, Invalid).
  void check_peer_region(Device& dev, RemoteRegion& remote) const;
  // An Op for fut (counted in local's in-flight uses); the caller posts it.
  Op* make_op(const Future& fut, const std::shared_ptr<MemRegion>& local,
              const std::shared_ptr<RemoteRegion>& remote);
  static void unpost(Op* op);  // undoes make_op when the post fails
  // Runs a memcpy's or write_flagged's command of n bytes: on the caller's thread where that is
  // cheaper (post_inline; over sockets alone also larger ones, fut carrying what is left), else
  // on the progress thread. False once the device is closed.
  bool post_data(size_t n, const Future& fut, std::function<void()> task);
  // A rider as write_flagged's command posts it: the caller's Rider and the op that tracks it.
  struct RiderPost {
    Op* op = nullptr;
    Rider rider;
  };
  // flagged.cpp: write_flagged's data and word as one active message, when this endpoint takes
  // that path (FlaggedWrites) and n allows; false (nothing posted) otherwise. Progress thread.
  static bool send_flagged_message(ProgressThread* t, Op* data, Op* word, size_t local_off,
                                   size_t remote_off, size_t n, size_t word_remote_off,
                                   uint64_t value, const RiderPost* rider = nullptr);
  // write_flagged as its command runs (progress thread, or the caller's under the worker lock):
  // the message path, else the data's path and the word behind it. True when the message
  // carried the rider; else the caller posts it as a word-only write of its own.
  static bool post_flagged(ProgressThread* t, Op* data, const Future& data_fut, Op* word,
                           const Path& data_path, const Path& word_path, uint64_t value,
                           const RiderPost* rider, bool striped = false);
  // stripe.cpp, write_flagged's stripe=. stripe_partner: the channel that carries the second
  // half of n bytes, or null where the write is not split (the conditions at write_flagged);
  // opens it the first time. Any thread.
  std::shared_ptr<Channel> stripe_partner(Device& dev, size_t n, const MemRegion& local,
                                          const RemoteRegion& remote);
  // Splits n bytes: returns how many this channel puts and the Op of far's half (the caller
  // posts it with post_far_half). Both halves count in `parts`; data_fut (the first half's
  // future on entry) becomes the future of both, which the word waits for.
  std::pair<size_t, Op*> stripe_halves(Channel& far, size_t n, const std::shared_ptr<MemRegion>& local,
                                       const std::shared_ptr<RemoteRegion>& remote,
                                       const std::shared_ptr<FutureJoin>& parts, Future& data_fut);
  // Posts far's half of n bytes (counted in striped_posted_); false, the op undone, once far's
  // device is closed.
  bool post_far_half(Channel& far, Op* far_op, size_t local_off, size_t remote_off, size_t n);
  // fence() and flush(): waits (wait_word, driving the worker) until the word of every striped
  // write posted so far is put; throws Timeout (the device's rpc_timeout) or Peer. Caller's thread.
  void drain_striped(Device& dev);

  // Progress-thread only.
  bool ensure_ep();
  ucp_rkey_h rkey_for(const RemoteRegion& r);
  // The same-host mapping of r, or null; cached like the rkey and dropped with it.
  Mapping* mapping_for(const RemoteRegion& r);
  void drop_rkey(uint64_t region_id);
  std::vector<ucs_status_ptr_t> close_ep(bool force);
  void fail(const std::string& why);
  static void on_ep_error(void* arg, ucp_ep_h, ucs_status_t st);

  std::weak_ptr<Device> dev_;
  std::shared_ptr<Peer> peer_;
  int qp_ = 0;
  ProgressThread* thread_ = nullptr;
  std::shared_ptr<Drivers> drivers_;  // thread_'s
  int remote_thread_ = 0;
  // Progress-thread-only state.
  ucp_ep_h ep_ = nullptr;
  std::unordered_map<uint64_t, ucp_rkey_h> rkeys_;
  uint64_t seen_revocations_ = 0;  // Device::revocations_ when rkeys_ was last checked against it
  std::unordered_map<uint64_t, std::shared_ptr<Mapping>> mappings_;
  std::vector<Op*> unflushed_;
  int rma_pending_ = 0;  // UCX puts/gets not yet complete; mapped copies wait for them
  // Flagged writes sent as messages (flagged.cpp) that no completed flush covers yet: mapped
  // copies wait for them, as they would overtake a message still on its way. am_unflushed_: those
  // no requested flush covers either; a mapped copy that finds some requests one.
  int am_pending_ = 0;
  int am_unflushed_ = 0;
  std::atomic<bool> flagged_by_message_{false};  // write_flagged's path on this endpoint (FlaggedWrites)
  bool one_stream_ = false;  // Auto and one tcp lane: everything on ep_ lands in posting order
  std::atomic<bool> sockets_only_{false};  // every lane of ep_ is tcp (Channel::post_data)
  bool dirty_ = false;
  // write_flagged words waiting for their data's flush, in posting order (channel.cpp).
  struct DeferredWord {
    Op* word;
    size_t local_off, remote_off;
    Future data;  // null: the data needs no wait (none, or copied already)
    bool striped = false;  // data is split over two channels: a fence cannot order it
  };
  // Removes the front deferred word (a striped one counted in striped_flagged_). Progress thread.
  void pop_deferred();
  std::deque<DeferredWord> deferred_;
  bool deferred_listed_ = false;  // in thread_'s list of channels with deferred words
  // Puts every deferred word whose data (and every earlier word's) has landed; fails the words
  // whose data failed. now: puts every deferred word at once, each behind a fence (for fence()
  // and flush(), which cover them). Progress thread.
  void post_ready_words(ProgressThread* t, bool now = false);
  // Completes fut (null: a new one, returned) once a flush of this endpoint requested now has
  // completed, i.e. once every UCX operation posted on it before the call has; fails it when
  // the endpoint cannot be made. flush()'s, and a word alone's wait (post_flagged). Progress
  // thread.
  Future flush_barrier(ProgressThread* t, Future fut = nullptr);
  // Shared state.
  // Striped writes posted, and those whose word has left the deferred queue (drain_striped).
  std::atomic<uint64_t> striped_posted_{0}, striped_flagged_{0};
  std::mutex stripe_m_;                // guards stripe_ while it is made
  std::weak_ptr<Channel> stripe_;      // stripe_partner's channel, once opened
  std::atomic<bool> failed_{false};
  mutable std::mutex m_;
  std::string error_;
  std::mutex open_m_;    // held while the channel opens (Device::open_channel)
  bool opened_ = false;  // under open_m_
};

// A static pair's sends over UCX into host slots (Channel::send_slot) with all but the
// transfer's number, source and rider fixed when the pair is made: transfer k goes into slot
// (k - 1) % depth once the ack word says the receiver has consumed k - depth. What a send takes
// from the caller is two integers, so a small transfer's fixed cost is not spent converting
// the same twelve arguments every time. Not thread-safe: a pair's sends are serialized by its
// caller.
class SlotSender {
 public:
  // slot_offsets, word_offsets, word_remote_offsets: one per slot (their count is the depth).
  SlotSender(std::shared_ptr<Channel> ch, uintptr_t ack_addr, uint64_t closed_value,
             std::shared_ptr<MemRegion> local, std::shared_ptr<RemoteRegion> remote, size_t nbytes,
             std::vector<size_t> slot_offsets, std::vector<size_t> word_offsets,
             std::vector<size_t> word_remote_offsets);
  // Transfer k (>= 1) of nbytes from local[local_off], with rider if not null:
  // Channel::send_slot's wait (bounded by timeout_s), its post and its results. Blocks; throws
  // like it.
  std::pair<WaitStatus, Future> send(uint64_t k, size_t local_off, double timeout_s,
                                     const Channel::Rider* rider = nullptr);

 private:
  std::shared_ptr<Channel> ch_;
  uintptr_t ack_addr_;
  uint64_t closed_value_;
  std::shared_ptr<MemRegion> local_;
  std::shared_ptr<RemoteRegion> remote_;
  size_t nbytes_;
  std::vector<size_t> slot_at_, word_at_, word_remote_at_;
};

// A pair's receives from its sender with all but the transfer's number and the ack it owes
// fixed once the sender has introduced itself: transfer k is awaited in slot (k - 1) % depth.
// An owed ack goes first: over UCX posted as Channel::ack_and_receive does, on one host a store
// through the sender's window (receive_slot). What a receive takes from the caller is three
// integers, as SlotSender's send. Not thread-safe: a pair's receives are serialized by its
// caller.
class SlotReceiver {
 public:
  // window: the sender's region mapped here (same host), or null, when an ack is a write from
  // local (this receiver's region) to the sender's ack word at remote[ack_remote_off]. One flag
  // address per slot (their count is the depth); ctl_addr holds the sender's generation.
  SlotReceiver(std::shared_ptr<Channel> ch, std::shared_ptr<DirectWindow> window,
               std::shared_ptr<MemRegion> local, std::shared_ptr<RemoteRegion> remote,
               size_t ack_remote_off, std::vector<uintptr_t> flag_addrs, uintptr_t ctl_addr,
               uint64_t generation);
  // Hands back transfer ack_value (0: none owed; over UCX its source word at
  // local[ack_local_off]), then waits for transfer k (>= 1) as receive_slot does, bounded by
  // timeout_s, driving the worker over UCX. Returns the wait's status and the ack's future
  // (null without a posted ack). Blocks; throws like Channel::ack_and_receive.
  std::pair<WaitStatus, Future> recv(uint64_t k, uint64_t ack_value, size_t ack_local_off,
                                     double timeout_s);

 private:
  std::shared_ptr<Channel> ch_;
  std::shared_ptr<DirectWindow> window_;
  std::shared_ptr<MemRegion> local_;
  std::shared_ptr<RemoteRegion> remote_;
  size_t ack_remote_off_;
  std::vector<uintptr_t> flag_at_;
  uintptr_t ctl_addr_;
  uint64_t generation_;
};

// The RDMA device (Xue et al. §3.1). Every method may be called from any thread.
class Device : public std::enable_shared_from_this<Device> {
 public:
  // Validates cfg (Invalid), listens on cfg.endpoint, starts the progress threads.
  static std::shared_ptr<Device> create(const DeviceConfig& cfg);
  ~Device();
  // Idempotent. Stops the progress threads (pending futures fail with Closed), then
  // deregisters every region.
  void close();
  bool closed() const { return closing_.load(); }

  // Page-aligned, populated memory; shared memory when the same-host path is on.
  std::shared_ptr<MemRegion> alloc_region(size_t nbytes);
  // Memory the caller owns and keeps alive while the region lives: host memory, or GPU memory
  // of CUDA device cuda_device (>= 0; Invalid where this UCX has no CUDA support).
  std::shared_ptr<MemRegion> register_memory(uintptr_t addr, size_t nbytes, int cuda_device = -1);
  // Whether this UCX context can register GPU memory (a CUDA transport is in UCX_TLS).
  bool cuda_supported() const;
  // Connects (and authenticates) on first use, bounded by connect_timeout; throws
  // OutOfBounds for a qp_idx outside [0, qps_per_peer), Auth for a peer of another job.
  // Blocks. The first call for (peer, qp_idx) opens the channel: this device's endpoint to the
  // peer, then the peer's endpoint back (one round trip on the control link, bounded by
  // rpc_timeout; Peer or Timeout if it fails, and the next call tries again). Every call
  // returns only once the channel is open.
  std::shared_ptr<Channel> channel(const std::string& remote_endpoint, int qp_idx);

  // Side RPC: named byte strings handed out to authenticated peers.
  void publish(const std::string& name, const std::string& value);
  void unpublish(const std::string& name);
  // timeout < 0: rpc_timeout. Connecting first, if need be, counts against it (bounded by
  // connect_timeout too). Throws Invalid when the peer published nothing under name.
  // claim (non-null): the lookup also claims the name, atomically at its owner, if the name
  // still holds *claim (the value the caller looked up and checked; else Invalid, "published
  // anew", and nothing is claimed). The first claim of a published value succeeds, every later
  // one throws Invalid until the name is published anew or unpublished (a transfer receiver
  // pairs with the one sender that claimed it).
  std::string lookup(const std::string& remote_endpoint, const std::string& name, double timeout,
                     const std::string* claim = nullptr);

  const std::string& endpoint() const { return endpoint_; }
  uint64_t uuid() const { return uuid_; }
  const DeviceConfig& config() const { return cfg_; }
  int num_cqs() const { return int(threads_.size()); }
  std::string ucx_info() const;  // ucp_context_print_info
  bool same_host_mapping() const { return map_enabled_; }
  // The congestion control UCX's tcp data sockets run (DeviceConfig::tcp_congestion resolved),
  // and the one this device sets on them ("" when it leaves the system's).
  const std::string& tcp_congestion() const { return tcp_cc_.effective; }
  const std::string& tcp_congestion_set() const { return tcp_cc_.set; }
  // The network devices UCX was given (UCX_NET_DEVICES, or DeviceConfig::net_devices); "all".
  const std::string& net_devices() const { return net_devices_; }
  // memcpys done by a CPU copy through a same-host mapping, and through UCX.
  uint64_t mapped_ops() const { return mapped_ops_.load(); }
  uint64_t ucx_ops() const { return ucx_ops_.load(); }
  // Flagged writes sent as one active message, and those received that named no live region
  // of this device (dropped).
  uint64_t message_writes() const { return message_writes_.load(); }
  uint64_t dropped_writes() const { return dropped_writes_.load(); }
  // Flagged writes over puts: words put once their data's flush completed, and words put right
  // behind their data on an endpoint of one tcp lane (FlaggedWrites::Auto).
  uint64_t flushed_words() const { return flushed_words_.load(); }
  uint64_t stream_words() const { return stream_words_.load(); }
  // Flagged writes whose data was split over two channels (Channel::write_flagged's stripe).
  uint64_t striped_writes() const { return striped_writes_.load(); }
  // Posts above 64 KiB run on the caller's thread (over sockets alone) that handed what was left
  // of them to the progress thread (ProgressThread::post_inline's carry).
  uint64_t carried_posts() const { return carried_posts_.load(); }

 private:
  friend class Channel;
  friend class DirectWindow;
  friend class Handshaker;
  friend class MemRegion;
  friend class ProgressThread;
  Device();
  // device.cpp
  void init(const DeviceConfig& cfg);
  void check_open() const;
  std::string op_error_message(Op* op, ucs_status_t st, ErrorKind* kind);

  // region.cpp
  std::shared_ptr<MemRegion> register_region(uintptr_t addr, size_t nbytes,
                                             const std::shared_ptr<RegionMemory>& mem,
                                             int cuda_device = -1);
  // cuda.cpp: the CUDA context of the GPU memory this device uses, made current on a thread that
  // drives a worker (UCX's CUDA transports call the driver there, and fail without one).
  void use_cuda_device(int ordinal);
  void cuda_thread_context();
  std::string encode_descriptor(const MemRegion& r, const RegionMemory& mem) const;
  void verify_remote(RemoteRegion& r);
  bool revoked(uint64_t owner, uint64_t id);
  void free_region(MemRegion& r);
  bool revoke_at(const std::vector<Link*>& holders, uint64_t region_id);

  // same_host.cpp
  std::shared_ptr<Mapping> map_remote(const RemoteRegion& r);
  void unmap_remote(uint64_t owner, uint64_t region_id);
  void copy_mapped(void* dst, const void* src, size_t n);

  // wireup.cpp: connecting, the handshake, control messages and link failures.
  // within = -1: bounded by connect_timeout alone; else by the shorter of the two (a caller's
  // shorter bound fails only that call: the handshake goes on for the others).
  std::shared_ptr<Peer> connect(const std::string& endpoint, double within = -1);
  // After a handshake (the handshake thread): the control link, made on progress thread 0,
  // its endpoint from our control worker to the peer's worker 0. open_link: ours to p, which it
  // makes Ready (or Failed). accept_link: the link of a peer that proved it knows the secret;
  // false (why set) if it was not made within rpc_timeout (at most the handshake timeout).
  void open_link(const std::shared_ptr<Peer>& p, uint64_t token, uint64_t remote_token,
                 uint64_t remote_uuid, std::vector<std::string> worker_addrs);
  bool accept_link(uint64_t remote_token, uint64_t remote_uuid, const std::string& remote_endpoint,
                   const std::string& worker_addr, uint64_t* token, std::string* why);
  // Progress thread 0: the endpoint to worker_addr (from the control worker) and the link,
  // registered under token (0: a fresh one); nullptr (why set) if UCX refused the endpoint.
  Link* make_link(uint64_t token, uint64_t remote_token, const std::string& worker_addr,
                  std::string* why);
  bool connect_link(Link* l, const std::string& worker_addr, std::string* why);
  std::shared_ptr<Peer> wait_connected(const std::shared_ptr<Peer>& p, double within);
  void send_ctrl(Link* l, uint32_t type, uint64_t req, const std::string& payload);
  void handle_ctrl(Link* l, uint32_t type, uint64_t req, const std::string& payload);
  void handle_as_server(Link* l, uint32_t type, uint64_t req, const std::string& payload);
  void handle_as_client(Link* l, uint32_t type, uint64_t req, const std::string& payload);
  void on_link_error(Link* l, ucs_status_t st);
  void on_data_ep_error(Channel* ch, ucs_status_t st);
  std::vector<ucs_status_ptr_t> close_links();  // progress thread 0, at close
  static ucs_status_t am_cb(void* arg, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param);
  // flagged.cpp: a flagged write arriving as an active message, on any worker.
  static ucs_status_t flagged_cb(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  static void link_err_cb(void* arg, ucp_ep_h, ucs_status_t st);

  // rpc.cpp: the side RPC's requests (LOOKUP, VALIDATE, REVOKE) and their answers.
  struct Request;
  bool post_request(Link* l, uint32_t type, const std::string& payload, bool ok_if_dead,
                    const char* if_dead, Request* out);
  std::string call(Link* l, uint32_t type, const std::string& payload, const char* if_dead,
                   double timeout, const std::string& what, ErrorKind refused_kind,
                   const std::function<std::string(const std::string&)>& refused);
  std::string wait_rpc(uint64_t id, const std::shared_ptr<Rpc>& r, double timeout,
                       const std::string& what);
  void finish_rpc(uint64_t id, bool ok, ErrorKind k, const std::string& reply);
  void fail_rpcs_for(Link* l, const std::string& why);
  void fail_all_rpcs(const std::string& why);
  void ensure_validated(const std::shared_ptr<Peer>& peer, RemoteRegion& r);
  void answer_lookup(Link* l, uint64_t req, const std::string& name, bool claim,
                     const std::string& expected);
  void answer_validate(Link* l, uint64_t req, uint64_t id, uint64_t addr, uint64_t len);
  // channel.cpp: the two ends of opening a channel (docs/architecture.md, "Opening a channel").
  void open_channel(const std::shared_ptr<Peer>& p, const std::shared_ptr<Channel>& ch);
  // channel() once the peer is connected and qp_idx checked (Channel::stripe_partner's way in,
  // which may use a qp past qps_per_peer).
  std::shared_ptr<Channel> channel_at(const std::shared_ptr<Peer>& p, int qp_idx);
  void answer_open_channel(Link* l, uint64_t req, uint32_t qp, const std::string& worker_addr);
  void answer_revoke(Link* l, uint64_t req, uint64_t region_id);

  DeviceConfig cfg_;
  std::string endpoint_;
  uint64_t uuid_ = 0;
  uint64_t job_tag_ = 0;
  ucp_context_h ctx_ = nullptr;
  std::vector<std::unique_ptr<ProgressThread>> threads_;
  std::unique_ptr<Handshaker> handshaker_;
  std::atomic<bool> closing_{false};
  std::atomic<uint64_t> next_region_{1};
  std::atomic<int> cuda_ordinal_{-1};  // use_cuda_device
  std::atomic<uint64_t> next_rpc_{1};
  std::atomic<uint64_t> mapped_ops_{0}, ucx_ops_{0}, message_writes_{0}, dropped_writes_{0};
  std::atomic<uint64_t> flushed_words_{0}, stream_words_{0}, carried_posts_{0}, striped_writes_{0};
  bool map_enabled_ = false;
  TcpCongestion tcp_cc_;
  std::string net_devices_ = "all";
  std::unique_ptr<CopyPool> copier_;
  std::string boot_id_;
  std::mutex maps_m_;
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<Mapping>> maps_;  // null: unmappable

  mutable std::mutex m_;
  std::map<std::string, std::shared_ptr<Peer>> peers_;
  std::map<uint64_t, std::weak_ptr<MemRegion>> regions_;
  std::map<std::string, std::string> published_;
  std::map<std::string, std::string> claimed_;  // published name -> endpoint of its claimant
  std::map<uint64_t, std::pair<Link*, std::shared_ptr<Rpc>>> rpcs_;  // id -> (link, rpc)
  std::set<std::pair<uint64_t, uint64_t>> revoked_;                 // (owner uuid, region)
  // Entries ever put in revoked_: a channel that sees it move forgets what was revoked before
  // answer_revoke's drop reaches its thread (Channel::rkey_for).
  std::atomic<uint64_t> revocations_{0};
  std::vector<std::shared_ptr<RegionMemory>> quarantine_;  // memory a silent peer may still write
  // Progress thread 0 only.
  std::unordered_map<uint64_t, Link*> links_;  // by token
  std::vector<Link*> dead_links_;  // kept until close: queued commands may still name them
};

// A thread-safe allocator over one registered region (Xue et al. §3.4: one region registered
// once, sized up front, carved up by an allocator). Best fit with coalescing of free neighbours.
class Arena : public std::enable_shared_from_this<Arena> {
 public:
  Arena(std::shared_ptr<MemRegion> region, size_t alignment);
  size_t alloc(size_t nbytes);  // offset into the region; throws Error(Full)
  void free(size_t offset);
  const std::shared_ptr<MemRegion>& region() const { return region_; }
  size_t capacity() const { return capacity_; }
  size_t alignment() const { return align_; }
  size_t used() const;
  size_t largest_free() const;
  size_t num_allocations() const;
  size_t num_free_blocks() const;

 private:
  void insert_free(size_t off, size_t len);
  void erase_free(std::map<size_t, size_t>::iterator it);
  std::shared_ptr<MemRegion> region_;
  size_t capacity_ = 0, align_ = 256, used_ = 0;
  mutable std::mutex m_;
  std::map<size_t, size_t> free_by_off_;        // offset -> length
  std::multimap<size_t, size_t> free_by_len_;   // length -> offset
  std::unordered_map<size_t, size_t> live_;     // offset -> length
};

// One allocation; returns itself to the arena when the last reference (e.g. a tensor) goes.
struct ArenaBlock {
  std::shared_ptr<Arena> arena;
  size_t offset = 0, length = 0;
  ~ArenaBlock() {
    if (arena) arena->free(offset);
  }
};

// cuda.cpp. CUDA IPC, for the transfer layer's same-host GPU path: the handle of the allocation
// holding GPU memory at ptr (64 bytes) and ptr's offset in it; and the base address of a peer's
// allocation in this process, opened once per handle (it stays mapped until the process ends).
std::pair<std::string, uint64_t> cuda_ipc_export(uintptr_t ptr, int ordinal);
uintptr_t cuda_ipc_open(const std::string& handle, int ordinal);

// How a wait on a word, or a transfer's send or receive on the direct path, ended.
enum class WaitStatus : int {
  Ok = 0,
  Timeout = 1,      // nothing written: the wait may be repeated
  PeerFailed = 2,   // the channel watched failed before the word arrived
  Closed = 3,       // the ack word says the receiver closed (send_slot)
  OtherSender = 4,  // another sender introduced itself to the receiver (receive_slot)
  Mismatch = 5,     // the flag holds a later transfer than the one awaited (receive_slot)
};

// Waits until the 8-byte word at addr is >= value (acquire loads). Polls first: it spins
// (after its first 10 us yielding the core between rounds of loads) for an adaptive time (per
// thread: about four times the last wait, if that one took at most 1 ms, between 50 and 250 us;
// halved after a longer one), then yields the core 50 times, then sleeps with a backoff of 1,
// 2, 4 ... 50 us, so an idle wait costs a wake-up per 50 us and no core. `peer` (may be
// null) is looked at while sleeping; with `drive`, the waiter also progresses peer's worker
// between looks (Channel::progress_now). timeout_s < 0: none.
WaitStatus wait_word(uintptr_t addr, uint64_t value, double timeout_s, const Channel* peer,
                     bool drive = false);
// wait_word without a peer; false on timeout.
bool wait_u64_at_least(uintptr_t addr, uint64_t value, double timeout_s);
// A pair's credit: waits (wait_word) until the ack word at ack_addr is >= need (need <= 0: no
// wait) and below closed_value. Ok, Closed (ack >= closed_value, before or after the wait),
// Timeout or PeerFailed. Channel::send_slot and DirectWindow::send_slot.
WaitStatus wait_credit(uintptr_t ack_addr, int64_t need, uint64_t closed_value, double timeout_s,
                       const Channel* peer, bool drive);

// A same-host peer's shared region mapped into this process, written by the caller's own
// thread: no progress thread, no queue, no future (the direct path of transfer pairs). A call
// returns when its stores are done; data written before store_word() is visible to a reader
// that loads that word with acquire semantics (a release store; non-temporal copies are
// fenced first). Calls are not ordered with operations posted on the channel: a transfer pair
// uses one path or the other for everything it writes. Any thread.
class DirectWindow {
 public:
  size_t length() const;
  // Where the peer's region is mapped in this process (valid while this window lives): for
  // readers that load from it in place, e.g. a sparse table's gather (rdmaflow/ps/sparse.py).
  uintptr_t address() const;
  // Copies n bytes from src to [off, off + n) of the peer's region. Throws OutOfBounds,
  // Region (the owner freed it), Peer (the channel failed), Closed.
  void write(size_t off, const void* src, size_t n);
  // Stores v at off (8-byte aligned) with release semantics. Throws like write.
  void store_word(size_t off, uint64_t v);
  // One transfer of a static or bounded pair: waits until the word at ack_addr (this
  // process's memory) is >= need (credits; need <= 0: none) and below closed_value, then
  // write(header_off, header, header_n) (a bounded transfer's size record; none when
  // header_n is 0), write(data_off, src, n), then store_word(flag_off, k). Returns Ok, or
  // before writing anything: Timeout, Closed (ack >= closed_value) or PeerFailed.
  WaitStatus send_slot(uintptr_t ack_addr, int64_t need, uint64_t closed_value, size_t data_off,
                       const void* src, size_t n, size_t flag_off, uint64_t k, double timeout_s,
                       size_t header_off = 0, const void* header = nullptr, size_t header_n = 0);

 private:
  friend class Channel;
  void check_bounds(size_t off, size_t n) const;       // OutOfBounds
  void check_word(size_t off) const;                   // bounds and 8-byte alignment
  std::shared_ptr<Device> check_live() const;          // Closed, Peer, Region
  void copy(Device& dev, size_t off, const void* src, size_t n);  // checked by the caller
  void store(size_t off, uint64_t v);                              // checked by the caller
  std::weak_ptr<Device> dev_;
  std::shared_ptr<Channel> ch_;
  std::shared_ptr<RemoteRegion> remote_;
  std::shared_ptr<Mapping> map_;
};

// A receiver's recv of transfer k on any transport, as one call: first, when ack is given,
// the ack of a consumed transfer (ack->store_word(ack_off, ack_value)); then wait_word on the
// slot's flag at flag_addr (watching peer, and driving its worker with `drive`: when the
// sender's puts need this side's progress); then the checks that the flag holds exactly k
// (Mismatch) and that the word at ctl_addr still holds the generation of the sender that
// introduced itself (OtherSender).
WaitStatus receive_slot(uintptr_t flag_addr, uint64_t k, uintptr_t ctl_addr, uint64_t generation,
                        const Channel* peer, double timeout_s, DirectWindow* ack, size_t ack_off,
                        uint64_t ack_value, bool drive);

std::string ucx_version();
std::string ucs_error(ucs_status_t st);

// HMAC-SHA256 of msg under key (32 bytes); exposed for its known-answer tests.
std::string hmac_sha256_bytes(const std::string& key, const std::string& msg);

}  // namespace rdmaflow
