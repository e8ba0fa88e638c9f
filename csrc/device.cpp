// Device setup and teardown: validating the configuration (the job secret's strength), the UCX
// context, the progress threads and the handshake listener; close(); and how a failed
// operation's status becomes an error.
#include <cctype>
#include <cstdio>
#include <cstdlib>

#include "internal.hpp"
#include "wire.hpp"

namespace rdmaflow {

Device::Device() = default;

// A captured handshake can always be attacked offline: a secret must be too long to guess.
void check_secret_strength(const std::string& secret) {
  bool blank = true;
  for (char c : secret)
    if (!std::isspace(static_cast<unsigned char>(c))) blank = false;
  if (secret.size() < kMinSecretBytes || blank)
    throw Error(ErrorKind::Invalid,
                "the job secret is too weak (" +
                    std::string(blank ? "only whitespace" : std::to_string(secret.size()) + " bytes") +
                    "; at least " + std::to_string(kMinSecretBytes) +
                    " are needed, not all whitespace): make one with "
                    "python -c \"import secrets; print(secrets.token_hex(16))\" and give every "
                    "process of the job the same (secret=... or RDMAFLOW_JOB_SECRET)");
}

std::shared_ptr<Device> Device::create(const DeviceConfig& cfg) {
  std::shared_ptr<Device> d(new Device());
  d->init(cfg);
  return d;
}

void Device::init(const DeviceConfig& cfg) {
  cfg_ = cfg;
  if (cfg.secret.empty())
    throw Error(ErrorKind::Invalid,
                "a job secret is required: pass secret=... or set RDMAFLOW_JOB_SECRET; devices "
                "only hand remote keys to peers that prove they know it");
  check_secret_strength(cfg.secret);
  if (cfg.num_cqs < 1 || cfg.num_cqs > 64)
    throw Error(ErrorKind::Invalid, "num_cqs must be between 1 and 64, got " +
                                        std::to_string(cfg.num_cqs));
  if (cfg.qps_per_peer < 1 || cfg.qps_per_peer > 256)
    throw Error(ErrorKind::Invalid, "qps_per_peer must be between 1 and 256, got " +
                                        std::to_string(cfg.qps_per_peer));
  socklen_t slen = 0;
  sockaddr_storage ss = resolve(cfg.endpoint, &slen, true);
  random_bytes(&uuid_, sizeof uuid_);
  {
    auto d = hmac_sha256(cfg.secret, "rdmaflow-job-tag", 16);
    std::memcpy(&job_tag_, d.data(), 8);
  }
  if (cfg.same_host != SameHost::Off && cfg.same_host != SameHost::On &&
      cfg.same_host != SameHost::Auto)
    throw Error(ErrorKind::Invalid, "same_host must be SameHost.OFF, ON or AUTO, got " +
                                        std::to_string(int(cfg.same_host)));
  boot_id_ = read_boot_id();
  map_enabled_ = !boot_id_.empty() &&
                 (cfg.same_host == SameHost::On ||
                  (cfg.same_host == SameHost::Auto && tls_allow_shared_memory()));
  if (cfg.copy_threads < 1 || cfg.copy_threads > 64)
    throw Error(ErrorKind::Invalid, "copy_threads must be between 1 and 64, got " +
                                        std::to_string(cfg.copy_threads));
  if (map_enabled_) copier_ = std::make_unique<CopyPool>(cfg.copy_threads - 1);
  tcp_cc_ = resolve_tcp_congestion(cfg.tcp_congestion);

  ucp_config_t* ucfg = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &ucfg);
  if (st != UCS_OK) throw Error(ErrorKind::Generic, "ucp_config_read failed: " + ucs_error(st));
  // A flagged write's message (at most 512 KiB and its headers) in one tcp segment, not in
  // UCX's default 8 KiB (send) and 64 KiB (receive): each segment costs both sides a syscall
  // and a progress round (docs/benchmarks.md). An environment setting wins.
  const std::string seg = std::to_string(kFlaggedSegBytes);
  for (const char* name : {"TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE"})
    if (!std::getenv((std::string("UCX_") + name).c_str()))
      ucp_config_modify(ucfg, name, seg.c_str());
  // Where the environment names no network device, those the caller chose: UCX's tcp
  // interfaces (and their data ports) then exist only on the device's own interface.
  const char* env_nets = std::getenv("UCX_NET_DEVICES");
  if (env_nets && *env_nets) {
    net_devices_ = env_nets;
  } else if (!cfg.net_devices.empty()) {
    st = ucp_config_modify(ucfg, "NET_DEVICES", cfg.net_devices.c_str());
    if (st != UCS_OK) {
      ucp_config_release(ucfg);
      throw Error(ErrorKind::Invalid, "net_devices " + cfg.net_devices + ": " + ucs_error(st));
    }
    net_devices_ = cfg.net_devices;
  }
  ucp_params_t p{};
  p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                 UCP_PARAM_FIELD_NAME;
  p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  p.mt_workers_shared = 1;
  p.name = "rdmaflow";
  st = ucp_init(&p, ucfg, &ctx_);
  ucp_config_release(ucfg);
  if (st != UCS_OK) throw Error(ErrorKind::Generic, "ucp_init failed: " + ucs_error(st));

