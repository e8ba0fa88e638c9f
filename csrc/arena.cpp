// Arena: the allocator over one registered region, and wait_u64_at_least, the flag wait that
// readers of arena memory poll with.
#include <algorithm>
#include <thread>

#include "internal.hpp"

namespace rdmaflow {

Arena::Arena(std::shared_ptr<MemRegion> region, size_t alignment)
    : region_(std::move(region)), capacity_(region_->length()), align_(alignment) {
  if (align_ == 0 || (align_ & (align_ - 1)))
    throw Error(ErrorKind::Invalid, "arena alignment must be a power of two");
  insert_free(0, capacity_ / align_ * align_);
}

void Arena::insert_free(size_t off, size_t len) {
  if (len == 0) return;
  free_by_off_[off] = len;
  free_by_len_.emplace(len, off);
}

void Arena::erase_free(std::map<size_t, size_t>::iterator it) {
  auto range = free_by_len_.equal_range(it->second);
  for (auto j = range.first; j != range.second; ++j)
    if (j->second == it->first) {
      free_by_len_.erase(j);
      break;
    }
  free_by_off_.erase(it);
}

size_t Arena::alloc(size_t nbytes) {
  size_t need = (std::max<size_t>(nbytes, 1) + align_ - 1) / align_ * align_;
  std::lock_guard<std::mutex> lk(m_);
  if (region_->freed()) throw Error(ErrorKind::Region, "the arena's region was freed");
  auto best = free_by_len_.lower_bound(need);
  if (best == free_by_len_.end()) {
    size_t largest = free_by_len_.empty() ? 0 : free_by_len_.rbegin()->first;
    throw Error(ErrorKind::Full,
                "arena full: cannot allocate " + std::to_string(nbytes) + " bytes (" +
                    std::to_string(need) + " aligned) in an arena of " +
                    std::to_string(capacity_) + " bytes with " +
                    std::to_string(capacity_ - used_) + " bytes free, the largest free block " +
                    std::to_string(largest) + " bytes");
  }
  size_t off = best->second, len = best->first;
  erase_free(free_by_off_.find(off));
  insert_free(off + need, len - need);
  live_[off] = need;
  used_ += need;
  return off;
}

void Arena::free(size_t offset) {
  std::lock_guard<std::mutex> lk(m_);
  auto it = live_.find(offset);
  if (it == live_.end()) return;
  size_t off = offset, len = it->second;
  live_.erase(it);
  used_ -= len;
  // Coalesce with the free neighbours so a repeated pattern cannot fragment the arena.
  auto next = free_by_off_.lower_bound(off);
  if (next != free_by_off_.end() && next->first == off + len) {
    len += next->second;
    erase_free(next);
  }
  auto after = free_by_off_.lower_bound(off);
  if (after != free_by_off_.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == off) {
      off = prev->first;
      len += prev->second;
      erase_free(prev);
    }
  }
  insert_free(off, len);
}

size_t Arena::used() const {
  std::lock_guard<std::mutex> lk(m_);
  return used_;
}

size_t Arena::largest_free() const {
  std::lock_guard<std::mutex> lk(m_);
  return free_by_len_.empty() ? 0 : free_by_len_.rbegin()->first;
}

size_t Arena::num_allocations() const {
  std::lock_guard<std::mutex> lk(m_);
  return live_.size();
}

size_t Arena::num_free_blocks() const {
  std::lock_guard<std::mutex> lk(m_);
  return free_by_off_.size();
}

// Sleeps of at most kMaxSleepUs between looks once the spinning and yielding are done.
constexpr long kMaxSleepUs = 50;

bool wait_u64_at_least(uintptr_t addr, uint64_t value, double timeout_s) {
  auto* p = reinterpret_cast<const uint64_t*>(addr);
  auto ready = [&] { return __atomic_load_n(p, __ATOMIC_ACQUIRE) >= value; };
  for (int i = 0; i < 2000; ++i) {
    if (ready()) return true;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
  auto t0 = Clock::now();
  long sleep_us = 1;
  int yields = 0;
  while (!ready()) {
    if (timeout_s >= 0 && seconds_since(t0) > timeout_s) return ready();
    // On a machine with few cores the writer (or the progress thread applying its puts) may
    // need this core: yield first, then sleep with a short capped backoff, so a wait neither
    // starves the writer nor oversleeps the flag (docs/benchmarks.md has the figures).
    if (yields < 50) {
      ++yields;
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      sleep_us = std::min<long>(sleep_us * 2, kMaxSleepUs);
    }
  }
  return true;
}

}  // namespace rdmaflow
