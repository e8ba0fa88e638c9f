// The same-host fast path: a peer's shared region mapped into this process, and the copies
// made through such mappings (the copy pool, streamed or cached by size).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "internal.hpp"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace rdmaflow {

bool tls_allow_shared_memory() {
  // A user who restricts UCX to tcp (or to verbs) wants the data to take that path, so the
  // same-host mapping stays off then.
  const char* env = std::getenv("UCX_TLS");
  if (!env || !*env) return true;
  std::string s(env);
  bool negate = s[0] == '^';
  if (negate) s.erase(0, 1);
  static const std::set<std::string> shm = {"sm", "shm", "posix", "sysv", "cma", "xpmem", "knem", "mm"};
  bool any_shm = false, all = false;
  std::stringstream ss(s);
  for (std::string t; std::getline(ss, t, ',');) {
    for (auto& c : t) c = char(std::tolower(static_cast<unsigned char>(c)));
    if (shm.count(t)) any_shm = true;
    if (t == "all") all = true;
  }
  return negate ? !any_shm : (any_shm || all);
}

std::string read_boot_id() {
  std::string id;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {0};
    if (std::fgets(buf, sizeof buf, f)) id = buf;
    std::fclose(f);
    while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  }
  return id;
}

Mapping::~Mapping() {
  if (base) munmap(base, length);
}

// The last-level cache as this CPU sees it: sysfs first, since in a VM sysconf can report the
// host's total, many times what the guest's cores share.
static size_t llc_bytes() {
  for (int i = 3; i >= 2; --i) {
    std::string base = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    FILE* f = std::fopen((base + "size").c_str(), "r");
    if (!f) continue;
    unsigned long v = 0;
    char unit = 0;
    int got = std::fscanf(f, "%lu%c", &v, &unit);
    std::fclose(f);
    if (got >= 1 && v > 0) {
      size_t b = v;
      if (unit == 'K') b <<= 10;
      else if (unit == 'M') b <<= 20;
      return b;
    }
  }
  long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 > 0 ? size_t(l3) : size_t(32) << 20;
}

// A same-host copy is read next by the peer, not by this CPU. When it is too large to stay in
// the last-level cache anyway, non-temporal stores write it to memory without first reading
// every destination line (a third of a cached copy's memory traffic) and without evicting the
// reader's working set, which makes large copies faster than glibc's memcpy. Smaller copies
// stay cached: the peer then reads them from the last-level cache, faster than a streamed copy
// reaches memory. docs/benchmarks.md ("Figures behind the core's constants") has the figures.
static size_t stream_threshold() {
  static const size_t t = std::max(llc_bytes() / 2, size_t(4) << 20);
  return t;
}

// Callers fence before publishing a flag (non-temporal stores are weakly ordered).
static void bulk_copy(void* dst, const void* src, size_t n, bool stream) {
#if defined(__x86_64__)
  if (stream) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t body = n & ~size_t(63);
    auto* D = reinterpret_cast<__m128i*>(d);
    auto* S = reinterpret_cast<const __m128i*>(s);
    for (size_t i = 0; i < body / 16; i += 4) {
      __m128i a = _mm_loadu_si128(S + i), b = _mm_loadu_si128(S + i + 1);
      __m128i c = _mm_loadu_si128(S + i + 2), e = _mm_loadu_si128(S + i + 3);
      _mm_stream_si128(D + i, a);
      _mm_stream_si128(D + i + 1, b);
      _mm_stream_si128(D + i + 2, c);
      _mm_stream_si128(D + i + 3, e);
    }
    std::memcpy(d + body, s + body, n - body);
    _mm_sfence();
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

struct CopyPool::Batch {
  std::mutex m;
  std::condition_variable cv;
  int left = 0;
};

CopyPool::CopyPool(int helpers) {
  for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { loop(); });
}

