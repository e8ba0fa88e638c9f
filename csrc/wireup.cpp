// Wire-up: the control link between two devices (each side's UCX endpoint, with peer-failure
// handling, from its control worker to the other's worker 0: ProgressThread::control_handle),
// made once the handshake over the device's own tcp listener ended (handshake.cpp); the
// dispatch of control messages; and what happens when a link or a data endpoint fails.
//
// Handshake (docs/architecture.md, "Connecting"): HELLO(nonce_c) -> CHALLENGE(nonce_s) ->
// AUTH(connector's MAC, its token and worker 0 address) -> WELCOME(acceptor's MAC, token,
// worker addresses). The acceptor sends nothing keyed by the secret before the connector's MAC
// verified; each control message then names the receiver's token.
#include <algorithm>
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
    handshaker_->connect(p, ss, slen);
  }
  return wait_connected(p, within);
}

Link* Device::make_link(uint64_t token, uint64_t remote_token, const std::string& worker_addr,
                        std::string* why) {
  if (token == 0) {
    do random_bytes(&token, sizeof token);
    while (token == 0 || links_.count(token));
  } else if (links_.count(token)) {
    *why = "its link token is in use";
    return nullptr;
  }
  Link* l = new Link;
  l->dev = this;
  l->token = token;
  l->remote_token = remote_token;
  if (!connect_link(l, worker_addr, why)) {
    delete l;
    return nullptr;
  }
  links_[token] = l;
  return l;
}

bool Device::connect_link(Link* l, const std::string& worker_addr, std::string* why) {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(worker_addr.data());
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = link_err_cb;
  ep.err_handler.arg = l;
  ucp_ep_h h = nullptr;
  ucs_status_t st = ucp_ep_create(threads_[0]->control_handle(), &ep, &h);
  if (st != UCS_OK) {
    *why = "cannot create a UCX endpoint to it: " + ucs_error(st);
    return false;
  }
  l->ep = h;
  return true;
}

void Device::open_link(const std::shared_ptr<Peer>& p, uint64_t token, uint64_t remote_token,
                       uint64_t remote_uuid, std::vector<std::string> worker_addrs) {
  auto made = [this, p, token, remote_token, remote_uuid, addrs = std::move(worker_addrs)] {
    std::string why;
    Link* l = make_link(token, remote_token, addrs[0], &why);
    std::unique_lock<std::mutex> lk(p->m);
    if (!l) {
      if (p->state == Peer::Connecting) {
        p->state = Peer::Failed;
        p->error = "cannot connect to " + p->endpoint + ": " + why;
        p->cv.notify_all();
      }
      return;
    }
    l->client = true;
    l->peer = p;
    l->remote_uuid = remote_uuid;
    l->remote_endpoint = p->endpoint;
    if (p->state != Peer::Connecting) {  // every caller gave up: nobody uses the link
      lk.unlock();
      l->dead = true;
      links_.erase(l->token);
      dead_links_.push_back(l);
      close_endpoint(l->ep, true, nullptr);
      l->ep = nullptr;
      return;
    }
    p->link = l;
    p->uuid = remote_uuid;
    p->num_workers = int(addrs.size());
    p->worker_addrs = addrs;
    p->state = Peer::Ready;
    p->cv.notify_all();
  };
  if (!threads_[0]->post(std::move(made))) {
    std::lock_guard<std::mutex> lk(p->m);
    if (p->state == Peer::Connecting) {
      p->state = Peer::Failed;
      p->error = "device " + endpoint_ + " was closed";
      p->cv.notify_all();
    }
  }
}

