"""Keep the start-up heap out of Python's cyclic garbage collector (vLLM's freeze_gc_heap).

An engine holds millions of long-lived objects once started (torch, transformers, the model's
modules, the tokenizer). Every collection of the oldest generation walks all of them: on a
2-core machine that was a pause of ~140 ms inside a step, several times a minute under load.
Frozen (gc.freeze), they are never walked again; objects made later (requests, outputs) are
collected as before.

Invariant: called once the engine is built, after a full collection, so nothing already
garbage is frozen. Frozen objects are still freed by reference counting when dropped; a
reference cycle among them would outlive its last reference, so each call first unfreezes
what the previous one froze: garbage made since an earlier engine started (another engine in
the same process, a notebook's or a test suite's objects) is collected when the next one
starts, not kept for the process's life (a test suite that froze without unfreezing grew to
twice the memory). The engine itself holds no cycle (the test checks a dropped engine's model
is freed even while frozen).

That unfreeze makes each start a full collection (~0.13 s over a fresh engine's 300,000
objects, more in a larger heap): nothing beside loading a model, but the test suite starts
engines by the hundred in one process and turns freezing off (`ENABLED`; it added 6 minutes
to the suite), testing it where it is asked for.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)

ENABLED = True  # off only in a process that starts engines by the hundred (module doc)


def freeze_startup_heap() -> None:
    if not ENABLED:
        return
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    logger.debug("froze %d start-up objects out of the garbage collector", gc.get_freeze_count())
