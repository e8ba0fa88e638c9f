// The handshake listener: a plain tcp socket of the device's own, and the thread that runs
// every handshake over it, accepted (the device's endpoint) and opened (connect()). Only a peer
// that proved it knows the job secret gets a control link (wireup.cpp); no UCX resource exists
// for any other connection, so a flood of bad ones costs one fd each while it lasts.
//
// Bounds (docs/security.md, "The handshake listener"): a connection that has not finished its
// handshake within handshake_timeout (RDMAFLOW_HANDSHAKE_TIMEOUT, default 5 s) is closed; a
// frame with a wrong magic, a type out of turn, a length over kMaxHandshakeFrame or a payload
// that does not parse closes it at once; at most kMaxHalfOpen accepted connections are in
// their handshake at once (a new one closes the one that got least far); a refusal is counted
// and reported on stderr at most once per kReportEvery.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "internal.hpp"
#include "wire.hpp"

namespace rdmaflow {

namespace {

constexpr size_t kMaxHalfOpen = 64;
constexpr int kMaxTries = 4;  // a connector's handshakes with one peer, when the listener closes them
constexpr double kReportEvery = 10.0;  // seconds between two lines on stderr
constexpr double kDefaultHandshakeTimeout = 5.0;

double handshake_timeout_from_env() {
  const char* v = std::getenv("RDMAFLOW_HANDSHAKE_TIMEOUT");
  if (!v || !*v) return kDefaultHandshakeTimeout;
  char* end = nullptr;
  double s = std::strtod(v, &end);
  if (end == v || *end != '\0' || !(s > 0) || s > 600)
    throw Error(ErrorKind::Invalid, std::string("$RDMAFLOW_HANDSHAKE_TIMEOUT=") + v +
                                        " must be a number of seconds in (0, 600]");
  return s;
}

Clock::time_point after(double s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

std::string frame(uint32_t type, const std::string& payload) {
  Writer w;
  w.u32(kHandshakeMagic);
  w.u32(type);
  w.u32(uint32_t(payload.size()));
  w.s += payload;
  return w.s;
}

std::string transcript(const uint8_t* nc, const uint8_t* ns, uint64_t uuid_c, uint64_t uuid_s) {
  Writer w;
  w.raw(nc, 16);
  w.raw(ns, 16);
  w.u64(uuid_c);
  w.u64(uuid_s);
  return w.s;
}

}  // namespace

struct Handshaker::Conn {
  int fd = -1;
  bool outbound = false;
  std::shared_ptr<Peer> peer;  // outbound
  enum Step { Connecting, WantHello, WantAuth, WantChallenge, WantWelcome, Closing } step;
  Clock::time_point deadline;
  std::string in, out;
  size_t out_off = 0;
  uint8_t nc[16] = {0}, ns[16] = {0};
  uint64_t uuid_c = 0, uuid_s = 0, token_c = 0;
  std::string remote_endpoint;
  sockaddr_storage ss{};  // outbound: where to, for another try
  socklen_t slen = 0;
  int tries = 0;
};

Handshaker::Handshaker(Device* dev, const sockaddr_storage& ss, socklen_t slen) : dev_(dev) {
  timeout_ = handshake_timeout_from_env();
  const std::string& where = dev->cfg_.endpoint;
  lfd_ = ::socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (lfd_ < 0) throw Error(ErrorKind::Generic, "cannot listen on " + where + ": " + strerror(errno));
  // A fixed port is free again at once after its previous device closed (its accepted sockets
  // may still be in TIME_WAIT); two live listeners on one port are still refused (EADDRINUSE).
  int one = 1;
  setsockopt(lfd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(lfd_, reinterpret_cast<const sockaddr*>(&ss), slen) != 0 || ::listen(lfd_, 128) != 0) {
    int e = errno;
    ::close(lfd_);
    lfd_ = -1;
    throw Error(ErrorKind::Invalid, "cannot listen on " + where + ": " +
                                        (e == EADDRINUSE ? std::string("the address is already in use")
                                                         : std::string(strerror(e))));
  }
  socklen_t blen = sizeof bound_;
  getsockname(lfd_, reinterpret_cast<sockaddr*>(&bound_), &blen);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) {
    ::close(lfd_);
    lfd_ = -1;
    throw Error(ErrorKind::Generic, "eventfd failed");
  }
}

Handshaker::~Handshaker() {
  stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Handshaker::start() { thread_ = std::thread([this] { loop(); }); }

void Handshaker::stop() {
  {
    std::lock_guard<std::mutex> lk(m_);
    stop_ = true;
  }
  wake();
  if (thread_.joinable()) thread_.join();
  if (lfd_ >= 0) ::close(lfd_);  // the port is free once close() returns
  lfd_ = -1;
}

void Handshaker::wake() {
  uint64_t one = 1;
  ssize_t r = ::write(wake_fd_, &one, sizeof one);
  (void)r;
}

void Handshaker::connect(const std::shared_ptr<Peer>& p, const sockaddr_storage& ss, socklen_t slen) {
  open(p, ss, slen, 0, after(dev_->cfg_.connect_timeout + 1.0));
}

void Handshaker::open(const std::shared_ptr<Peer>& p, const sockaddr_storage& ss, socklen_t slen,
                      int tries, Clock::time_point deadline) {
  auto c = std::make_unique<Conn>();
  c->outbound = true;
  c->peer = p;
  c->deadline = deadline;
  c->ss = ss;
  c->slen = slen;
  c->tries = tries;
  c->uuid_c = dev_->uuid_;
  random_bytes(c->nc, 16);
  c->fd = ::socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (c->fd < 0) {
    fail_peer(*c, std::string("cannot connect to ") + p->endpoint + ": " + strerror(errno), false);
    return;
  }
  int one = 1;
  setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (::connect(c->fd, reinterpret_cast<const sockaddr*>(&ss), slen) != 0 && errno != EINPROGRESS) {
    fail_peer(*c, "cannot connect to " + p->endpoint + ": " + strerror(errno) +
                      " (is an rdmaflow device listening there?)", false);
    ::close(c->fd);
    return;
  }
  c->step = Conn::Connecting;
  {
    std::lock_guard<std::mutex> lk(m_);
    if (stop_) {
      ::close(c->fd);
      fail_peer(*c, "device is closed", false);
      return;
    }
    incoming_.push_back(std::move(c));
  }
  wake();
}

void Handshaker::fail_peer(Conn& c, const std::string& why, bool auth) {
  std::lock_guard<std::mutex> lk(c.peer->m);
  if (c.peer->state != Peer::Connecting) return;
  c.peer->state = Peer::Failed;
  c.peer->error = why;
  c.peer->auth_failed = auth;
  c.peer->cv.notify_all();
}

void Handshaker::refuse(const char* why) {
  ++refused_[why];
  report(false);
}

void Handshaker::report(bool flush) {
  if (refused_.empty()) return;
  if (reported_once_ && seconds_since(last_report_) < kReportEvery && !flush) return;
  std::string line;
  size_t total = 0;
  for (auto& kv : refused_) {
    total += kv.second;
    line += (line.empty() ? "" : ", ") + std::to_string(kv.second) + " " + kv.first;
  }
  std::fprintf(stderr,
               "rdmaflow: device %s closed %zu handshake connection%s since %s (%s); only peers "
               "that know the job secret get a link\n",
               dev_->endpoint_.c_str(), total, total == 1 ? "" : "s",
               reported_once_ ? "its last report" : "it started", line.c_str());
  std::fflush(stderr);
  refused_.clear();
  reported_once_ = true;
  last_report_ = Clock::now();
}

void Handshaker::loop() {
  std::vector<std::unique_ptr<Conn>> conns;
  Clock::time_point accept_pause{};  // out of fds: the listener rests until then
  for (;;) {
    {
      std::lock_guard<std::mutex> lk(m_);
      if (stop_) break;
      for (auto& c : incoming_) conns.push_back(std::move(c));
      incoming_.clear();
    }
    // Connections past their deadline, or whose peer stopped waiting, are closed.
    const auto now = Clock::now();
    for (auto& c : conns) {
      if (!c) continue;
      bool gone = now >= c->deadline;
      if (c->outbound) {
        std::lock_guard<std::mutex> lk(c->peer->m);
        gone = gone || c->peer->state != Peer::Connecting;
      }
      if (gone) {
        if (!c->outbound && c->step != Conn::Closing) refuse("timed out");
        if (c->outbound)
          fail_peer(*c, "timed out after " + seconds_text(dev_->cfg_.connect_timeout) +
                            " s connecting to " + c->peer->endpoint +
                            " (no answer from an rdmaflow device there)", false);
        ::close(c->fd);
        c.reset();
      }
    }
    conns.erase(std::remove(conns.begin(), conns.end(), nullptr), conns.end());

    std::vector<pollfd> pfds;
    pfds.push_back({wake_fd_, POLLIN, 0});
    const bool listening = Clock::now() >= accept_pause;
    pfds.push_back({listening ? lfd_ : -1, POLLIN, 0});
    auto next = after(kReportEvery);
    for (auto& c : conns) {
      short ev = POLLIN;
      if (c->step == Conn::Connecting || c->out_off < c->out.size()) ev |= POLLOUT;
      pfds.push_back({c->fd, ev, 0});
      next = std::min(next, c->deadline);
    }
    if (!listening) next = std::min(next, accept_pause);
    if (!refused_.empty()) next = std::min(next, last_report_ + std::chrono::seconds(int(kReportEvery)));
    int ms = int(std::max<int64_t>(
        1, std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count() + 1));
    int n = ::poll(pfds.data(), pfds.size(), ms);
    if (n < 0 && errno != EINTR) break;
    report(false);
    if (n <= 0) continue;
    if (pfds[0].revents) {
      uint64_t v;
      ssize_t r = ::read(wake_fd_, &v, sizeof v);
      (void)r;
    }
    for (size_t i = 0; i < conns.size(); ++i) {
      const short re = pfds[i + 2].revents;
      if (re && !step(*conns[i], re)) {
        ::close(conns[i]->fd);
        conns[i].reset();
      }
    }
    conns.erase(std::remove(conns.begin(), conns.end(), nullptr), conns.end());
    if (pfds[1].revents & POLLIN) accept_all(conns, &accept_pause);
  }
  for (auto& c : conns) {
    if (c->outbound) fail_peer(*c, "device " + dev_->endpoint_ + " was closed", false);
    ::close(c->fd);
  }
  {
    std::lock_guard<std::mutex> lk(m_);
    for (auto& c : incoming_) {
      fail_peer(*c, "device " + dev_->endpoint_ + " was closed", false);
      ::close(c->fd);
    }
    incoming_.clear();
  }
  report(true);
}

void Handshaker::accept_all(std::vector<std::unique_ptr<Conn>>& conns, Clock::time_point* pause) {
  for (;;) {
    int fd = ::accept4(lfd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        refuse("not accepted (out of file descriptors)");
        *pause = after(0.1);
      }
      return;
    }
    // Over the cap, the connection that got least far goes: one still without a whole HELLO
    // before one whose AUTH is due (a legitimate connector sends each at once), the oldest first.
    size_t inbound = 0;
    Conn* oldest = nullptr;
    auto rank = [](const Conn* c) { return std::make_pair(c->step != Conn::WantHello, c->deadline); };
    for (auto& c : conns)
      if (!c->outbound && c->step != Conn::Closing) {
        ++inbound;
        if (!oldest || rank(c.get()) < rank(oldest)) oldest = c.get();
      }
    if (inbound >= kMaxHalfOpen && oldest) {
      refuse("closed for a newer one (over the cap of 64 in their handshake)");
      ::close(oldest->fd);
      for (auto& c : conns)
        if (c.get() == oldest) c.reset();
      conns.erase(std::remove(conns.begin(), conns.end(), nullptr), conns.end());
    }
    auto c = std::make_unique<Conn>();
    c->fd = fd;
    c->step = Conn::WantHello;
    c->deadline = after(timeout_);
    c->uuid_s = dev_->uuid_;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    conns.push_back(std::move(c));
  }
}

// Moves c on after poll reported `re`; false: close it.
bool Handshaker::step(Conn& c, short re) {
  if (c.step == Conn::Connecting) {
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0 || (re & (POLLERR | POLLHUP) && !(re & POLLOUT))) {
      fail_peer(c, "cannot connect to " + c.peer->endpoint + ": " + strerror(err ? err : ECONNREFUSED) +
                       " (is an rdmaflow device listening there?)", false);
      return false;
    }
    if (!(re & POLLOUT)) return true;
    Writer w;
    w.u32(kProtoVersion);
    w.raw(c.nc, 16);
    w.u64(c.uuid_c);
    w.str(dev_->endpoint_);
    c.out = frame(HELLO, w.s);
    c.step = Conn::WantChallenge;
  }
  if (c.out_off < c.out.size()) {
    ssize_t k = ::send(c.fd, c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL);
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return lost(c);
    if (k > 0) c.out_off += size_t(k);
  }
  if (c.step == Conn::Closing) return c.out_off < c.out.size();
  if (re & (POLLIN | POLLHUP | POLLERR)) {
    char buf[4096];
    ssize_t k = ::recv(c.fd, buf, sizeof buf, 0);
    if (k == 0) return lost(c);
    if (k < 0) return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? true : lost(c);
    c.in.append(buf, size_t(k));
  }
  // One frame at a time: a peer speaks only when it is its turn.
  const size_t max_payload = c.outbound ? kMaxCtrlPayload : kMaxHandshakeFrame;
  while (c.in.size() >= 12 && c.step != Conn::Closing) {
    uint32_t magic, type, len;
    std::memcpy(&magic, c.in.data(), 4);
    std::memcpy(&type, c.in.data() + 4, 4);
    std::memcpy(&len, c.in.data() + 8, 4);
    if (magic != kHandshakeMagic || len > max_payload) return malformed(c);
    if (c.in.size() < 12 + size_t(len)) break;
    std::string payload = c.in.substr(12, len);
    c.in.erase(0, 12 + size_t(len));
    try {
      if (!(c.outbound ? client_frame(c, type, payload) : server_frame(c, type, payload)))
        return false;
    } catch (Error&) {
      return malformed(c);
    }
    if (c.out_off < c.out.size()) {  // what the frame's answer has of it goes now
      ssize_t k = ::send(c.fd, c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL);
      if (k > 0) c.out_off += size_t(k);
    }
  }
  if (!c.outbound && c.step != Conn::Closing && c.in.size() > 12 + kMaxHandshakeFrame)
    return malformed(c);
  return c.step != Conn::Closing || c.out_off < c.out.size();
}

