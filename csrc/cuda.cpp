// GPU memory: the CUDA context of the threads that drive UCX workers. The core links no CUDA
// library: the driver (libcuda.so.1) is opened when GPU memory is first registered or a peer's
// GPU region is first used, so a host-only process never touches CUDA. UCX's CUDA transports
// call the driver on whichever thread drives the worker (a put's copy, an event query when the
// worker is armed, opening a peer's IPC handle when its remote key is unpacked) and fail, or
// crash, on a thread with no current context: every thread that drives a worker of a device
// that uses GPU memory makes that device's primary context current first (cuda_thread_context).
#include <dlfcn.h>

#include <cstring>
#include <map>
#include <mutex>

#include "internal.hpp"

namespace rdmaflow {

namespace {
using CUresult = int;
using CUdevice = int;
using CUcontext = void*;

using CUdeviceptr = unsigned long long;
struct CUipcMemHandle {
  char reserved[64];
};

struct Driver {
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*set_current)(CUcontext) = nullptr;
  CUresult (*address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*ipc_get)(CUipcMemHandle*, CUdeviceptr) = nullptr;
  CUresult (*ipc_open)(CUdeviceptr*, CUipcMemHandle, unsigned) = nullptr;
  std::string error;  // why the driver cannot be used; empty when it can
};

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
      d.error = std::string("the CUDA driver (libcuda.so.1) cannot be loaded: ") + dlerror();
      return;
    }
    d.init = reinterpret_cast<CUresult (*)(unsigned)>(dlsym(h, "cuInit"));
    d.device_get = reinterpret_cast<CUresult (*)(CUdevice*, int)>(dlsym(h, "cuDeviceGet"));
    d.primary_retain =
        reinterpret_cast<CUresult (*)(CUcontext*, CUdevice)>(dlsym(h, "cuDevicePrimaryCtxRetain"));
    d.set_current = reinterpret_cast<CUresult (*)(CUcontext)>(dlsym(h, "cuCtxSetCurrent"));
    d.address_range = reinterpret_cast<CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr)>(
        dlsym(h, "cuMemGetAddressRange_v2"));
    d.ipc_get = reinterpret_cast<CUresult (*)(CUipcMemHandle*, CUdeviceptr)>(dlsym(h, "cuIpcGetMemHandle"));
    d.ipc_open = reinterpret_cast<CUresult (*)(CUdeviceptr*, CUipcMemHandle, unsigned)>(
        dlsym(h, "cuIpcOpenMemHandle_v2"));
    if (!d.init || !d.device_get || !d.primary_retain || !d.set_current)
      d.error = "the CUDA driver lacks cuInit/cuDeviceGet/cuDevicePrimaryCtxRetain/cuCtxSetCurrent";
    else if (CUresult r = d.init(0))
      d.error = "cuInit failed with CUDA error " + std::to_string(r);
  });
  return d;
}

// Retains ordinal's primary context (the one PyTorch and UCX use) and makes it current here.
void make_current(int ordinal) {
  thread_local int current = -1;
  if (current == ordinal) return;
  const Driver& d = driver();
  if (!d.error.empty()) throw Error(ErrorKind::Invalid, "GPU memory: " + d.error);
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUresult r = d.device_get(&dev, ordinal);
  if (!r) r = d.primary_retain(&ctx, dev);
  if (!r) r = d.set_current(ctx);
  if (r)
    throw Error(ErrorKind::Invalid, "GPU memory: cannot make CUDA device " + std::to_string(ordinal) +
                                        "'s context current (CUDA error " + std::to_string(r) + ")");
  current = ordinal;
}
}  // namespace

std::pair<std::string, uint64_t> cuda_ipc_export(uintptr_t ptr, int ordinal) {
  make_current(ordinal);
  const Driver& d = driver();
  if (!d.address_range || !d.ipc_get) throw Error(ErrorKind::Invalid, "GPU memory: the driver has no CUDA IPC");
  CUdeviceptr base = 0;
  size_t size = 0;
  CUipcMemHandle h{};
  CUresult r = d.address_range(&base, &size, CUdeviceptr(ptr));
  if (!r) r = d.ipc_get(&h, base);
  if (r)
    throw Error(ErrorKind::Invalid,
                "GPU memory: no CUDA IPC handle for this allocation (CUDA error " + std::to_string(r) + ")");
  return {std::string(h.reserved, sizeof h.reserved), uint64_t(ptr - base)};
}

uintptr_t cuda_ipc_open(const std::string& handle, int ordinal) {
  static std::mutex m;
  static std::map<std::pair<std::string, int>, uintptr_t> opened;  // a handle opens once per process
  if (handle.size() != sizeof(CUipcMemHandle)) throw Error(ErrorKind::Invalid, "malformed CUDA IPC handle");
  make_current(ordinal);
  std::lock_guard<std::mutex> lk(m);
  auto it = opened.find({handle, ordinal});
  if (it != opened.end()) return it->second;
  const Driver& d = driver();
  if (!d.ipc_open) throw Error(ErrorKind::Invalid, "GPU memory: the driver has no CUDA IPC");
  CUipcMemHandle h{};
  std::memcpy(h.reserved, handle.data(), sizeof h.reserved);
  CUdeviceptr p = 0;
  if (CUresult r = d.ipc_open(&p, h, 1 /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */))
    throw Error(ErrorKind::Invalid, "GPU memory: cannot open the peer's CUDA IPC handle (CUDA error " +
                                        std::to_string(r) + ")");
  opened[{handle, ordinal}] = uintptr_t(p);
  return uintptr_t(p);
}

bool Device::cuda_supported() const {
  ucp_context_attr_t a{};
  a.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  return ucp_context_query(ctx_, &a) == UCS_OK && (a.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA));
}

void Device::use_cuda_device(int ordinal) {
  int none = -1;
  cuda_ordinal_.compare_exchange_strong(none, ordinal);  // the first GPU this device uses
  make_current(cuda_ordinal_.load());
}

void Device::cuda_thread_context() {
  int o = cuda_ordinal_.load(std::memory_order_relaxed);
  if (o < 0) return;
  try {
    make_current(o);
  } catch (const Error&) {
    // use_cuda_device made it current on the registering thread, so the driver works; a thread
    // that fails here leaves UCX to report the failed operation.
  }
}

}  // namespace rdmaflow
