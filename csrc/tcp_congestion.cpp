// The congestion control of UCX's tcp sockets (DeviceConfig::tcp_congestion; docs/transfer.md,
// "The congestion control of the data sockets").
//
// UCX has no option for it, so the core finds the sockets a UCX call opened: the TCP sockets in
// /proc/self/fd after the call whose inode was not there before it. The calls are the ones that
// open UCX's data sockets: ucp_worker_create (its tcp interface's listener, whose accepted
// connections inherit a congestion control chosen with setsockopt) and ucp_ep_create of a data
// endpoint (UCX's tcp connect is blocking by default, UCX_TCP_CONN_NB=n). A TCP socket that
// another thread opens during one of those calls gets the same choice.
#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "internal.hpp"

namespace rdmaflow {

namespace {

constexpr const char* kSystem = "system";
constexpr const char* kAuto = "auto";

// The sockets open in this process: inode -> fd.
std::map<unsigned long, int> open_sockets() {
  std::map<unsigned long, int> out;
  DIR* d = opendir("/proc/self/fd");
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    char path[64], link[64];
    std::snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
    ssize_t n = readlink(path, link, sizeof link - 1);
    if (n <= 0) continue;
    link[n] = 0;
    unsigned long ino = 0;
    if (std::sscanf(link, "socket:[%lu]", &ino) == 1) out[ino] = std::atoi(e->d_name);
  }
  closedir(d);
  return out;
}

bool is_tcp(int fd) {
  int v = 0;
  socklen_t len = sizeof v;
  if (getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &v, &len) != 0 || v != IPPROTO_TCP) return false;
  len = sizeof v;
  return getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &v, &len) == 0 && (v == AF_INET || v == AF_INET6);
}

// 0 or the errno of setting cc on fd.
int set_cc(int fd, const std::string& cc) {
  return setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc.data(), socklen_t(cc.size())) == 0 ? 0
                                                                                         : errno;
}

std::string get_cc(int fd) {
  char name[32] = {};
  socklen_t len = sizeof name - 1;
  if (getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &len) != 0) return "";
  return std::string(name, strnlen(name, len));
}

std::string read_line(const char* path) {
  FILE* f = std::fopen(path, "r");
  if (!f) return "";
  char buf[256] = {};
  std::string s = std::fgets(buf, sizeof buf, f) ? buf : "";
  std::fclose(f);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

}  // namespace

TcpCongestion resolve_tcp_congestion(const std::string& wanted) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return {};  // no IPv4 sockets here: UCX opens no tcp sockets to tune either
  std::string system_cc = get_cc(fd);
  if (wanted == kSystem) {
    close(fd);
    return {"", system_cc};
  }
  std::string chosen;
  int err = 0;
  if (wanted == kAuto) {
    // bbr paces a connection's segments at the rate it has estimated; a stream of bursts (a
    // transfer, then a wait for credits) ran a fifth slower under it than under Linux's
    // default, cubic, or reno, which send as the window allows (docs/benchmarks.md).
    if (system_cc.rfind("bbr", 0) == 0) {
      for (const char* cc : {"cubic", "reno"})
        if (set_cc(fd, cc) == 0) {
          chosen = cc;
          break;
        }
    }
  } else if ((err = set_cc(fd, wanted)) == 0) {
    chosen = wanted;
  }
  close(fd);
  if (err != 0)
    throw Error(ErrorKind::Invalid,
                "cannot give UCX's tcp sockets the congestion control '" + wanted +
                    "': " + std::strerror(err) + " (this host has: " +
                    read_line("/proc/sys/net/ipv4/tcp_available_congestion_control") +
                    "; a process without CAP_NET_ADMIN may choose: " +
                    read_line("/proc/sys/net/ipv4/tcp_allowed_congestion_control") +
                    "; 'auto' and 'system' are the other choices)");
  if (chosen.empty() || chosen == system_cc) return {"", system_cc};
  return {chosen, chosen};
}

NewTcpSockets::NewTcpSockets(const std::string& cc) : cc_(cc) {
  if (!cc_.empty()) before_ = open_sockets();
}

void NewTcpSockets::apply() {
  if (cc_.empty()) return;
  for (const auto& [ino, fd] : open_sockets())
    if (!before_.count(ino) && is_tcp(fd)) set_cc(fd, cc_);
  before_.clear();
}

}  // namespace rdmaflow
