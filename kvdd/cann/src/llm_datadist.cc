// kvdd's simulated CANN root: libllm_datadist.so, llm_datadist::LlmDataDist backed by kvdd's
// simulator engine.
//
// Written by the kvdd project (not derived from vendor code).  This library has no Python symbol:
// on the first construction it finds the simulator (once per process):
//   * in a Python process (Py_IsInitialized() visible and true: kvdd's native binding), it loads
//     libkvdd_simbridge.so, which calls kvdd.sim.engine in that interpreter;
//   * in a plain C++ process, it loads the libpython recorded in the root's marker (RTLD_GLOBAL),
//     starts the interpreter of the kvdd installation that wrote the root (libkvdd_pyembed.so:
//     its venv, no PYTHON* environment, no signal handlers) once, releases the GIL, then loads
//     libkvdd_simbridge.so.
// In both worlds kvdd.cann.root_problem() then checks that the root belongs to the running kvdd
// (version and sources); a stale root is refused.  When anything fails, the constructor prints
// one clear message on stderr and every method returns LLM_FAILED (the reason is also the
// calling thread's aclGetRecentErrMsg()); it never crashes.
//
// KVDD_CANN_STRICT_RESERVED=1 (read at every call): kvdd's lint, stricter than CANN.  Every struct
// argument's reserved bytes must be zero, as code that value-initializes its structs guarantees;
// a non-zero byte makes the call return LLM_FAILED with the reason as the call's error detail,
// before the simulator sees it.  Real CANN accepts non-zero reserved bytes (the vendor's own C++
// samples leave stack garbage there and run on hardware), so this mode is off by default.
//
// After a successful Initialize, llm.DeviceId is the calling thread's current ACL device
// (libascendcl.so of the same root), as CANN's Initialize sets the device.  The explanation of
// each failed call is recorded for aclGetRecentErrMsg() on the calling thread.
//
// Hooks for kvdd's own tests (never present in a real CANN install; none changes what a call does
// unless kvdd's test suite asks for it):
//   * extern "C" int kvdd_testdouble_listen_port(void *llm_datadist): the port the simulator
//     bound; -1 not listening, -2 on error or unknown instance.
//   * extern "C" int kvdd_testdouble_cxx11_abi(void): the _GLIBCXX_USE_CXX11_ABI it was built with.
//   * extern "C" const char *kvdd_testdouble_last_error(void): why the calling thread's last
//     LlmDataDist call failed ("" after a success or without an explanation); valid until the
//     thread's next call.
//   * Only when KVDD_TESTDOUBLE_THROW_HOOK=1 is set in the environment at construction (kvdd's
//     test suite sets it, in the tests that need it; nothing else should): instances constructed
//     with one of the kThrow* cluster ids below throw a C++ exception from every method except the
//     constructor, the destructor and Finalize.  Without it those ids are ordinary cluster ids.
#include "llm_datadist/llm_datadist.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine.h"

#define KVDD_EXPORT extern "C" __attribute__((visibility("default")))

extern "C" void kvdd_acl_llm_set_device(int32_t device_id);  // libascendcl.so of this root
extern "C" void kvdd_acl_record_error(const char *message);

