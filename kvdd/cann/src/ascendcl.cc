// kvdd's simulated CANN root: libascendcl.so, the ACL subset of include/acl/acl.h.
//
// Written by the kvdd project from CANN's public ACL documentation (function names, signatures,
// enumerator values, return codes); no vendor code.  Device memory is host memory: aclrtMalloc
// returns page-aligned host memory that the simulator registers and moves like any other, every
// copy kind is a memcpy, aclrtMemcpyAsync completes before it returns.  A context is bookkeeping
// (a device id); each thread has a current context as on CANN, set by aclrtSetDevice,
// aclrtCreateContext, aclrtSetCurrentContext, or by a successful LlmDataDist::Initialize of
// libllm_datadist.so (device `llm.DeviceId`, through kvdd_acl_llm_set_device below).  Calls that
// need a device (malloc, memcpy, memset, stream creation) fail with ACL_ERROR_RT_CONTEXT_NULL on a
// thread without one.  aclInit is not required (LLM-DataDist programs do not call it).
//
// aclrtMalloc's memory is a sealed memfd mapped MAP_SHARED (plain aligned memory when memfd_create
// fails), so that a simulator peer process on this host can map it (kvdd.empty's memory, found
// through kvdd_acl_shared_memory): same-host transfers of C++ programs copy through a mapping.
// A forked child shares these pages (CANN does not support using device memory after fork).
//
// Not part of CANN's API, used by libllm_datadist.so of the same root:
//   extern "C" void kvdd_acl_llm_set_device(int32_t device_id);
//   extern "C" void kvdd_acl_record_error(const char *message);
// and by the simulator in a process that has this library loaded (kvdd/shm.py):
//   extern "C" int kvdd_acl_shared_memory(uintptr_t addr, uintptr_t *base, uint64_t *size,
//                                        int *fd, uint64_t *ino);
#include "acl/acl.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>

#define KVDD_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

struct Context {
  int32_t device_id;
  bool is_default;  // the device's primary context (aclrtSetDevice)
};

struct Stream {
  Context *context;
};

std::mutex g_mutex;
bool g_initialized = false;
std::map<int32_t, int> *g_device_refs = nullptr;        // aclrtSetDevice count per device
std::map<int32_t, Context *> *g_default_ctx = nullptr;  // primary context per device
std::set<Context *> *g_contexts = nullptr;
std::set<Stream *> *g_streams = nullptr;
std::map<uintptr_t, size_t> *g_device_mem = nullptr;  // aclrtMalloc: start -> size

struct SharedBlock {  // an aclrtMalloc block in a memfd: its mapping and file
  size_t mapped;      // bytes mapped (the file's size: the request rounded up to a page)
  int fd;
  uint64_t ino;
};
std::map<uintptr_t, SharedBlock> *g_device_shared = nullptr;  // start -> its memfd
std::map<uintptr_t, size_t> *g_host_mem = nullptr;    // aclrtMallocHost: start -> size

thread_local Context *t_current = nullptr;
thread_local std::string t_pending_error;  // messages not yet read, newest first
thread_local std::string t_returned_error;  // what the last aclGetRecentErrMsg returned

// The globals are never destroyed, so ACL calls from static destructors stay safe.
void EnsureState() {
  if (g_device_refs == nullptr) {
    g_device_refs = new std::map<int32_t, int>();
    g_default_ctx = new std::map<int32_t, Context *>();
    g_contexts = new std::set<Context *>();
    g_streams = new std::set<Stream *>();
    g_device_mem = new std::map<uintptr_t, size_t>();
    g_device_shared = new std::map<uintptr_t, SharedBlock>();
    g_host_mem = new std::map<uintptr_t, size_t>();
  }
}

// Messages stack up (newest on top) until aclGetRecentErrMsg reads them; a thread that never reads
// them (kvdd's Python binding) keeps only the newest kMaxPendingMessages.
constexpr int kMaxPendingMessages = 8;

void Record(const std::string &message) {
  if (t_pending_error.empty()) {
    t_pending_error = message;
    return;
  }
  std::string stacked = message + "\n" + t_pending_error;
  size_t pos = 0;
  for (int kept = 0; kept < kMaxPendingMessages && pos != std::string::npos; ++kept) {
    pos = stacked.find('\n', pos == 0 ? 0 : pos + 1);
  }
  if (pos != std::string::npos) {
    stacked.resize(pos);
  }
  t_pending_error.swap(stacked);
}

