"""``kvdd demo``: a prefill and a decode instance move a real model's KV cache, verified byte for byte.

What runs
---------
Two ``kvdd.LlmDataDist`` instances, *prefill* (cluster 1, ``LlmRole.PROMPT``) and *decode* (cluster 2,
``LlmRole.DECODER``), by default in two OS processes on loopback (the parent runs decode, a
``multiprocessing`` spawn child runs prefill).  Both derive the same cache geometry from a model
(:data:`kvdd.models.MODELS` or a Hugging Face ``config.json``, or a model directory holding one) and a workload (requests x tokens, block size).

* Prefill listens (``llm.ListenIpInfo``), allocates a paged cache (``[blocks, block_size, *token]``,
  one tensor per K and V of every layer, or one per layer for each MLA component) and a contiguous
  cache (``[requests, tokens, *token]``), fills both with deterministic position-dependent data
  (:class:`Pattern`: a bijective mix of (cache, tensor, request, token, word)), registers them and
  waits for decode on its control channel.
* Decode allocates its own caches, fills them with *its own* pattern, registers them, links, and runs
  five transfers: a paged block pull (PullKvBlocks, one request's random non-contiguous block table
  into random local blocks), a layer-by-layer pull (one PullKvBlocks per layer and cache, as a
  pipelined prefill streams it), a batch-row pull (PullKvCache of one contiguous row into another
  row), a prefix pull (PullKvCache with ``size`` = the first N tokens' bytes) and a push (prefill
  calls PushKvBlocks into decode's blocks).  After every transfer decode recomputes the expected
  bytes of *all* its cache memory (targets and everything else, guard bytes around every cache
  included) independently of prefill and compares; at the end prefill checks that its source caches
  are intact.  Then both unlink, finalize and exit 0; any error or mismatch exits 1 naming the
  transfer, cache, tensor (layer, K/V), block or row, token and byte, expected vs got.

Control channel
---------------
LLM-DataDist moves bytes; a serving system exchanges metadata (cache ids, block tables, who is ready)
over its own channel.  The demo's is one TCP connection, one JSON object per line, prefill listening
on ``--control-port`` (default: its LLM-DataDist port + 1, or a free port when that port is 0):

==========  =========  ===================================================================
direction   type       content
==========  =========  ===================================================================
D -> P      hello      protocol, geometry, seed, transfer backend, decode cluster id
P -> D      welcome    prefill cluster id, cache ids, the requests' block tables
D -> P      push       decode's cache ids, the request, destination blocks, listen address
P -> D      pushed     calls, bytes, seconds of the PushKvBlocks calls
D -> P      done       ok, error (decode finished: unlinked, about to finalize)
P -> D      bye        source_intact, error (prefill checked its caches; it then finalizes)
either      error      message (the sender gives up)
==========  =========  ===================================================================

Prefill finalizes only after ``done``, so the decode side never reads from a finalized peer.
Before any line, both sides prove they hold the fabric secret (the link handshake's mutual
challenge-response, ``KVDD_FABRIC_AUTH=off`` honoured; docs/security.md); prefill refuses any
connection that fails it and keeps waiting; every line is at most ``control.MAX_LINE`` bytes.

Modes
-----
default: two processes; ``--role prefill|decode``: one side (two commands, or two hosts);
``--in-process`` (internal, for tests): both sides as two threads of one process.

Modules
-------
``model`` (built-in models and Hugging Face configs), ``geometry`` (model x workload),
``pattern`` (deterministic data), ``image`` (cache memory and the verifier), ``options``,
``control`` (the control channel), ``prefill`` and ``decode`` (the two sides), ``report``
(results, JSON and text), ``runner`` (both sides as processes or threads), ``cli``.
Terms: a *row* is one batch index of a contiguous cache (``[rows, tokens, *token_shape]``); a
*block* is ``block_size`` tokens of a paged cache (``[blocks, block_size, *token_shape]``); the
*stride* is the bytes of one row or block of one tensor (docs/spec/SEMANTICS.md §2.1).
"""

from __future__ import annotations

from .cli import add_demo_arguments, main, options_from_args, run_from_args
from .decode import run_decode
from .errors import ConfigError, DemoError, VerificationError
from .geometry import Geometry
from .image import CacheImage
from .model import DEFAULT_MODEL, DTYPES, MODELS, CacheFamily, ModelSpec, model_from_hf_config, resolve_model
from .options import DemoOptions
from .pattern import Pattern
from .prefill import run_prefill
from .report import DemoReport, TransferResult, render_text
from .runner import run_demo
from .text import Progress

__all__ = [
    "MODELS",
    "DTYPES",
    "DEFAULT_MODEL",
    "CacheFamily",
    "ModelSpec",
    "Geometry",
    "ConfigError",
    "DemoError",
    "VerificationError",
    "DemoOptions",
    "DemoReport",
    "TransferResult",
    "Pattern",
    "CacheImage",
    "Progress",
    "model_from_hf_config",
    "resolve_model",
    "run_demo",
    "run_prefill",
    "run_decode",
    "render_text",
    "add_demo_arguments",
    "options_from_args",
    "run_from_args",
    "main",
]