namespace llm_datadist {
namespace {

constexpr uint64_t kThrowRuntimeErrorClusterId = 0xFFFFFFFFFFFFFF00ULL;
constexpr uint64_t kThrowBadAllocClusterId = 0xFFFFFFFFFFFFFF01ULL;
constexpr uint64_t kThrowNonStdClusterId = 0xFFFFFFFFFFFFFF02ULL;
constexpr const char kMarkerName[] = "kvdd_simulated_root";
constexpr const char kPrefix[] = "kvdd simulated CANN root: ";

thread_local std::string t_last_error;

void SetError(const std::string &message) {
  t_last_error = message;
  kvdd_acl_record_error(message.c_str());
}

// Whether kvdd's test suite armed the exception hook (KVDD_TESTDOUBLE_THROW_HOOK=1).
bool ThrowHookArmed() {
  const char *v = std::getenv("KVDD_TESTDOUBLE_THROW_HOOK");
  return v != nullptr && v[0] == '1' && v[1] == '\0';
}

void MaybeThrowInjected(bool armed, uint64_t cluster_id, const char *method) {
  if (!armed) {
    return;
  }
  switch (cluster_id) {
    case kThrowRuntimeErrorClusterId:
      throw std::runtime_error(std::string("kvdd test double: injected C++ exception in ") + method);
    case kThrowBadAllocClusterId:
      throw std::bad_alloc();
    case kThrowNonStdClusterId:
      throw 42;  // not derived from std::exception
    default:
      break;
  }
}

// ---- finding the simulator (once per process) ---------------------------------------------------

struct Runtime {
  kvdd_bridge_create_fn create = nullptr;
  std::string error;  // why create is null
};

std::string Dirname(const std::string &path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

std::map<std::string, std::string> ReadMarker(const std::string &path) {
  std::map<std::string, std::string> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos && !line.empty() && line[0] != '#') {
      out[line.substr(0, eq)] = line.substr(eq + 1);
    }
  }
  return out;
}

std::string LoadRuntime(Runtime &rt) {
  Dl_info info;
  if (dladdr(reinterpret_cast<void *>(&ReadMarker), &info) == 0 || info.dli_fname == nullptr) {
    return "cannot find the path of libllm_datadist.so (dladdr failed)";
  }
  const std::string lib_dir = Dirname(info.dli_fname);
  const std::string root = Dirname(lib_dir);
  const std::string marker_path = root + "/" + kMarkerName;
  std::map<std::string, std::string> marker = ReadMarker(marker_path);
  if (marker.empty()) {
    return "no marker " + marker_path + ": this libllm_datadist.so is not inside a root written "
           "by `kvdd cann-root`";
  }
  const std::string rewrite = " Re-write the root with `kvdd cann-root " + root +
                              "` using the Python environment where kvdd is installed.";

  typedef int (*is_initialized_fn)(void);
  auto is_initialized = reinterpret_cast<is_initialized_fn>(dlsym(RTLD_DEFAULT, "Py_IsInitialized"));
  const bool in_python = is_initialized != nullptr && is_initialized() != 0;
  if (!in_python) {
    const std::string &libpython = marker["libpython"];
    const std::string &python = marker["python"];
    if (libpython.empty()) {
      return "the Python that wrote this root (" + python + ") has no shared libpython (it was "
             "built without --enable-shared), so a C++ program cannot start it. Write the root "
             "with a Python that has one (most distribution and pyenv --enable-shared builds do)";
    }
    if (access(python.c_str(), X_OK) != 0) {
      return "stale root: the Python that wrote it (" + python + ") no longer exists." + rewrite;
    }
    if (dlopen(libpython.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      const char *why = dlerror();
      return "stale root: cannot load " + libpython + " (" + (why ? why : "?") + ")." + rewrite;
    }
    void *embed = dlopen((lib_dir + "/libkvdd_pyembed.so").c_str(), RTLD_NOW | RTLD_LOCAL);
    if (embed == nullptr) {
      const char *why = dlerror();
      return std::string("cannot load libkvdd_pyembed.so (") + (why ? why : "?") + ")." + rewrite;
    }
    auto start = reinterpret_cast<kvdd_pyembed_start_fn>(dlsym(embed, "kvdd_pyembed_start"));
    char error[2048] = {0};
    if (start == nullptr || start(python.c_str(), error, sizeof error) != 0) {
      return std::string(error[0] != '\0' ? error : "libkvdd_pyembed.so is incomplete") + "." +
             rewrite;
    }
  }
  void *bridge = dlopen((lib_dir + "/libkvdd_simbridge.so").c_str(), RTLD_NOW | RTLD_LOCAL);
  if (bridge == nullptr) {
    const char *why = dlerror();
    return std::string("cannot load libkvdd_simbridge.so (") + (why ? why : "?") + ")." + rewrite;
  }
  auto check = reinterpret_cast<kvdd_bridge_check_root_fn>(dlsym(bridge, "kvdd_bridge_check_root"));
  auto create = reinterpret_cast<kvdd_bridge_create_fn>(dlsym(bridge, "kvdd_bridge_create"));
  if (check == nullptr || create == nullptr) {
    return "libkvdd_simbridge.so is incomplete." + rewrite;
  }
  char error[2048] = {0};
  if (check(root.c_str(), error, sizeof error) != 0) {
    return error;
  }
  rt.create = create;
  return "";
}

Runtime &GetRuntime() {
  static Runtime runtime;
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      runtime.error = LoadRuntime(runtime);
    } catch (const std::exception &exc) {
      runtime.error = exc.what();
    }
    if (!runtime.error.empty()) {
      runtime.create = nullptr;
    }
  });
  return runtime;
}

// ---- KVDD_CANN_STRICT_RESERVED ------------------------------------------------------------------

bool StrictReserved() {
  const char *v = std::getenv("KVDD_CANN_STRICT_RESERVED");
  return v != nullptr && v[0] == '1' && v[1] == '\0';
}