bool Handshaker::lost(Conn& c) {
  // A listener closes the handshakes that got least far when too many wait (a flood): the
  // connector tries again, with fresh nonces, while its deadline allows.
  if (c.outbound && c.tries < kMaxTries && Clock::now() < c.deadline) {
    open(c.peer, c.ss, c.slen, c.tries + 1, c.deadline);
    return false;
  }
  if (c.outbound)
    fail_peer(c, "cannot connect to " + c.peer->endpoint +
                     ": the connection closed during the handshake (is an rdmaflow device listening there?)",
              false);
  else
    refuse("closed by the peer before the end of their handshake");
  return false;
}

bool Handshaker::malformed(Conn& c) {
  if (c.outbound)
    fail_peer(c, "cannot connect to " + c.peer->endpoint +
                     ": it answered with a malformed handshake (is it an rdmaflow device of this version?)",
              false);
  else
    refuse("malformed or out of turn");
  return false;
}

// The accepting side. Nothing it sends before the connector's AUTH verified depends on the
// secret: CHALLENGE is a fresh nonce and the device's uuid, REJECT a fixed text.
bool Handshaker::server_frame(Conn& c, uint32_t type, const std::string& payload) {
  Reader rd(payload, "handshake message");
  if (c.step == Conn::WantHello && type == HELLO) {
    uint32_t ver = rd.num<uint32_t>();
    rd.raw(c.nc, 16);
    c.uuid_c = rd.num<uint64_t>();
    c.remote_endpoint = rd.str(1024);
    rd.end();
    if (ver != kProtoVersion) {
      refuse("of another protocol version");
      c.out += frame(REJECT, "protocol version " + std::to_string(ver) +
                                 " is not supported (this device speaks " +
                                 std::to_string(kProtoVersion) + ")");
      c.step = Conn::Closing;
      return true;
    }
    random_bytes(c.ns, 16);
    Writer w;
    w.raw(c.ns, 16);
    w.u64(c.uuid_s);
    c.out += frame(CHALLENGE, w.s);
    c.step = Conn::WantAuth;
    return true;
  }
  if (c.step == Conn::WantAuth && type == AUTH) {
    const uint64_t token_c = rd.num<uint64_t>();
    std::string worker_addr = rd.str(kMaxHandshakeFrame);
    const size_t body_len = rd.pos;
    char mac[32];
    rd.raw(mac, 32);
    rd.end();
    const std::string want = handshake_mac(dev_->cfg_.secret, "rdmaflow-client",
                                           transcript(c.nc, c.ns, c.uuid_c, c.uuid_s),
                                           payload.substr(0, body_len));
    if (!equal_ct(reinterpret_cast<const uint8_t*>(want.data()), reinterpret_cast<const uint8_t*>(mac), 32)) {
      refuse("with a wrong job secret");
      c.out += frame(REJECT, kSecretMismatch);
      c.step = Conn::Closing;
      return true;
    }
    // The connector proved it knows the secret: its control link, then our proof and WELCOME.
    uint64_t token_s = 0;
    std::string why;
    if (!dev_->accept_link(token_c, c.uuid_c, c.remote_endpoint, worker_addr, &token_s, &why)) {
      c.out += frame(REJECT, why);
      c.step = Conn::Closing;
      return true;
    }
    Writer w;
    w.u64(token_s);
    w.u32(uint32_t(dev_->threads_.size()));
    for (auto& t : dev_->threads_) w.str(t->address());
    w.raw(handshake_mac(dev_->cfg_.secret, "rdmaflow-server", transcript(c.nc, c.ns, c.uuid_c, c.uuid_s), w.s)
              .data(),
          32);
    c.out += frame(WELCOME, w.s);
    c.step = Conn::Closing;
    return true;
  }
  throw Error(ErrorKind::Invalid, "handshake message out of turn");
}

