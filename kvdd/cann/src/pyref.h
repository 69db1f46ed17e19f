// kvdd's simulated CANN root: the Python C API helpers of libkvdd_simbridge.so (owned references,
// the GIL, conversions, turning Python exceptions into std::runtime_error).  Internal; included
// by bridge.cc only.  Stable ABI (Py_LIMITED_API 3.10).
#ifndef KVDD_CANN_SRC_PYREF_H_
#define KVDD_CANN_SRC_PYREF_H_

#define PY_SSIZE_T_CLEAN
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000
#endif
#include <Python.h>

#include <pthread.h>
#include <signal.h>
#include <time.h>

#include <cstdint>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <map>
#include <unordered_map>
#include <utility>
#include <vector>

#include <cstdio>

#include "engine.h"

namespace kvdd_cann {
namespace {

using llm_datadist::CachePlacement;
using llm_datadist::DataType;
using llm_datadist::IpInfo;


// Holds the GIL for its lifetime.  Declare it before any Ref so that it is released last.
//
// It also blocks SIGPIPE on the calling thread meanwhile: the embedded interpreter installs no
// signal handler (the C++ program keeps its own), so SIGPIPE keeps its default action, and a
// send of the simulator's to a peer that died would kill the program (EPIPE raises it on the
// sending thread).  Blocked, the send fails with EPIPE, which the fabric reports as a status; a
// SIGPIPE left pending by the call is taken off before the program's mask is restored.  The
// simulator's own threads, started during calls, inherit the blocked mask.
class Gil {
 public:
  Gil() {
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, &saved_);
    state_ = PyGILState_Ensure();
  }
  ~Gil() {
    PyGILState_Release(state_);
    if (sigismember(&saved_, SIGPIPE) == 0) {  // (a nested Gil leaves it to the outer one)
      sigset_t pipe, pending;
      sigemptyset(&pipe);
      sigaddset(&pipe, SIGPIPE);
      if (sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1) {
        const struct timespec now = {0, 0};
        (void)sigtimedwait(&pipe, nullptr, &now);
      }
      pthread_sigmask(SIG_SETMASK, &saved_, nullptr);
    }
  }
  Gil(const Gil &) = delete;
  Gil &operator=(const Gil &) = delete;

 private:
  sigset_t saved_;
  PyGILState_STATE state_;
};

// An owned (strong) reference.
class Ref {
 public:
  Ref() = default;
  explicit Ref(PyObject *p) : p_(p) {}
  ~Ref() { Py_XDECREF(p_); }
  Ref(const Ref &) = delete;
  Ref &operator=(const Ref &) = delete;
  Ref(Ref &&other) noexcept : p_(other.p_) { other.p_ = nullptr; }
  Ref &operator=(Ref &&other) noexcept {
    if (this != &other) {
      Py_XDECREF(p_);
      p_ = other.p_;
      other.p_ = nullptr;
    }
    return *this;
  }
  PyObject *get() const { return p_; }
  PyObject *release() {
    PyObject *p = p_;
    p_ = nullptr;
    return p;
  }