// "" when every byte is zero, else the explanation.
template <size_t N>
std::string CheckZero(const uint8_t (&bytes)[N], const char *type, const std::string &what) {
  for (size_t i = 0; i < N; ++i) {
    if (bytes[i] != 0) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", bytes[i]);
      return std::string("KVDD_CANN_STRICT_RESERVED=1: reserved byte ") + std::to_string(i) +
             " of " + what + " (" + type + ") is " + hex + ", not 0 (kvdd's lint, stricter than CANN, "
             "which accepts non-zero reserved bytes); value-initialize the struct (" + type +
             " x{}; or " + type + "()) so that its reserved bytes are zero";
    }
  }
  return "";
}

std::string Reserved(const IpInfo &v, const std::string &what) {
  return CheckZero(v.reserved, "IpInfo", what);
}
std::string Reserved(const ClusterInfo &v, const std::string &what) {
  std::string r = CheckZero(v.reserved, "ClusterInfo", what);
  for (size_t i = 0; r.empty() && i < v.local_ip_infos.size(); ++i) {
    r = Reserved(v.local_ip_infos[i], what + ".local_ip_infos[" + std::to_string(i) + "]");
  }
  for (size_t i = 0; r.empty() && i < v.remote_ip_infos.size(); ++i) {
    r = Reserved(v.remote_ip_infos[i], what + ".remote_ip_infos[" + std::to_string(i) + "]");
  }
  return r;
}
std::string Reserved(const CacheIndex &v, const std::string &what) {
  return CheckZero(v.reserved, "CacheIndex", what);
}
std::string Reserved(const CacheDesc &v, const std::string &what) {
  return CheckZero(v.reserved, "CacheDesc", what);
}
std::string Reserved(const Cache &v, const std::string &what) {
  std::string r = CheckZero(v.reserved, "Cache", what);
  return r.empty() ? Reserved(v.cache_desc, what + ".cache_desc") : r;
}
std::string Reserved(const KvCacheExtParam &v, const std::string &what) {
  return CheckZero(v.reserved, "KvCacheExtParam", what);
}
std::string Reserved(const RegisterCfg &v, const std::string &what) {
  return CheckZero(v.reserved, "RegisterCfg", what);
}
std::string Reserved(const std::vector<ClusterInfo> &v, const std::string &what) {
  for (size_t i = 0; i < v.size(); ++i) {
    std::string r = Reserved(v[i], what + "[" + std::to_string(i) + "]");
    if (!r.empty()) {
      return r;
    }
  }
  return "";
}

// The first non-zero reserved byte among the arguments, "" when none (or strict mode is off).
std::string StrictProblem(const char *) { return ""; }
template <typename T, typename... Rest>
std::string StrictProblem(const char *method, const char *name, const T &value,
                          const Rest &...rest) {
  std::string r = Reserved(value, std::string("argument ") + name + " of " + method);
  return r.empty() ? StrictProblem(method, rest...) : r;
}

class ListenPortSource {
 public:
  virtual ~ListenPortSource() = default;
  virtual int ListenPort() = 0;
};

std::mutex g_registry_mutex;
std::unordered_map<const void *, ListenPortSource *> *g_registry = nullptr;

}  // namespace

class LlmDataDist::LlmDataDistImpl : public ListenPortSource {
 public:
  LlmDataDistImpl(uint64_t cluster_id, LlmRole role)
      : cluster_id_(cluster_id), throw_hook_(ThrowHookArmed()) {
    Runtime &rt = GetRuntime();
    error_ = rt.error;
    if (rt.create != nullptr) {
      char error[2048] = {0};
      engine_.reset(rt.create(cluster_id, static_cast<int32_t>(role), error, sizeof error));
      if (engine_ == nullptr) {
        error_ = std::string("cannot create the simulator engine: ") + error;
      }
    }
    if (engine_ == nullptr) {
      error_ = kPrefix + error_;
      std::fprintf(stderr, "%s\n  Every LlmDataDist call of this instance returns LLM_FAILED.\n",
                   error_.c_str());
      std::fflush(stderr);
    }
  }

  int ListenPort() override {
    if (engine_ == nullptr) {
      return -2;
    }
    try {
      return engine_->ListenPort();
    } catch (...) {
      return -2;
    }
  }

