// Regions: allocating and registering local memory, its descriptor (encoded here, parsed and
// authenticated for remote regions), and freeing it (revocation at every peer that validated it).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "internal.hpp"
#include "wire.hpp"

namespace rdmaflow {

RegionMemory::~RegionMemory() {
  if (owned && addr) {
    long page = sysconf(_SC_PAGESIZE);
    size_t len = (length + page - 1) / page * page;
    munmap(addr, len ? len : page);
  }
  if (fd >= 0) close(fd);
}

std::vector<uint8_t> MemRegion::descriptor() const {
  if (freed_.load()) throw Error(ErrorKind::Region, "region " + std::to_string(id_) + " was freed");
  return descriptor_;
}

void MemRegion::free() {
  if (freed_.exchange(true)) return;
  auto dev = dev_.lock();
  if (dev && !dev->closed()) dev->free_region(*this);
}

std::shared_ptr<RemoteRegion> RemoteRegion::parse(const std::string& bytes) {
  if (bytes.size() < 4 + kMacLen || std::memcmp(bytes.data(), kDescMagic, 4) != 0)
    throw Error(ErrorKind::Invalid,
                "malformed descriptor: not an rdmaflow region descriptor (bad magic or too short)");
  auto r = std::make_shared<RemoteRegion>();
  r->body = bytes.substr(0, bytes.size() - kMacLen);
  std::memcpy(r->mac, bytes.data() + r->body.size(), kMacLen);
  Reader rd(r->body, "descriptor");
  char magic[4];
  rd.raw(magic, 4);
  uint16_t version = rd.num<uint16_t>();
  uint16_t flags = rd.num<uint16_t>();
  if (version != 1)
    throw Error(ErrorKind::Invalid,
                "malformed descriptor: version " + std::to_string(version) + " is not supported");
  r->job_tag = rd.num<uint64_t>();
  r->owner_uuid = rd.num<uint64_t>();
  r->region_id = rd.num<uint64_t>();
  r->addr = rd.num<uint64_t>();
  r->length = rd.num<uint64_t>();
  r->owner_endpoint = rd.str(1024);
  std::string rk = rd.str(1 << 16);
  r->rkey.assign(rk.begin(), rk.end());
  if (flags & kDescShared) {
    r->shared = true;
    r->boot_id = rd.str(64);
    r->pid = rd.num<uint32_t>();
    r->fd = rd.num<uint32_t>();
    r->st_dev = rd.num<uint64_t>();
    r->st_ino = rd.num<uint64_t>();
  }
  if (flags & kDescCuda) {
    r->cuda_device = int(rd.num<uint32_t>());
    if (r->shared || r->cuda_device < 0)
      throw Error(ErrorKind::Invalid, "malformed descriptor: GPU memory cannot be shared host memory");
  }
  rd.end();
  if (r->length > (uint64_t(1) << 56) || r->addr + r->length < r->addr)
    throw Error(ErrorKind::Invalid, "malformed descriptor: impossible address range");
  return r;
}

std::shared_ptr<MemRegion> Device::alloc_region(size_t nbytes) {
  check_open();
  if (nbytes == 0) throw Error(ErrorKind::Invalid, "cannot allocate a region of 0 bytes");
  long page = sysconf(_SC_PAGESIZE);
  // Faulting in more than the host has would fill its memory, then swap, for as long as it takes.
  const uint64_t host_bytes = uint64_t(sysconf(_SC_PHYS_PAGES)) * uint64_t(page);
  if (host_bytes && nbytes > host_bytes)
    throw Error(ErrorKind::Full, "cannot allocate a region of " + std::to_string(nbytes) +
                                     " bytes: this host has " + std::to_string(host_bytes) +
                                     " bytes of memory");
  size_t len = (nbytes + page - 1) / page * page;
  auto mem = std::make_shared<RegionMemory>();  // unmaps (and closes the memfd) on any throw
  mem->length = nbytes;
  mem->owned = true;
  char* p = nullptr;
  if (map_enabled_) {
    // Shared memory (a memfd) that same-host peers map through /proc/<pid>/fd/<fd>; it is
    // still registered with UCX, so remote peers reach it over the network as usual.
    int fd = memfd_create("rdmaflow-region", MFD_CLOEXEC);
    struct stat st {};
    void* m = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, off_t(len)) == 0 && fstat(fd, &st) == 0)
      m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m != MAP_FAILED) {
      p = static_cast<char*>(m);
      mem->fd = fd;
      mem->st_dev = uint64_t(st.st_dev);
      mem->st_ino = uint64_t(st.st_ino);
    } else if (fd >= 0) {
      ::close(fd);  // fall back to private memory
    }
  }
  const size_t huge = size_t(2) << 20;
  if (!p) {
    // 2 MiB-aligned so that transparent huge pages can back it.
    size_t slack = len >= huge ? huge : 0;
    void* raw = mmap(nullptr, len + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
      throw Error(ErrorKind::Generic, "cannot allocate a region of " + std::to_string(nbytes) +
                                          " bytes: " + strerror(errno));
    p = static_cast<char*>(raw);
    if (slack) {
      char* aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + huge - 1) & ~(huge - 1));
      if (aligned > p) munmap(p, size_t(aligned - p));
      size_t tail = size_t(p + len + slack - (aligned + len));
      if (tail) munmap(aligned + len, tail);
      p = aligned;
    }
  }
  mem->addr = p;
  // Huge pages where the kernel allows (shared memory: only with shmem_enabled=advise), then
  // faulted in: registration pins memory on verbs anyway, and the first transfer should not
  // pay for page faults.
  if (len >= huge) madvise(p, len, MADV_HUGEPAGE);
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
  if (madvise(p, len, MADV_POPULATE_WRITE) != 0) {
    if (errno == ENOMEM)
      throw Error(ErrorKind::Full, "cannot allocate a region of " + std::to_string(nbytes) +
                                       " bytes: the host ran out of memory faulting it in");
    for (size_t off = 0; off < len; off += size_t(page)) p[off] = 0;  // a kernel without populate
  }
  return register_region(reinterpret_cast<uintptr_t>(p), nbytes, mem);
}

