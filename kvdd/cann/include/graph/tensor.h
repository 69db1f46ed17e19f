/*
 * kvdd's simulated CANN root: graph/tensor.h (included through external/ge_common/ge_api_types.h,
 * as in a CANN install).
 *
 * Written by the kvdd project (not the vendor header).  CANN declares metadef's graph tensor
 * classes here; LLM-DataDist's API takes raw device addresses instead, so kvdd's root provides the
 * header (and what it brings in: ge::AscendString, ge::DataType) without those classes.
 */
#ifndef KVDD_CANN_GRAPH_TENSOR_H_
#define KVDD_CANN_GRAPH_TENSOR_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "graph/ascend_string.h"
#include "graph/types.h"

#endif  // KVDD_CANN_GRAPH_TENSOR_H_