  // Runs one forwarded call: injected exceptions, the missing engine, strict mode, then the
  // engine; records the explanation of a failure.
  template <typename Call>
  Status Run(const char *method, const std::string &strict_problem, Call &&call) {
    t_last_error.clear();
    MaybeThrowInjected(throw_hook_, cluster_id_, method);
    if (engine_ == nullptr) {
      SetError(error_);
      return LLM_FAILED;
    }
    if (!strict_problem.empty()) {
      SetError(strict_problem);
      return LLM_FAILED;
    }
    const Status status = call(*engine_);
    if (status != LLM_SUCCESS) {
      std::string detail = engine_->LastErrorDetail();
      SetError(detail.empty() ? std::string(method) + " failed with status " +
                                    std::to_string(status)
                              : detail);
    }
    return status;
  }

  template <typename... Args>
  static std::string Strict(const char *method, const Args &...args) {
    return StrictReserved() ? StrictProblem(method, args...) : std::string();
  }

  uint64_t cluster_id_;
  bool throw_hook_;
  std::unique_ptr<kvdd_cann::Engine> engine_;
  std::string error_;
};

LlmDataDist::LlmDataDist(uint64_t cluster_id, LlmRole role)
    : impl_(new LlmDataDistImpl(cluster_id, role)) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  if (g_registry == nullptr) {
    g_registry = new std::unordered_map<const void *, ListenPortSource *>();
  }
  (*g_registry)[this] = impl_.get();
}

LlmDataDist::~LlmDataDist() {
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    if (g_registry != nullptr) {
      g_registry->erase(this);
    }
  }
  impl_.reset();
}

Status LlmDataDist::Initialize(const std::map<AscendString, AscendString> &options) {
  Status status = impl_->Run("Initialize", "", [&](kvdd_cann::Engine &e) {
    return e.Initialize(options);
  });
  if (status == LLM_SUCCESS && impl_->engine_ != nullptr) {
    kvdd_acl_llm_set_device(impl_->engine_->DeviceId());  // as CANN's Initialize sets the device
  }
  return status;
}

void LlmDataDist::Finalize() {
  t_last_error.clear();
  if (impl_->engine_ != nullptr) {
    impl_->engine_->Finalize();
  }
}

Status LlmDataDist::SetRole(LlmRole role, const std::map<AscendString, AscendString> &options) {
  return impl_->Run("SetRole", "", [&](kvdd_cann::Engine &e) { return e.SetRole(role, options); });
}

Status LlmDataDist::LinkLlmClusters(const std::vector<ClusterInfo> &clusters,
                                    std::vector<Status> &rets, int32_t timeout_in_millis) {
  return impl_->Run("LinkLlmClusters",
                    LlmDataDistImpl::Strict("LinkLlmClusters", "clusters", clusters),
                    [&](kvdd_cann::Engine &e) {
                      return e.LinkLlmClusters(clusters, rets, timeout_in_millis);
                    });
}

Status LlmDataDist::UnlinkLlmClusters(const std::vector<ClusterInfo> &clusters,
                                      std::vector<Status> &rets, int32_t timeout_in_millis,
                                      bool force_flag) {
  return impl_->Run("UnlinkLlmClusters",
                    LlmDataDistImpl::Strict("UnlinkLlmClusters", "clusters", clusters),
                    [&](kvdd_cann::Engine &e) {
                      return e.UnlinkLlmClusters(clusters, rets, timeout_in_millis, force_flag);
                    });
}

Status LlmDataDist::AllocateCache(const CacheDesc &cache_desc, Cache &cache) {
  return impl_->Run("AllocateCache",
                    LlmDataDistImpl::Strict("AllocateCache", "cache_desc", cache_desc),
                    [&](kvdd_cann::Engine &e) { return e.AllocateCache(cache_desc, cache); });
}

Status LlmDataDist::DeallocateCache(int64_t cache_id) {
  return impl_->Run("DeallocateCache", "",
                    [&](kvdd_cann::Engine &e) { return e.DeallocateCache(cache_id); });
}

Status LlmDataDist::PullKvCache(const CacheIndex &src_cache_index, const Cache &dst_cache,
                                uint32_t batch_index, int64_t size,
                                const KvCacheExtParam &ext_param) {
  return impl_->Run("PullKvCache",
                    LlmDataDistImpl::Strict("PullKvCache", "src_cache_index", src_cache_index,
                                            "dst_cache", dst_cache, "ext_param", ext_param),
                    [&](kvdd_cann::Engine &e) {
                      return e.PullKvCache(src_cache_index, dst_cache, batch_index, size,
                                           ext_param);
                    });
}

