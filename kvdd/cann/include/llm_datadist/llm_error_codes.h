/*
 * kvdd's simulated CANN root: the LLM-DataDist status codes that CANN's llm_datadist.h does not
 * declare.
 *
 * Written by the kvdd project from the status table of kvdd's SEMANTICS.md section 1 (values
 * 0x5010B000 + n); not the vendor header.  CANN declares these twelve only in namespace ge, in a
 * header that llm_datadist.h does not include; code written against llm_datadist.h alone cannot
 * name them as llm_datadist::LLM_*.
 */
#ifndef KVDD_CANN_LLM_DATADIST_LLM_ERROR_CODES_H_
#define KVDD_CANN_LLM_DATADIST_LLM_ERROR_CODES_H_

#include "external/ge_common/api_error_codes.h"

namespace ge {

constexpr Status LLM_REPEAT_REQUEST = 0x5010B003U;
constexpr Status LLM_REQUEST_ALREADY_COMPLETED = 0x5010B004U;
constexpr Status LLM_ENGINE_FINALIZED = 0x5010B006U;
constexpr Status LLM_PREFIX_ALREADY_EXIST = 0x5010B00FU;
constexpr Status LLM_PREFIX_NOT_EXIST = 0x5010B010U;
constexpr Status LLM_SEQ_LEN_OVER_LIMIT = 0x5010B011U;
constexpr Status LLM_NO_FREE_BLOCK = 0x5010B012U;
constexpr Status LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013U;
constexpr Status LLM_CACHE_INCOMPATIBLE = 0x5010B014U;
constexpr Status LLM_CACHE_KEY_ALREADY_EXIST = 0x5010B015U;
constexpr Status LLM_COPY_CACHE_FAILED = 0x5010B016U;
constexpr Status LLM_CACHE_ID_ALREADY_EXIST = 0x5010B017U;

}  // namespace ge

#endif  // KVDD_CANN_LLM_DATADIST_LLM_ERROR_CODES_H_