aclError Fail(aclError code, const std::string &message) {
  Record("kvdd simulated ACL: " + message + " (error " + std::to_string(code) + ")");
  return code;
}

int32_t DeviceCount() {
  const char *env = std::getenv("KVDD_CANN_DEVICE_COUNT");
  if (env != nullptr && *env != '\0') {
    char *end = nullptr;
    long v = std::strtol(env, &end, 10);
    if (end != nullptr && *end == '\0' && v > 0 && v <= 1024) {
      return static_cast<int32_t>(v);
    }
  }
  return 16;
}

size_t PageSize() {
  long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? static_cast<size_t>(p) : 4096U;
}

// `bytes` (a multiple of the page) in a new memfd sealed against any change of size, mapped
// MAP_SHARED read-write; nullptr when the kernel refuses any step (the caller falls back).
void *AllocShared(size_t bytes, SharedBlock *block) {
  int fd = memfd_create("kvdd-device", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return nullptr;
  }
  struct stat st {};
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0 || fstat(fd, &st) != 0) {
    close(fd);
    return nullptr;
  }
  void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return nullptr;
  }
  *block = SharedBlock{bytes, fd, static_cast<uint64_t>(st.st_ino)};
  return p;
}

bool ValidPolicy(uint32_t policy) {
  const uint32_t flags = ACL_MEM_TYPE_LOW_BAND_WIDTH | ACL_MEM_TYPE_HIGH_BAND_WIDTH |
                         ACL_MEM_ACCESS_USER_SPACE_READONLY;
  uint32_t base = policy & ~flags;
  if ((policy & ACL_MEM_TYPE_LOW_BAND_WIDTH) != 0 && (policy & ACL_MEM_TYPE_HIGH_BAND_WIDTH) != 0) {
    return false;
  }
  return base <= ACL_MEM_MALLOC_HUGE1G_ONLY_P2P;
}

// The aclrtMalloc block containing [p, p + n), or false.  g_mutex held.
bool InDeviceMemory(const void *p, size_t n) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = g_device_mem->upper_bound(a);
  if (it == g_device_mem->begin()) {
    return false;
  }
  --it;
  return a >= it->first && n <= it->second && a - it->first <= it->second - n;
}

Context *NewDefaultContext(int32_t device_id) {
  auto it = g_default_ctx->find(device_id);
  if (it != g_default_ctx->end()) {
    return it->second;
  }
  Context *ctx = new Context{device_id, true};
  (*g_default_ctx)[device_id] = ctx;
  g_contexts->insert(ctx);
  return ctx;
}

aclError CopyChecked(void *dst, size_t dest_max, const void *src, size_t count, int kind,
                     const char *who) {
  if (dst == nullptr || src == nullptr) {
    return Fail(ACL_ERROR_INVALID_PARAM, std::string(who) + ": dst and src must not be null");
  }
  if (count > dest_max) {
    return Fail(ACL_ERROR_INVALID_PARAM, std::string(who) + ": count " + std::to_string(count) +
                                             " exceeds destMax " + std::to_string(dest_max));
  }
  if (kind < ACL_MEMCPY_HOST_TO_HOST || kind > ACL_MEMCPY_INTER_DEVICE_TO_DEVICE) {
    return Fail(ACL_ERROR_INVALID_PARAM, std::string(who) + ": invalid aclrtMemcpyKind " +
                                             std::to_string(kind));
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    EnsureState();
    if (t_current == nullptr) {
      return Fail(ACL_ERROR_RT_CONTEXT_NULL,
                  std::string(who) + ": no current context on this thread (call aclrtSetDevice, "
                                     "or LlmDataDist::Initialize, first)");
    }
    const bool dst_device = kind == ACL_MEMCPY_HOST_TO_DEVICE || kind == ACL_MEMCPY_DEVICE_TO_DEVICE ||
                            kind == ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE ||
                            kind == ACL_MEMCPY_INNER_DEVICE_TO_DEVICE ||
                            kind == ACL_MEMCPY_INTER_DEVICE_TO_DEVICE;
    const bool src_device = kind == ACL_MEMCPY_DEVICE_TO_HOST || kind == ACL_MEMCPY_DEVICE_TO_DEVICE ||
                            kind == ACL_MEMCPY_INNER_DEVICE_TO_DEVICE ||
                            kind == ACL_MEMCPY_INTER_DEVICE_TO_DEVICE;
    if (count > 0 && dst_device && !InDeviceMemory(dst, count)) {
      return Fail(ACL_ERROR_RT_PARAM_INVALID,
                  std::string(who) + ": the destination range is not inside one aclrtMalloc block");
    }
    if (count > 0 && src_device && !InDeviceMemory(src, count)) {
      return Fail(ACL_ERROR_RT_PARAM_INVALID,
                  std::string(who) + ": the source range is not inside one aclrtMalloc block");
    }
  }
  if (count > 0) {
    std::memmove(dst, src, count);
  }
  return ACL_SUCCESS;
}

}  // namespace

