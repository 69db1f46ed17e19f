/*
 * kvdd simulated CANN root: ge::AscendString.
 *
 * Written by the kvdd project from the facts in kvdd's spec (VENDOR.md); this is not the vendor
 * header.  The class is constructible from `const char*` and `(const char*, size_t)`, exposes
 * GetString()/GetLength(), is ordered by operator< (it is the key type of the option maps), and
 * has Find, Hash and operator==/!= with a `const char*` (std::hash<ge::AscendString> uses Hash).
 * Like the real class, its methods are defined out of line in libmetadef.so, so the std::string
 * ABI (_GLIBCXX_USE_CXX11_ABI) of the caller and of the library must agree.
 */
#ifndef KVDD_CANN_GRAPH_ASCEND_STRING_H_
#define KVDD_CANN_GRAPH_ASCEND_STRING_H_

#include <cstddef>
#include <memory>
#include <string>

namespace ge {

class AscendString {
 public:
  AscendString() = default;
  ~AscendString() = default;
  AscendString(const char *name);                       // NOLINT: implicit, as upstream
  AscendString(const char *name, size_t length);

  const char *GetString() const;
  size_t GetLength() const;

  bool operator<(const AscendString &other) const;
  bool operator>(const AscendString &other) const;
  bool operator==(const AscendString &other) const;
  bool operator!=(const AscendString &other) const;
  bool operator<=(const AscendString &other) const;
  bool operator>=(const AscendString &other) const;
  bool operator==(const char *name) const;
  bool operator!=(const char *name) const;

  // The position of `ascend_string` in this string, std::string::npos when it does not occur.
  size_t Find(const AscendString &ascend_string) const;
  // A hash of the characters: equal strings hash equal.
  size_t Hash() const;

 private:
  std::shared_ptr<std::string> value_;
};

}  // namespace ge

namespace std {
template <>
struct hash<ge::AscendString> {
  size_t operator()(const ge::AscendString &name) const { return name.Hash(); }
};
}  // namespace std

#endif  // KVDD_CANN_GRAPH_ASCEND_STRING_H_
