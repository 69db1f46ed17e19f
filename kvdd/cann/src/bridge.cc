// kvdd's simulated CANN root: libkvdd_simbridge.so, the simulator side of libllm_datadist.so.
//
// Written by the kvdd project (not derived from vendor code).  Each Engine method converts its C++
// arguments back into kvdd value types (kvdd.types) and calls the method of the same name (Backend
// protocol, API.md) on a kvdd.sim.engine.SimBackend created by the constructor, then converts the
// result back into the C++ outputs the way upstream fills them:
//   * the status is returned unchanged;
//   * per-cluster statuses are APPENDED to the caller's `rets` (never cleared, SEMANTICS.md §7.17);
//   * RegisterKvCache writes `cache_id` only on success; AllocateCache fills `cache` only on
//     success.
// So every field a caller (kvdd's binding, or a C++ program) passes reaches the simulator.
//
// This library is loaded (dlopen, by libllm_datadist.so) only into a process where CPython's
// symbols are visible: a Python process, or a C++ process after libllm_datadist.so loaded
// libpython and libkvdd_pyembed.so started the interpreter.  It does not link libpython and uses
// only the stable ABI (Py_LIMITED_API 3.10), so one build works with any CPython >= 3.10.
// A Python exception raised by the simulator becomes std::runtime_error carrying the Python
// exception type and message.
#include "pyref.h"

namespace kvdd_cann {
namespace {

class SimEngine final : public Engine {
 public:
  SimEngine(uint64_t cluster_id, int32_t role) {
    Gil gil;
    // Looked up at every construction, so a test can replace kvdd.sim.engine.SimBackend.
    Ref engine_module(Check(PyImport_ImportModule("kvdd.sim.engine"), "import kvdd.sim.engine"));
    types_ = Ref(Check(PyImport_ImportModule("kvdd.types"), "import kvdd.types"));
    Ref cls = GetAttr(engine_module.get(), "SimBackend");
    Ref cid = UInt(cluster_id);
    Ref r = Int(role);
    engine_ = Ref(Check(PyObject_CallFunctionObjArgs(cls.get(), cid.get(), r.get(), nullptr),
                        "SimBackend(cluster_id, role)"));
  }

  ~SimEngine() override {
    if (!Py_IsInitialized()) {
      // The interpreter is gone: nothing can be released safely; leak the references.
      (void)engine_.release();
      (void)types_.release();
      for (auto &kv : memo_) {
        (void)kv.second.release();
      }
      return;
    }
    Gil gil;
    if (engine_.get() != nullptr) {
      // Upstream's destructor tears a still-initialized instance down, and frees a port that a
      // failed Initialize left bound (SEMANTICS.md §3.1, §3.2 step 10): SimBackend.destroy().
      const char *method = PyObject_HasAttrString(engine_.get(), "destroy") ? "destroy" : "finalize";
      Ref r(PyObject_CallMethod(engine_.get(), method, nullptr));
      if (r.get() == nullptr) {
        PyErr_Clear();
      }
    }
    memo_.clear();
    engine_ = Ref();
    types_ = Ref();
  }

  // ---- C++ -> kvdd.types -------------------------------------------------------------------

  Ref Make(const char *type_name, PyObject *kwargs) {
    Ref cls = GetAttr(types_.get(), type_name);
    return CallKw(cls.get(), kwargs, std::string("kvdd.types.") + type_name + "(...)");
  }

  static Ref OptionsDict(const Options &options) {
    Ref dict(Check(PyDict_New(), "dict"));
    for (const auto &kv : options) {
      Ref key = Str(kv.first);
      Ref value = Str(kv.second);
      if (PyDict_SetItem(dict.get(), key.get(), value.get()) != 0) {
        ThrowPythonError("options dict");
      }
    }
    return dict;
  }

  Ref ToPy(const IpInfo &info) {
    Ref kw(Check(PyDict_New(), "dict"));
    SetItem(kw.get(), "ip", Str(info.ip));
    SetItem(kw.get(), "port", UInt(info.port));
    return Make("IpInfo", kw.get());
  }

  Ref ToPy(const ClusterInfo &cluster) {
    Ref kw(Check(PyDict_New(), "dict"));
    SetItem(kw.get(), "remote_cluster_id", UInt(cluster.remote_cluster_id));
    SetItem(kw.get(), "remote_role_type", Int(cluster.remote_role_type));
    SetItem(kw.get(), "local_ip_infos",
            Tuple(cluster.local_ip_infos, [this](const IpInfo &i) { return ToPy(i); }));
    SetItem(kw.get(), "remote_ip_infos",
            Tuple(cluster.remote_ip_infos, [this](const IpInfo &i) { return ToPy(i); }));
    return Make("ClusterInfo", kw.get());
  }

