// Endpoints ("host:port", "[v6]:port"): parsing, resolution, and the endpoint a listener
// advertises.
#include <arpa/inet.h>
#include <netdb.h>
#include <unistd.h>

#include <cstring>

#include "internal.hpp"

namespace rdmaflow {

std::pair<std::string, std::string> split_endpoint(const std::string& ep) {
  auto colon = ep.rfind(':');
  if (colon == std::string::npos || colon + 1 == ep.size())
    throw Error(ErrorKind::Invalid, "endpoint '" + ep + "' is not of the form host:port");
  std::string host = ep.substr(0, colon), port = ep.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  for (char c : port)
    if (c < '0' || c > '9')
      throw Error(ErrorKind::Invalid, "endpoint '" + ep + "' has a non-numeric port");
  if (std::stoul(port) > 65535)
    throw Error(ErrorKind::Invalid, "endpoint '" + ep + "' has a port above 65535");
  return {host, port};
}

sockaddr_storage resolve(const std::string& ep, socklen_t* len, bool passive) {
  auto [host, port] = split_endpoint(ep);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || !res)
    throw Error(ErrorKind::Invalid, "cannot resolve endpoint '" + ep + "': " + gai_strerror(rc));
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return ss;
}

static uint16_t sockaddr_port(const sockaddr_storage& ss) {
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(ss).sin_port);
  return ntohs(reinterpret_cast<const sockaddr_in6&>(ss).sin6_port);
}

std::string listening_endpoint(const std::string& configured, const sockaddr_storage& bound) {
  std::string host = split_endpoint(configured).first;
  if (host.empty() || host == "0.0.0.0" || host == "::") {
    char hn[256] = {0};
    gethostname(hn, sizeof hn - 1);
    host = hn;
  }
  bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(sockaddr_port(bound));
}

}  // namespace rdmaflow