 private:
  PyObject *p_ = nullptr;
};

std::string PyText(PyObject *obj) {
  if (obj == nullptr) {
    return "<null>";
  }
  Ref s(PyObject_Str(obj));
  if (s.get() == nullptr) {
    PyErr_Clear();
    return "<unprintable>";
  }
  Py_ssize_t size = 0;
  const char *utf8 = PyUnicode_AsUTF8AndSize(s.get(), &size);
  if (utf8 == nullptr) {
    PyErr_Clear();
    return "<unprintable>";
  }
  return std::string(utf8, static_cast<size_t>(size));
}

// Turns the pending Python exception into a C++ exception.  GIL held.
[[noreturn]] void ThrowPythonError(const std::string &where) {
  PyObject *type = nullptr;
  PyObject *value = nullptr;
  PyObject *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  Ref type_ref(type);
  Ref value_ref(value);
  Ref tb_ref(traceback);
  std::string type_name = "<unknown>";
  if (type != nullptr) {
    Ref name(PyObject_GetAttrString(type, "__qualname__"));
    if (name.get() != nullptr) {
      type_name = PyText(name.get());
    } else {
      PyErr_Clear();
    }
  }
  throw std::runtime_error("kvdd simulated CANN root: Python exception in " + where + ": " + type_name +
                           ": " + PyText(value));
}

// Checks a new reference returned by the C API.
PyObject *Check(PyObject *obj, const std::string &where) {
  if (obj == nullptr) {
    ThrowPythonError(where);
  }
  return obj;
}

Ref Int(int64_t v) { return Ref(Check(PyLong_FromLongLong(v), "int conversion")); }
Ref UInt(uint64_t v) { return Ref(Check(PyLong_FromUnsignedLongLong(v), "int conversion")); }

Ref Str(const AscendString &s) {
  return Ref(Check(PyUnicode_DecodeUTF8(s.GetString(), static_cast<Py_ssize_t>(s.GetLength()),
                                        "strict"),
                   "option string decoding"));
}

void SetItem(PyObject *dict, const char *key, const Ref &value) {
  if (PyDict_SetItemString(dict, key, value.get()) != 0) {
    ThrowPythonError(std::string("building keyword ") + key);
  }
}

// Calls `callable(**kwargs)` where kwargs is built by the caller.
Ref CallKw(PyObject *callable, PyObject *kwargs, const std::string &where) {
  Ref args(Check(PyTuple_New(0), where));
  return Ref(Check(PyObject_Call(callable, args.get(), kwargs), where));
}

template <typename Seq, typename F>
Ref Tuple(const Seq &seq, F &&convert) {
  Ref tuple(Check(PyTuple_New(static_cast<Py_ssize_t>(seq.size())), "tuple"));
  Py_ssize_t i = 0;
  for (const auto &item : seq) {
    Ref value = convert(item);
    if (PyTuple_SetItem(tuple.get(), i++, value.release()) != 0) {  // steals
      ThrowPythonError("tuple");
    }
  }
  return tuple;
}

template <typename Seq, typename F>
Ref List(const Seq &seq, F &&convert) {
  Ref list(Check(PyList_New(0), "list"));
  for (const auto &item : seq) {
    Ref value = convert(item);
    if (PyList_Append(list.get(), value.get()) != 0) {
      ThrowPythonError("list");
    }
  }
  return list;
}

uint64_t AsUInt64(PyObject *obj, const char *what) {
  unsigned long long v = PyLong_AsUnsignedLongLong(obj);
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred() != nullptr) {
    ThrowPythonError(what);
  }
  return static_cast<uint64_t>(v);
}

int64_t AsInt64(PyObject *obj, const char *what) {
  long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred() != nullptr) {
    ThrowPythonError(what);
  }
  return static_cast<int64_t>(v);
}

Status AsStatus(PyObject *obj, const std::string &where) {
  if (!PyLong_Check(obj)) {
    throw std::runtime_error("kvdd simulated CANN root: " + where + " returned a non-int status: " +
                             PyText(obj));
  }
  uint64_t v = AsUInt64(obj, "status conversion");
  if (v > 0xFFFFFFFFULL) {
    throw std::runtime_error("kvdd simulated CANN root: " + where + " returned a status wider than 32 bits");
  }
  return static_cast<Status>(v);
}

Ref GetAttr(PyObject *obj, const char *name) {
  return Ref(Check(PyObject_GetAttrString(obj, name), std::string("reading attribute ") + name));
}

// Splits the `(status, output)` pair returned by several protocol methods.
std::pair<Status, Ref> StatusAndOutput(Ref result, const std::string &where) {
  if (!PyTuple_Check(result.get()) || PyTuple_Size(result.get()) != 2) {
    throw std::runtime_error("kvdd simulated CANN root: " + where +
                             " did not return a (status, output) tuple: " + PyText(result.get()));
  }
  PyObject *status = PyTuple_GetItem(result.get(), 0);  // borrowed
  PyObject *output = PyTuple_GetItem(result.get(), 1);  // borrowed
  Py_INCREF(output);
  return {AsStatus(status, where), Ref(output)};
}

}  // namespace
}  // namespace kvdd_cann

#endif  // KVDD_CANN_SRC_PYREF_H_
