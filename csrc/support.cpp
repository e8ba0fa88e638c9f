// Small helpers the core's files share: UCX status strings and version, random bytes, an active
// message handler, closing an endpoint, and the HMAC entry point its known-answer tests call.
#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "internal.hpp"
#include "wire.hpp"

namespace rdmaflow {

std::string ucs_error(ucs_status_t st) { return ucs_status_string(st); }

std::string ucx_version() { return ucp_get_version_string(); }

void random_bytes(void* out, size_t n) {
  uint8_t* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    ssize_t r = getrandom(p, n, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw Error(ErrorKind::Generic, std::string("getrandom failed: ") + strerror(errno));
    }
    p += r;
    n -= size_t(r);
  }
}

void set_am_handler(ucp_worker_h w, uint16_t id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t ap{};
  ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  ap.id = id;
  ap.cb = cb;
  ap.arg = arg;
  ap.flags = UCP_AM_FLAG_WHOLE_MSG;
  ucs_status_t st = ucp_worker_set_am_recv_handler(w, &ap);
  if (st != UCS_OK)
    throw Error(ErrorKind::Generic, "ucp_worker_set_am_recv_handler failed: " + ucs_error(st));
}

void close_endpoint(ucp_ep_h ep, bool force, std::vector<ucs_status_ptr_t>* reqs) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t sp = ucp_ep_close_nbx(ep, &p);
  if (!sp || UCS_PTR_IS_ERR(sp)) return;
  if (reqs)
    reqs->push_back(sp);
  else
    ucp_request_free(sp);
}

std::string hmac_sha256_bytes(const std::string& key, const std::string& msg) {
  auto d = hmac_sha256(key, msg.data(), msg.size());
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

}  // namespace rdmaflow