  // kvdd.types values are immutable: a struct passed again with the same fields (the usual case:
  // a serving loop reuses its CacheIndex, Cache and KvCacheExtParam) reuses the Python value built
  // for it, which saves most of the per-call conversion.  Bounded; cleared when full.
  template <typename F>
  Ref Memoized(std::vector<int64_t> key, F &&make) {
    auto it = memo_.find(key);
    if (it != memo_.end()) {
      Py_INCREF(it->second.get());
      return Ref(it->second.get());
    }
    Ref value = make();
    if (memo_.size() >= 64) {
      memo_.clear();
    }
    Py_INCREF(value.get());
    memo_.emplace(std::move(key), Ref(value.get()));
    return value;
  }

  static void DescKey(std::vector<int64_t> &key, const CacheDesc &desc) {
    key.push_back(static_cast<int64_t>(desc.placement));
    key.push_back(static_cast<int64_t>(desc.num_tensors));
    key.push_back(static_cast<int64_t>(desc.data_type));
    key.push_back(static_cast<int64_t>(desc.shape.size()));
    key.insert(key.end(), desc.shape.begin(), desc.shape.end());
  }

  Ref ToPy(const CacheDesc &desc) {
    std::vector<int64_t> key = {1};
    DescKey(key, desc);
    return Memoized(std::move(key), [&] { return Convert(desc); });
  }

  Ref ToPy(const Cache &cache) {
    std::vector<int64_t> key = {2, cache.cache_id};
    DescKey(key, cache.cache_desc);
    for (uintptr_t a : cache.tensor_addrs) {
      key.push_back(static_cast<int64_t>(a));
    }
    return Memoized(std::move(key), [&] { return Convert(cache); });
  }

  Ref ToPy(const CacheIndex &index) {
    return Memoized({3, static_cast<int64_t>(index.cluster_id), index.cache_id,
                     static_cast<int64_t>(index.batch_index)},
                    [&] { return Convert(index); });
  }

  Ref ToPy(const KvCacheExtParam &param) {
    return Memoized({4, param.src_layer_range.first, param.src_layer_range.second,
                     param.dst_layer_range.first, param.dst_layer_range.second,
                     static_cast<int64_t>(param.tensor_num_per_layer)},
                    [&] { return Convert(param); });
  }

  Ref Convert(const CacheDesc &desc) {
    Ref kw(Check(PyDict_New(), "dict"));
    SetItem(kw.get(), "num_tensors", UInt(desc.num_tensors));
    // ge::DataType has no fixed underlying type; kvdd stores any int32 in it.
    SetItem(kw.get(), "data_type", Int(static_cast<int32_t>(desc.data_type)));
    SetItem(kw.get(), "shape", Tuple(desc.shape, [](int64_t d) { return Int(d); }));
    SetItem(kw.get(), "placement", UInt(static_cast<uint32_t>(desc.placement)));
    return Make("CacheDesc", kw.get());
  }

  Ref Convert(const Cache &cache) {
    Ref kw(Check(PyDict_New(), "dict"));
    SetItem(kw.get(), "cache_id", Int(cache.cache_id));
    SetItem(kw.get(), "tensor_addrs",
            Tuple(cache.tensor_addrs, [](uintptr_t a) { return UInt(static_cast<uint64_t>(a)); }));
    SetItem(kw.get(), "cache_desc", Convert(cache.cache_desc));
    return Make("Cache", kw.get());
  }

  Ref Convert(const CacheIndex &index) {
    Ref kw(Check(PyDict_New(), "dict"));
    SetItem(kw.get(), "cluster_id", UInt(index.cluster_id));
    SetItem(kw.get(), "cache_id", Int(index.cache_id));
    SetItem(kw.get(), "batch_index", UInt(index.batch_index));
    return Make("CacheIndex", kw.get());
  }

