// Flagged writes as one active message (FlaggedWrites::Message): data and word travel together
// and the target's handler applies them in order, the data with a copy and then the word with a
// release store, so the word is never seen before the data on any transport, with no fence.
// Over tcp a put is applied by the target's software anyway; what this saves is the strong
// fence's round trip between the two puts (docs/transfer.md, "Flagged writes").
#include <algorithm>
#include <cstring>

#include "internal.hpp"
#include "wire.hpp"

namespace rdmaflow {

size_t Channel::flagged_message_bytes() { return kFlaggedMaxBytes; }

EndpointPaths flagged_paths(FlaggedWrites mode, ucp_ep_h ep) {
  ucp_transport_entry_t entries[32];
  ucp_ep_attr_t attr{};
  attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
  attr.transports.entries = entries;
  attr.transports.num_entries = 32;
  attr.transports.entry_size = sizeof(entries[0]);
  bool tcp = ucp_ep_query(ep, &attr) == UCS_OK && attr.transports.num_entries != 0;
  for (unsigned i = 0; tcp && i < attr.transports.num_entries; ++i)
    tcp = std::strcmp(entries[i].transport_name, "tcp") == 0;
  // Message only where every lane is tcp (FlaggedWrites): elsewhere a flush does not say that
  // the message's handler has run, so nothing could order a later write behind it.
  if (mode != FlaggedWrites::Auto) return {tcp && mode == FlaggedWrites::Message, false, tcp};
  return {tcp, tcp && attr.transports.num_entries == 1, tcp};
}

bool Channel::send_flagged_message(ProgressThread* t, Op* data, Op* word, size_t local_off,
                                   size_t remote_off, size_t n, size_t word_remote_off,
                                   uint64_t value, const RiderPost* rider) {
  Channel* ch = word->ch.get();
  // Puts still in flight on this endpoint are not ordered with a message (unless the endpoint is
  // one tcp connection): they keep the put path. Beyond kFlaggedMaxBytes the message's extra
  // copy on the target costs more than the put.
  // The handler copies with the CPU into the word's region: not for GPU data, nor for data
  // bound for another region than the word's.
  if (n > kFlaggedMaxBytes || (ch->rma_pending_ != 0 && !ch->one_stream_) || ch->failed() ||
      (data && (data->gpu() || data->remote != word->remote)) || !ch->ensure_ep() ||
      !ch->flagged_by_message_)
    return false;
  const RemoteRegion& r = *word->remote;
  Op* lead = data ? data : word;  // the op whose buffer the send reads: the data's, or the word's
  // The write's ops complete together when the message has left: the handler applies data and
  // word in order, so no flush is needed for the word's order, and waiting for one would cost a
  // request/reply through the peer's progress per message (docs/transfer.md, "Completion").
  struct Group {
    ProgressThread* t;
    Op* ops[3];
    void note(ucs_status_t st) {
      for (Op* op : ops)
        if (op) t->op_note(op, st);
      delete this;
    }
  };
  auto* g = new Group{t, {data, word, rider ? rider->op : nullptr}};
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = [](void* req, ucs_status_t st, void* user) {
    static_cast<Group*>(user)->note(st);
    ucp_request_free(req);
  };
  p.user_data = g;
  // Eager: the message fits one UCX tcp segment (kFlaggedSegBytes); rendezvous would add a round
  // trip of its own. One message, not several smaller ones: each costs the sender a sendmsg and
  // the receiver a pass of its handler (docs/benchmarks.md).
  p.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_COPY_HEADER;
  if (lead->local->memh_) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = lead->local->memh_;
  }
  // Mapped copies wait until a flush covers the message (Path::same_host).
  ++ch->am_pending_;
  ++ch->am_unflushed_;
  t->device()->message_writes_.fetch_add(1, std::memory_order_relaxed);
  const char* laddr = reinterpret_cast<const char*>(lead->local->addr_) + local_off;
  FlaggedHeader h{kFlaggedMagic, r.region_id, r.addr, remote_off, word_remote_off, value, 0, 0, 0, 0};
  if (rider) {
    h.rider_region_id = rider->rider.remote->region_id;
    h.rider_region_addr = rider->rider.remote->addr;
    h.rider_off = rider->rider.remote_off;
    h.rider_value = rider->rider.value;
  }
  ucs_status_ptr_t sp =
      ucp_am_send_nbx(ch->ep_, kFlaggedAmId, &h, sizeof h, const_cast<char*>(laddr), n, &p);
  if (UCS_PTR_IS_ERR(sp))
    g->note(UCS_PTR_STATUS(sp));
  else if (sp == nullptr)
    g->note(UCS_OK);
  return true;
}

namespace {
// An aligned 8-byte word at off lies inside r.
bool word_inside(const MemRegion& r, uint64_t off) {
  return off <= r.length() && 8 <= r.length() - off && (off & 7) == 0;
}
}  // namespace

// Runs on whichever thread drives the worker. The sender checked the ranges against the
// region's authenticated descriptor; a message that names no live region of this device (freed
// since, or not from a peer of this job) is dropped and counted, never applied.
ucs_status_t Device::flagged_cb(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
  auto* d = static_cast<Device*>(arg);
  FlaggedHeader h{};
  if (header_length != sizeof h || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    d->dropped_writes_.fetch_add(1, std::memory_order_relaxed);
    return UCS_OK;
  }
  std::memcpy(&h, header, sizeof h);
  std::shared_ptr<MemRegion> r, rider;
  {
    std::lock_guard<std::mutex> lk(d->m_);
    auto it = d->regions_.find(h.region_id);
    if (it != d->regions_.end()) r = it->second.lock();
    if (h.rider_region_id) {
      it = d->regions_.find(h.rider_region_id);
      if (it != d->regions_.end()) rider = it->second.lock();
    }
  }
  size_t len = r ? r->length_ : 0;
  if (h.magic != kFlaggedMagic || !r || r->freed() || r->addr_ != h.region_addr ||
      h.data_off > len || length > len - h.data_off || !word_inside(*r, h.word_off)) {
    d->dropped_writes_.fetch_add(1, std::memory_order_relaxed);
    return UCS_OK;
  }
  char* base = reinterpret_cast<char*>(r->addr_);
  if (length) std::memcpy(base + h.data_off, data, length);
  // The rider first: a peer that sees the word sees the rider too (a reply's flag and the
  // credit it hands back arrive together).
  if (h.rider_region_id) {
    if (rider && !rider->freed() && rider->addr_ == h.rider_region_addr &&
        word_inside(*rider, h.rider_off))
      __atomic_store_n(reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(rider->addr_) + h.rider_off),
                       h.rider_value, __ATOMIC_RELEASE);
    else
      d->dropped_writes_.fetch_add(1, std::memory_order_relaxed);
  }
  __atomic_store_n(reinterpret_cast<uint64_t*>(base + h.word_off), h.value, __ATOMIC_RELEASE);
  return UCS_OK;
}

}  // namespace rdmaflow
