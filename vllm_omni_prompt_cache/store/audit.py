"""Scrubbing hits: re-encode a sampled fraction of them and compare with what the cache served.

A cache keyed on arguments is wrong when an encode reads something that is not an argument (a
pipeline attribute, a global), or when weights change by a path no hook sees. Keys, witnesses and
first-use layout checks cannot see either: they compare inputs, or a layout's first calls. An audit
compares outputs, at any time: with a fraction ``f``, each call served without encoding is, with
probability ``f``, encoded again and compared with what was served, within the row checks'
tolerance (:func:`~.encoder_rows.compare_outputs`). A mismatch serves the fresh encode, turns the cache off
for the pipeline's class in this process (entries dropped, directory tier unused), and says so once.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import Any

from vllm_omni_prompt_cache.encoders.forms import form_of, take_apart, whole
from vllm_omni_prompt_cache.logs import warn_once
from vllm_omni_prompt_cache.rows.encoder_rows import compare_outputs

logger = logging.getLogger(__name__)

#: Pipeline classes an audit caught serving a wrong entry in this process, with why; a cache
#: installed later on such a class starts off.
FAILED_CLASSES: dict[type, str] = {}
_lock = threading.Lock()


#: The audit's own random stream starts here in every process: ranks of one stage see the same calls
#: and take the same hits, so they draw the same audits (an encoder's collectives run on all or none).
SEED = 0x5EED


class Audit:
    """Decides which hits are re-encoded: each with probability ``fraction`` (0 < fraction <= 1)."""

    def __init__(self, fraction: float, *, seed: int = SEED) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"an audit fraction must be in (0, 1], got {fraction!r}")
        self.fraction = fraction
        self._random = random.Random(seed)

    def due(self) -> bool:
        """Return True when this hit is to be re-encoded and compared."""
        return self.fraction >= 1.0 or self._random.random() < self.fraction


def off_reason(kind: type) -> str | None:
    """Return why an audit turned the cache off for pipeline class ``kind`` in this process, or None."""
    return FAILED_CLASSES.get(kind)


def turn_off(cache: Any, kind: type, tag: str, why: str) -> str:
    """Turn ``cache`` off for good, and the class ``kind`` with it; warn once per class. Return the
    reason its calls are now bypassed with."""
    reason = f"an audit found a served entry differing from a fresh encode ({why})"
    with _lock:
        first = kind not in FAILED_CLASSES
        FAILED_CLASSES.setdefault(kind, reason)
    cache.turn_off(reason)
    if cache.directory is not None:
        cache.directory.disable("an audit found a wrong entry in this process")
    if first:
        logger.warning(
            "Prompt-embed cache: an audit re-encoded a hit of %s and got another output (%s): its encode reads "
            "something besides its arguments, or its weights changed unseen. The cache is off for %s in this "
            "process; that call was served from the fresh encode.",
            tag,
            why,
            kind.__qualname__,
        )
    return reason


def audited(cache: Any, kind: type, tag: str, output: Any, value: tuple, encode: Callable[[], Any], method: str) -> Any:
    """Encode an answered encoder call again (``encode()``) and compare it with what its entry ``value`` keeps;
    return ``output`` (what was served), or on a difference the fresh output, with ``cache`` turned off for the
    pipeline class ``kind``."""
    try:
        fresh = encode()
        form, leaves = take_apart(fresh)
        pairs = [(whole(value[2][index]), leaf) for index, leaf in enumerate(leaves) if value[2][index] is not None]
        why = compare_outputs([stored for stored, _ in pairs], [leaf for _, leaf in pairs])[0]
        if why is None and form != form_of(value[1]):
            why = "its output has another form"
    except Exception as error:  # out of memory, say: the call was served; the audit is what failed
        warn_once(f"an audit's encode failed ({type(error).__qualname__}: {error}); the hit was served")
        return output
    cache.record_audit(mismatch=why is not None, method=method)
    if why is None:
        return output
    turn_off(cache, kind, tag, why.replace("assembled", "served"))
    return fresh