CopyPool::~CopyPool() {
  {
    std::lock_guard<std::mutex> lk(m_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void CopyPool::loop() {
  for (;;) {
    Part p;
    {
      std::unique_lock<std::mutex> lk(m_);
      cv_.wait(lk, [this] { return stop_ || !q_.empty(); });
      if (q_.empty()) return;
      p = q_.back();
      q_.pop_back();
    }
    bulk_copy(p.dst, p.src, p.n, p.stream);
    // Non-temporal stores are not ordered by the mutex's release: fence before signalling.
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    std::lock_guard<std::mutex> lk(p.batch->m);
    if (--p.batch->left == 0) p.batch->cv.notify_all();
  }
}

void CopyPool::copy(void* dst, const void* src, size_t n) {
  constexpr size_t kMinSplit = size_t(8) << 20;  // below this, handing off costs more than it saves
  size_t parts = threads_.size() + 1;
  bool stream = n >= stream_threshold();
  if (parts == 1 || n < kMinSplit) {
    bulk_copy(dst, src, n, stream);
    return;
  }
  size_t chunk = (n / parts + 4095) & ~size_t(4095);
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  Batch b;
  {
    std::lock_guard<std::mutex> lk(m_);
    for (size_t off = chunk; off < n; off += chunk) {
      q_.push_back(Part{d + off, s + off, std::min(chunk, n - off), stream, &b});
      ++b.left;
    }
  }
  cv_.notify_all();
  bulk_copy(d, s, std::min(chunk, n), stream);
  std::unique_lock<std::mutex> lk(b.m);
  b.cv.wait(lk, [&b] { return b.left == 0; });
}

// A copy into or out of a same-host peer's mapped region. Large memcpys may use non-temporal
// stores, which x86 does not order with later stores; the fence makes the data visible before
// anything posted after this copy (such as a flag). An aligned 8-byte copy is one atomic store,
// so a peer polling a flag word never sees it torn.
void Device::copy_mapped(void* dst, const void* src, size_t n) {
  if (n == 8 && (reinterpret_cast<uintptr_t>(dst) & 7) == 0 &&
      (reinterpret_cast<uintptr_t>(src) & 7) == 0) {
    __atomic_store_n(static_cast<uint64_t*>(dst),
                     __atomic_load_n(static_cast<const uint64_t*>(src), __ATOMIC_RELAXED),
                     __ATOMIC_SEQ_CST);
    return;
  }
  copier_->copy(dst, src, n);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

std::shared_ptr<Mapping> Device::map_remote(const RemoteRegion& r) {
  if (!map_enabled_ || !r.shared || r.boot_id != boot_id_) return nullptr;
  if (revoked(r.owner_uuid, r.region_id)) return nullptr;
  auto key = std::make_pair(r.owner_uuid, r.region_id);
  std::lock_guard<std::mutex> lk(maps_m_);
  auto it = maps_.find(key);
  if (it != maps_.end()) return it->second;
  // Same boot, but possibly another PID namespace or a reused pid: the file must be the
  // owner's memfd (device and inode from the authenticated descriptor), or we do not map it.
  std::shared_ptr<Mapping> m;
  std::string path = "/proc/" + std::to_string(r.pid) + "/fd/" + std::to_string(r.fd);
  int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd >= 0) {
    struct stat st {};
    long page = sysconf(_SC_PAGESIZE);
    size_t len = (r.length + page - 1) / page * page;
    if (fstat(fd, &st) == 0 && uint64_t(st.st_dev) == r.st_dev && uint64_t(st.st_ino) == r.st_ino &&
        uint64_t(st.st_size) >= len) {
      void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
      if (p != MAP_FAILED) {
        m = std::make_shared<Mapping>();
        m->base = p;
        m->length = len;
      }
    }
    ::close(fd);
  }
  maps_[key] = m;
  return m;
}

void Device::unmap_remote(uint64_t owner, uint64_t region_id) {
  std::shared_ptr<Mapping> m;  // unmapped when the last copy using it is done
  std::lock_guard<std::mutex> lk(maps_m_);
  auto it = maps_.find({owner, region_id});
  if (it == maps_.end()) return;
  m = std::move(it->second);
  maps_.erase(it);
}

}  // namespace rdmaflow
