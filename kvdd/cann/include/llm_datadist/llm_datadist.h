/*
 * kvdd's simulated CANN root: the public LLM-DataDist C++ API (llm_datadist::LlmDataDist).
 *
 * Written by the kvdd project from the type and signature tables of kvdd's VENDOR.md and the
 * constants of API.md; it is NOT the vendor header and copies nothing from it.  It provides the
 * same names, member types, member order, defaults and include path, so that kvdd's Cython
 * binding and C++ programs written for CANN compile against it exactly as against a CANN install.
 * Every struct ends in a reserved byte array that user code does not touch (128 bytes; 127 in
 * KvCacheExtParam); as in CANN, only RegisterCfg's is zero-initialized by default, so code must
 * value-initialize the structs it fills (`CacheDesc desc{};`).  Only the 18 status codes CANN's
 * llm_datadist.h has are declared here; all thirty are ge::LLM_* in ge/llm_error_codes.h, which this
 * header does not include.  The implementation (kvdd/cann/src/) forwards each call to
 * kvdd's simulator engine.
 */
#ifndef KVDD_CANN_LLM_DATADIST_LLM_DATADIST_H_
#define KVDD_CANN_LLM_DATADIST_LLM_DATADIST_H_

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "external/ge_common/api_error_codes.h"
#include "external/ge_common/ge_api_types.h"

namespace llm_datadist {

using ge::AscendString;
using ge::DataType;
using ge::Status;

using ge::DT_FLOAT;
using ge::DT_FLOAT16;
using ge::DT_INT8;
using ge::DT_INT32;
using ge::DT_UINT8;
using ge::DT_INT16;
using ge::DT_UINT16;
using ge::DT_UINT32;
using ge::DT_INT64;
using ge::DT_UINT64;
using ge::DT_DOUBLE;
using ge::DT_BOOL;
using ge::DT_STRING;
using ge::DT_DUAL_SUB_INT8;
using ge::DT_DUAL_SUB_UINT8;
using ge::DT_COMPLEX64;
using ge::DT_COMPLEX128;
using ge::DT_QINT8;
using ge::DT_QINT16;
using ge::DT_QINT32;
using ge::DT_QUINT8;
using ge::DT_QUINT16;
using ge::DT_RESOURCE;
using ge::DT_STRING_REF;
using ge::DT_DUAL;
using ge::DT_VARIANT;
using ge::DT_BF16;
using ge::DT_UNDEFINED;
using ge::DT_INT4;
using ge::DT_UINT1;
using ge::DT_INT2;
using ge::DT_UINT2;
using ge::DT_COMPLEX32;
using ge::DT_HIFLOAT8;
using ge::DT_FLOAT8_E5M2;
using ge::DT_FLOAT8_E4M3FN;
using ge::DT_FLOAT8_E8M0;
using ge::DT_FLOAT6_E3M2;
using ge::DT_FLOAT6_E2M3;
using ge::DT_FLOAT4_E2M1;
using ge::DT_FLOAT4_E1M2;

// Option keys (Initialize / SetRole).
constexpr const char OPTION_LISTEN_IP_INFO[] = "llm.ListenIpInfo";
constexpr const char OPTION_DEVICE_ID[] = "llm.DeviceId";
constexpr const char OPTION_SYNC_CACHE_WAIT_TIME[] = "llm.SyncKvCacheWaitTime";
constexpr const char OPTION_BUF_POOL_CFG[] = "llm.BufPoolCfg";
constexpr const char OPTION_ENABLE_SET_ROLE[] = "llm.EnableSwitchRole";
constexpr const char OPTION_LOCAL_COMM_RES[] = "llm.LocalCommRes";
constexpr const char OPTION_TRANSFER_BACKEND[] = "llm.TransferBackend";
constexpr const char OPTION_GLOBAL_RESOURCE_CONFIG[] = "llm.GlobalResourceConfig";

// Statuses: 0x5010B000 + n, plus success and ge::FAILED (the 18 of CANN's llm_datadist.h).
constexpr Status LLM_SUCCESS = 0x0U;
constexpr Status LLM_FAILED = 0xFFFFFFFFU;
constexpr Status LLM_WAIT_PROC_TIMEOUT = 0x5010B001U;
constexpr Status LLM_KV_CACHE_NOT_EXIST = 0x5010B002U;
constexpr Status LLM_PARAM_INVALID = 0x5010B005U;
constexpr Status LLM_NOT_YET_LINK = 0x5010B007U;
constexpr Status LLM_ALREADY_LINK = 0x5010B008U;
constexpr Status LLM_LINK_FAILED = 0x5010B009U;
constexpr Status LLM_UNLINK_FAILED = 0x5010B00AU;
constexpr Status LLM_NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00BU;
constexpr Status LLM_CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00CU;
constexpr Status LLM_PROCESSING_LINK = 0x5010B00DU;
constexpr Status LLM_DEVICE_OUT_OF_MEMORY = 0x5010B00EU;
constexpr Status LLM_EXIST_LINK = 0x5010B018U;
constexpr Status LLM_FEATURE_NOT_ENABLED = 0x5010B019U;
constexpr Status LLM_TIMEOUT = 0x5010B01AU;
constexpr Status LLM_LINK_BUSY = 0x5010B01BU;
constexpr Status LLM_OUT_OF_MEMORY = 0x5010B01CU;

enum class LlmRole : int32_t {
  kPrompt = 1,
  kDecoder = 2,
  kMix = 3,
  kEnd
};

enum class CachePlacement : uint32_t {
  kHost = 0U,
  kDevice = 1U
};

struct IpInfo {
  AscendString ip;
  uint16_t port = 0U;
  uint8_t reserved[128];
};

struct ClusterInfo {
  uint64_t remote_cluster_id = 0U;
  int32_t remote_role_type = 0;
  std::vector<IpInfo> local_ip_infos;
  std::vector<IpInfo> remote_ip_infos;
  uint8_t reserved[128];
};

struct CacheIndex {
  uint64_t cluster_id;
  int64_t cache_id;
  uint32_t batch_index;
  uint8_t reserved[128];
};

struct CacheDesc {
  CachePlacement placement = CachePlacement::kDevice;
  uint32_t num_tensors = 0U;
  DataType data_type = DT_UNDEFINED;
  std::vector<int64_t> shape;
  uint8_t reserved[128];
};

struct Cache {
  int64_t cache_id = -1;
  std::vector<uintptr_t> tensor_addrs;
  CacheDesc cache_desc;
  uint8_t reserved[128];
};

struct KvCacheExtParam {
  std::pair<int32_t, int32_t> src_layer_range = {-1, -1};
  std::pair<int32_t, int32_t> dst_layer_range = {-1, -1};
  uint8_t tensor_num_per_layer = 2U;
  uint8_t reserved[127];
};

struct RegisterCfg {
  uint8_t reserved[128] = {};
};

class LlmDataDist {
 public:
  LlmDataDist(uint64_t cluster_id, LlmRole role);
  ~LlmDataDist();
  LlmDataDist(const LlmDataDist &) = delete;
  LlmDataDist &operator=(const LlmDataDist &) = delete;