  Ref Convert(const KvCacheExtParam &param) {
    Ref kw(Check(PyDict_New(), "dict"));
    Ref src(Check(PyTuple_New(2), "tuple"));
    Ref dst(Check(PyTuple_New(2), "tuple"));
    PyTuple_SetItem(src.get(), 0, Int(param.src_layer_range.first).release());
    PyTuple_SetItem(src.get(), 1, Int(param.src_layer_range.second).release());
    PyTuple_SetItem(dst.get(), 0, Int(param.dst_layer_range.first).release());
    PyTuple_SetItem(dst.get(), 1, Int(param.dst_layer_range.second).release());
    SetItem(kw.get(), "src_layer_range", src);
    SetItem(kw.get(), "dst_layer_range", dst);
    SetItem(kw.get(), "tensor_num_per_layer", UInt(param.tensor_num_per_layer));
    return Make("KvCacheExtParam", kw.get());
  }

  Ref ToPy(const RegisterCfg &) {
    Ref kw(Check(PyDict_New(), "dict"));
    return Make("RegisterCfg", kw.get());
  }

  static Ref Blocks(const std::vector<uint64_t> &blocks) {
    return List(blocks, [](uint64_t b) { return UInt(b); });
  }

  // ---- calls ----------------------------------------------------------------------------------

  // Calls engine.<method>(*args) and returns the result.  GIL held.
  template <typename... Args>
  Ref Call(const char *method, const Args &...args) {
    Ref bound = GetAttr(engine_.get(), method);
    Ref tuple(Check(PyTuple_Pack(sizeof...(Args), args.get()...),
                    std::string("arguments of ") + method));
    return Ref(Check(PyObject_Call(bound.get(), tuple.get(), nullptr),
                     std::string("kvdd.sim.engine.SimBackend.") + method));
  }

  Status CallStatus(const char *method, Ref result) {
    return AsStatus(result.get(), std::string("SimBackend.") + method);
  }

  Status CallWithRets(const char *method, Ref result, std::vector<Status> &rets) {
    const std::string where = std::string("SimBackend.") + method;
    auto out = StatusAndOutput(std::move(result), where);
    Ref seq(Check(PySequence_List(out.second.get()), where + " per-cluster statuses"));
    const Py_ssize_t n = PyList_Size(seq.get());
    for (Py_ssize_t i = 0; i < n; ++i) {
      rets.push_back(AsStatus(PyList_GetItem(seq.get(), i), where));  // appended, never cleared
    }
    return out.first;
  }

  void FillCache(PyObject *py_cache, Cache &cache) {
    Ref cache_id = GetAttr(py_cache, "cache_id");
    Ref addrs = GetAttr(py_cache, "tensor_addrs");
    Ref desc = GetAttr(py_cache, "cache_desc");
    Ref num_tensors = GetAttr(desc.get(), "num_tensors");
    Ref data_type = GetAttr(desc.get(), "data_type");
    Ref shape = GetAttr(desc.get(), "shape");
    Ref placement = GetAttr(desc.get(), "placement");
    Cache out{};
    out.cache_id = AsInt64(cache_id.get(), "Cache.cache_id");
    Ref addr_list(Check(PySequence_List(addrs.get()), "Cache.tensor_addrs"));
    for (Py_ssize_t i = 0; i < PyList_Size(addr_list.get()); ++i) {
      out.tensor_addrs.push_back(
          static_cast<uintptr_t>(AsUInt64(PyList_GetItem(addr_list.get(), i), "tensor address")));
    }
    out.cache_desc.num_tensors = static_cast<uint32_t>(AsUInt64(num_tensors.get(), "num_tensors"));
    out.cache_desc.data_type = static_cast<DataType>(AsInt64(data_type.get(), "data_type"));
    out.cache_desc.placement = static_cast<CachePlacement>(AsUInt64(placement.get(), "placement"));
    Ref shape_list(Check(PySequence_List(shape.get()), "CacheDesc.shape"));
    for (Py_ssize_t i = 0; i < PyList_Size(shape_list.get()); ++i) {
      out.cache_desc.shape.push_back(AsInt64(PyList_GetItem(shape_list.get(), i), "shape"));
    }
    cache = std::move(out);
  }

  int ListenPort() override {
    Gil gil;
    Ref port(PyObject_GetAttrString(engine_.get(), "listen_port"));
    if (port.get() == nullptr) {
      PyErr_Clear();
      return -2;
    }
    if (port.get() == Py_None) {
      return -1;
    }
    long v = PyLong_AsLong(port.get());
    if (v == -1 && PyErr_Occurred() != nullptr) {
      PyErr_Clear();
      return -2;
    }
    return static_cast<int>(v);
  }

