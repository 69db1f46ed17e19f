/*
 * kvdd's simulated CANN root: utils/extern_math_util.h (included through
 * external/ge_common/ge_api_types.h, as in a CANN install).
 *
 * Written by the kvdd project (not the vendor header).  CANN keeps metadef's arithmetic helpers
 * here; LLM-DataDist's API needs none of them, so kvdd's root provides the header without them.
 */
#ifndef KVDD_CANN_UTILS_EXTERN_MATH_UTIL_H_
#define KVDD_CANN_UTILS_EXTERN_MATH_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <limits>

#endif  // KVDD_CANN_UTILS_EXTERN_MATH_UTIL_H_
