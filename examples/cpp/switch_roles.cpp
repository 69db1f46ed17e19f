// kvdd example: two instances swap roles with SetRole.  Phase 1: A is the prompt (listening) and
// B, the decoder, pulls a block from it.  Phase 2: A becomes the decoder, B the prompt (listening,
// on the comm backend it starts listening only now), and A pulls a block from B.  Each side checks
// every byte it received.
//
//   switch_roles prefill comm|hixl PORT_BASE    # A: cluster 1, starts as prompt on PORT_BASE
//   switch_roles decode  comm|hixl PORT_BASE    # B: cluster 2, starts as decoder; prompt on PORT_BASE+1
//
// Exit status 0 when every byte is right, 1 on a failed call or a wrong byte, 2 on bad arguments.
#include "common.h"

using namespace example;
using llm_datadist::LlmRole;

namespace {

// Pulls block 3 of the peer's cache `peer_cache_id` into our block 5 and checks every byte.
int64_t PullAndCheck(llm_datadist::LlmDataDist &dd, const DeviceCache &mine, uint64_t peer_cluster,
                     int64_t peer_cache_id, int peer_tag, const std::string &what) {
  llm_datadist::CacheIndex index{};
  index.cluster_id = peer_cluster;
  index.cache_id = peer_cache_id;
  index.batch_index = 0;
  Check(dd.PullKvBlocks(index, mine.AsCache(), {3}, {5}), "PullKvBlocks");
  return Verify(mine, what, [&](uint32_t t, int64_t i) {
    return i / kBlockBytes == 5 ? Pattern(peer_tag, t, 3 * kBlockBytes + i % kBlockBytes) : kUntouched;
  });
}

int RunA(const Args &a) {  // prompt, then decoder
  llm_datadist::LlmDataDist dd(1, LlmRole::kPrompt);
  auto options = Options(a, 0, a.port_base);
  options[llm_datadist::OPTION_ENABLE_SET_ROLE] = "1";
  Check(dd.Initialize(options), "Initialize");
  DeviceCache src(kBlocks, kBlockBytes);
  DeviceCache dst(kBlocks, kBlockBytes);
  src.Fill(1);
  dst.Fill(0);
  Check(dd.RegisterKvCache(src.desc, src.Addrs(), llm_datadist::RegisterCfg{}, src.cache_id),
        "RegisterKvCache(src)");
  Check(dd.RegisterKvCache(dst.desc, dst.Addrs(), llm_datadist::RegisterCfg{}, dst.cache_id),
        "RegisterKvCache(dst)");
  Control control = Control::Listen(a.port_base + 2);
  control.Send("cache " + std::to_string(src.cache_id));
  const std::vector<int64_t> phase1 = control.Expect("pulled");  // B pulled, checked, unlinked

  // Phase 2: we become the decoder (on comm: stop listening), B the prompt.
  Check(dd.SetRole(LlmRole::kDecoder, {}), "SetRole(kDecoder)");
  control.Send("switched");
  const std::vector<int64_t> b_cache = control.Expect("prompt");  // B listens now
  if (b_cache.size() != 1) {
    Die("control socket: expected B's cache id");
  }
  const llm_datadist::ClusterInfo b = Peer(2, LlmRole::kPrompt, a.port_base + 1);
  Link(dd, b);
  int64_t bad = PullAndCheck(dd, dst, 2, b_cache[0], 2, "A (decoder now) pulls B's block 3 -> 5");
  Unlink(dd, b);
  control.Send("done " + std::to_string(bad));
  dd.Finalize();
  const bool ok = bad == 0 && phase1.size() == 1 && phase1[0] == 0;
  std::printf("A: %s\n", ok ? "both phases right" : "FAILED");
  return ok ? 0 : 1;
}

int RunB(const Args &a) {  // decoder, then prompt
  llm_datadist::LlmDataDist dd(2, LlmRole::kDecoder);
  auto options = Options(a, 1, a.hixl ? a.port_base + 1 : 0);
  options[llm_datadist::OPTION_ENABLE_SET_ROLE] = "1";
  Check(dd.Initialize(options), "Initialize");
  DeviceCache src(kBlocks, kBlockBytes);
  DeviceCache dst(kBlocks, kBlockBytes);
  src.Fill(2);
  dst.Fill(0);
  Check(dd.RegisterKvCache(src.desc, src.Addrs(), llm_datadist::RegisterCfg{}, src.cache_id),
        "RegisterKvCache(src)");
  Check(dd.RegisterKvCache(dst.desc, dst.Addrs(), llm_datadist::RegisterCfg{}, dst.cache_id),
        "RegisterKvCache(dst)");
  Control control = Control::Connect(a.port_base + 2);
  const std::vector<int64_t> a_cache = control.Expect("cache");
  if (a_cache.size() != 1) {
    Die("control socket: expected A's cache id");
  }
  const llm_datadist::ClusterInfo peer_a = Peer(1, LlmRole::kPrompt, a.port_base);
  Link(dd, peer_a);
  int64_t bad = PullAndCheck(dd, dst, 1, a_cache[0], 1, "B (decoder) pulls A's block 3 -> 5");
  Unlink(dd, peer_a);
  control.Send("pulled " + std::to_string(bad));

  control.Expect("switched");
  std::map<AscendString, AscendString> listen;
  listen[llm_datadist::OPTION_LISTEN_IP_INFO] = Endpoint(a.port_base + 1).c_str();
  Check(dd.SetRole(LlmRole::kPrompt, listen), "SetRole(kPrompt)");
  control.Send("prompt " + std::to_string(src.cache_id));
  const std::vector<int64_t> done = control.Expect("done");  // A pulled and checked
  dd.Finalize();
  const bool ok = bad == 0 && done.size() == 1 && done[0] == 0;
  std::printf("B: %s\n", ok ? "both phases right" : "FAILED");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char **argv) {
  const Args a = ParseArgs(argc, argv, "switch_roles");
  return a.prefill ? RunA(a) : RunB(a);
}