KVDD_EXPORT void kvdd_acl_llm_set_device(int32_t device_id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  EnsureState();
  (*g_device_refs)[device_id] += 1;
  t_current = NewDefaultContext(device_id);
}

KVDD_EXPORT void kvdd_acl_record_error(const char *message) {
  if (message != nullptr && *message != '\0') {
    Record(message);
  }
}

KVDD_EXPORT aclError aclInit(const char *configPath) {
  (void)configPath;  // no configuration is read
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_initialized) {
    return Fail(ACL_ERROR_REPEAT_INITIALIZE, "aclInit: already initialized");
  }
  g_initialized = true;
  return ACL_SUCCESS;
}

KVDD_EXPORT aclError aclFinalize(void) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_initialized) {
    return Fail(ACL_ERROR_UNINITIALIZE, "aclFinalize: aclInit was not called");
  }
  g_initialized = false;
  return ACL_SUCCESS;
}

KVDD_EXPORT aclError aclrtSetDevice(int32_t deviceId) {
  if (deviceId < 0 || deviceId >= DeviceCount()) {
    return Fail(ACL_ERROR_RT_INVALID_DEVICEID,
                "aclrtSetDevice: device " + std::to_string(deviceId) + " does not exist (" +
                    std::to_string(DeviceCount()) + " simulated devices, KVDD_CANN_DEVICE_COUNT)");
  }
  kvdd_acl_llm_set_device(deviceId);
  return ACL_SUCCESS;
}

KVDD_EXPORT aclError aclrtResetDevice(int32_t deviceId) {
  std::lock_guard<std::mutex> lock(g_mutex);
  EnsureState();
  auto it = g_device_refs->find(deviceId);
  if (deviceId < 0 || deviceId >= DeviceCount() || it == g_device_refs->end() || it->second <= 0) {
    return Fail(ACL_ERROR_RT_INVALID_DEVICEID,
                "aclrtResetDevice: device " + std::to_string(deviceId) + " was not set");
  }
  it->second -= 1;
  if (t_current != nullptr && t_current->is_default && t_current->device_id == deviceId) {
    t_current = nullptr;
  }
  return ACL_SUCCESS;
}

KVDD_EXPORT aclError aclrtGetDevice(int32_t *deviceId) {
  if (deviceId == nullptr) {
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtGetDevice: deviceId must not be null");
  }
  if (t_current == nullptr) {
    return Fail(ACL_ERROR_RT_CONTEXT_NULL, "aclrtGetDevice: no current context on this thread");
  }
  *deviceId = t_current->device_id;
  return ACL_SUCCESS;
}

