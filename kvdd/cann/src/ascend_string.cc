// kvdd's simulated CANN root: ge::AscendString, defined out of line as in CANN's libmetadef.so.
// Written by the kvdd project; see include/graph/ascend_string.h.
#include "graph/ascend_string.h"

#include <cstring>
#include <functional>
#include <string>

namespace ge {

AscendString::AscendString(const char *name) {
  if (name != nullptr) {
    value_ = std::make_shared<std::string>(name);
  }
}

AscendString::AscendString(const char *name, size_t length) {
  if (name != nullptr) {
    value_ = std::make_shared<std::string>(name, length);
  }
}

const char *AscendString::GetString() const {
  return value_ == nullptr ? "" : value_->c_str();
}

size_t AscendString::GetLength() const {
  return value_ == nullptr ? 0U : value_->size();
}

namespace {
int Compare(const std::shared_ptr<std::string> &a, const std::shared_ptr<std::string> &b) {
  static const std::string kEmpty;
  const std::string &lhs = a == nullptr ? kEmpty : *a;
  const std::string &rhs = b == nullptr ? kEmpty : *b;
  return lhs.compare(rhs);
}
}  // namespace

bool AscendString::operator<(const AscendString &other) const { return Compare(value_, other.value_) < 0; }
bool AscendString::operator>(const AscendString &other) const { return Compare(value_, other.value_) > 0; }
bool AscendString::operator==(const AscendString &other) const { return Compare(value_, other.value_) == 0; }
bool AscendString::operator!=(const AscendString &other) const { return Compare(value_, other.value_) != 0; }
bool AscendString::operator<=(const AscendString &other) const { return Compare(value_, other.value_) <= 0; }
bool AscendString::operator>=(const AscendString &other) const { return Compare(value_, other.value_) >= 0; }

bool AscendString::operator==(const char *name) const {
  return std::strcmp(GetString(), name == nullptr ? "" : name) == 0;
}

bool AscendString::operator!=(const char *name) const { return !(*this == name); }

size_t AscendString::Find(const AscendString &ascend_string) const {
  static const std::string kEmpty;
  const std::string &haystack = value_ == nullptr ? kEmpty : *value_;
  return haystack.find(ascend_string.GetString(), 0, ascend_string.GetLength());
}

size_t AscendString::Hash() const {
  static const std::string kEmpty;
  return std::hash<std::string>()(value_ == nullptr ? kEmpty : *value_);
}

}  // namespace ge