std::shared_ptr<MemRegion> Device::register_memory(uintptr_t addr, size_t nbytes, int cuda_device) {
  auto mem = std::make_shared<RegionMemory>();  // the caller's memory: neither owned nor shared
  mem->addr = reinterpret_cast<void*>(addr);
  mem->length = nbytes;
  return register_region(addr, nbytes, mem, cuda_device);
}

std::shared_ptr<MemRegion> Device::register_region(uintptr_t addr, size_t nbytes,
                                                   const std::shared_ptr<RegionMemory>& mem,
                                                   int cuda_device) {
  check_open();
  if (nbytes == 0) throw Error(ErrorKind::Invalid, "cannot register a region of 0 bytes");
  if (addr == 0) throw Error(ErrorKind::Invalid, "cannot register memory at address 0");
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = reinterpret_cast<void*>(addr);
  mp.length = nbytes;
  if (cuda_device >= 0) {
    if (!cuda_supported())
      throw Error(ErrorKind::Invalid,
                  "cannot register GPU memory: this UCX has no CUDA support (built without CUDA, "
                  "or UCX_TLS leaves out cuda_copy and cuda_ipc)");
    use_cuda_device(cuda_device);  // UCX queries the memory through this thread's context
    mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    mp.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(ctx_, &mp, &memh);
  if (st != UCS_OK)
    throw Error(ErrorKind::Generic, "cannot register " + std::to_string(nbytes) + " bytes of " +
                                        (cuda_device >= 0 ? "GPU" : "host") +
                                        " memory with UCX: " + ucs_error(st));
  void* rkbuf = nullptr;
  size_t rklen = 0;
  st = ucp_rkey_pack(ctx_, memh, &rkbuf, &rklen);
  if (st != UCS_OK) {
    ucp_mem_unmap(ctx_, memh);
    throw Error(ErrorKind::Generic, "ucp_rkey_pack failed: " + ucs_error(st));
  }
  auto r = std::make_shared<MemRegion>();
  r->dev_ = weak_from_this();
  r->mem_ = mem;
  r->addr_ = addr;
  r->length_ = nbytes;
  r->memh_ = memh;
  r->id_ = next_region_.fetch_add(1);
  r->cuda_device_ = cuda_device;
  r->rkey_.assign(static_cast<uint8_t*>(rkbuf), static_cast<uint8_t*>(rkbuf) + rklen);
  ucp_rkey_buffer_release(rkbuf);
  std::string desc = encode_descriptor(*r, *mem);
  r->descriptor_.assign(desc.begin(), desc.end());
  {
    std::lock_guard<std::mutex> lk(m_);
    regions_[r->id_] = r;
  }
  return r;
}

// The layout is in docs/architecture.md ("Descriptors"); the MAC covers everything before it.
std::string Device::encode_descriptor(const MemRegion& r, const RegionMemory& mem) const {
  Writer w;
  bool is_shared = mem.fd >= 0;  // private memory has no fd
  bool is_cuda = r.cuda_device_ >= 0;
  w.raw(kDescMagic, 4);
  w.u16(1);
  w.u16(uint16_t((is_shared ? kDescShared : 0) | (is_cuda ? kDescCuda : 0)));
  w.u64(job_tag_);
  w.u64(uuid_);
  w.u64(r.id_);
  w.u64(r.addr_);
  w.u64(r.length_);
  w.str(endpoint_);
  w.str(std::string(r.rkey_.begin(), r.rkey_.end()));
  if (is_shared) {
    w.str(boot_id_);
    w.u32(uint32_t(getpid()));
    w.u32(uint32_t(mem.fd));
    w.u64(mem.st_dev);
    w.u64(mem.st_ino);
  }
  if (is_cuda) w.u32(uint32_t(r.cuda_device_));
  return w.s + mac16(cfg_.secret, w.s);
}

void Device::verify_remote(RemoteRegion& r) {
  if (r.verified.load() == 1 && r.verified_for == uuid_) return;
  if (r.job_tag != job_tag_)
    throw Error(ErrorKind::Region,
                "descriptor belongs to another job: it was made by a device that does not share "
                "this job's secret (owner " + r.owner_endpoint + ")");
  std::string mac = mac16(cfg_.secret, r.body);
  if (!equal_ct(reinterpret_cast<const uint8_t*>(mac.data()), r.mac, kMacLen))
    throw Error(ErrorKind::Region, "descriptor failed authentication: it was altered or forged");
  r.verified_for = uuid_;
  r.verified.store(1);
}

bool Device::revoked(uint64_t owner, uint64_t id) {
  std::lock_guard<std::mutex> lk(m_);
  return revoked_.count({owner, id}) != 0;
}

void Device::free_region(MemRegion& r) {
  std::vector<Link*> holders;  // peers that validated the region
  {
    std::lock_guard<std::mutex> lk(r.m_);
    holders.assign(r.holders_.begin(), r.holders_.end());
    r.holders_.clear();
  }
  bool safe = revoke_at(holders, r.id_);
  auto t0 = Clock::now();
  while (r.inflight_.load() > 0 && seconds_since(t0) < cfg_.rpc_timeout)
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  bool idle = r.inflight_.load() == 0;
  {
    std::lock_guard<std::mutex> lk(m_);
    regions_.erase(r.id_);
    // A peer that did not confirm may still write here: keep the memory mapped until close.
    if (!safe || !idle) quarantine_.push_back(r.mem_);
  }
  std::lock_guard<std::mutex> lk(r.m_);
  if (idle && r.memh_) {
    ucp_mem_unmap(ctx_, r.memh_);
    r.memh_ = nullptr;
  }
}

// Sends REVOKE to every holder at once, then waits for their acknowledgements. False when one
// may still write to the region: it did not answer in time, or the device closed meanwhile.
bool Device::revoke_at(const std::vector<Link*>& holders, uint64_t region_id) {
  bool safe = true;
  Writer w;
  w.u64(region_id);
  std::vector<Request> acks;
  for (Link* l : holders) {
    Request q;
    // A dead peer writes nothing more: its request succeeds.
    if (!post_request(l, REVOKE, w.s, true, "", &q)) {
      safe = false;
      break;
    }
    acks.push_back(q);
  }
  for (auto& q : acks) {
    try {
      wait_rpc(q.id, q.rpc, cfg_.rpc_timeout, "revoking region " + std::to_string(region_id));
    } catch (Error& e) {
      if (e.kind == ErrorKind::Timeout) safe = false;
    }
  }
  return safe;
}

}  // namespace rdmaflow
