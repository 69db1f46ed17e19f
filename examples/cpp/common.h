// Helpers shared by kvdd's C++ LLM-DataDist examples (pull.cpp, push.cpp, switch_roles.cpp).
//
// Written for kvdd; plain LLM-DataDist + ACL code that builds against CANN or against kvdd's
// simulated CANN root (`kvdd cann-root`).  Each example is one program run as two processes
// ("prefill" and "decode") on loopback.  They synchronise over a TCP control socket: prefill
// listens on PORT_BASE+2, decode connects, and they exchange one-line messages.  Every cache is
// device memory (aclrtMalloc), filled and read back with aclrtMemcpy, and every byte the decode
// side should hold afterwards is checked.
#ifndef KVDD_EXAMPLES_CPP_COMMON_H_
#define KVDD_EXAMPLES_CPP_COMMON_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "acl/acl.h"
#include "llm_datadist/llm_datadist.h"

namespace example {

using llm_datadist::AscendString;
using llm_datadist::Status;

// Geometry: 2 layers, K and V per layer (4 tensors of uint8).
constexpr uint32_t kLayers = 2;
constexpr uint32_t kTensors = 2 * kLayers;
constexpr int64_t kBlocks = 8, kBlockBytes = 64;   // paged cache: [8 blocks, 64 bytes]
constexpr int64_t kRows = 2, kRowBytes = 512;      // contiguous cache: [2 rows, 512 bytes]
constexpr uint8_t kUntouched = 0xEE;               // what destination memory holds before a transfer

struct Args {
  bool prefill = true;
  bool hixl = false;
  int port_base = 0;
};

inline Args ParseArgs(int argc, char **argv, const char *prog) {
  Args a;
  if (argc != 4 || (std::strcmp(argv[1], "prefill") != 0 && std::strcmp(argv[1], "decode") != 0) ||
      (std::strcmp(argv[2], "comm") != 0 && std::strcmp(argv[2], "hixl") != 0) ||
      std::atoi(argv[3]) <= 0 || std::atoi(argv[3]) > 65533) {
    std::fprintf(stderr, "usage: %s prefill|decode comm|hixl PORT_BASE\n", prog);
    std::exit(2);
  }
  a.prefill = std::strcmp(argv[1], "prefill") == 0;
  a.hixl = std::strcmp(argv[2], "hixl") == 0;
  a.port_base = std::atoi(argv[3]);
  return a;
}

[[noreturn]] inline void Die(const std::string &what) {
  std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  std::exit(1);
}

inline void Check(Status s, const std::string &call) {
  if (s != llm_datadist::LLM_SUCCESS) {
    const char *why = aclGetRecentErrMsg();
    char hex[16];
    std::snprintf(hex, sizeof hex, "0x%08X", s);
    Die(call + " returned " + hex + (why != nullptr ? std::string(": ") + why : std::string()));
  }
}

inline void CheckAcl(aclError e, const std::string &call) {
  if (e != ACL_ERROR_NONE) {
    const char *why = aclGetRecentErrMsg();
    Die(call + " returned ACL error " + std::to_string(e) +
        (why != nullptr ? std::string(": ") + why : std::string()));
  }
}

inline std::string Endpoint(int port) { return "127.0.0.1:" + std::to_string(port); }

// Initialize options: device, transfer backend, and a listen address when `listen_port` > 0.
inline std::map<AscendString, AscendString> Options(const Args &a, int device, int listen_port) {
  std::map<AscendString, AscendString> options;
  options[llm_datadist::OPTION_DEVICE_ID] = std::to_string(device).c_str();
  if (listen_port > 0) {
    options[llm_datadist::OPTION_LISTEN_IP_INFO] = Endpoint(listen_port).c_str();
  }
  if (a.hixl) {
    options[llm_datadist::OPTION_TRANSFER_BACKEND] = "hixl";
  }
  return options;
}

// The value of byte `offset` of tensor `tensor` of the source cache tagged `tag`.
inline uint8_t Pattern(int tag, uint32_t tensor, int64_t offset) {
  return static_cast<uint8_t>(tag * 131 + static_cast<int>(tensor) * 31 + offset * 7 + offset / 251);
}

// A cache in device memory: one aclrtMalloc per tensor.
struct DeviceCache {
  llm_datadist::CacheDesc desc{};
  std::vector<void *> tensors;
  int64_t tensor_bytes = 0;
  int64_t cache_id = -1;