  Status Initialize(const std::map<AscendString, AscendString> &options);
  void Finalize();
  Status SetRole(LlmRole role, const std::map<AscendString, AscendString> &options = {});

  Status LinkLlmClusters(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets,
                         int32_t timeout_in_millis = 1000);
  Status UnlinkLlmClusters(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets,
                           int32_t timeout_in_millis = 1000, bool force_flag = false);

  Status AllocateCache(const CacheDesc &cache_desc, Cache &cache);
  Status DeallocateCache(int64_t cache_id);

  Status PullKvCache(const CacheIndex &src_cache_index, const Cache &dst_cache,
                     uint32_t batch_index = 0U, int64_t size = -1,
                     const KvCacheExtParam &ext_param = {});
  Status PullKvBlocks(const CacheIndex &src_cache_index, const Cache &dst_cache,
                      const std::vector<uint64_t> &src_blocks,
                      const std::vector<uint64_t> &dst_blocks,
                      const KvCacheExtParam &ext_param = {});

  Status CopyKvCache(const Cache &src_cache, const Cache &dst_cache,
                     uint32_t src_batch_index = 0U, uint32_t dst_batch_index = 0U,
                     uint64_t offset = 0U, int64_t size = -1);
  Status CopyKvBlocks(const Cache &src_cache, const Cache &dst_cache,
                      const std::vector<uint64_t> &src_blocks,
                      const std::vector<std::vector<uint64_t>> &dst_blocks_list);

  Status PushKvCache(const Cache &src_cache, const CacheIndex &dst_cache_index,
                     uint32_t src_batch_index = 0U, int64_t size = -1,
                     const KvCacheExtParam &ext_param = {});
  Status PushKvBlocks(const Cache &src_cache, const CacheIndex &dst_cache_index,
                      const std::vector<uint64_t> &src_blocks,
                      const std::vector<uint64_t> &dst_blocks,
                      const KvCacheExtParam &ext_param = {});

  Status RegisterKvCache(const CacheDesc &cache_desc, const std::vector<uint64_t> &addrs,
                         const RegisterCfg &cfg, int64_t &cache_id);
  Status UnregisterKvCache(int64_t cache_id);

 private:
  class LlmDataDistImpl;
  std::unique_ptr<LlmDataDistImpl> impl_;
};

}  // namespace llm_datadist

#endif  // KVDD_CANN_LLM_DATADIST_LLM_DATADIST_H_
