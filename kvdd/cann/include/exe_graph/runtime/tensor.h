/*
 * kvdd's simulated CANN root: exe_graph/runtime/tensor.h (included through
 * external/ge_common/ge_api_types.h, as in a CANN install).
 *
 * Written by the kvdd project (not the vendor header).  CANN declares metadef's runtime tensor
 * types here; LLM-DataDist's API uses none of them, so kvdd's root provides the header without
 * them.
 */
#ifndef KVDD_CANN_EXE_GRAPH_RUNTIME_TENSOR_H_
#define KVDD_CANN_EXE_GRAPH_RUNTIME_TENSOR_H_

#include <cstddef>
#include <cstdint>

#include "exe_graph/runtime/shape.h"
#include "graph/types.h"

#endif  // KVDD_CANN_EXE_GRAPH_RUNTIME_TENSOR_H_