  DeviceCache(int64_t dim0, int64_t bytes_per_dim0) {
    desc.placement = llm_datadist::CachePlacement::kDevice;
    desc.num_tensors = kTensors;
    desc.data_type = llm_datadist::DT_UINT8;
    desc.shape = {dim0, bytes_per_dim0};
    tensor_bytes = dim0 * bytes_per_dim0;
    for (uint32_t t = 0; t < kTensors; ++t) {
      void *p = nullptr;
      CheckAcl(aclrtMalloc(&p, static_cast<size_t>(tensor_bytes), ACL_MEM_MALLOC_HUGE_FIRST),
               "aclrtMalloc");
      tensors.push_back(p);
    }
  }
  ~DeviceCache() {
    for (void *p : tensors) {
      (void)aclrtFree(p);
    }
  }
  DeviceCache(const DeviceCache &) = delete;
  DeviceCache &operator=(const DeviceCache &) = delete;

  std::vector<uint64_t> Addrs() const {
    std::vector<uint64_t> out;
    for (void *p : tensors) {
      out.push_back(reinterpret_cast<uint64_t>(p));
    }
    return out;
  }
  llm_datadist::Cache AsCache() const {
    llm_datadist::Cache c{};
    c.cache_id = cache_id;
    c.cache_desc = desc;
    for (void *p : tensors) {
      c.tensor_addrs.push_back(reinterpret_cast<uintptr_t>(p));
    }
    return c;
  }
  // Source data (tag > 0) or the untouched marker (tag == 0), written host-to-device.
  void Fill(int tag) {
    std::vector<uint8_t> host(static_cast<size_t>(tensor_bytes));
    for (uint32_t t = 0; t < kTensors; ++t) {
      for (int64_t i = 0; i < tensor_bytes; ++i) {
        host[static_cast<size_t>(i)] = tag == 0 ? kUntouched : Pattern(tag, t, i);
      }
      CheckAcl(aclrtMemcpy(tensors[t], static_cast<size_t>(tensor_bytes), host.data(), host.size(),
                           ACL_MEMCPY_HOST_TO_DEVICE),
               "aclrtMemcpy host-to-device");
    }
  }
  // Tensor `t` read back device-to-host.
  std::vector<uint8_t> Read(uint32_t t) const {
    std::vector<uint8_t> host(static_cast<size_t>(tensor_bytes));
    CheckAcl(aclrtMemcpy(host.data(), host.size(), tensors[t], static_cast<size_t>(tensor_bytes),
                         ACL_MEMCPY_DEVICE_TO_HOST),
             "aclrtMemcpy device-to-host");
    return host;
  }
};

// Checks every byte of `dst` against `expected(tensor, offset)`; returns the number of mismatches
// (and prints the first few).
template <typename Expected>
int64_t Verify(const DeviceCache &dst, const std::string &what, Expected &&expected) {
  int64_t bad = 0;
  for (uint32_t t = 0; t < kTensors; ++t) {
    std::vector<uint8_t> got = dst.Read(t);
    for (int64_t i = 0; i < dst.tensor_bytes; ++i) {
      const uint8_t want = expected(t, i);
      if (got[static_cast<size_t>(i)] != want) {
        if (bad < 5) {
          std::fprintf(stderr, "%s: tensor %u byte %lld is 0x%02x, expected 0x%02x\n", what.c_str(),
                       t, static_cast<long long>(i), got[static_cast<size_t>(i)], want);
        }
        ++bad;
      }
    }
  }
  std::printf("%-44s %s (%lld bytes checked)\n", what.c_str(), bad == 0 ? "ok" : "MISMATCH",
              static_cast<long long>(dst.tensor_bytes * kTensors));
  return bad;
}

// One end of the control connection: newline-terminated text messages.
class Control {
 public:
  // Prefill: listen on `port` and accept one connection.  Decode: connect (the peer may not be
  // listening yet: retried until `timeout_s`).
  static Control Listen(int port) {
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr = Address(port);
    if (ls < 0 || bind(ls, reinterpret_cast<sockaddr *>(&addr), sizeof addr) != 0 ||
        listen(ls, 1) != 0) {
      Die("control socket: cannot listen on " + Endpoint(port));
    }
    int fd = accept(ls, nullptr, nullptr);
    close(ls);
    if (fd < 0) {
      Die("control socket: accept failed");
    }
    return Control(fd);
  }
  static Control Connect(int port, int timeout_s = 60) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
    while (true) {
      int fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr = Address(port);
      if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr *>(&addr), sizeof addr) == 0) {
        return Control(fd);
      }
      if (fd >= 0) {
        close(fd);
      }
      if (std::chrono::steady_clock::now() > deadline) {
        Die("control socket: nobody listens on " + Endpoint(port));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the peer is still starting
    }
  }
  Control(Control &&other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  ~Control() {
    if (fd_ >= 0) {
      close(fd_);
    }
  }

  void Send(const std::string &line) {
    const std::string msg = line + "\n";
    if (send(fd_, msg.data(), msg.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(msg.size())) {
      Die("control socket: send failed");
    }
  }
  // The next line; dies if the peer closed the connection (it failed).
  std::string Receive() {
    std::string line;
    char c = 0;
    while (true) {
      ssize_t n = recv(fd_, &c, 1, 0);
      if (n <= 0) {
        Die("control socket: the peer closed the connection (it failed)");
      }
      if (c == '\n') {
        return line;
      }
      line.push_back(c);
    }
  }
  // Receives "<word> <numbers...>", checking the word.
  std::vector<int64_t> Expect(const std::string &word) {
    std::string line = Receive();
    if (line.compare(0, word.size(), word) != 0) {
      Die("control socket: expected '" + word + "', got '" + line + "'");
    }
    std::vector<int64_t> numbers;
    const char *p = line.c_str() + word.size();
    char *end = nullptr;
    for (long long v = std::strtoll(p, &end, 10); end != p; v = std::strtoll(p, &end, 10)) {
      numbers.push_back(v);
      p = end;
    }
    return numbers;
  }

 private:
  explicit Control(int fd) : fd_(fd) {}
  static sockaddr_in Address(int port) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return addr;
  }
  int fd_;
};

