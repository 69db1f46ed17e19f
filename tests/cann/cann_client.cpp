// A C++ client compiled against kvdd's simulated CANN root as against a CANN install (built by
// tests/cann/test_cann_root.py and by .ci/native.sh with -Wall -Wextra -Werror): the status codes
// of ge/llm_error_codes.h (where a CANN install puts it), llm_datadist.h's include chain, and
// ge::AscendString's Find, Hash and comparison with a literal (defined in libmetadef.so).
// Needs only libmetadef.so at run time (no LlmDataDist is constructed).  Exit status 0 when every
// check passed; prints one line per check.
#include <cstdio>
#include <string>
#include <unordered_map>

#include "ge/llm_engine_types.h"
#include "ge/llm_error_codes.h"
#include "llm_datadist/llm_datadist.h"

namespace {

int g_failures = 0;

void Expect(bool ok, const char *what) {
  std::printf("%s %s\n", ok ? "ok" : "FAIL", what);
  if (!ok) {
    ++g_failures;
  }
}

}  // namespace

int main() {
  // ge::LLM_* (all thirty-odd codes) and llm_datadist::LLM_* (the 18 of llm_datadist.h) agree
  Expect(ge::LLM_PARAM_INVALID == llm_datadist::LLM_PARAM_INVALID, "ge::LLM_PARAM_INVALID");
  Expect(ge::LLM_REPEAT_REQUEST == 0x5010B003U, "ge::LLM_REPEAT_REQUEST = 0x5010B003");
  Expect(ge::LLM_OUT_OF_MEMORY == llm_datadist::LLM_OUT_OF_MEMORY, "ge::LLM_OUT_OF_MEMORY");
  Expect(std::string(llm::LLM_OPTION_SYNC_KV_CACHE_WAIT_TIME) ==
             llm_datadist::OPTION_SYNC_CACHE_WAIT_TIME,
         "llm::LLM_OPTION_SYNC_KV_CACHE_WAIT_TIME");

  const ge::AscendString ip("127.0.0.1");
  Expect(ip == "127.0.0.1", "AscendString == literal");
  Expect(!(ip != "127.0.0.1"), "AscendString != literal (equal)");
  Expect(ip != "127.0.0.2", "AscendString != literal (different)");
  Expect(ge::AscendString() == "", "empty AscendString == \"\"");
  Expect(ip.Find(ge::AscendString("0.0")) == 4U, "Find of a substring");
  Expect(ip.Find(ge::AscendString("10.")) == std::string::npos, "Find of an absent string");
  Expect(ip.Hash() == ge::AscendString("127.0.0.1").Hash(), "equal strings hash equal");
  Expect(ip.Hash() != ge::AscendString("127.0.0.2").Hash(), "different strings hash apart");

  std::unordered_map<ge::AscendString, int> by_name;  // std::hash<ge::AscendString>
  by_name[ge::AscendString(llm_datadist::OPTION_DEVICE_ID)] = 1;
  by_name["llm.ListenIpInfo"] = 2;
  Expect(by_name.at(ge::AscendString("llm.DeviceId")) == 1 && by_name.size() == 2U,
         "std::unordered_map<ge::AscendString, int>");
  return g_failures == 0 ? 0 : 1;
}
