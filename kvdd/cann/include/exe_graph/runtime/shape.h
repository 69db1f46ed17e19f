/*
 * kvdd's simulated CANN root: exe_graph/runtime/shape.h (included through
 * external/ge_common/ge_api_types.h, as in a CANN install).
 *
 * Written by the kvdd project (not the vendor header).  CANN declares metadef's runtime shape
 * types here; LLM-DataDist's API describes shapes as std::vector<int64_t> (CacheDesc::shape), so
 * kvdd's root provides the header without them.
 */
#ifndef KVDD_CANN_EXE_GRAPH_RUNTIME_SHAPE_H_
#define KVDD_CANN_EXE_GRAPH_RUNTIME_SHAPE_H_

#include <cstddef>
#include <cstdint>

#endif  // KVDD_CANN_EXE_GRAPH_RUNTIME_SHAPE_H_
