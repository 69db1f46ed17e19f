// kvdd example: decode pulls KV cache from prefill (PullKvCache of a batch row, PullKvBlocks of
// paged blocks, PullKvBlocks of one layer), then checks every byte of its caches.
//
//   pull prefill comm|hixl PORT_BASE     # cluster 1, listens on PORT_BASE
//   pull decode  comm|hixl PORT_BASE     # cluster 2 (listens on PORT_BASE+1 with hixl)
//
// Exit status 0 when every byte is right, 1 on a failed call or a wrong byte, 2 on bad arguments.
#include "common.h"

using namespace example;
using llm_datadist::LlmRole;

namespace {

int Prefill(const Args &a) {
  llm_datadist::LlmDataDist dd(1, LlmRole::kPrompt);
  Check(dd.Initialize(Options(a, 0, a.port_base)), "Initialize");
  DeviceCache paged(kBlocks, kBlockBytes);
  DeviceCache contig(kRows, kRowBytes);
  paged.Fill(1);
  contig.Fill(2);
  Check(dd.RegisterKvCache(paged.desc, paged.Addrs(), llm_datadist::RegisterCfg{}, paged.cache_id),
        "RegisterKvCache(paged)");
  Check(dd.RegisterKvCache(contig.desc, contig.Addrs(), llm_datadist::RegisterCfg{}, contig.cache_id),
        "RegisterKvCache(contiguous)");

  Control control = Control::Listen(a.port_base + 2);
  control.Send("caches " + std::to_string(paged.cache_id) + " " + std::to_string(contig.cache_id));
  const std::vector<int64_t> done = control.Expect("done");  // decode pulled and checked
  Check(dd.UnregisterKvCache(paged.cache_id), "UnregisterKvCache(paged)");
  Check(dd.UnregisterKvCache(contig.cache_id), "UnregisterKvCache(contiguous)");
  dd.Finalize();
  const bool ok = done.size() == 1 && done[0] == 0;
  std::printf("prefill: decode reported %s\n", ok ? "every byte right" : "a failure");
  return ok ? 0 : 1;
}

int Decode(const Args &a) {
  llm_datadist::LlmDataDist dd(2, LlmRole::kDecoder);
  Check(dd.Initialize(Options(a, 1, a.hixl ? a.port_base + 1 : 0)), "Initialize");
  DeviceCache paged(kBlocks, kBlockBytes);
  DeviceCache contig(kRows, kRowBytes);
  paged.Fill(0);
  contig.Fill(0);
  Check(dd.RegisterKvCache(paged.desc, paged.Addrs(), llm_datadist::RegisterCfg{}, paged.cache_id),
        "RegisterKvCache(paged)");
  Check(dd.RegisterKvCache(contig.desc, contig.Addrs(), llm_datadist::RegisterCfg{}, contig.cache_id),
        "RegisterKvCache(contiguous)");

  Control control = Control::Connect(a.port_base + 2);
  const std::vector<int64_t> ids = control.Expect("caches");
  if (ids.size() != 2) {
    Die("control socket: expected two cache ids");
  }
  const llm_datadist::ClusterInfo prefill = Peer(1, LlmRole::kPrompt, a.port_base);
  Link(dd, prefill);
  int64_t bad = 0;

  // 1. PullKvCache: prefill's row 1 of the contiguous cache into our row 0.
  llm_datadist::CacheIndex row{};
  row.cluster_id = 1;
  row.cache_id = ids[1];
  row.batch_index = 1;
  Check(dd.PullKvCache(row, contig.AsCache(), 0), "PullKvCache");
  bad += Verify(contig, "PullKvCache row 1 -> row 0", [](uint32_t t, int64_t i) {
    return i < kRowBytes ? Pattern(2, t, kRowBytes + i) : kUntouched;
  });

  // 2. PullKvBlocks: blocks 5, 2, 7 into our blocks 0, 3, 4 (all layers).
  llm_datadist::CacheIndex blocks{};
  blocks.cluster_id = 1;
  blocks.cache_id = ids[0];
  blocks.batch_index = 0;
  Check(dd.PullKvBlocks(blocks, paged.AsCache(), {5, 2, 7}, {0, 3, 4}), "PullKvBlocks");
  std::map<int64_t, int64_t> src_of = {{0, 5}, {3, 2}, {4, 7}};  // dst block -> src block
  bad += Verify(paged, "PullKvBlocks 5,2,7 -> 0,3,4", [&](uint32_t t, int64_t i) {
    auto it = src_of.find(i / kBlockBytes);
    return it == src_of.end() ? kUntouched : Pattern(1, t, it->second * kBlockBytes + i % kBlockBytes);
  });

  // 3. PullKvBlocks of layer 1 only (tensors 2 and 3): block 1 into our block 6.
  llm_datadist::KvCacheExtParam layer{};
  layer.src_layer_range = {1, 1};
  layer.dst_layer_range = {1, 1};
  layer.tensor_num_per_layer = 2;
  Check(dd.PullKvBlocks(blocks, paged.AsCache(), {1}, {6}, layer), "PullKvBlocks(layer 1)");
  bad += Verify(paged, "PullKvBlocks layer 1: 1 -> 6", [&](uint32_t t, int64_t i) {
    const int64_t b = i / kBlockBytes;
    if (b == 6) {
      return t >= 2 ? Pattern(1, t, 1 * kBlockBytes + i % kBlockBytes) : kUntouched;
    }
    auto it = src_of.find(b);
    return it == src_of.end() ? kUntouched : Pattern(1, t, it->second * kBlockBytes + i % kBlockBytes);
  });

  Unlink(dd, prefill);
  control.Send("done " + std::to_string(bad));
  Check(dd.UnregisterKvCache(paged.cache_id), "UnregisterKvCache(paged)");
  Check(dd.UnregisterKvCache(contig.cache_id), "UnregisterKvCache(contiguous)");
  dd.Finalize();
  std::printf("decode: %s\n", bad == 0 ? "every byte right" : "WRONG BYTES");
  return bad == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char **argv) {
  const Args a = ParseArgs(argc, argv, "pull");
  return a.prefill ? Prefill(a) : Decode(a);
}
