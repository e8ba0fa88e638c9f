// How long one cache line takes to move between two CPUs (cache_line_handoff_ns; the
// benchmarks' host probe, docs/benchmarks.md). Under a hypervisor the guest's vCPUs may share a
// last-level cache for a while and then run on different dies: a line then takes several times
// longer to change hands, and so does every copy that hands lines from one process to another.
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "internal.hpp"

namespace rdmaflow {

namespace {

bool pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
}

}  // namespace

double cache_line_handoff_ns(int cpu_a, int cpu_b, double seconds) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0)
    throw Error(ErrorKind::Generic, "sched_getaffinity failed");
  for (int cpu : {cpu_a, cpu_b})
    if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &allowed))
      throw Error(ErrorKind::Invalid, "cpu " + std::to_string(cpu) + " is not one this process may run on");
  if (cpu_a == cpu_b) throw Error(ErrorKind::Invalid, "the two cpus must differ");
  if (!(seconds > 0 && seconds <= 10)) throw Error(ErrorKind::Invalid, "seconds must be in (0, 10]");

  // `ask` stores an odd value, `answer` the next even one: each waits for the other's store, so
  // every step moves the line from one cpu to the other. stop bounds both waits.
  alignas(64) std::atomic<uint64_t> line{0};
  double step_ns = 0;  // ask's result, read after the joins
  alignas(64) std::atomic<bool> stop{false}, pinned{true};
  std::thread answer([&] {
    if (!pin_to(cpu_b)) pinned.store(false);
    for (uint64_t v = 1; !stop.load(std::memory_order_relaxed); v += 2) {
      while (line.load(std::memory_order_acquire) != v)
        if (stop.load(std::memory_order_relaxed)) return;
      line.store(v + 1, std::memory_order_release);
    }
  });
  std::thread ask([&] {
    if (!pin_to(cpu_a)) pinned.store(false);
    using clock = std::chrono::steady_clock;
    const auto end = clock::now() + std::chrono::duration<double>(seconds);
    uint64_t v = 0, steps = 0;
    auto t0 = clock::now();
    while (clock::now() < end) {
      for (int i = 0; i < 1000; ++i, v += 2) {
        line.store(v + 1, std::memory_order_release);
        while (line.load(std::memory_order_acquire) != v + 2)
          if (stop.load(std::memory_order_relaxed)) return;
      }
      steps += 2000;
    }
    step_ns = std::chrono::duration<double, std::nano>(clock::now() - t0).count() / double(steps);
    stop.store(true);
  });
  // A thread that never gets its cpu (a hypervisor that does not run it) would spin forever:
  // the wait is bounded by a watchdog on this thread.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds + 5);
  while (!stop.load() && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const bool finished = stop.exchange(true);
  ask.join();
  answer.join();
  if (!pinned.load()) throw Error(ErrorKind::Generic, "could not pin a thread to its cpu");
  if (!finished) throw Error(ErrorKind::Timeout, "the cache line did not move for seconds + 5 s");
  return step_ns;
}

}  // namespace rdmaflow