// The connecting side: answers CHALLENGE with its proof, checks the acceptor's in WELCOME.
bool Handshaker::client_frame(Conn& c, uint32_t type, const std::string& payload) {
  Reader rd(payload, "handshake message");
  const std::string& ep = c.peer->endpoint;
  if (type == REJECT) {
    bool auth = payload == kSecretMismatch;
    fail_peer(c, auth ? "job secret mismatch: the device at " + ep + " does not belong to this job"
                      : "the device at " + ep + " refused the connection: " + payload,
              auth);
    return false;
  }
  if (c.step == Conn::WantChallenge && type == CHALLENGE) {
    rd.raw(c.ns, 16);
    c.uuid_s = rd.num<uint64_t>();
    rd.end();
    random_bytes(&c.token_c, sizeof c.token_c);
    Writer w;
    w.u64(c.token_c);
    w.str(dev_->threads_[0]->address());
    w.raw(handshake_mac(dev_->cfg_.secret, "rdmaflow-client", transcript(c.nc, c.ns, c.uuid_c, c.uuid_s), w.s)
              .data(),
          32);
    c.out += frame(AUTH, w.s);
    c.step = Conn::WantWelcome;
    return true;
  }
  if (c.step == Conn::WantWelcome && type == WELCOME) {
    const uint64_t token_s = rd.num<uint64_t>();
    uint32_t n = rd.num<uint32_t>();
    if (n == 0 || n > 64) throw Error(ErrorKind::Invalid, "bad worker count");
    std::vector<std::string> addrs;
    for (uint32_t i = 0; i < n; ++i) addrs.push_back(rd.str(1 << 16));
    const size_t body_len = rd.pos;
    char mac[32];
    rd.raw(mac, 32);
    rd.end();
    const std::string want = handshake_mac(dev_->cfg_.secret, "rdmaflow-server",
                                           transcript(c.nc, c.ns, c.uuid_c, c.uuid_s),
                                           payload.substr(0, body_len));
    if (!equal_ct(reinterpret_cast<const uint8_t*>(want.data()), reinterpret_cast<const uint8_t*>(mac), 32)) {
      fail_peer(c, "job secret mismatch: the device at " + ep + " does not belong to this job", true);
      return false;
    }
    dev_->open_link(c.peer, c.token_c, token_s, c.uuid_s, std::move(addrs));
    c.step = Conn::Closing;
    return true;
  }
  throw Error(ErrorKind::Invalid, "handshake message out of turn");
}

}  // namespace rdmaflow
