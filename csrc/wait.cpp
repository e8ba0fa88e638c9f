// Polling waits on 8-byte words in memory a peer writes (flags, acks, counters): the one
// policy for how a waiter spends the time between a word's arrival and its noticing it
// (Xue et al. §3.2 and §4: receives poll; here bounded, then asleep).
#include <algorithm>
#include <optional>
#include <thread>

#include "internal.hpp"

namespace rdmaflow {

namespace {
// The spin budget adapts per thread: a wait that took at most kSpinWorthNs, whether it ended
// while spinning or asleep, sets it to four times what it took (within the bounds); a longer
// wait halves it. A ping-pong partner that answers in microseconds is seen in microseconds; an
// idle waiter stops burning the core after kMinSpinNs. (A sleep, however short, costs the timer
// slack: tens of us.) Halving after every wait that slept, as this once did, let a ping-pong
// settle where both sides sleep: each answer then waits for a sleeper's wake-up, so every wait
// outlasts the shrinking budget, and the round trip stays ten times longer.
// The spin yields the core between rounds of loads: a spin that only paused took the core from
// whatever else was runnable there for the whole budget. Where processes outnumber the cores (a
// shard beside its workers; stages sharing a host) that is the writer, or the thread whose work
// the writer waits for, and up to 250 us of each wait was taken from them (docs/benchmarks.md,
// "Spinning that yields"). With nothing else runnable a yield returns at once. The first
// kPureSpinNs only pause: yielding from the first look made the shared-memory ping-pong
// bimodal (one way 5-6 us instead of 2.4 for one or two sizes of four, in four runs of six;
// probably partners handing one core back and forth), which a pause-only spin never showed.
constexpr int64_t kPureSpinNs = 10'000;
constexpr int64_t kMinSpinNs = 50'000;
constexpr int64_t kMaxSpinNs = 250'000;
constexpr int64_t kSpinWorthNs = 1'000'000;
constexpr int kYields = 50;
constexpr long kMaxSleepUs = 50;  // an idle wait wakes at most every 50 us
thread_local int64_t spin_budget_ns = 50'000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline int64_t ns_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}
}  // namespace

WaitStatus wait_word(uintptr_t addr, uint64_t value, double timeout_s, const Channel* peer,
                     bool drive) {
  drive = drive && peer;
  auto* p = reinterpret_cast<const uint64_t*>(addr);
  auto ready = [&] { return __atomic_load_n(p, __ATOMIC_ACQUIRE) >= value; };
  if (ready()) return WaitStatus::Ok;
  // A waiter that does not drive relies on the progress threads (over UCX): none may stay parked.
  std::optional<ProgressThread::Relying> relying;
  if (!drive) relying.emplace();
  struct Counted {  // this waiter, counted in while it drives (ProgressThread::drivers)
    const Channel* ch;
    explicit Counted(const Channel* c) : ch(c) { if (ch) ch->count_driver(1); }
    ~Counted() { leave(); }
    void leave() {
      if (ch) ch->count_driver(-1);
      ch = nullptr;
    }
  } counted(drive ? peer : nullptr);
  auto t0 = Clock::now();
  const int64_t budget = std::min<int64_t>(spin_budget_ns, timeout_s < 0 ? kMaxSpinNs : int64_t(timeout_s * 1e9));
  for (int i = 0;; ++i) {
    for (int j = 0; j < 16; ++j) {
      if (ready()) {
        int64_t took = ns_since(t0);
        spin_budget_ns = std::clamp<int64_t>(4 * took, kMinSpinNs, kMaxSpinNs);
        return WaitStatus::Ok;
      }
      cpu_relax();
    }
    if (drive) peer->progress_now();
    const int64_t waited = ns_since(t0);
    if (waited >= budget) break;
    if (waited >= kPureSpinNs) std::this_thread::yield();
  }
  long sleep_us = 1;
  int yields = 0;
  while (!ready()) {
    if (peer && peer->failed()) return ready() ? WaitStatus::Ok : WaitStatus::PeerFailed;
    if (timeout_s >= 0 && seconds_since(t0) > timeout_s) return ready() ? WaitStatus::Ok : WaitStatus::Timeout;
    // On a machine with few cores the writer (or the progress thread applying its puts) may
    // need this core: yield first, then sleep with a short capped backoff, so a wait neither
    // starves the writer nor oversleeps the word (docs/benchmarks.md has the figures).
    // A drive that moved something (a large put arriving in pieces) is followed by another at
    // once, as in the progress thread's loop; backing off between the pieces slowed a 64 MiB
    // stream over tcp (docs/benchmarks.md, "A waiter that drives").
    if (drive && peer->progress_now()) {
      sleep_us = 1;
      continue;
    }
    if (yields < kYields) {
      ++yields;
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      sleep_us = std::min<long>(sleep_us * 2, kMaxSleepUs);
    }
  }
  const int64_t took = ns_since(t0);
  if (took <= kSpinWorthNs) {
    spin_budget_ns = std::clamp<int64_t>(4 * took, kMinSpinNs, kMaxSpinNs);
  } else {
    spin_budget_ns = std::max<int64_t>(spin_budget_ns / 2, kMinSpinNs);
    // A long wait is a large transfer's: what follows it (the next one) keeps arriving while the
    // caller computes only if the progress thread takes the worker back now, rather than staying
    // parked for a driver that was here moments ago (docs/benchmarks.md, "A waiter that drives").
    if (drive) {
      counted.leave();
      peer->hand_back();
    }
  }
  return WaitStatus::Ok;
}

bool wait_u64_at_least(uintptr_t addr, uint64_t value, double timeout_s) {
  return wait_word(addr, value, timeout_s, nullptr) == WaitStatus::Ok;
}

WaitStatus wait_credit(uintptr_t ack_addr, int64_t need, uint64_t closed_value, double timeout_s,
                       const Channel* peer, bool drive) {
  auto* ack = reinterpret_cast<const uint64_t*>(ack_addr);
  if (__atomic_load_n(ack, __ATOMIC_ACQUIRE) >= closed_value) return WaitStatus::Closed;
  if (need <= 0) return WaitStatus::Ok;
  WaitStatus st = wait_word(ack_addr, uint64_t(need), timeout_s, peer, drive);
  if (st != WaitStatus::Ok) return st;
  return __atomic_load_n(ack, __ATOMIC_ACQUIRE) >= closed_value ? WaitStatus::Closed : WaitStatus::Ok;
}

}  // namespace rdmaflow