// A ClusterInfo for linking to `remote_cluster_id` listening on `remote_port`.
inline llm_datadist::ClusterInfo Peer(uint64_t remote_cluster_id, llm_datadist::LlmRole remote_role,
                                      int remote_port) {
  llm_datadist::ClusterInfo info{};
  info.remote_cluster_id = remote_cluster_id;
  info.remote_role_type = static_cast<int32_t>(remote_role);
  llm_datadist::IpInfo local{};
  local.ip = "127.0.0.1";
  llm_datadist::IpInfo remote{};
  remote.ip = "127.0.0.1";
  remote.port = static_cast<uint16_t>(remote_port);
  info.local_ip_infos.push_back(local);
  info.remote_ip_infos.push_back(remote);
  return info;
}

inline void Link(llm_datadist::LlmDataDist &dd, const llm_datadist::ClusterInfo &peer) {
  std::vector<Status> rets;
  Check(dd.LinkLlmClusters({peer}, rets, 5000), "LinkLlmClusters");
  if (rets.size() != 1 || rets[0] != llm_datadist::LLM_SUCCESS) {
    Die("LinkLlmClusters: the per-cluster status is not LLM_SUCCESS");
  }
}

inline void Unlink(llm_datadist::LlmDataDist &dd, const llm_datadist::ClusterInfo &peer) {
  std::vector<Status> rets;
  Check(dd.UnlinkLlmClusters({peer}, rets, 5000), "UnlinkLlmClusters");
}

}  // namespace example

#endif  // KVDD_EXAMPLES_CPP_COMMON_H_
