/*
 * kvdd's simulated CANN root: external/ge_common/ge_api_types.h.
 *
 * Written by the kvdd project from kvdd's VENDOR.md (not the vendor header).  In a CANN install
 * llm_datadist.h reaches graph/tensor.h, exe_graph/runtime/ and utils/extern_math_util.h through
 * this header; kvdd's root keeps the same include chain, so code that relies on it compiles.
 * LLM-DataDist's API uses none of the metadef types those headers declare in CANN; kvdd's declare
 * only what its spec states (see each header).
 */
#ifndef KVDD_CANN_EXTERNAL_GE_COMMON_GE_API_TYPES_H_
#define KVDD_CANN_EXTERNAL_GE_COMMON_GE_API_TYPES_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "exe_graph/runtime/shape.h"
#include "exe_graph/runtime/tensor.h"
#include "graph/tensor.h"
#include "utils/extern_math_util.h"

#endif  // KVDD_CANN_EXTERNAL_GE_COMMON_GE_API_TYPES_H_
