// The side RPC between authenticated devices: publish/lookup of named byte strings, VALIDATE
// (a peer checks that a region is live before its first use, and becomes one of its holders)
// and REVOKE (the owner tells each holder that a region is gone, and waits for its ACK).
//
// A request is registered under a fresh id, sent by progress thread 0 and completed by the
// reply, by the link's failure or by the waiter's timeout, whichever comes first.
#include <cmath>

#include "internal.hpp"
#include "wire.hpp"

namespace rdmaflow {

bool Device::post_request(Link* l, uint32_t type, const std::string& payload, bool ok_if_dead,
                          const char* if_dead, Request* out) {
  out->rpc = std::make_shared<Rpc>();
  out->id = next_rpc_.fetch_add(1);
  {
    std::lock_guard<std::mutex> lk(m_);
    rpcs_[out->id] = {l, out->rpc};
  }
  uint64_t id = out->id;
  std::string dead_reply = if_dead;
  return threads_[0]->post([this, l, id, type, payload, ok_if_dead, dead_reply] {
    if (l->dead || !l->ep) {
      finish_rpc(id, ok_if_dead, ok_if_dead ? ErrorKind::Generic : ErrorKind::Peer, dead_reply);
      return;
    }
    send_ctrl(l, type, id, payload);
  });
}

std::string Device::call(Link* l, uint32_t type, const std::string& payload, const char* if_dead,
                         double timeout, const std::string& what, ErrorKind refused_kind,
                         const std::function<std::string(const std::string&)>& refused) {
  Request q;
  if (!post_request(l, type, payload, false, if_dead, &q))
    throw Error(ErrorKind::Closed, "device is closed");
  try {
    return wait_rpc(q.id, q.rpc, timeout, what);
  } catch (Error& e) {
    // Generic: the peer answered, and the answer is no.
    if (e.kind == ErrorKind::Generic) throw Error(refused_kind, refused(e.what()));
    throw;
  }
}

void Device::finish_rpc(uint64_t id, bool ok, ErrorKind k, const std::string& reply) {
  std::shared_ptr<Rpc> r;
  {
    std::lock_guard<std::mutex> lk(m_);
    auto it = rpcs_.find(id);
    if (it == rpcs_.end()) return;
    r = it->second.second;
    rpcs_.erase(it);
  }
  {
    std::lock_guard<std::mutex> lk(r->m);
    if (r->done) return;
    r->done = true;
    r->ok = ok;
    r->kind = k;
    r->reply = reply;
  }
  r->cv.notify_all();
}

void Device::fail_rpcs_for(Link* l, const std::string& why) {
  std::vector<uint64_t> ids;
  {
    std::lock_guard<std::mutex> lk(m_);
    for (auto& kv : rpcs_)
      if (kv.second.first == l) ids.push_back(kv.first);
  }
  for (auto id : ids) finish_rpc(id, false, ErrorKind::Peer, why);
}

std::string Device::wait_rpc(uint64_t id, const std::shared_ptr<Rpc>& r, double timeout,
                                 const std::string& what) {
  std::unique_lock<std::mutex> lk(r->m);
  timeout = std::min(timeout, 1e9);  // "no limit" (infinity) without overflowing the clock
  if (!r->cv.wait_for(lk, std::chrono::duration<double>(timeout), [&] { return r->done; })) {
    lk.unlock();
    finish_rpc(id, false, ErrorKind::Timeout, "");
    throw Error(ErrorKind::Timeout, "timed out after " + seconds_text(timeout) + " s " + what);
  }
  if (!r->ok) {
    if (r->kind == ErrorKind::Timeout)
      throw Error(ErrorKind::Timeout, "timed out " + what);
    throw Error(r->kind, r->reply.empty() ? "failed " + what : r->reply);
  }
  return r->reply;
}

void Device::fail_all_rpcs(const std::string& why) {
  std::lock_guard<std::mutex> lk(m_);
  for (auto& kv : rpcs_) {
    auto& r = kv.second.second;
    std::lock_guard<std::mutex> rl(r->m);
    if (!r->done) {
      r->done = true;
      r->ok = false;
      r->kind = ErrorKind::Closed;
      r->reply = why;
    }
    r->cv.notify_all();
  }
}

void Device::ensure_validated(const std::shared_ptr<Peer>& peer, RemoteRegion& r) {
  {
    std::lock_guard<std::mutex> lk(peer->m);
    if (peer->validated.count(r.region_id)) return;
  }
  Writer w;
  w.u64(r.region_id);
  w.u64(r.addr);
  w.u64(r.length);
  call(peer->link, VALIDATE, w.s, "connection to the owner is closed", cfg_.rpc_timeout,
       "validating a region with " + peer->endpoint, ErrorKind::Region,
       [&r](const std::string& why) {
         return "remote region " + std::to_string(r.region_id) + " of " + r.owner_endpoint +
                " is not live: " + why;
       });
  std::lock_guard<std::mutex> lk(peer->m);
  peer->validated.insert(r.region_id);
}

static constexpr size_t kMaxValue = 512 * 1024;  // a published value

// The peer refuses a longer name as a malformed message and drops the link: refused here first.
static void check_name(const std::string& name, const char* what) {
  if (name.empty() || name.size() > 4096)
    throw Error(ErrorKind::Invalid, std::string(what) + " must be 1 to 4096 bytes long (got " +
                                        std::to_string(name.size()) + ")");
}

void Device::publish(const std::string& name, const std::string& value) {
  check_open();
  check_name(name, "published names");
  if (value.size() > kMaxValue)
    throw Error(ErrorKind::Invalid, "published values are limited to 512 KiB (got " +
                                        std::to_string(value.size()) + " bytes)");
  std::lock_guard<std::mutex> lk(m_);
  published_[name] = value;
  claimed_.erase(name);  // a new value: claimable again
}

void Device::unpublish(const std::string& name) {
  std::lock_guard<std::mutex> lk(m_);
  published_.erase(name);
  claimed_.erase(name);
}

std::string Device::lookup(const std::string& remote_endpoint, const std::string& name,
                           double timeout, const std::string* claim) {
  if (std::isnan(timeout)) throw Error(ErrorKind::Invalid, "timeout must be a number of seconds, got nan");
  check_name(name, "names looked up");
  if (claim && claim->size() > kMaxValue)
    throw Error(ErrorKind::Invalid, "a claimed value is a published one, at most 512 KiB (got " +
                                        std::to_string(claim->size()) + " bytes)");
  if (timeout < 0) timeout = cfg_.rpc_timeout;
  const double asked = timeout;
  const auto t0 = std::chrono::steady_clock::now();
  auto p = connect(remote_endpoint, timeout);
  timeout = std::max(0.0, timeout - std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  Writer w;
  w.str(name);
  w.u32(claim != nullptr);
  w.str(claim ? *claim : std::string());
  const std::string what = "looking up '" + name + "' at " + remote_endpoint;
  try {
    return call(p->link, LOOKUP, w.s, "connection is closed", timeout, what, ErrorKind::Invalid,
                [](const std::string& why) { return why; });  // the owner's words
  } catch (Error& e) {
    // Said with the caller's timeout, not what was left of it once connected.
    if (e.kind == ErrorKind::Timeout) throw Error(ErrorKind::Timeout, "timed out after " + seconds_text(asked) + " s " + what);
    throw;
  }
}

// Server side: the value published under name, if any; a claim takes it for the asker once,
// if it still holds the value the asker expects.
void Device::answer_lookup(Link* l, uint64_t req, const std::string& name, bool claim,
                           const std::string& expected) {
  Writer w;
  std::lock_guard<std::mutex> lk(m_);
  auto it = published_.find(name);
  if (it == published_.end()) {
    w.u32(0);
    w.str("the device at " + endpoint_ + " has published nothing named '" + name + "'");
  } else if (claim && it->second != expected) {
    w.u32(0);
    w.str("'" + name + "' at " + endpoint_ + " was published anew since it was looked up: nothing "
          "claimed, look it up again");
  } else if (claim && claimed_.count(name)) {
    w.u32(0);
    w.str("'" + name + "' at " + endpoint_ + " was already claimed by " + claimed_[name] +
          ": it pairs with one sender for its life (a retry after a timed-out claim counts as a "
          "second one); publish it anew to pair with another");
  } else {
    if (claim) claimed_[name] = l->remote_endpoint.empty() ? "another device" : l->remote_endpoint;
    w.u32(1);
    w.str(it->second);
  }
  send_ctrl(l, LOOKUP_REPLY, req, w.s);
}

// Server side: whether region id is live at [addr, addr + len); the asker becomes a holder.
void Device::answer_validate(Link* l, uint64_t req, uint64_t id, uint64_t addr, uint64_t len) {
  std::shared_ptr<MemRegion> r;
  {
    std::lock_guard<std::mutex> lk(m_);
    auto it = regions_.find(id);
    if (it != regions_.end()) r = it->second.lock();
  }
  bool ok = false;
  if (r) {
    std::lock_guard<std::mutex> lk(r->m_);
    ok = !r->freed_.load() && r->address() == addr && r->length() == len;
    if (ok) r->holders_.insert(l);
  }
  Writer w;
  w.u32(ok);
  w.str(ok ? "" : "the region was freed or never existed");
  send_ctrl(l, VALIDATE_REPLY, req, w.s);
}

// Holder side: forgets the region, then acknowledges only after every progress thread has
// flushed what it sent to the owner, so no write of ours lands after the owner frees it.
void Device::answer_revoke(Link* l, uint64_t req, uint64_t region_id) {
  uint64_t owner = l->remote_uuid;
  {
    std::lock_guard<std::mutex> lk(m_);
    revoked_.insert({owner, region_id});
    revocations_.fetch_add(1);  // seq_cst: a word counted before this is seen, or sees this
  }
  {
    std::lock_guard<std::mutex> lk(l->peer->m);
    l->peer->validated.erase(region_id);
  }
  unmap_remote(owner, region_id);
  auto left = std::make_shared<std::atomic<int>>(int(threads_.size()));
  auto ack = [this, l, req, left] {
    if (left->fetch_sub(1) == 1)
      threads_[0]->post([this, l, req] { send_ctrl(l, REVOKE_ACK, req, ""); });
  };
  for (auto& pt : threads_) {
    ProgressThread* t = pt.get();
    t->post([t, owner, region_id, ack] {
      for (auto& ch : t->channels())
        if (ch->peer_->uuid == owner) ch->drop_rkey(region_id);
      auto* cb = new std::function<void()>(ack);
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      p.cb.send = [](void* rq, ucs_status_t, void* u) {
        auto* f = static_cast<std::function<void()>*>(u);
        (*f)();
        delete f;
        ucp_request_free(rq);
      };
      p.user_data = cb;
      ucs_status_ptr_t sp = ucp_worker_flush_nbx(t->handle(), &p);
      if (sp == nullptr || UCS_PTR_IS_ERR(sp)) {
        (*cb)();
        delete cb;
      }
    });
  }
}

}  // namespace rdmaflow
