// Wire-up: the control link between two devices (one UCX endpoint with peer-failure handling,
// opened by the connecting side through the peer's listener), its handshake, the dispatch of
// control messages, and what happens when a link or a data endpoint fails.
//
// Handshake (docs/architecture.md, "Connecting"): HELLO(nonce_c) -> CHALLENGE(nonce_s, server
// MAC) -> AUTH(client MAC) -> WELCOME(worker addresses). Each MAC is HMAC-SHA256 of the job
// secret over both nonces, so each side proves it knows the secret without sending it.
#include <cstring>

#include "internal.hpp"
#include "wire.hpp"

namespace rdmaflow {

void Device::link_err_cb(void* arg, ucp_ep_h, ucs_status_t st) {
  Link* l = static_cast<Link*>(arg);
  l->dev->on_link_error(l, st);
}

namespace {
void ctrl_sent_cb(void* req, ucs_status_t, void* user) {
  delete static_cast<std::pair<CtrlHeader, std::string>*>(user);
  ucp_request_free(req);
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// The connecting side.

std::shared_ptr<Peer> Device::connect(const std::string& endpoint, double within) {
  check_open();
  std::shared_ptr<Peer> p;
  bool fresh = false;
  {
    std::lock_guard<std::mutex> lk(m_);
    auto it = peers_.find(endpoint);
    if (it != peers_.end()) {
      std::lock_guard<std::mutex> pl(it->second->m);
      if (it->second->state != Peer::Failed) p = it->second;
    }
    if (!p) {
      p = std::make_shared<Peer>();
      p->endpoint = endpoint;
      random_bytes(p->nc, 16);
      peers_[endpoint] = p;
      fresh = true;
    }
  }
  if (fresh) {
    socklen_t slen = 0;
    sockaddr_storage ss;
    try {
      ss = resolve(endpoint, &slen, false);
    } catch (Error& e) {
      std::lock_guard<std::mutex> lk(p->m);
      p->state = Peer::Failed;
      p->error = e.what();
      throw;
    }
    if (!threads_[0]->post([this, p, ss, slen] { open_link(p, ss, slen); }))
      throw Error(ErrorKind::Closed, "device is closed");
  }
  return wait_connected(p, within);
}

// Progress thread 0: opens the control link to p and sends HELLO.
void Device::open_link(const std::shared_ptr<Peer>& p, const sockaddr_storage& ss,
                       socklen_t slen) {
  Link* l = new Link;
  l->dev = this;
  l->client = true;
  l->peer = p;
  std::memcpy(l->nc, p->nc, 16);
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
  ep.sockaddr.addrlen = slen;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = link_err_cb;
  ep.err_handler.arg = l;
  ucp_ep_h h = nullptr;
  ucs_status_t st = ucp_ep_create(threads_[0]->handle(), &ep, &h);
  if (st != UCS_OK) {
    delete l;
    std::lock_guard<std::mutex> lk(p->m);
    p->state = Peer::Failed;
    p->error = "cannot connect to " + p->endpoint + ": " + ucs_error(st);
    p->cv.notify_all();
    return;
  }
  l->ep = h;
  links_[h] = l;
  p->link = l;
  Writer w;
  w.u32(kProtoVersion);
  w.raw(l->nc, 16);
  w.u64(uuid_);
  w.str(endpoint_);
  send_ctrl(l, HELLO, 0, w.s);
}

// Waits (up to connect_timeout, or within if that is shorter) for the handshake with p to end;
// throws if it failed.
std::shared_ptr<Peer> Device::wait_connected(const std::shared_ptr<Peer>& p, double within) {
  const bool caller_bound = within >= 0 && within < cfg_.connect_timeout;
  std::unique_lock<std::mutex> lk(p->m);
  bool done = p->cv.wait_for(lk, std::chrono::duration<double>(caller_bound ? within : cfg_.connect_timeout),
                             [&] { return p->state != Peer::Connecting; });
  if (!done && caller_bound)
    throw Error(ErrorKind::Timeout, "timed out after " + seconds_text(within) + " s connecting to " +
                                        p->endpoint + " (no answer from an rdmaflow device there yet)");
  if (!done) {
    p->state = Peer::Failed;
    p->error = "timed out after " + seconds_text(cfg_.connect_timeout) +
               " s connecting to " + p->endpoint + " (no answer from an rdmaflow device there)";
    std::string err = p->error;
    lk.unlock();
    threads_[0]->post([this, p] {
      if (p->link) on_link_error(p->link, UCS_ERR_TIMED_OUT);
    });
    throw Error(ErrorKind::Timeout, err);
  }
  if (p->state == Peer::Failed)
    throw Error(p->auth_failed ? ErrorKind::Auth : ErrorKind::Peer, p->error);
  return p;
}

// ---------------------------------------------------------------------------------------------
// The accepting side.

void Device::conn_cb(ucp_conn_request_h req, void* arg) {
  auto* d = static_cast<Device*>(arg);
  if (d->closing_.load()) {
    ucp_listener_reject(d->listener_, req);
    return;
  }
  Link* l = new Link;
  l->dev = d;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = req;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = link_err_cb;
  ep.err_handler.arg = l;
  ucp_ep_h h = nullptr;
  if (ucp_ep_create(d->threads_[0]->handle(), &ep, &h) != UCS_OK) {
    delete l;
    return;
  }
  l->ep = h;
  d->links_[h] = l;
}

// ---------------------------------------------------------------------------------------------
// Control messages.

void Device::send_ctrl(Link* l, uint32_t type, uint64_t req, const std::string& payload) {
  if (!l->ep || l->dead) return;
  auto* m = new std::pair<CtrlHeader, std::string>(CtrlHeader{kCtrlMagic, type, req}, payload);
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = ctrl_sent_cb;
  p.user_data = m;
  p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t sp = ucp_am_send_nbx(l->ep, kAmId, &m->first, sizeof(CtrlHeader),
                                        m->second.data(), m->second.size(), &p);
  if (sp == nullptr || UCS_PTR_IS_ERR(sp)) delete m;
}

ucs_status_t Device::am_cb(void* arg, const void* header, size_t header_length, void* data,
                               size_t length, const ucp_am_recv_param_t* param) {
  auto* d = static_cast<Device*>(arg);
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return UCS_OK;  // never sent by peers
  auto it = d->links_.find(param->reply_ep);
  if (it == d->links_.end()) return UCS_OK;
  Link* l = it->second;
  CtrlHeader h{};
  if (header_length != sizeof h || length > kMaxCtrlPayload) {
    l->dead = true;
    return UCS_OK;
  }
  std::memcpy(&h, header, sizeof h);
  if (h.magic != kCtrlMagic) {
    l->dead = true;
    return UCS_OK;
  }
  std::string payload(static_cast<const char*>(data), length);
  // Replies are sent from the command queue, not from inside UCX's callback.
  d->threads_[0]->post([d, l, h, payload] {
    if (l->dead) return;
    try {
      d->handle_ctrl(l, h.type, h.req, payload);
    } catch (Error& e) {
      d->send_ctrl(l, REJECT, h.req, std::string("protocol error: ") + e.what());
      d->on_link_error(l, UCS_ERR_INVALID_PARAM);
    }
  });
  return UCS_OK;
}

void Device::handle_ctrl(Link* l, uint32_t type, uint64_t req, const std::string& payload) {
  if (l->client)
    handle_as_client(l, type, req, payload);
  else
    handle_as_server(l, type, req, payload);
}

// Messages a link we accepted receives: the handshake's HELLO and AUTH, requests (once
// authenticated) and the acknowledgements of our REVOKEs.
void Device::handle_as_server(Link* l, uint32_t type, uint64_t req, const std::string& payload) {
  Reader rd(payload, "control message");
  switch (type) {
    case HELLO: {
      uint32_t ver = rd.num<uint32_t>();
      rd.raw(l->nc, 16);
      l->remote_uuid = rd.num<uint64_t>();
      l->remote_endpoint = rd.str(1024);
      rd.end();
      if (ver != kProtoVersion) {
        send_ctrl(l, REJECT, req, "protocol version " + std::to_string(ver) +
                                      " is not supported (this device speaks " +
                                      std::to_string(kProtoVersion) + ")");
        return;
      }
      random_bytes(l->ns, 16);
      Writer w;
      w.raw(l->ns, 16);
      w.u64(uuid_);
      w.raw(handshake_mac(cfg_.secret, "rdmaflow-server", l->nc, l->ns).data(), 32);
      send_ctrl(l, CHALLENGE, req, w.s);
      return;
    }
    case AUTH: {
      if (!check_handshake_mac(rd, cfg_.secret, "rdmaflow-client", l->nc, l->ns)) {
        send_ctrl(l, REJECT, req,
                  "job secret mismatch: device " + endpoint_ + " does not belong to your job");
        return;
      }
      l->authed = true;
      Writer w;
      w.u32(uint32_t(threads_.size()));
      for (auto& t : threads_) w.str(t->address());
      send_ctrl(l, WELCOME, req, w.s);
      return;
    }
    case LOOKUP:
    case VALIDATE:
    case OPEN_CHANNEL: {
      if (!l->authed) {
        send_ctrl(l, REJECT, req, "not authenticated");
        return;
      }
      if (type == LOOKUP) {
        std::string name = rd.str(4096);
        uint32_t claim = rd.num<uint32_t>();
        std::string expected = rd.str(1024 * 1024);
        rd.end();
        answer_lookup(l, req, name, claim != 0, expected);
        return;
      }
      if (type == OPEN_CHANNEL) {
        uint32_t qp = rd.num<uint32_t>();
        std::string worker_addr = rd.str(64 * 1024);
        rd.end();
        answer_open_channel(l, req, qp, worker_addr);
        return;
      }
      uint64_t id = rd.num<uint64_t>(), addr = rd.num<uint64_t>(), len = rd.num<uint64_t>();
      rd.end();
      answer_validate(l, req, id, addr, len);
      return;
    }
    case REVOKE_ACK:
      finish_rpc(req, true, ErrorKind::Generic, "");
      return;
    default:
      throw Error(ErrorKind::Invalid, "unexpected message type " + std::to_string(type));
  }
}

// Messages a link we opened receives: the handshake's CHALLENGE and WELCOME (or a REJECT),
// replies to our requests, and REVOKEs of regions we validated.
void Device::handle_as_client(Link* l, uint32_t type, uint64_t req, const std::string& payload) {
  Reader rd(payload, "control message");
  auto peer = l->peer;
  switch (type) {
    case CHALLENGE: {
      rd.raw(l->ns, 16);
      l->remote_uuid = rd.num<uint64_t>();
      if (!check_handshake_mac(rd, cfg_.secret, "rdmaflow-server", l->nc, l->ns)) {
        std::lock_guard<std::mutex> lk(peer->m);
        peer->state = Peer::Failed;
        peer->error = "job secret mismatch: the device at " + peer->endpoint +
                      " does not belong to this job";
        peer->auth_failed = true;
        peer->cv.notify_all();
        l->dead = true;
        return;
      }
      Writer w;
      w.raw(handshake_mac(cfg_.secret, "rdmaflow-client", l->nc, l->ns).data(), 32);
      send_ctrl(l, AUTH, req, w.s);
      return;
    }
    case WELCOME: {
      uint32_t n = rd.num<uint32_t>();
      if (n == 0 || n > 64) throw Error(ErrorKind::Invalid, "bad worker count");
      std::vector<std::string> addrs;
      for (uint32_t i = 0; i < n; ++i) addrs.push_back(rd.str(1 << 16));
      rd.end();
      l->authed = true;
      std::lock_guard<std::mutex> lk(peer->m);
      peer->uuid = l->remote_uuid;
      peer->num_workers = int(n);
      peer->worker_addrs = std::move(addrs);
      peer->state = Peer::Ready;
      peer->cv.notify_all();
      return;
    }
    case REJECT: {
      std::string why = payload;
      fail_rpcs_for(l, "rejected by " + peer->endpoint + ": " + why);
      std::lock_guard<std::mutex> lk(peer->m);
      if (peer->state == Peer::Connecting) {
        peer->state = Peer::Failed;
        peer->error = "the device at " + peer->endpoint + " refused the connection: " + why;
        peer->auth_failed = why.find("secret") != std::string::npos;
        peer->cv.notify_all();
      }
      return;
    }
    case LOOKUP_REPLY:
    case VALIDATE_REPLY:
    case OPEN_CHANNEL_REPLY: {
      uint32_t ok = rd.num<uint32_t>();
      std::string v = rd.str();
      rd.end();
      finish_rpc(req, ok != 0, ErrorKind::Generic, v);
      return;
    }
    case REVOKE: {
      uint64_t id = rd.num<uint64_t>();
      rd.end();
      answer_revoke(l, req, id);
      return;
    }
    default:
      throw Error(ErrorKind::Invalid, "unexpected message type " + std::to_string(type));
  }
}

// ---------------------------------------------------------------------------------------------
// Failures and teardown.

void Device::on_link_error(Link* l, ucs_status_t st) {
  if (l->dead && !l->ep) return;
  l->dead = true;
  std::string why = (l->client ? "connection to " + l->peer->endpoint
                               : "connection from " + l->remote_endpoint) +
                    " lost: " + ucs_error(st);
  if (l->client) {
    auto peer = l->peer;
    std::vector<std::shared_ptr<Channel>> chans;
    {
      std::lock_guard<std::mutex> lk(peer->m);
      if (peer->state == Peer::Connecting) {
        peer->error = "cannot connect to " + peer->endpoint + ": " + ucs_error(st) +
                      " (is an rdmaflow device listening there?)";
      } else {
        peer->error = "peer " + peer->endpoint + " is unreachable: " + ucs_error(st);
      }
      peer->state = Peer::Failed;
      for (auto& kv : peer->channels) chans.push_back(kv.second);
      peer->cv.notify_all();
    }
    for (auto& ch : chans) ch->fail(peer->error);
    why = peer->error;
  } else {
    std::lock_guard<std::mutex> lk(m_);
    for (auto& kv : regions_)
      if (auto r = kv.second.lock()) {
        std::lock_guard<std::mutex> rl(r->m_);
        r->holders_.erase(l);
      }
  }
  fail_rpcs_for(l, why);
  if (l->ep) {
    ucp_ep_h ep = l->ep;
    l->ep = nullptr;
    links_.erase(ep);
    dead_links_.push_back(l);
    threads_[0]->post([ep] { close_endpoint(ep, true, nullptr); });
  }
}

void Device::on_data_ep_error(Channel* ch, ucs_status_t st) {
  ch->fail("peer " + ch->remote_endpoint() + " is unreachable: " + ucs_error(st));
  auto keep = ch->shared_from_this();
  ch->thread_->post([keep] {
    auto reqs = keep->close_ep(true);
    for (auto sp : reqs) ucp_request_free(sp);
  });
}

std::vector<ucs_status_ptr_t> Device::close_links() {
  std::vector<ucs_status_ptr_t> reqs;
  if (listener_) {
    ucp_listener_destroy(listener_);
    listener_ = nullptr;
  }
  for (auto& kv : links_) {
    Link* l = kv.second;
    if (!l->ep) continue;
    close_endpoint(l->ep, true, &reqs);
    l->ep = nullptr;
    l->dead = true;
  }
  return reqs;
}

}  // namespace rdmaflow
