// kvdd example: per-call time of a small PullKvBlocks from C++ (one 64-byte block of a one-tensor
// [4, 64] uint8 cache) between two LlmDataDist instances in this process.  On kvdd's simulated
// CANN root this is the simulator's per-call overhead as seen by a C++ program; pull_overhead.py
// compares it with the same call through kvdd's Python API.
//
//   pull_overhead [CALLS_PER_BATCH [BATCHES]]     prints: pull_overhead ns_per_call=<median>
#include <algorithm>
#include <chrono>

#include "common.h"

using namespace example;
using llm_datadist::LlmRole;

int main(int argc, char **argv) {
  const int calls = argc > 1 ? std::atoi(argv[1]) : 2000;
  const int batches = argc > 2 ? std::atoi(argv[2]) : 7;
  if (calls <= 0 || batches <= 0) {
    std::fprintf(stderr, "usage: pull_overhead [CALLS_PER_BATCH [BATCHES]]\n");
    return 2;
  }
  llm_datadist::LlmDataDist prompt(1, LlmRole::kPrompt);
  Args a;
  Check(prompt.Initialize(Options(a, 0, 0)), "Initialize(prompt)");
  // Port 0 asks for a free port; the real library cannot report it, so listen on a fixed one.
  llm_datadist::LlmDataDist decoder(2, LlmRole::kDecoder);
  Check(decoder.Initialize(Options(a, 1, 0)), "Initialize(decoder)");
  std::map<AscendString, AscendString> listen;
  const int port = 26900 + static_cast<int>(getpid() % 90);
  listen[llm_datadist::OPTION_LISTEN_IP_INFO] = Endpoint(port).c_str();
  Check(prompt.SetRole(LlmRole::kPrompt, listen), "SetRole(listen)");

  llm_datadist::CacheDesc desc{};
  desc.placement = llm_datadist::CachePlacement::kDevice;
  desc.num_tensors = 1;
  desc.data_type = llm_datadist::DT_UINT8;
  desc.shape = {4, 64};
  void *src = nullptr;
  void *dst = nullptr;
  CheckAcl(aclrtMalloc(&src, 256, ACL_MEM_MALLOC_HUGE_FIRST), "aclrtMalloc");
  CheckAcl(aclrtMalloc(&dst, 256, ACL_MEM_MALLOC_HUGE_FIRST), "aclrtMalloc");
  CheckAcl(aclrtMemset(src, 256, 0x5A, 256), "aclrtMemset");
  CheckAcl(aclrtMemset(dst, 256, 0, 256), "aclrtMemset");
  int64_t src_id = -1, dst_id = -1;
  Check(prompt.RegisterKvCache(desc, {reinterpret_cast<uint64_t>(src)}, {}, src_id), "RegisterKvCache");
  Check(decoder.RegisterKvCache(desc, {reinterpret_cast<uint64_t>(dst)}, {}, dst_id), "RegisterKvCache");
  const llm_datadist::ClusterInfo peer = Peer(1, LlmRole::kPrompt, port);
  Link(decoder, peer);

  llm_datadist::CacheIndex index{};
  index.cluster_id = 1;
  index.cache_id = src_id;
  llm_datadist::Cache cache{};
  cache.cache_id = dst_id;
  const std::vector<uint64_t> src_blocks = {2};
  const std::vector<uint64_t> dst_blocks = {1};
  std::vector<double> per_call;
  for (int b = 0; b < batches; ++b) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) {
      Check(decoder.PullKvBlocks(index, cache, src_blocks, dst_blocks), "PullKvBlocks");
    }
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
    per_call.push_back(took.count() / calls);
  }
  uint8_t moved[64] = {0};
  CheckAcl(aclrtMemcpy(moved, 64, static_cast<uint8_t *>(dst) + 64, 64, ACL_MEMCPY_DEVICE_TO_HOST),
           "aclrtMemcpy");
  if (std::count(moved, moved + 64, 0x5A) != 64) {
    Die("the pull moved the wrong bytes");
  }
  Unlink(decoder, peer);
  std::sort(per_call.begin(), per_call.end());
  std::printf("pull_overhead ns_per_call=%.0f calls=%d batches=%d\n", per_call[per_call.size() / 2],
              calls, batches);
  decoder.Finalize();
  prompt.Finalize();
  (void)aclrtFree(src);
  (void)aclrtFree(dst);
  return 0;
}
