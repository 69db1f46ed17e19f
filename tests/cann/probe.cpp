// Test program of tests/cann/test_cann_root.py: a plain C++ process on kvdd's simulated CANN root.
//
//   probe pull      two instances in this process; PullKvBlocks moves the right bytes
//   probe strict    KVDD_CANN_STRICT_RESERVED: non-zero reserved bytes -> LLM_FAILED + reason
//   probe acl       the libascendcl.so stand-in: contexts, memory, copies, error codes, messages
//   probe broken    the simulator cannot start: construction works, every call is LLM_FAILED
//   probe hook      the exception hook's cluster ids are ordinary ids unless the test suite arms it
//   probe hook-armed  ... and with KVDD_TESTDOUBLE_THROW_HOOK=1 they throw
//   probe where     the path of the libllm_datadist.so this process loaded
//   probe sigpipe PORT CACHE_ID  pushes 32 MiB rows to a peer process the test kills meanwhile,
//                   SIGPIPE at its default action (as a C++ program's is): every push returns
//
// Prints one line per check; exit status 0 when all passed, 1 otherwise.
#include <dlfcn.h>

#include <csignal>
#include <cstdlib>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "acl/acl.h"
#include "llm_datadist/llm_datadist.h"

using namespace llm_datadist;

// Hooks of kvdd's simulated root (not in CANN): the port an instance listens on, its ABI.
extern "C" int kvdd_testdouble_listen_port(void *llm_datadist);
extern "C" int kvdd_testdouble_cxx11_abi(void);

