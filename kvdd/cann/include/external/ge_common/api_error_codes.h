/*
 * kvdd simulated CANN root: ge::Status and the headers the llm_datadist header pulls in through it.
 *
 * Written by the kvdd project from kvdd's VENDOR.md (not the vendor header).  Newer CANN releases
 * ship this file as external/ge_common/api_error_codes.h, older ones as
 * external/ge_common/ge_api_error_codes.h; kvdd provides both names.
 */
#ifndef KVDD_CANN_EXTERNAL_GE_COMMON_API_ERROR_CODES_H_
#define KVDD_CANN_EXTERNAL_GE_COMMON_API_ERROR_CODES_H_

#include <cstdint>

#include "graph/ascend_string.h"
#include "graph/types.h"

namespace ge {

using Status = uint32_t;

constexpr Status SUCCESS = 0U;
constexpr Status FAILED = 0xFFFFFFFFU;

}  // namespace ge

#endif  // KVDD_CANN_EXTERNAL_GE_COMMON_API_ERROR_CODES_H_
