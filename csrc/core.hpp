// rdmaflow core: the paper's RDMA "device" (seed 000, Table 1) over UCX's UCP API.
//
//   Device       one ucp_context; num_cqs workers ("completion queues"), each with its own
//                progress thread; a listener on worker 0 for the side RPC.
//   MemRegion    memory mapped with ucp_mem_map; its descriptor carries address, length, packed
//                remote key, owner and a MAC made with the job secret.
//   Channel      (peer, qp_idx): a ucp_ep from worker qp_idx % num_cqs to the peer's worker
//                qp_idx % peer_num_cqs.
//   memcpy       ucp_put_nbx / ucp_get_nbx; a WRITE completes only after an endpoint flush, so
//                a completed future means the data is visible at the destination.
//
// Every UCX call on a worker happens on that worker's thread: other threads hand it closures
// through a queue and wake it with ucp_worker_signal. No UCX lock is taken on the data path.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace rdmaflow {

enum class ErrorKind { Generic, OutOfBounds, Peer, Region, Closed, Timeout, Auth, Invalid, Full };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind k, const std::string& m) : std::runtime_error(m), kind(k) {}
  ErrorKind kind;
};

enum class Direction : int { Write = 0, Read = 1 };

struct DeviceConfig {
  std::string endpoint = "127.0.0.1:0";
  int num_cqs = 1;
  int qps_per_peer = 1;
  std::string secret;
  bool busy_poll = false;
  int spin_us = 50;               // progress this long before sleeping on the wakeup fd
  double connect_timeout = 10.0;  // seconds
  double rpc_timeout = 10.0;      // seconds, side RPC and revocation
  bool data_error_handling = false;  // UCP_ERR_HANDLING_MODE_PEER on data endpoints too
  // Same-host fast path: regions live in shared memory that a peer on the same host maps, so
  // a memcpy to them is one CPU copy instead of a transport operation. 0 off, 1 on, 2 auto
  // (on unless UCX_TLS rules out shared-memory transports).
  int same_host = 2;
  // Threads that share one large mapped copy (the progress thread and copy_threads - 1
  // helpers, which sleep when idle): a single core cannot reach the memory bandwidth.
  int copy_threads = 1;
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

class DeviceImpl;
class Worker;
class Channel;
struct Link;

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

class MemRegion {
 public:
  uint64_t id() const { return id_; }
  uintptr_t address() const { return reinterpret_cast<uintptr_t>(mem_->addr); }
  size_t length() const { return mem_->length; }
  bool freed() const { return freed_.load(); }
  std::vector<uint8_t> descriptor() const;
  std::shared_ptr<RegionMemory> memory() const { return mem_; }
  void free();  // revokes remote access, waits for in-flight use, deregisters

 private:
  friend class DeviceImpl;
  friend class Worker;
  friend class Channel;
  std::weak_ptr<DeviceImpl> dev_;
  std::shared_ptr<RegionMemory> mem_;
  ucp_mem_h memh_ = nullptr;
  uint64_t id_ = 0;
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
  static std::shared_ptr<RemoteRegion> parse(const std::string& bytes);
  uint64_t job_tag = 0, owner_uuid = 0, region_id = 0, addr = 0, length = 0;
  std::string owner_endpoint;
  std::vector<uint8_t> rkey;
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

struct Peer {
  std::string endpoint;
  uint64_t uuid = 0;
  int num_workers = 0;
  std::vector<std::string> worker_addrs;
  Link* link = nullptr;  // worker-0 thread only
  enum State { Connecting, Ready, Failed } state = Connecting;
  std::string error;
  bool auth_failed = false;
  uint8_t nc[16] = {0};
  std::mutex m;
  std::condition_variable cv;
  std::map<int, std::shared_ptr<Channel>> channels;
  std::set<uint64_t> validated;  // region ids validated with the owner
};

class Channel : public std::enable_shared_from_this<Channel> {
 public:
  Future memcpy(const std::shared_ptr<MemRegion>& local, size_t local_off,
                const std::shared_ptr<RemoteRegion>& remote, size_t remote_off, size_t n,
                Direction dir, Callback cb);
  // Orders operations posted after it behind those posted before (ucp_worker_fence).
  void fence();
  // Completes when every WRITE posted before it is visible at the peer.
  Future flush(Callback cb);
  int qp_idx() const { return qp_; }
  std::string remote_endpoint() const { return peer_->endpoint; }
  bool failed() const { return failed_.load(); }
  std::string error() const;
  const std::shared_ptr<Peer>& peer() const { return peer_; }
  Worker* worker_ptr() const { return worker_; }
  std::shared_ptr<DeviceImpl> device() const { return dev_.lock(); }