Status LlmDataDist::PullKvBlocks(const CacheIndex &src_cache_index, const Cache &dst_cache,
                                 const std::vector<uint64_t> &src_blocks,
                                 const std::vector<uint64_t> &dst_blocks,
                                 const KvCacheExtParam &ext_param) {
  return impl_->Run("PullKvBlocks",
                    LlmDataDistImpl::Strict("PullKvBlocks", "src_cache_index", src_cache_index,
                                            "dst_cache", dst_cache, "ext_param", ext_param),
                    [&](kvdd_cann::Engine &e) {
                      return e.PullKvBlocks(src_cache_index, dst_cache, src_blocks, dst_blocks,
                                            ext_param);
                    });
}

Status LlmDataDist::CopyKvCache(const Cache &src_cache, const Cache &dst_cache,
                                uint32_t src_batch_index, uint32_t dst_batch_index,
                                uint64_t offset, int64_t size) {
  return impl_->Run("CopyKvCache",
                    LlmDataDistImpl::Strict("CopyKvCache", "src_cache", src_cache, "dst_cache",
                                            dst_cache),
                    [&](kvdd_cann::Engine &e) {
                      return e.CopyKvCache(src_cache, dst_cache, src_batch_index,
                                           dst_batch_index, offset, size);
                    });
}

Status LlmDataDist::CopyKvBlocks(const Cache &src_cache, const Cache &dst_cache,
                                 const std::vector<uint64_t> &src_blocks,
                                 const std::vector<std::vector<uint64_t>> &dst_blocks_list) {
  return impl_->Run("CopyKvBlocks",
                    LlmDataDistImpl::Strict("CopyKvBlocks", "src_cache", src_cache, "dst_cache",
                                            dst_cache),
                    [&](kvdd_cann::Engine &e) {
                      return e.CopyKvBlocks(src_cache, dst_cache, src_blocks, dst_blocks_list);
                    });
}

Status LlmDataDist::PushKvCache(const Cache &src_cache, const CacheIndex &dst_cache_index,
                                uint32_t src_batch_index, int64_t size,
                                const KvCacheExtParam &ext_param) {
  return impl_->Run("PushKvCache",
                    LlmDataDistImpl::Strict("PushKvCache", "src_cache", src_cache,
                                            "dst_cache_index", dst_cache_index, "ext_param",
                                            ext_param),
                    [&](kvdd_cann::Engine &e) {
                      return e.PushKvCache(src_cache, dst_cache_index, src_batch_index, size,
                                           ext_param);
                    });
}

Status LlmDataDist::PushKvBlocks(const Cache &src_cache, const CacheIndex &dst_cache_index,
                                 const std::vector<uint64_t> &src_blocks,
                                 const std::vector<uint64_t> &dst_blocks,
                                 const KvCacheExtParam &ext_param) {
  return impl_->Run("PushKvBlocks",
                    LlmDataDistImpl::Strict("PushKvBlocks", "src_cache", src_cache,
                                            "dst_cache_index", dst_cache_index, "ext_param",
                                            ext_param),
                    [&](kvdd_cann::Engine &e) {
                      return e.PushKvBlocks(src_cache, dst_cache_index, src_blocks, dst_blocks,
                                            ext_param);
                    });
}

Status LlmDataDist::RegisterKvCache(const CacheDesc &cache_desc, const std::vector<uint64_t> &addrs,
                                    const RegisterCfg &cfg, int64_t &cache_id) {
  return impl_->Run("RegisterKvCache",
                    LlmDataDistImpl::Strict("RegisterKvCache", "cache_desc", cache_desc, "cfg",
                                            cfg),
                    [&](kvdd_cann::Engine &e) {
                      return e.RegisterKvCache(cache_desc, addrs, cfg, cache_id);
                    });
}

Status LlmDataDist::UnregisterKvCache(int64_t cache_id) {
  return impl_->Run("UnregisterKvCache", "",
                    [&](kvdd_cann::Engine &e) { return e.UnregisterKvCache(cache_id); });
}

}  // namespace llm_datadist

KVDD_EXPORT int kvdd_testdouble_listen_port(void *dd) {
  llm_datadist::ListenPortSource *impl = nullptr;
  {
    std::lock_guard<std::mutex> lock(llm_datadist::g_registry_mutex);
    if (llm_datadist::g_registry == nullptr) {
      return -2;
    }
    auto it = llm_datadist::g_registry->find(dd);
    if (it == llm_datadist::g_registry->end()) {
      return -2;
    }
    impl = it->second;
  }
  return impl->ListenPort();
}

KVDD_EXPORT int kvdd_testdouble_cxx11_abi(void) { return _GLIBCXX_USE_CXX11_ABI; }

KVDD_EXPORT const char *kvdd_testdouble_last_error(void) {
  return llm_datadist::t_last_error.c_str();
}