KVDD_EXPORT aclError aclrtCreateContext(aclrtContext *context, int32_t deviceId) {
  if (context == nullptr) {
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtCreateContext: context must not be null");
  }
  if (deviceId < 0 || deviceId >= DeviceCount()) {
    return Fail(ACL_ERROR_RT_INVALID_DEVICEID,
                "aclrtCreateContext: device " + std::to_string(deviceId) + " does not exist");
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  EnsureState();
  Context *ctx = new Context{deviceId, false};
  g_contexts->insert(ctx);
  t_current = ctx;  // a new context becomes the thread's current one
  *context = ctx;
  return ACL_SUCCESS;
}

KVDD_EXPORT aclError aclrtDestroyContext(aclrtContext context) {
  std::lock_guard<std::mutex> lock(g_mutex);
  EnsureState();
  Context *ctx = static_cast<Context *>(context);
  if (ctx == nullptr || g_contexts->count(ctx) == 0 || ctx->is_default) {
    return Fail(ACL_ERROR_INVALID_PARAM,
                "aclrtDestroyContext: not a context created by aclrtCreateContext");
  }
  g_contexts->erase(ctx);
  if (t_current == ctx) {
    t_current = nullptr;
  }
  delete ctx;
  return ACL_SUCCESS;
}

KVDD_EXPORT aclError aclrtGetCurrentContext(aclrtContext *context) {
  if (context == nullptr) {
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtGetCurrentContext: context must not be null");
  }
  if (t_current == nullptr) {
    return Fail(ACL_ERROR_RT_CONTEXT_NULL, "aclrtGetCurrentContext: no current context");
  }
  *context = t_current;
  return ACL_SUCCESS;
}

KVDD_EXPORT aclError aclrtSetCurrentContext(aclrtContext context) {
  std::lock_guard<std::mutex> lock(g_mutex);
  EnsureState();
  Context *ctx = static_cast<Context *>(context);
  if (ctx == nullptr || g_contexts->count(ctx) == 0) {
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtSetCurrentContext: unknown context");
  }
  t_current = ctx;
  return ACL_SUCCESS;
}

KVDD_EXPORT aclError aclrtCreateStream(aclrtStream *stream) {
  if (stream == nullptr) {
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtCreateStream: stream must not be null");
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  EnsureState();
  if (t_current == nullptr) {
    return Fail(ACL_ERROR_RT_CONTEXT_NULL, "aclrtCreateStream: no current context on this thread");
  }
  Stream *s = new Stream{t_current};
  g_streams->insert(s);
  *stream = s;
  return ACL_SUCCESS;
}

KVDD_EXPORT aclError aclrtDestroyStream(aclrtStream stream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  EnsureState();
  Stream *s = static_cast<Stream *>(stream);
  if (s == nullptr || g_streams->erase(s) == 0) {
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtDestroyStream: unknown stream");
  }
  delete s;
  return ACL_SUCCESS;
}

KVDD_EXPORT aclError aclrtSynchronizeStream(aclrtStream stream) {
  std::lock_guard<std::mutex> lock(g_mutex);
  EnsureState();
  Stream *s = static_cast<Stream *>(stream);
  if (s != nullptr && g_streams->count(s) == 0) {  // null: the default stream
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtSynchronizeStream: unknown stream");
  }
  return ACL_SUCCESS;  // every operation completed when it returned
}

KVDD_EXPORT aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
  if (devPtr == nullptr) {
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtMalloc: devPtr must not be null");
  }
  if (size == 0) {
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtMalloc: size must be > 0");
  }
  if (!ValidPolicy(static_cast<uint32_t>(policy))) {
    return Fail(ACL_ERROR_INVALID_PARAM,
                "aclrtMalloc: invalid aclrtMemMallocPolicy " + std::to_string(policy));
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    EnsureState();
    if (t_current == nullptr) {
      return Fail(ACL_ERROR_RT_CONTEXT_NULL,
                  "aclrtMalloc: no current context on this thread (call aclrtSetDevice, or "
                  "LlmDataDist::Initialize, first)");
    }
  }
  const size_t page = PageSize();
  if (size > SIZE_MAX - page) {
    return Fail(ACL_ERROR_RT_MEMORY_ALLOCATION, "aclrtMalloc: size too large");
  }
  const size_t bytes = (size + page - 1) / page * page;
  SharedBlock block{0, -1, 0};
  void *p = AllocShared(bytes, &block);
  if (p == nullptr && (posix_memalign(&p, page, bytes) != 0 || p == nullptr)) {
    return Fail(ACL_ERROR_RT_MEMORY_ALLOCATION,
                "aclrtMalloc: out of memory for " + std::to_string(size) + " bytes");
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  (*g_device_mem)[reinterpret_cast<uintptr_t>(p)] = size;
  if (block.fd >= 0) {
    (*g_device_shared)[reinterpret_cast<uintptr_t>(p)] = block;
  }
  *devPtr = p;
  return ACL_SUCCESS;
}

KVDD_EXPORT aclError aclrtFree(void *devPtr) {
  if (devPtr == nullptr) {
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtFree: devPtr must not be null");
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    EnsureState();
    if (g_device_mem->erase(reinterpret_cast<uintptr_t>(devPtr)) == 0) {
      return Fail(ACL_ERROR_RT_PARAM_INVALID, "aclrtFree: not an address returned by aclrtMalloc");
    }
    auto it = g_device_shared->find(reinterpret_cast<uintptr_t>(devPtr));
    if (it != g_device_shared->end()) {
      munmap(devPtr, it->second.mapped);
      close(it->second.fd);
      g_device_shared->erase(it);
      return ACL_SUCCESS;
    }
  }
  std::free(devPtr);
  return ACL_SUCCESS;
}

// The memfd of the aclrtMalloc block holding `addr`: 1 and its start, mapped bytes, fd and inode;
// 0 for any other address.
KVDD_EXPORT int kvdd_acl_shared_memory(uintptr_t addr, uintptr_t *base, uint64_t *size, int *fd,
                                       uint64_t *ino) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_device_shared == nullptr || base == nullptr || size == nullptr || fd == nullptr ||
      ino == nullptr) {
    return 0;
  }
  auto it = g_device_shared->upper_bound(addr);
  if (it == g_device_shared->begin()) {
    return 0;
  }
  --it;
  if (addr - it->first >= it->second.mapped) {
    return 0;
  }
  *base = it->first;
  *size = it->second.mapped;
  *fd = it->second.fd;
  *ino = it->second.ino;
  return 1;
}

