/*
 * kvdd's simulated CANN root: every LLM-DataDist status code as ge::LLM_* (include/ge/, where a
 * CANN install puts this header).
 *
 * Written by the kvdd project from the status table of kvdd's API.md (values 0x5010B000 + n);
 * not the vendor header.  CANN's llm_datadist.h declares 18 of these as llm_datadist::LLM_* and
 * does not include this header; the twelve others (REPEAT_REQUEST, PREFIX_*, CACHE_*, ...) exist
 * only here, in namespace ge.
 */
#ifndef KVDD_CANN_GE_LLM_ERROR_CODES_H_
#define KVDD_CANN_GE_LLM_ERROR_CODES_H_

#include "external/ge_common/api_error_codes.h"

namespace ge {

constexpr Status LLM_WAIT_PROC_TIMEOUT = 0x5010B001U;
constexpr Status LLM_KV_CACHE_NOT_EXIST = 0x5010B002U;
constexpr Status LLM_REPEAT_REQUEST = 0x5010B003U;
constexpr Status LLM_REQUEST_ALREADY_COMPLETED = 0x5010B004U;
constexpr Status LLM_PARAM_INVALID = 0x5010B005U;
constexpr Status LLM_ENGINE_FINALIZED = 0x5010B006U;
constexpr Status LLM_NOT_YET_LINK = 0x5010B007U;
constexpr Status LLM_ALREADY_LINK = 0x5010B008U;
constexpr Status LLM_LINK_FAILED = 0x5010B009U;
constexpr Status LLM_UNLINK_FAILED = 0x5010B00AU;
constexpr Status LLM_NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00BU;
constexpr Status LLM_CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00CU;
constexpr Status LLM_PROCESSING_LINK = 0x5010B00DU;
constexpr Status LLM_DEVICE_OUT_OF_MEMORY = 0x5010B00EU;
constexpr Status LLM_PREFIX_ALREADY_EXIST = 0x5010B00FU;
constexpr Status LLM_PREFIX_NOT_EXIST = 0x5010B010U;
constexpr Status LLM_SEQ_LEN_OVER_LIMIT = 0x5010B011U;
constexpr Status LLM_NO_FREE_BLOCK = 0x5010B012U;
constexpr Status LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013U;
constexpr Status LLM_CACHE_INCOMPATIBLE = 0x5010B014U;
constexpr Status LLM_CACHE_KEY_ALREADY_EXIST = 0x5010B015U;
constexpr Status LLM_COPY_CACHE_FAILED = 0x5010B016U;
constexpr Status LLM_CACHE_ID_ALREADY_EXIST = 0x5010B017U;
constexpr Status LLM_EXIST_LINK = 0x5010B018U;
constexpr Status LLM_FEATURE_NOT_ENABLED = 0x5010B019U;
constexpr Status LLM_TIMEOUT = 0x5010B01AU;
constexpr Status LLM_LINK_BUSY = 0x5010B01BU;
constexpr Status LLM_OUT_OF_MEMORY = 0x5010B01CU;

}  // namespace ge

#endif  // KVDD_CANN_GE_LLM_ERROR_CODES_H_