  std::string LastErrorDetail() override {
    Gil gil;
    Ref detail(PyObject_CallMethod(engine_.get(), "last_error_detail", nullptr));
    if (detail.get() == nullptr) {
      PyErr_Clear();
      return "";
    }
    return detail.get() == Py_None ? std::string() : PyText(detail.get());
  }

  int32_t DeviceId() override {
    Gil gil;
    Ref id(PyObject_GetAttrString(engine_.get(), "device_id"));
    if (id.get() == nullptr) {
      PyErr_Clear();
      return 0;
    }
    long v = PyLong_AsLong(id.get());
    if (v == -1 && PyErr_Occurred() != nullptr) {
      PyErr_Clear();
      return 0;
    }
    return static_cast<int32_t>(v);
  }

  // ---- the LlmDataDist methods ----------------------------------------------------------------

  Status Initialize(const Options &options) override {
    Gil gil;
    Ref opts = OptionsDict(options);
    return CallStatus("initialize", Call("initialize", opts));
  }

  void Finalize() override {
    Gil gil;
    Ref result = Call("finalize");
    (void)result;
  }

  Status SetRole(LlmRole role, const Options &options) override {
    Gil gil;
    Ref r = Int(static_cast<int32_t>(role));
    Ref opts = OptionsDict(options);
    return CallStatus("set_role", Call("set_role", r, opts));
  }

  Status LinkLlmClusters(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets,
                         int32_t timeout_in_millis) override {
    Gil gil;
    Ref py_clusters = List(clusters, [this](const ClusterInfo &c) { return ToPy(c); });
    Ref timeout = Int(timeout_in_millis);
    return CallWithRets("link_llm_clusters", Call("link_llm_clusters", py_clusters, timeout),
                        rets);
  }

  Status UnlinkLlmClusters(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets,
                           int32_t timeout_in_millis, bool force_flag) override {
    Gil gil;
    Ref py_clusters = List(clusters, [this](const ClusterInfo &c) { return ToPy(c); });
    Ref timeout = Int(timeout_in_millis);
    Ref force(Check(PyBool_FromLong(force_flag ? 1 : 0), "bool"));
    return CallWithRets("unlink_llm_clusters",
                        Call("unlink_llm_clusters", py_clusters, timeout, force), rets);
  }

  Status AllocateCache(const CacheDesc &cache_desc, Cache &cache) override {
    Gil gil;
    Ref desc = ToPy(cache_desc);
    auto out = StatusAndOutput(Call("allocate_cache", desc), "SimBackend.allocate_cache");
    if (out.first == llm_datadist::LLM_SUCCESS && out.second.get() != Py_None) {
      FillCache(out.second.get(), cache);  // the output is written only on success
    }
    return out.first;
  }

  Status DeallocateCache(int64_t cache_id) override {
    Gil gil;
    Ref id = Int(cache_id);
    return CallStatus("deallocate_cache", Call("deallocate_cache", id));
  }

  Status PullKvCache(const CacheIndex &src_cache_index, const Cache &dst_cache,
                     uint32_t batch_index, int64_t size, const KvCacheExtParam &ext_param) override {
    Gil gil;
    Ref index = ToPy(src_cache_index);
    Ref cache = ToPy(dst_cache);
    Ref batch = UInt(batch_index);
    Ref sz = Int(size);
    Ref ext = ToPy(ext_param);
    return CallStatus("pull_kv_cache", Call("pull_kv_cache", index, cache, batch, sz, ext));
  }

  Status PullKvBlocks(const CacheIndex &src_cache_index, const Cache &dst_cache,
                      const std::vector<uint64_t> &src_blocks,
                      const std::vector<uint64_t> &dst_blocks,
                      const KvCacheExtParam &ext_param) override {
    Gil gil;
    Ref index = ToPy(src_cache_index);
    Ref cache = ToPy(dst_cache);
    Ref src = Blocks(src_blocks);
    Ref dst = Blocks(dst_blocks);
    Ref ext = ToPy(ext_param);
    return CallStatus("pull_kv_blocks", Call("pull_kv_blocks", index, cache, src, dst, ext));
  }

  Status CopyKvCache(const Cache &src_cache, const Cache &dst_cache, uint32_t src_batch_index,
                     uint32_t dst_batch_index, uint64_t offset, int64_t size) override {
    Gil gil;
    Ref src = ToPy(src_cache);
    Ref dst = ToPy(dst_cache);
    Ref src_batch = UInt(src_batch_index);
    Ref dst_batch = UInt(dst_batch_index);
    Ref off = UInt(offset);
    Ref sz = Int(size);
    return CallStatus("copy_kv_cache",
                      Call("copy_kv_cache", src, dst, src_batch, dst_batch, off, sz));
  }

