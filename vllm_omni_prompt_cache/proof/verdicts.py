"""What a traced encode decides about its method, and how that is said: the :class:`Verdict` the front acts on
(:class:`~.method_calls.MethodCalls`), an encode that was not run or was made instead of a hit
(:class:`NotRun`, :class:`Unproven`), a first use that learned more than its key held (:class:`Learned`), and
the reasons a method is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from vllm_omni_prompt_cache.keys.call_key import Bypass
from vllm_omni_prompt_cache.keys.reads import (
    Trace,
)
from vllm_omni_prompt_cache.proof.discovery import Observation
from vllm_omni_prompt_cache.proof.encoder_gate import (
    GateRun,
)

#: Bypass reason for a row call whose encode read or wrote pipeline state earlier calls had not.
LEARNED_REASON = "its encode read or wrote pipeline state no earlier call had: served whole and uncached"


class Verdict(NamedTuple):
    """What a call decided about its method, for the front to act on (:meth:`~.method_calls.MethodCalls.settle`)."""

    refusal: str | None = None  # the method is not cached from now on (already in its state): say why, once
    rejection: str | None = None  # a candidate found by watching is not an encode: unwrap it, for this reason
    confirmed: bool = False  # its first use ended: it is cached from now on
    whole_only: bool = False  # its calls read or write pipeline state: keyed whole, no row layout
    restrategize: bool = False  # its calls were seen to write pipeline state: choose how calls are served again

    def __or__(self, other: Verdict) -> Verdict:
        """Both verdicts: the first refusal and rejection stand, the flags add up."""
        return Verdict(
            self.refusal or other.refusal,
            self.rejection or other.rejection,
            self.confirmed or other.confirmed,
            self.whole_only or other.whole_only,
            self.restrategize or other.restrategize,
        )


#: A call that decided nothing about its method.
NO_VERDICT = Verdict()


class NotRun(NamedTuple):
    """A call :meth:`FirstUse.learn` left for the front to run once it has acted on the verdict."""

    bypass: str | None  # run uncached, counted as a bypass for this reason; None: not an encode, run outside the cache


class Learned(BaseException):
    """Raised out of an encode that read or wrote more than the method's key holds (or cannot be cached):
    its result must not be kept under the key the call was looked up with. A BaseException, so that no
    handler of encoder failures takes it for one. ``record``: what reached its text encoder; ``verdict``:
    what it decided about the method."""

    def __init__(
        self, result: Any, trace: Trace, refusal: str | None, record: str | None = None, verdict: Verdict = NO_VERDICT
    ) -> None:
        super().__init__(refusal or LEARNED_REASON)
        self.result, self.trace, self.reason, self.record, self.verdict = result, trace, refusal, record, verdict


class Encode(NamedTuple):
    """One traced encode (see :meth:`FirstUse._encode`)."""

    result: Any  # what the method returned
    trace: Trace  # what it read from and wrote to the instance
    gate_run: GateRun  # what reached its first text encoder, and what a proof run found
    observation: Observation | None  # which modules and collectives it ran (None: not watched)


class Unproven(NamedTuple):
    """A call that found an entry it could not be proven equal to: it encoded instead."""

    result: Any  # what the call returns: its own encode
    trace: Trace | None  # what that encode read and wrote; None: not to be kept (its key lacked state)
    record: str | None  # its encode's record, for the entry kept beside (or over) the old one
    reason: str  # why the entry was not served (see encoder_gate)
    verdict: Verdict = NO_VERDICT  # what its encode decided about the method
    first_input: str | None = None  # what reached its first encoder call: which entry beside the old one it is


def drawing_refusal(draw: str) -> str:
    """Return why a method whose encode draws random numbers is not cached."""
    return f"its encode draws random numbers ({draw}): a hit would not draw them as a miss does"


#: Why a method whose proof run left stand-in data behind is not cached.
LEFT_BEHIND = (
    "it keeps what its text encoder returned somewhere the cache cannot put back (a helper, a global): "
    "a hit's proof would leave stand-in data there"
)


def unprovable_refusal(why: Bypass) -> str:
    """Return why a method whose text encoder takes inputs no key can hold is not cached."""
    return f"its text encoder's inputs cannot be keyed ({why.reason}), so no hit could be proven equal to an encode"


def collectives_refusal(collectives: Sequence[str]) -> str:
    """Return why a method whose encode runs collectives is not cached."""
    return (
        f"it runs collectives ({', '.join(collectives)}): a hit would skip them on one rank while another rank "
        "runs them"
    )
