/*
 * kvdd simulated CANN root: the older CANN name of external/ge_common/api_error_codes.h.
 */
#ifndef KVDD_CANN_EXTERNAL_GE_COMMON_GE_API_ERROR_CODES_H_
#define KVDD_CANN_EXTERNAL_GE_COMMON_GE_API_ERROR_CODES_H_

#include "external/ge_common/api_error_codes.h"

#endif  // KVDD_CANN_EXTERNAL_GE_COMMON_GE_API_ERROR_CODES_H_