KVDD_EXPORT aclError aclrtMallocHost(void **hostPtr, size_t size) {
  if (hostPtr == nullptr) {
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtMallocHost: hostPtr must not be null");
  }
  if (size == 0) {
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtMallocHost: size must be > 0");
  }
  const size_t page = PageSize();
  void *p = nullptr;
  if (size > SIZE_MAX - page ||
      posix_memalign(&p, page, (size + page - 1) / page * page) != 0 || p == nullptr) {
    return Fail(ACL_ERROR_RT_MEMORY_ALLOCATION,
                "aclrtMallocHost: out of memory for " + std::to_string(size) + " bytes");
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  EnsureState();
  (*g_host_mem)[reinterpret_cast<uintptr_t>(p)] = size;
  *hostPtr = p;
  return ACL_SUCCESS;
}

KVDD_EXPORT aclError aclrtFreeHost(void *hostPtr) {
  if (hostPtr == nullptr) {
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtFreeHost: hostPtr must not be null");
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    EnsureState();
    if (g_host_mem->erase(reinterpret_cast<uintptr_t>(hostPtr)) == 0) {
      return Fail(ACL_ERROR_RT_PARAM_INVALID,
                  "aclrtFreeHost: not an address returned by aclrtMallocHost");
    }
  }
  std::free(hostPtr);
  return ACL_SUCCESS;
}

KVDD_EXPORT aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
                                 aclrtMemcpyKind kind) {
  return CopyChecked(dst, destMax, src, count, static_cast<int>(kind), "aclrtMemcpy");
}

KVDD_EXPORT aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                                      aclrtMemcpyKind kind, aclrtStream stream) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    EnsureState();
    Stream *s = static_cast<Stream *>(stream);
    if (s != nullptr && g_streams->count(s) == 0) {
      return Fail(ACL_ERROR_INVALID_PARAM, "aclrtMemcpyAsync: unknown stream");
    }
  }
  return CopyChecked(dst, destMax, src, count, static_cast<int>(kind), "aclrtMemcpyAsync");
}

KVDD_EXPORT aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count) {
  if (devPtr == nullptr) {
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtMemset: devPtr must not be null");
  }
  if (count > maxCount) {
    return Fail(ACL_ERROR_INVALID_PARAM, "aclrtMemset: count " + std::to_string(count) +
                                             " exceeds maxCount " + std::to_string(maxCount));
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    EnsureState();
    if (t_current == nullptr) {
      return Fail(ACL_ERROR_RT_CONTEXT_NULL, "aclrtMemset: no current context on this thread");
    }
    if (count > 0 && !InDeviceMemory(devPtr, count)) {
      return Fail(ACL_ERROR_RT_PARAM_INVALID,
                  "aclrtMemset: the range is not inside one aclrtMalloc block");
    }
  }
  std::memset(devPtr, value, count);
  return ACL_SUCCESS;
}

KVDD_EXPORT const char *aclGetRecentErrMsg(void) {
  if (t_pending_error.empty()) {
    return nullptr;
  }
  t_returned_error.swap(t_pending_error);  // "obtains and clears"
  t_pending_error.clear();
  return t_returned_error.c_str();
}
