// The floor of a one-way stream of fixed-size messages over one loopback TCP connection, doing
// the work `rdmaflow bench transfer` asks of every system (docs/benchmarks.md, "Session 40"):
// a sender with a window of W messages, a receiver that reads into a buffer of SEG bytes (as
// UCX's tcp receive segment), copies each message into one of W slots, takes its max, spins
// EXTRA_US more (what torch's reduce costs over this loop), and returns a one-byte credit. Both
// sides spin with sched_yield on non-blocking sockets. No UCX, no Python: what is left is the
// kernel's TCP and the copies.
//
//   gcc -O3 -march=native -ffast-math -o /tmp/tcp_stream_floor scripts/tcp_stream_floor.c
//   /tmp/tcp_stream_floor [MSG=262144] [COUNT=20000] [W=2] [SEG=532485] [EXTRA_US=0]
//
// Prints GB/s and us per message at the receiver, the first 1000 messages left out.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

// A send or receive that failed for good (the peer gone): the run ends rather than spinning.
static int would_block(ssize_t r) {
  return r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void receive(int s, size_t msg, int count, int window, size_t seg, double extra_us) {
  char* buf = aligned_alloc(4096, (seg + 4095) & ~(size_t)4095);
  char* slots = aligned_alloc(4096, ((msg * window) + 4095) & ~(size_t)4095);
  size_t have = 0;
  double t0 = 0, acc = 0;
  for (int k = 0; k < count; k++) {
    while (have < msg) {
      ssize_t r = recv(s, buf + have, seg - have, 0);
      if (r > 0)
        have += (size_t)r;
      else if (would_block(r))
        sched_yield();
      else
        exit(1);
    }
    float* f = (float*)(slots + (size_t)(k % window) * msg);
    memcpy(f, buf, msg);
    memmove(buf, buf + msg, have - msg);
    have -= msg;
    float m = -1e30f;
    for (size_t i = 0; i < msg / 4; i++) m = f[i] > m ? f[i] : m;
    acc += m;
    if (extra_us > 0)
      for (double end = now() + extra_us * 1e-6; now() < end;) {
      }
    char c = 1;
    for (ssize_t r; (r = send(s, &c, 1, MSG_NOSIGNAL)) != 1;) {
      if (!would_block(r)) exit(1);
      sched_yield();
    }
    if (k == 1000) t0 = now();
  }
  const double dt = now() - t0, n = count - 1001;
  printf("MSG %zu W %d SEG %zu EXTRA %.1f us: %.3f GB/s, %.1f us per message (max sum %g)\n", msg,
         window, seg, extra_us, n * (double)msg / dt / 1e9, 1e6 * dt / n, acc);
  fflush(stdout);
}

int main(int argc, char** argv) {
  const size_t msg = argc > 1 ? strtoul(argv[1], NULL, 0) : 262144;
  const int count = argc > 2 ? atoi(argv[2]) : 20000;
  const int window = argc > 3 ? atoi(argv[3]) : 2;
  const size_t seg = argc > 4 ? strtoul(argv[4], NULL, 0) : 532485;
  const double extra_us = argc > 5 ? atof(argv[5]) : 0;
  if (msg < 4 || count <= 1001 || window < 1 || seg < msg) {
    fprintf(stderr, "need MSG >= 4, COUNT > 1001, W >= 1 and SEG >= MSG\n");
    return 2;
  }
  int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t alen = sizeof a;
  if (bind(ls, (void*)&a, sizeof a) || getsockname(ls, (void*)&a, &alen) || listen(ls, 1)) {
    perror("listen");
    return 1;
  }
  pid_t child = fork();
  if (child == 0) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, (void*)&a, sizeof a)) _exit(1);
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(s, F_SETFL, O_NONBLOCK);
    receive(s, msg, count, window, seg, extra_us);
    _exit(0);
  }
  int s = accept(ls, NULL, NULL);
  setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  char* src = malloc(msg);
  memset(src, 0, msg);
  int credits = window;
  char cb[64];
  for (int k = 0; k < count; k++) {
    while (credits == 0) {
      ssize_t r = recv(s, cb, sizeof cb, MSG_DONTWAIT);
      if (r > 0)
        credits += (int)r;
      else if (would_block(r))
        sched_yield();
      else
        return 1;
    }
    for (size_t off = 0; off < msg;) {
      ssize_t r = send(s, src + off, msg - off, MSG_NOSIGNAL);
      if (r > 0)
        off += (size_t)r;
      else if (!would_block(r))
        return 1;
    }
    credits--;
  }
  int status = 0;
  waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
