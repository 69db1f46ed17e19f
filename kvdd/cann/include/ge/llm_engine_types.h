/*
 * kvdd's simulated CANN root: include/ge/llm_engine_types.h.
 *
 * Written by the kvdd project (not the vendor header).  In a CANN install this header carries the
 * option keys of LLM-DataDist's older engine interface in namespace llm; kvdd's root declares the
 * ones kvdd's spec documents (SEMANTICS.md §3.2: read or ignored by the V2 Initialize) so that code
 * including it compiles.  llm_datadist.h does not include it.
 */
#ifndef KVDD_CANN_GE_LLM_ENGINE_TYPES_H_
#define KVDD_CANN_GE_LLM_ENGINE_TYPES_H_

namespace llm {

constexpr const char LLM_OPTION_SYNC_KV_CACHE_WAIT_TIME[] = "llm.SyncKvCacheWaitTime";
constexpr const char LLM_OPTION_ENABLE_SWITCH_ROLE[] = "llm.EnableSwitchRole";
constexpr const char LLM_OPTION_BUF_POOL_CFG[] = "llm.BufPoolCfg";

}  // namespace llm

#endif  // KVDD_CANN_GE_LLM_ENGINE_TYPES_H_