  // Worker-thread only.
  bool ensure_ep();
  ucp_rkey_h rkey_for(const RemoteRegion& r);
  // The same-host mapping of r, or null; cached like the rkey and dropped with it.
  Mapping* mapping_for(const RemoteRegion& r);
  void drop_rkey(uint64_t region_id);
  std::vector<ucs_status_ptr_t> close_ep(bool force);
  void fail(const std::string& why);

 private:
  friend class DeviceImpl;
  friend class Worker;
  std::weak_ptr<DeviceImpl> dev_;
  std::shared_ptr<Peer> peer_;
  int qp_ = 0;
  Worker* worker_ = nullptr;
  int remote_worker_ = 0;
  // Worker-thread-only state.
  ucp_ep_h ep_ = nullptr;
  std::unordered_map<uint64_t, ucp_rkey_h> rkeys_;
  std::unordered_map<uint64_t, std::shared_ptr<Mapping>> mappings_;
  std::vector<struct Op*> unflushed_;
  int rma_pending_ = 0;  // UCX puts/gets not yet complete; mapped copies wait for them
  bool dirty_ = false;
  // Shared state.
  std::atomic<bool> failed_{false};
  mutable std::mutex m_;
  std::string error_;
};

struct Op {
  Future fut;
  int pending = 1;
  bool finished = false;  // future completed
  ucs_status_t status = UCS_OK;
  bool rma = false;  // went through UCX (counted in ch->rma_pending_)
  std::shared_ptr<MemRegion> local;
  std::shared_ptr<Channel> ch;
  std::shared_ptr<RemoteRegion> remote;
};

class Worker {
 public:
  Worker(DeviceImpl* dev, int idx, ucp_context_h ctx);
  ~Worker();
  void start();
  void stop();  // closes endpoints, fails what is left, joins the thread
  bool post(std::function<void()> fn);  // false once the worker has stopped
  ucp_worker_h handle() const { return w_; }
  const std::string& address() const { return addr_; }
  int index() const { return idx_; }
  DeviceImpl* device() const { return dev_; }
  bool on_thread() const { return std::this_thread::get_id() == tid_; }

  // Worker-thread-only helpers.
  void track(Op* op) { inflight_.insert(op); }
  void op_done(Op* op);
  void op_note(Op* op, ucs_status_t st);
  void mark_dirty(Channel* ch);
  void add_channel(const std::shared_ptr<Channel>& ch) { channels_.push_back(ch); }
  std::vector<std::shared_ptr<Channel>>& channels() { return channels_; }

 private:
  void loop();
  bool run_commands();
  void flush_dirty();
  DeviceImpl* dev_;
  int idx_;
  ucp_worker_h w_ = nullptr;
  int efd_ = -1;
  std::string addr_;
  std::thread thr_;
  std::thread::id tid_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};
  std::mutex qm_;
  bool accepting_ = true;
  std::vector<std::function<void()>> q_;
  std::atomic<size_t> qsize_{0};
  std::vector<Channel*> dirty_;
  std::unordered_set<Op*> inflight_;
  std::vector<std::shared_ptr<Channel>> channels_;
};

// A control connection (side RPC) to or from a peer device; worker-0 thread only.
struct Link {
  DeviceImpl* dev = nullptr;
  ucp_ep_h ep = nullptr;
  bool client = false;           // we connected (peer set) or accepted
  std::shared_ptr<Peer> peer;    // client side
  bool authed = false;
  bool dead = false;
  uint8_t nc[16] = {0}, ns[16] = {0};
  uint64_t remote_uuid = 0;
  std::string remote_endpoint;
};

struct Rpc {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  bool ok = false;
  ErrorKind kind = ErrorKind::Generic;
  std::string reply;
};

class DeviceImpl : public std::enable_shared_from_this<DeviceImpl> {
 public:
  static std::shared_ptr<DeviceImpl> create(const DeviceConfig& cfg);
  ~DeviceImpl();
  void close();
  bool closed() const { return closing_.load(); }

  std::shared_ptr<MemRegion> alloc_region(size_t nbytes);
  std::shared_ptr<MemRegion> register_memory(uintptr_t addr, size_t nbytes,
                                             const RegionMemory* shared = nullptr);
  std::shared_ptr<Channel> channel(const std::string& remote_endpoint, int qp_idx);

  // Side RPC: named byte strings handed out to authenticated peers.
  void publish(const std::string& name, const std::string& value);
  void unpublish(const std::string& name);
  std::string lookup(const std::string& remote_endpoint, const std::string& name, double timeout);