namespace {

int kvdd_port(LlmDataDist &dd) { return kvdd_testdouble_listen_port(&dd); }

int g_failures = 0;

void Expect(bool ok, const std::string &what) {
  std::printf("%s %s\n", ok ? "ok" : "FAIL", what.c_str());
  if (!ok) {
    ++g_failures;
  }
}

// The calling thread's ACL error messages (newest first), on one line.
std::string RecentMessage() {
  const char *m = aclGetRecentErrMsg();
  std::string text = m == nullptr ? std::string() : std::string(m);
  for (char &c : text) {
    c = c == '\n' ? '|' : c;
  }
  return text;
}

CacheDesc Desc() {
  CacheDesc desc{};
  desc.num_tensors = 2;
  desc.data_type = DT_UINT8;
  desc.shape = {4, 256};
  desc.placement = CachePlacement::kDevice;
  return desc;
}

int Pull() {
  LlmDataDist prompt(1, LlmRole::kPrompt);
  std::map<AscendString, AscendString> listen{{OPTION_LISTEN_IP_INFO, "127.0.0.1:0"},
                                             {OPTION_DEVICE_ID, "0"}};
  Expect(prompt.Initialize(listen) == LLM_SUCCESS, "prompt Initialize");
  LlmDataDist decoder(2, LlmRole::kDecoder);
  Expect(decoder.Initialize({{OPTION_DEVICE_ID, "1"}}) == LLM_SUCCESS, "decoder Initialize");
  int32_t device = -1;
  Expect(aclrtGetDevice(&device) == ACL_SUCCESS && device == 1,
         "Initialize made llm.DeviceId the current device");
  const int port = kvdd_port(prompt);
  Expect(port > 0, "the prompt listens");
  std::vector<void *> src(2), dst(2);
  for (int t = 0; t < 2; ++t) {
    Expect(aclrtMalloc(&src[t], 1024, ACL_MEM_MALLOC_HUGE_ONLY) == ACL_SUCCESS, "aclrtMalloc src");
    Expect(aclrtMalloc(&dst[t], 1024, ACL_MEM_MALLOC_HUGE_ONLY) == ACL_SUCCESS, "aclrtMalloc dst");
    std::vector<uint8_t> host(1024);
    for (int i = 0; i < 1024; ++i) {
      host[i] = static_cast<uint8_t>(i * 3 + t * 101);
    }
    Expect(aclrtMemcpy(src[t], 1024, host.data(), 1024, ACL_MEMCPY_HOST_TO_DEVICE) == ACL_SUCCESS,
           "fill src");
    Expect(aclrtMemset(dst[t], 1024, 0xEE, 1024) == ACL_SUCCESS, "fill dst");
  }
  int64_t src_id = -1, dst_id = -1;
  Expect(prompt.RegisterKvCache(Desc(), {reinterpret_cast<uint64_t>(src[0]), reinterpret_cast<uint64_t>(src[1])},
                                RegisterCfg{}, src_id) == LLM_SUCCESS, "register src");
  Expect(decoder.RegisterKvCache(Desc(), {reinterpret_cast<uint64_t>(dst[0]), reinterpret_cast<uint64_t>(dst[1])},
                                 RegisterCfg{}, dst_id) == LLM_SUCCESS, "register dst");
  ClusterInfo peer{};
  peer.remote_cluster_id = 1;
  peer.remote_role_type = 1;
  IpInfo local{};
  local.ip = "127.0.0.1";
  IpInfo remote{};
  remote.ip = "127.0.0.1";
  remote.port = static_cast<uint16_t>(port);
  peer.local_ip_infos.push_back(local);
  peer.remote_ip_infos.push_back(remote);
  std::vector<Status> rets;
  Expect(decoder.LinkLlmClusters({peer}, rets, 5000) == LLM_SUCCESS && rets.size() == 1, "link");
  Cache cache{};
  cache.cache_id = dst_id;
  cache.cache_desc = Desc();
  cache.tensor_addrs = {reinterpret_cast<uintptr_t>(dst[0]), reinterpret_cast<uintptr_t>(dst[1])};
  CacheIndex index{};
  index.cluster_id = 1;
  index.cache_id = src_id;
  Expect(decoder.PullKvBlocks(index, cache, {3, 1}, {0, 2}) == LLM_SUCCESS, "PullKvBlocks");
  bool bytes_ok = true;
  for (int t = 0; t < 2; ++t) {
    std::vector<uint8_t> host(1024);
    Expect(aclrtMemcpy(host.data(), 1024, dst[t], 1024, ACL_MEMCPY_DEVICE_TO_HOST) == ACL_SUCCESS,
           "read dst");
    for (int i = 0; i < 1024; ++i) {
      const int block = i / 256;
      const int src_block = block == 0 ? 3 : block == 2 ? 1 : -1;
      const uint8_t want = src_block < 0 ? 0xEE
                                         : static_cast<uint8_t>((src_block * 256 + i % 256) * 3 + t * 101);
      bytes_ok = bytes_ok && host[i] == want;
    }
  }
  Expect(bytes_ok, "every byte of the destination is right");
  Expect(decoder.PullKvBlocks(index, cache, {9}, {0}) == LLM_PARAM_INVALID, "out-of-range block");
  Expect(RecentMessage().find("9") != std::string::npos, "aclGetRecentErrMsg explains the failure");
  Expect(aclGetRecentErrMsg() == nullptr, "aclGetRecentErrMsg cleared the message");
  rets.clear();
  Expect(decoder.UnlinkLlmClusters({peer}, rets, 5000) == LLM_SUCCESS, "unlink");
  decoder.Finalize();
  prompt.Finalize();
  for (int t = 0; t < 2; ++t) {
    Expect(aclrtFree(src[t]) == ACL_SUCCESS && aclrtFree(dst[t]) == ACL_SUCCESS, "aclrtFree");
  }
  return g_failures == 0 ? 0 : 1;
}

int Strict() {
  // KVDD_CANN_STRICT_RESERVED is set by the test for this process.
  LlmDataDist dd(1, LlmRole::kPrompt);
  Expect(dd.Initialize({{OPTION_DEVICE_ID, "0"}}) == LLM_SUCCESS, "Initialize");
  void *p = nullptr;
  Expect(aclrtMalloc(&p, 2048, ACL_MEM_MALLOC_HUGE_FIRST) == ACL_SUCCESS, "aclrtMalloc");
  CacheDesc desc = Desc();
  desc.reserved[7] = 0x5a;  // what an uninitialized struct on the stack may hold
  int64_t id = -1;
  const uint64_t addr = reinterpret_cast<uint64_t>(p);
  Expect(dd.RegisterKvCache(desc, {addr, addr + 1024}, RegisterCfg{}, id) == LLM_FAILED && id == -1,
         "non-zero reserved byte -> LLM_FAILED, nothing registered");
  const std::string why = RecentMessage();
  Expect(why.find("reserved byte 7") != std::string::npos && why.find("CacheDesc") != std::string::npos,
         "the reason names the struct and the byte: " + why);
  desc.reserved[7] = 0;
  Expect(dd.RegisterKvCache(desc, {addr, addr + 1024}, RegisterCfg{}, id) == LLM_SUCCESS && id >= 0,
         "zeroed reserved bytes -> registered");
  KvCacheExtParam ext{};
  ext.reserved[126] = 1;
  Cache cache{};
  cache.cache_id = id;
  cache.cache_desc = desc;
  cache.tensor_addrs = {static_cast<uintptr_t>(addr), static_cast<uintptr_t>(addr + 1024)};
  CacheIndex index{};
  index.cluster_id = 7;
  index.cache_id = 1;
  Expect(dd.PullKvBlocks(index, cache, {0}, {0}, ext) == LLM_FAILED, "ext_param checked too");
  Expect(RecentMessage().find("KvCacheExtParam") != std::string::npos, "reason names KvCacheExtParam");
  dd.Finalize();
  (void)aclrtFree(p);
  return g_failures == 0 ? 0 : 1;
}

int Acl() {
  void *p = nullptr;
  Expect(aclrtMalloc(&p, 64, ACL_MEM_MALLOC_HUGE_FIRST) == ACL_ERROR_RT_CONTEXT_NULL,
         "aclrtMalloc without a device: ACL_ERROR_RT_CONTEXT_NULL");
  Expect(!RecentMessage().empty(), "... with a message");
  Expect(aclrtSetDevice(-1) == ACL_ERROR_RT_INVALID_DEVICEID, "aclrtSetDevice(-1) refused");
  Expect(aclrtSetDevice(3) == ACL_SUCCESS, "aclrtSetDevice(3)");
  int32_t device = -1;
  Expect(aclrtGetDevice(&device) == ACL_SUCCESS && device == 3, "aclrtGetDevice");
  const uint32_t policies[] = {0, 1, 2, 3, 4, 5, 6, 7, 0x100, 0x1000, 0x102};
  for (uint32_t policy : policies) {
    void *q = nullptr;
    const bool ok = aclrtMalloc(&q, 100, static_cast<aclrtMemMallocPolicy>(policy)) == ACL_SUCCESS &&
                    reinterpret_cast<uintptr_t>(q) % 4096 == 0 && aclrtFree(q) == ACL_SUCCESS;
    Expect(ok, "aclrtMalloc policy " + std::to_string(policy) + ": page-aligned");
  }
  Expect(aclrtMalloc(&p, 100, static_cast<aclrtMemMallocPolicy>(9)) == ACL_ERROR_INVALID_PARAM,
         "invalid policy refused");
  Expect(aclrtMalloc(&p, 0, ACL_MEM_MALLOC_HUGE_FIRST) == ACL_ERROR_INVALID_PARAM, "size 0 refused");
  Expect(aclrtMalloc(&p, 8192, ACL_MEM_MALLOC_HUGE_FIRST) == ACL_SUCCESS, "aclrtMalloc 8192");
  char host[64] = "simulated device memory is host memory";
  char back[64] = {0};
  Expect(aclrtMemcpy(p, 8192, host, 64, ACL_MEMCPY_HOST_TO_DEVICE) == ACL_SUCCESS, "H2D");
  Expect(aclrtMemcpy(back, 64, p, 64, ACL_MEMCPY_DEVICE_TO_HOST) == ACL_SUCCESS &&
             std::memcmp(host, back, 64) == 0, "D2H round trip");
  Expect(aclrtMemcpy(back, 32, p, 64, ACL_MEMCPY_DEVICE_TO_HOST) == ACL_ERROR_INVALID_PARAM,
         "count > destMax refused");
  Expect(RecentMessage().find("destMax") != std::string::npos, "... and explained");
  Expect(aclrtMemcpy(back, 64, p, 64, static_cast<aclrtMemcpyKind>(8)) == ACL_ERROR_INVALID_PARAM,
         "invalid kind refused");
  Expect(aclrtMemcpy(host, 64, back, 64, ACL_MEMCPY_HOST_TO_DEVICE) == ACL_ERROR_RT_PARAM_INVALID,
         "H2D into host memory refused");
  Expect(aclrtMemcpy(static_cast<char *>(p) + 8190, 64, host, 4, ACL_MEMCPY_HOST_TO_DEVICE) ==
             ACL_ERROR_RT_PARAM_INVALID, "H2D past the end of the block refused");
  Expect(aclrtMemcpy(back, 64, host, 64, ACL_MEMCPY_DEFAULT) == ACL_SUCCESS, "ACL_MEMCPY_DEFAULT");
  aclrtStream stream = nullptr;
  Expect(aclrtCreateStream(&stream) == ACL_SUCCESS, "aclrtCreateStream");
  Expect(aclrtMemcpyAsync(static_cast<char *>(p) + 64, 64, host, 64, ACL_MEMCPY_HOST_TO_DEVICE, stream) ==
             ACL_SUCCESS && std::memcmp(static_cast<char *>(p) + 64, host, 64) == 0,
         "aclrtMemcpyAsync completes before it returns");
  Expect(aclrtSynchronizeStream(stream) == ACL_SUCCESS && aclrtDestroyStream(stream) == ACL_SUCCESS,
         "synchronize and destroy the stream");
  Expect(aclrtMemset(p, 8192, 0x11, 8192) == ACL_SUCCESS && static_cast<uint8_t *>(p)[8191] == 0x11,
         "aclrtMemset");
  Expect(aclrtMemset(p, 10, 0, 11) == ACL_ERROR_INVALID_PARAM, "aclrtMemset count > maxCount");
  aclError other = ACL_SUCCESS;
  std::thread([&] {
    void *q = nullptr;
    other = aclrtMalloc(&q, 64, ACL_MEM_MALLOC_HUGE_FIRST);
  }).join();
  Expect(other == ACL_ERROR_RT_CONTEXT_NULL, "another thread has no current context");
  aclrtContext ctx = nullptr, current = nullptr;
  Expect(aclrtCreateContext(&ctx, 5) == ACL_SUCCESS && aclrtGetCurrentContext(&current) == ACL_SUCCESS &&
             current == ctx && aclrtGetDevice(&device) == ACL_SUCCESS && device == 5,
         "aclrtCreateContext makes the new context current");
  Expect(aclrtDestroyContext(ctx) == ACL_SUCCESS, "aclrtDestroyContext");
  Expect(aclrtFree(p) == ACL_SUCCESS, "aclrtFree");
  Expect(aclrtFree(p) == ACL_ERROR_RT_PARAM_INVALID, "double aclrtFree refused");
  void *h = nullptr;
  Expect(aclrtMallocHost(&h, 100) == ACL_SUCCESS && aclrtFreeHost(h) == ACL_SUCCESS,
         "aclrtMallocHost / aclrtFreeHost");
  Expect(aclrtResetDevice(3) == ACL_SUCCESS, "aclrtResetDevice");
  for (int i = 0; i < 20; ++i) {
    (void)aclrtFree(nullptr);
  }
  const std::string stacked = RecentMessage();
  Expect(std::count(stacked.begin(), stacked.end(), '|') == 7,
         "unread messages stack up to the newest 8");
  Expect(aclInit(nullptr) == ACL_SUCCESS && aclInit(nullptr) == ACL_ERROR_REPEAT_INITIALIZE &&
             aclFinalize() == ACL_SUCCESS, "aclInit / aclFinalize");
  return g_failures == 0 ? 0 : 1;
}

int Broken() {
  LlmDataDist dd(1, LlmRole::kPrompt);  // prints why on stderr
  Expect(dd.Initialize({{OPTION_DEVICE_ID, "0"}}) == LLM_FAILED, "Initialize -> LLM_FAILED");
  int64_t id = -1;
  Expect(dd.RegisterKvCache(Desc(), {4096}, RegisterCfg{}, id) == LLM_FAILED && id == -1,
         "RegisterKvCache -> LLM_FAILED");
  const std::string why = RecentMessage();
  Expect(!why.empty(), "aclGetRecentErrMsg says why: " + why);
  dd.Finalize();
  return g_failures == 0 ? 0 : 1;
}

// The cluster id the exception hook knows (throws std::runtime_error when armed).
constexpr uint64_t kThrowingId = 0xFFFFFFFFFFFFFF00ULL;

int Hook(bool armed) {
  LlmDataDist dd(kThrowingId, LlmRole::kPrompt);
  bool threw = false;
  Status status = LLM_FAILED;
  try {
    status = dd.Initialize({{OPTION_DEVICE_ID, "0"}});
  } catch (const std::exception &) {
    threw = true;
  }
  if (armed) {
    Expect(threw, "armed: Initialize of the hook's cluster id throws");
  } else {
    Expect(!threw && status == LLM_SUCCESS, "not armed: an ordinary cluster id (Initialize succeeds)");
  }
  dd.Finalize();
  return g_failures == 0 ? 0 : 1;
}

int Where() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void *>(&kvdd_testdouble_cxx11_abi), &info) == 0 ||
      info.dli_fname == nullptr) {
    return 1;
  }
  std::printf("%s\n", info.dli_fname);
  return 0;
}