  try {
    for (int i = 0; i < cfg.num_cqs; ++i) {
      threads_.emplace_back(std::make_unique<ProgressThread>(this, i, ctx_));
      set_am_handler(threads_.back()->handle(), kFlaggedAmId, flagged_cb, this);
    }
    // Control messages arrive on progress thread 0's worker; handshakes on our own socket.
    set_am_handler(threads_[0]->handle(), kAmId, am_cb, this);
    handshaker_ = std::make_unique<Handshaker>(this, ss, slen);
    endpoint_ = listening_endpoint(cfg_.endpoint, handshaker_->bound());
  } catch (...) {
    handshaker_.reset();
    threads_.clear();
    ucp_cleanup(ctx_);
    ctx_ = nullptr;
    throw;
  }
  for (auto& t : threads_) t->start();
  handshaker_->start();
}

Device::~Device() {
  try {
    close();
  } catch (...) {
  }
}

void Device::check_open() const {
  if (closing_.load()) throw Error(ErrorKind::Closed, "device " + endpoint_ + " is closed");
}

void Device::close() {
  if (closing_.exchange(true)) return;
  // No handshake starts or ends any more (it may post to progress thread 0: it goes first).
  if (handshaker_) handshaker_->stop();
  for (auto& t : threads_) t->stop();
  fail_all_rpcs("device " + endpoint_ + " was closed");
  std::vector<std::shared_ptr<Peer>> peers;
  {
    std::lock_guard<std::mutex> lk(m_);
    for (auto& kv : peers_) peers.push_back(kv.second);
    peers_.clear();
  }
  for (auto& p : peers) {
    std::lock_guard<std::mutex> lk(p->m);
    if (p->state == Peer::Connecting) {
      p->state = Peer::Failed;
      p->error = "device " + endpoint_ + " was closed";
    }
    p->channels.clear();  // breaks the Peer <-> Channel cycle
    p->cv.notify_all();
  }
  // Progress threads go first: destroying their workers may purge requests that still use the
  // regions.
  threads_.clear();
  {
    std::lock_guard<std::mutex> lk(maps_m_);
    maps_.clear();
  }
  copier_.reset();
  std::vector<std::shared_ptr<MemRegion>> regions;
  {
    std::lock_guard<std::mutex> lk(m_);
    for (auto& kv : regions_)
      if (auto r = kv.second.lock()) regions.push_back(r);
    regions_.clear();
  }
  for (auto& r : regions) {
    std::lock_guard<std::mutex> lk(r->m_);
    r->freed_.store(true);
    r->holders_.clear();
    if (r->memh_) ucp_mem_unmap(ctx_, r->memh_);
    r->memh_ = nullptr;
  }
  for (auto& kv : links_) delete kv.second;
  links_.clear();
  for (Link* l : dead_links_) delete l;
  dead_links_.clear();
  if (ctx_) ucp_cleanup(ctx_);
  ctx_ = nullptr;
}

std::string Device::op_error_message(Op* op, ucs_status_t st, ErrorKind* kind) {
  if (closing_.load()) {
    *kind = ErrorKind::Closed;
    return "device " + endpoint_ + " was closed with the transfer in flight";
  }
  if (op->ch && op->ch->failed()) {
    *kind = ErrorKind::Peer;
    return op->ch->error();
  }
  if (op->remote && revoked(op->remote->owner_uuid, op->remote->region_id)) {
    *kind = ErrorKind::Region;
    return "remote region " + std::to_string(op->remote->region_id) + " was freed by its owner at " +
           op->remote->owner_endpoint;
  }
  switch (st) {
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_TIMED_OUT:
      if (op->ch) {
        op->ch->fail("peer " + op->ch->remote_endpoint() + " is unreachable: " + ucs_error(st));
        *kind = ErrorKind::Peer;
        return op->ch->error();
      }
      break;
    default:
      break;
  }
  *kind = ErrorKind::Generic;
  return "transfer failed in UCX: " + ucs_error(st);
}

std::string Device::ucx_info() const {
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (!f) return "";
  if (ctx_) ucp_context_print_info(ctx_, f);
  for (auto& t : threads_) ucp_worker_print_info(t->handle(), f);
  fclose(f);
  std::string s(buf, len);
  ::free(buf);
  return s;
}

}  // namespace rdmaflow