  Status CopyKvBlocks(const Cache &src_cache, const Cache &dst_cache,
                      const std::vector<uint64_t> &src_blocks,
                      const std::vector<std::vector<uint64_t>> &dst_blocks_list) override {
    Gil gil;
    Ref src = ToPy(src_cache);
    Ref dst = ToPy(dst_cache);
    Ref src_b = Blocks(src_blocks);
    Ref dst_list = List(dst_blocks_list, [](const std::vector<uint64_t> &b) { return Blocks(b); });
    return CallStatus("copy_kv_blocks", Call("copy_kv_blocks", src, dst, src_b, dst_list));
  }

  Status PushKvCache(const Cache &src_cache, const CacheIndex &dst_cache_index,
                     uint32_t src_batch_index, int64_t size,
                     const KvCacheExtParam &ext_param) override {
    Gil gil;
    Ref cache = ToPy(src_cache);
    Ref index = ToPy(dst_cache_index);
    Ref batch = UInt(src_batch_index);
    Ref sz = Int(size);
    Ref ext = ToPy(ext_param);
    return CallStatus("push_kv_cache", Call("push_kv_cache", cache, index, batch, sz, ext));
  }

  Status PushKvBlocks(const Cache &src_cache, const CacheIndex &dst_cache_index,
                      const std::vector<uint64_t> &src_blocks,
                      const std::vector<uint64_t> &dst_blocks,
                      const KvCacheExtParam &ext_param) override {
    Gil gil;
    Ref cache = ToPy(src_cache);
    Ref index = ToPy(dst_cache_index);
    Ref src = Blocks(src_blocks);
    Ref dst = Blocks(dst_blocks);
    Ref ext = ToPy(ext_param);
    return CallStatus("push_kv_blocks", Call("push_kv_blocks", cache, index, src, dst, ext));
  }

  Status RegisterKvCache(const CacheDesc &cache_desc, const std::vector<uint64_t> &addrs,
                         const RegisterCfg &cfg, int64_t &cache_id) override {
    Gil gil;
    Ref desc = ToPy(cache_desc);
    Ref py_addrs = Blocks(addrs);
    Ref py_cfg = ToPy(cfg);
    auto out = StatusAndOutput(Call("register_kv_cache", desc, py_addrs, py_cfg),
                               "SimBackend.register_kv_cache");
    if (out.first == llm_datadist::LLM_SUCCESS) {  // the output is written only on success
      cache_id = AsInt64(out.second.get(), "cache id");
    }
    return out.first;
  }

  Status UnregisterKvCache(int64_t cache_id) override {
    Gil gil;
    Ref id = Int(cache_id);
    return CallStatus("unregister_kv_cache", Call("unregister_kv_cache", id));
  }

 private:
  Ref types_;
  Ref engine_;
  std::map<std::vector<int64_t>, Ref> memo_;
};

}  // namespace
}  // namespace kvdd_cann

extern "C" __attribute__((visibility("default"))) int kvdd_bridge_check_root(const char *root,
                                                                             char *error,
                                                                             size_t error_size) {
  using namespace kvdd_cann;
  std::string why;
  try {
    Gil gil;
    Ref module(Check(PyImport_ImportModule("kvdd.cann"), "import kvdd.cann"));
    Ref fn = GetAttr(module.get(), "root_problem");
    Ref arg(Check(PyUnicode_DecodeFSDefault(root), "root path"));
    Ref result(Check(PyObject_CallFunctionObjArgs(fn.get(), arg.get(), nullptr),
                     "kvdd.cann.root_problem"));
    if (result.get() != Py_None) {
      why = PyText(result.get());
    }
  } catch (const std::exception &exc) {
    why = exc.what();
  }
  if (why.empty()) {
    return 0;
  }
  std::snprintf(error, error_size, "%s", why.c_str());
  return -1;
}

extern "C" __attribute__((visibility("default"))) kvdd_cann::Engine *kvdd_bridge_create(
    uint64_t cluster_id, int32_t role, char *error, size_t error_size) {
  try {
    return new kvdd_cann::SimEngine(cluster_id, role);
  } catch (const std::exception &exc) {
    std::snprintf(error, error_size, "%s", exc.what());
  } catch (...) {
    std::snprintf(error, error_size, "unknown C++ exception while creating the simulator engine");
  }
  return nullptr;
}
