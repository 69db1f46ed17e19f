// kvdd's simulated CANN root: the interface between libllm_datadist.so (the C++ API, no Python)
// and libkvdd_simbridge.so (the Python C API code that forwards each call to kvdd's simulator).
// Internal to the root; not installed under include/.
#ifndef KVDD_CANN_SRC_ENGINE_H_
#define KVDD_CANN_SRC_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "llm_datadist/llm_datadist.h"

namespace kvdd_cann {

using llm_datadist::AscendString;
using llm_datadist::Cache;
using llm_datadist::CacheDesc;
using llm_datadist::CacheIndex;
using llm_datadist::ClusterInfo;
using llm_datadist::KvCacheExtParam;
using llm_datadist::LlmRole;
using llm_datadist::RegisterCfg;
using llm_datadist::Status;
using Options = std::map<AscendString, AscendString>;

// One simulator instance (kvdd.sim.engine.SimBackend).  Methods have the semantics of the
// LlmDataDist methods of the same name; they throw std::runtime_error when the simulator raises.
class Engine {
 public:
  virtual ~Engine() = default;
  virtual Status Initialize(const Options &options) = 0;
  virtual void Finalize() = 0;
  virtual Status SetRole(LlmRole role, const Options &options) = 0;
  virtual Status LinkLlmClusters(const std::vector<ClusterInfo> &clusters,
                                 std::vector<Status> &rets, int32_t timeout_in_millis) = 0;
  virtual Status UnlinkLlmClusters(const std::vector<ClusterInfo> &clusters,
                                   std::vector<Status> &rets, int32_t timeout_in_millis,
                                   bool force_flag) = 0;
  virtual Status AllocateCache(const CacheDesc &cache_desc, Cache &cache) = 0;
  virtual Status DeallocateCache(int64_t cache_id) = 0;
  virtual Status PullKvCache(const CacheIndex &src, const Cache &dst, uint32_t batch_index,
                             int64_t size, const KvCacheExtParam &ext) = 0;
  virtual Status PullKvBlocks(const CacheIndex &src, const Cache &dst,
                              const std::vector<uint64_t> &src_blocks,
                              const std::vector<uint64_t> &dst_blocks,
                              const KvCacheExtParam &ext) = 0;
  virtual Status CopyKvCache(const Cache &src, const Cache &dst, uint32_t src_batch_index,
                             uint32_t dst_batch_index, uint64_t offset, int64_t size) = 0;
  virtual Status CopyKvBlocks(const Cache &src, const Cache &dst,
                              const std::vector<uint64_t> &src_blocks,
                              const std::vector<std::vector<uint64_t>> &dst_blocks_list) = 0;
  virtual Status PushKvCache(const Cache &src, const CacheIndex &dst, uint32_t src_batch_index,
                             int64_t size, const KvCacheExtParam &ext) = 0;
  virtual Status PushKvBlocks(const Cache &src, const CacheIndex &dst,
                              const std::vector<uint64_t> &src_blocks,
                              const std::vector<uint64_t> &dst_blocks,
                              const KvCacheExtParam &ext) = 0;
  virtual Status RegisterKvCache(const CacheDesc &cache_desc, const std::vector<uint64_t> &addrs,
                                 const RegisterCfg &cfg, int64_t &cache_id) = 0;
  virtual Status UnregisterKvCache(int64_t cache_id) = 0;

  // The port the simulator listens on; -1 not listening, -2 unknown.
  virtual int ListenPort() = 0;
  // Why the last failing call of this thread failed ("" when the simulator gave no reason).
  virtual std::string LastErrorDetail() = 0;
  // The device of llm.DeviceId after a successful Initialize.
  virtual int32_t DeviceId() = 0;
};

}  // namespace kvdd_cann

// libkvdd_simbridge.so (loaded only where CPython's symbols are visible, with an interpreter).
// Both write a message into `error` (size `error_size`) on failure.
extern "C" {
// 0 when `root` (the directory of the simulated root) belongs to the running kvdd.
typedef int (*kvdd_bridge_check_root_fn)(const char *root, char *error, size_t error_size);
// A new Engine, or nullptr.
typedef kvdd_cann::Engine *(*kvdd_bridge_create_fn)(uint64_t cluster_id, int32_t role,
                                                    char *error, size_t error_size);
}

// libkvdd_pyembed.so (loaded after libpython, only in a process without an interpreter): starts
// the interpreter of `python_executable` (its venv and site-packages) and releases the GIL.
extern "C" {
typedef int (*kvdd_pyembed_start_fn)(const char *python_executable, char *error,
                                     size_t error_size);
}

#endif  // KVDD_CANN_SRC_ENGINE_H_