  const std::string& endpoint() const { return endpoint_; }
  uint64_t uuid() const { return uuid_; }
  uint64_t job_tag() const { return job_tag_; }
  const DeviceConfig& config() const { return cfg_; }
  int num_cqs() const { return int(workers_.size()); }
  std::string ucx_info() const;  // ucp_context_print_info
  bool same_host_mapping() const { return map_enabled_; }
  // memcpys done by a CPU copy through a same-host mapping, and through UCX.
  std::atomic<uint64_t> mapped_ops{0}, ucx_ops{0};
  // The mapping of a same-host peer's shared region, or null when it cannot be mapped.
  std::shared_ptr<Mapping> map_remote(const RemoteRegion& r);
  void unmap_remote(uint64_t owner, uint64_t region_id);
  void copy_mapped(void* dst, const void* src, size_t n);

  // Internal, used by Channel/MemRegion/Worker.
  void check_open() const;
  void verify_remote(RemoteRegion& r);
  void ensure_validated(const std::shared_ptr<Peer>& peer, RemoteRegion& r);
  bool revoked(uint64_t owner, uint64_t id);
  void free_region(MemRegion& r);
  Worker& worker(int i) { return *workers_[i]; }
  ucp_context_h context() const { return ctx_; }
  void on_link_error(Link* l, ucs_status_t st);
  void on_data_ep_error(Channel* ch, ucs_status_t st);
  std::vector<ucs_status_ptr_t> close_links();  // worker-0 thread, at close
  static ucs_status_t am_cb(void* arg, const void* header, size_t header_length, void* data,
                            size_t length, const ucp_am_recv_param_t* param);
  static void conn_cb(ucp_conn_request_h req, void* arg);
  std::string op_error_message(Op* op, ucs_status_t st, ErrorKind* kind);

 private:
  DeviceImpl() = default;
  void init(const DeviceConfig& cfg);
  std::shared_ptr<Peer> connect(const std::string& endpoint);
  void send_ctrl(Link* l, uint32_t type, uint64_t req, const std::string& payload);
  void handle_ctrl(Link* l, uint32_t type, uint64_t req, const std::string& payload);
  std::shared_ptr<Rpc> start_rpc(Link* l, uint64_t* id);
  std::string wait_rpc(uint64_t id, const std::shared_ptr<Rpc>& r, double timeout,
                       const std::string& what);
  void finish_rpc(uint64_t id, bool ok, ErrorKind k, const std::string& reply);
  void fail_rpcs_for(Link* l, const std::string& why);
  Link* new_link(ucp_ep_h ep, bool client);
  void drop_link(Link* l);
  std::string mac_hex(const std::string& label, const uint8_t* a, const uint8_t* b);

  DeviceConfig cfg_;
  std::string endpoint_;
  uint64_t uuid_ = 0;
  uint64_t job_tag_ = 0;
  ucp_context_h ctx_ = nullptr;
  std::vector<std::unique_ptr<Worker>> workers_;
  ucp_listener_h listener_ = nullptr;
  std::atomic<bool> closing_{false};
  std::atomic<uint64_t> next_region_{1};
  std::atomic<uint64_t> next_rpc_{1};
  bool map_enabled_ = false;
  std::unique_ptr<CopyPool> copier_;
  std::string boot_id_;
  std::mutex maps_m_;
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<Mapping>> maps_;  // null: unmappable

  mutable std::mutex m_;
  std::map<std::string, std::shared_ptr<Peer>> peers_;
  std::map<uint64_t, std::weak_ptr<MemRegion>> regions_;
  std::map<std::string, std::string> published_;
  std::map<uint64_t, std::pair<Link*, std::shared_ptr<Rpc>>> rpcs_;  // id -> (link, rpc)
  std::set<std::pair<uint64_t, uint64_t>> revoked_;                 // (owner uuid, region)
  std::vector<std::shared_ptr<RegionMemory>> quarantine_;  // memory a silent peer may still write
  // Worker-0 thread only.
  std::unordered_map<ucp_ep_h, Link*> links_;
  std::vector<Link*> dead_links_;  // kept until close: queued commands may still name them
};

// A thread-safe allocator over one registered region (seed 000 §3.4: one region registered
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

// Waits until the 8-byte word at addr is >= value (acquire). Spins briefly, then yields and
// sleeps with backoff. Returns false on timeout (negative: none).
bool wait_u64_at_least(uintptr_t addr, uint64_t value, double timeout_s);

std::string ucx_version();
std::string ucs_error(ucs_status_t st);

}  // namespace rdmaflow
