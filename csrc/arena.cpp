// Arena: the allocator over one registered region.
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

}  // namespace rdmaflow