bool Device::accept_link(uint64_t remote_token, uint64_t remote_uuid,
                         const std::string& remote_endpoint, const std::string& worker_addr,
                         uint64_t* token, std::string* why) {
  // Who runs first of the command below and a waiter that gave up: a link made after its
  // handshake was refused would be one nobody uses.
  struct Slot {
    FutureState done;
    std::atomic<int> state{0};  // 0: pending, 1: the command runs, 2: the waiter gave up
    uint64_t token = 0;
  };
  auto slot = std::make_shared<Slot>();
  if (!threads_[0]->post([this, slot, remote_token, remote_uuid, remote_endpoint, worker_addr] {
        int pending = 0;
        if (!slot->state.compare_exchange_strong(pending, 1)) return;
        // Our endpoint to the connector's worker 0, from our control worker: the connector's
        // own endpoint goes from its control worker to our worker 0, another pair of workers
        // (ProgressThread::control_handle).
        std::string why;
        Link* l = make_link(0, remote_token, worker_addr, &why);
        if (!l) {
          slot->done.complete_error(ErrorKind::Peer, why);
          return;
        }
        l->remote_uuid = remote_uuid;
        l->remote_endpoint = remote_endpoint;
        slot->token = l->token;
        slot->done.complete_ok();
      })) {
    *why = "device " + endpoint_ + " is closing";
    return false;
  }
  // The handshake thread waits here: no longer than a handshake may last.
  const double bound = std::min(cfg_.rpc_timeout, handshaker_->timeout());
  bool done = slot->done.wait(bound);
  int pending = 0;
  if (!done && !slot->state.compare_exchange_strong(pending, 2))
    done = slot->done.wait(bound);  // the command was running: it ends within a UCX call
  if (!done) {
    *why = "device " + endpoint_ + " did not make the link within " + seconds_text(bound) + " s";
    return false;
  }
  if (!slot->done.ok()) {
    *why = slot->done.error();
    return false;
  }
  *token = slot->token;
  return true;
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
// Control messages.

void Device::send_ctrl(Link* l, uint32_t type, uint64_t req, const std::string& payload) {
  if (!l->ep || l->dead) return;
  auto* m = new std::pair<CtrlHeader, std::string>(CtrlHeader{kCtrlMagic, type, req, l->remote_token},
                                                    payload);
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = ctrl_sent_cb;
  p.user_data = m;
  p.flags = UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t sp = ucp_am_send_nbx(l->ep, kAmId, &m->first, sizeof(CtrlHeader),
                                        m->second.data(), m->second.size(), &p);
  if (sp == nullptr || UCS_PTR_IS_ERR(sp)) delete m;
}

ucs_status_t Device::am_cb(void* arg, const void* header, size_t header_length, void* data,
                               size_t length, const ucp_am_recv_param_t* param) {
  auto* d = static_cast<Device*>(arg);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return UCS_OK;  // never sent by peers
  CtrlHeader h{};
  if (header_length != sizeof h) return UCS_OK;
  std::memcpy(&h, header, sizeof h);
  // Only a link made by a handshake is known; anything else is dropped.
  auto it = h.magic == kCtrlMagic ? d->links_.find(h.link) : d->links_.end();
  if (it == d->links_.end()) return UCS_OK;
  Link* l = it->second;
  if (length > kMaxCtrlPayload) {
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

// Messages a link we accepted receives: requests and the acknowledgements of our REVOKEs.
void Device::handle_as_server(Link* l, uint32_t type, uint64_t req, const std::string& payload) {
  Reader rd(payload, "control message");
  switch (type) {
    case LOOKUP:
    case VALIDATE:
    case OPEN_CHANNEL: {
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

// Messages a link we opened receives: replies to our requests (or a REJECT) and REVOKEs of
// regions we validated.
void Device::handle_as_client(Link* l, uint32_t type, uint64_t req, const std::string& payload) {
  Reader rd(payload, "control message");
  auto peer = l->peer;
  switch (type) {
    case REJECT: {
      std::string why = payload;
      fail_rpcs_for(l, "rejected by " + peer->endpoint + ": " + why);
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
  if (links_.erase(l->token)) dead_links_.push_back(l);
  if (l->ep) {
    ucp_ep_h ep = l->ep;
    l->ep = nullptr;
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