int Sigpipe(int port, int64_t peer_cache) {
  std::signal(SIGPIPE, SIG_DFL);
  LlmDataDist decoder(2, LlmRole::kDecoder);
  Expect(decoder.Initialize({{OPTION_DEVICE_ID, "1"}}) == LLM_SUCCESS, "decoder Initialize");
  const int64_t n = 32 << 20;
  void *buf = nullptr;
  Expect(aclrtMalloc(&buf, n, ACL_MEM_MALLOC_HUGE_ONLY) == ACL_SUCCESS, "aclrtMalloc");
  CacheDesc desc{};
  desc.num_tensors = 1;
  desc.data_type = DT_UINT8;
  desc.shape = {1, n};
  desc.placement = CachePlacement::kDevice;
  int64_t id = -1;
  Expect(decoder.RegisterKvCache(desc, {reinterpret_cast<uint64_t>(buf)}, RegisterCfg{}, id) ==
             LLM_SUCCESS, "register");
  ClusterInfo peer{};
  peer.remote_cluster_id = 1;
  peer.remote_role_type = 1;
  IpInfo local{};
  local.ip = "127.0.0.1";
  IpInfo remote{};
  remote.ip = "127.0.0.1";
  remote.port = static_cast<uint16_t>(port);
  peer.local_ip_infos.push_back(local);
  peer.remote_ip_infos.push_back(remote);
  std::vector<Status> rets;
  Expect(decoder.LinkLlmClusters({peer}, rets, 5000) == LLM_SUCCESS, "link");
  Cache cache{};
  cache.cache_id = id;
  cache.cache_desc = desc;
  cache.tensor_addrs = {reinterpret_cast<uintptr_t>(buf)};
  CacheIndex index{};
  index.cluster_id = 1;
  index.cache_id = peer_cache;
  KvCacheExtParam ext{};
  ext.tensor_num_per_layer = 1;
  Expect(decoder.PushKvCache(cache, index, 0, -1, ext) == LLM_SUCCESS, "a push while the peer lives");
  std::printf("pushing\n");
  std::fflush(stdout);
  int failed = 0;
  for (int i = 0; i < 400 && failed < 20; ++i) {  // the test kills the peer meanwhile
    failed += decoder.PushKvCache(cache, index, 0, -1, ext) != LLM_SUCCESS;
  }
  Expect(failed > 0, "pushes to the dead peer return a status");
  decoder.Finalize();
  Expect(aclrtFree(buf) == ACL_SUCCESS, "aclrtFree");
  std::printf("survived\n");
  return g_failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char **argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "pull") return Pull();
  if (mode == "strict") return Strict();
  if (mode == "acl") return Acl();
  if (mode == "broken") return Broken();
  if (mode == "hook") return Hook(false);
  if (mode == "hook-armed") return Hook(true);
  if (mode == "where") return Where();
  if (mode == "sigpipe" && argc > 3) return Sigpipe(std::atoi(argv[2]), std::atoll(argv[3]));
  std::fprintf(stderr, "usage: probe pull|strict|acl|broken|hook|hook-armed|where|sigpipe PORT ID\n");
  return 2;
}
