"""How a row layout earns trust: checked against the uncached call, or inferred from one.

A :class:`~.layout.RowLayout` is a claim about a function: that each output row depends on its own
input row alone, padded and copied as declared. A wrong claim would assemble wrong embeddings, so
no layout found by name or inferred is taken on trust (one written in code is its author's word).
:class:`LayoutProof` tracks, for one installed cache, what kinds of call the layout has been
checked on; the first call that goes beyond them is served from the uncached batched call and
compared with the output assembled from rows encoded alone (:func:`compare_outputs`). A mismatch
turns rows off for the pipeline's class. A pipeline with no layout may get one from
:func:`infer_layout`, from the shapes of a call and of its uncached output; the same check then
decides.

Nothing here knows about vLLM-Omni.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_omni_prompt_cache.counts.counters import ENCODE_PROMPT
from vllm_omni_prompt_cache.rows.layout import RowLayout, RowOutput, RowSplit

logger = logging.getLogger(__name__)

#: Largest difference a check accepts between an assembled output and the uncached batched call:
#: per row, the largest absolute difference over that row's largest absolute value in the uncached
#: output. The kernels' batch-invariance gap measured here is far below it (docs/design.md); a
#: wrong layout puts another row's values, or padding, where a row should be: a difference of the
#: order of the row's own values. Integer and boolean outputs (masks) must be equal.
GAP_TOLERANCE: Mapping[torch.dtype, float] = {
    torch.float64: 1e-4,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 2e-2,
}
_DEFAULT_TOLERANCE = 2e-2  # other floating dtypes (fp8): the coarsest above


def compare_outputs(assembled: Any, expected: Any) -> tuple[str | None, float]:
    """Return ``(why they differ or None, the largest relative gap measured)`` for two outputs."""
    if isinstance(expected, (tuple, list)):
        if not isinstance(assembled, (tuple, list)) or len(assembled) != len(expected):
            return f"the uncached call returned {len(expected)} values, the rows assembled to another form", 0.0
        gap = 0.0
        for position, (mine, theirs) in enumerate(zip(assembled, expected, strict=True)):
            why, measured = compare_outputs(mine, theirs)
            if why is not None:
                return f"output {position}: {why}", measured
            gap = max(gap, measured)
        return None, gap
    if isinstance(expected, Mapping):  # e.g. Anima's encode_prompt returns a dict of tensors
        if not isinstance(assembled, Mapping) or set(assembled) != set(expected):
            return "the uncached call returned a dict, the rows assembled to another form or other keys", 0.0
        gap = 0.0
        for name, theirs in expected.items():
            why, measured = compare_outputs(assembled[name], theirs)
            if why is not None:
                return f"output {name!r}: {why}", measured
            gap = max(gap, measured)
        return None, gap
    if isinstance(expected, torch.Tensor):
        if not isinstance(assembled, torch.Tensor):
            return f"expected a tensor, assembled a {type(assembled).__qualname__}", 0.0
        if assembled.shape != expected.shape or assembled.dtype != expected.dtype:
            return (
                f"shape {tuple(assembled.shape)} {assembled.dtype} assembled, "
                f"{tuple(expected.shape)} {expected.dtype} uncached"
            ), 0.0
        if not expected.is_floating_point():
            return (None, 0.0) if torch.equal(assembled.to(expected.device), expected) else ("values differ", 1.0)
        return _compare_floats(assembled.to(expected.device), expected)
    return (None, 0.0) if assembled == expected else (f"{assembled!r} assembled, {expected!r} uncached", 1.0)


def _compare_floats(assembled: torch.Tensor, expected: torch.Tensor) -> tuple[str | None, float]:
    if expected.numel() == 0:
        return None, 0.0
    # Infinities and NaNs (an additive mask's -inf) must stand in the same places with the same values;
    # the gap is measured over the finite values only.
    special = ~torch.isfinite(expected) | ~torch.isfinite(assembled)
    if bool(special.any()):
        same = (assembled == expected) | (assembled.isnan() & expected.isnan())
        if not bool(same[special].all()):
            return "non-finite values differ", float("inf")
        assembled, expected = assembled.masked_fill(special, 0), expected.masked_fill(special, 0)
    rows = expected.reshape(expected.shape[0], -1) if expected.dim() else expected.reshape(1, 1)
    difference = (assembled.reshape(rows.shape).double() - rows.double()).abs().amax(dim=1)
    scale = rows.double().abs().amax(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    gaps = difference / scale
    if not bool(torch.isfinite(gaps).all()):
        return "non-finite values", float("inf")
    worst = float(gaps.max())
    tolerance = GAP_TOLERANCE.get(expected.dtype, _DEFAULT_TOLERANCE)
    if worst > tolerance:
        row = int(gaps.argmax())
        return f"row {row} differs by {worst:.3g} of its largest value (tolerance {tolerance:g})", worst
    return None, worst


def _token_rows(value: Any) -> int | None:
    """Return how many rows ``value`` holds if it looks like batched prompt input, else None."""
    if isinstance(value, torch.Tensor):
        integral = value.dtype is torch.bool or not (value.is_floating_point() or value.is_complex())
        return value.shape[0] if integral and value.dim() == 2 else None
    if isinstance(value, (list, tuple)) and value:
        if all(isinstance(item, str) for item in value):
            return len(value)
        if all(isinstance(item, (list, tuple)) and all(type(t) is int for t in item) for item in value):
            return len(value)
    return None


def _binary(tensor: torch.Tensor) -> bool:
    return tensor.dtype is torch.bool or bool(((tensor == 0) | (tensor == 1)).all())


#: Why a one-row call suggests no layout (every row layout describes it).
ONE_ROW = "one row: nothing to infer"


def infer_layout(signature: inspect.Signature, arguments: Mapping[str, Any], output: Any) -> RowLayout | str:
    """Return the row layout a call and its uncached output suggest, or why none can be inferred.

    Rows: every argument holding batched prompt input (a 2-D integer or bool tensor, a list of
    token lists or of strings) with one batch size B >= 2. Mask: the one bool tensor among them, or
    the one 0/1 integer tensor beside ids that are not. Copies: the integer argument n that makes
    every output B * n rows. Copy order, per output, from which of its rows repeat. The suggestion
    is only that: it is checked like any other layout before a row is served.
    """
    rows = {name: size for name, value in arguments.items() if (size := _token_rows(value)) is not None}
    if not rows:
        return "no argument holds batched prompt input"
    sizes = set(rows.values())
    if len(sizes) != 1:
        return f"prompt arguments disagree on the batch size: {sorted(sizes)}"
    (batch,) = sizes
    if batch < 2:
        return ONE_ROW
    tensors = {name: arguments[name] for name in rows if isinstance(arguments[name], torch.Tensor)}
    masks = [name for name, tensor in tensors.items() if tensor.dtype is torch.bool]
    if not masks:
        binary = [name for name, tensor in tensors.items() if _binary(tensor)]
        masks = binary if len(binary) == 1 and len(tensors) > 1 else []
    if len(masks) > 1:
        return f"several arguments could be the mask: {masks}"
    mask = masks[0] if masks else None
    if mask is not None:
        width = tensors[mask].shape[1]
        if any(name not in tensors or tensors[name].shape[1] != width for name in rows):
            return f"not every prompt argument is a [B, {width}] tensor beside the mask {mask!r}"
    values = list(output) if isinstance(output, (tuple, list)) else None
    if not values or not all(isinstance(value, torch.Tensor) and value.dim() >= 1 for value in values):
        return f"encode_prompt returned a {type(output).__qualname__}, not a tuple of tensors"
    leading = {value.shape[0] for value in values}
    if len(leading) != 1 or next(iter(leading)) % batch:
        return f"outputs of {sorted(leading)} rows for {batch} input rows"
    copies_value = next(iter(leading)) // batch
    integers = [
        name
        for name, value in arguments.items()
        if type(value) is int and signature.parameters[name].kind not in (inspect.Parameter.VAR_KEYWORD,)
    ]
    matching = [name for name in integers if arguments[name] == copies_value]
    if copies_value > 1 and len(matching) != 1:
        return f"{copies_value} copies per row, and {len(matching)} integer arguments of that value"
    # With one copy the value proves nothing: a call with copies > 1 is a new kind, checked again.
    copies = matching[0] if len(matching) == 1 else None
    outputs = []
    for position, value in enumerate(values):
        order = _copy_order(value, batch, copies_value)
        if order is None:
            return f"output {position} repeats its rows in no order a layout can describe"
        outputs.append(RowOutput(pad_dim=1 if value.dim() >= 2 else None, copies=order))
    return RowLayout(
        rows=tuple(rows),
        mask=mask,
        copies=copies,
        outputs=tuple(outputs),
        name=f"inferred ({', '.join(rows)}{'' if copies is None else f'; copies {copies}'})",
    )


def _copy_order(value: torch.Tensor, batch: int, copies: int) -> str | None:
    if copies == 1:
        return "interleave"  # one copy: both orders are the same
    interleaved = all(torch.equal(value[0], value[index]) for index in range(copies))
    tiled = all(torch.equal(value[0], value[index * batch]) for index in range(copies))
    if interleaved:
        return "interleave"  # rows alike: no order can be told apart; a call whose rows differ is checked again
    return "tile" if tiled else None


#: The sources of a layout written in code: the pipeline class's own ``prompt_embed_row_layout``,
#: or ``PromptEmbedCacheSettings(row_layout=...)``. Their author's word, served without a check;
#: a layout found by name (a user's setting, the proven layouts) or inferred is checked on first use.
DECLARED_BY_CLASS = "declared by the class"
DECLARED_IN_CODE = "given to install_prompt_embed_cache"

#: ``(class path, layout)`` pairs a check refuted in this process, and why; an inferred layout is
#: recorded as :data:`_INFERRED`, so the class is not inferred again.
_REFUTED: dict[tuple[str, Any], str] = {}
_INFERRED = "any inferred layout"
INFERRED_SOURCE = "inferred from a call"
_REFUTED_LOCK = threading.Lock()


def class_path(kind: type) -> str:
    """Return ``module.qualname``: how settings and logs name a pipeline class."""
    return f"{kind.__module__}.{kind.__qualname__}"


class LayoutProof:
    """A pipeline's row layout, where it came from, and what checks have proven it for.

    A check on a call proves the layout for later calls of the same kind (:func:`call_kind`)
    whose rows exercise no more than the checked call's did, output by output
    (:func:`row_strength`): a check whose rows all had the same mask says nothing about the
    mask's copy order, and one whose rows all had the same length says nothing about padding, so
    a later call that has them is checked again.
    """

    def __init__(
        self,
        pipeline_class: type,
        layout: RowLayout | None,
        source: str,
        *,
        may_infer: bool,
        trusted: bool = False,
        method: str = ENCODE_PROMPT,
    ) -> None:
        # Refutations are kept per class and method: another method's calls have other layouts.
        self.method = method
        self.owner = class_path(pipeline_class) + ("" if method == ENCODE_PROMPT else f".{method}")
        self.subject = f"{class_path(pipeline_class)}.{method}"  # what logs name: the class's method
        self.source = source
        self.trusted = trusted
        refuted = refuted_layouts(self.owner)
        self.layout = None if layout in refuted else layout
        self.may_infer = may_infer and _INFERRED not in refuted
        self.inferring = False  # one call at a time tries to infer a layout
        self.lock = threading.Lock()
        self._proven: dict[tuple, list[tuple]] = {}  # (layout, kind) -> strengths checked

    def needs_check(self, layout: RowLayout, split: RowSplit, strength: tuple) -> bool:
        """Return True when no earlier check of ``layout`` covers a call like ``split`` with ``strength``."""
        if self.trusted:
            return False  # the class (or the caller) vouches for its layout
        with self.lock:
            proven = list(self._proven.get((layout, call_kind(split)), ()))
        return not any(_covers(checked, strength) for checked in proven)

    def settled(self, layout: RowLayout, split: RowSplit) -> bool:
        """Return True when no call of ``split``'s kind needs measuring (:func:`row_strength`) for a check:
        the class vouches for ``layout``, or a check passed on such a call whose rows exercised everything
        (they differed, and in length where an output is padded)."""
        if self.trusted:
            return True
        strongest = tuple((True, output.pad_dim is not None) for output in layout.outputs)
        with self.lock:
            proven = self._proven.get((layout, call_kind(split)), ())
            return any(_covers(checked, strongest) for checked in proven)

    def has_checked(self, layout: RowLayout, split: RowSplit) -> bool:
        """Return True when a check has passed ``layout`` on a call of ``split``'s kind."""
        with self.lock:
            return bool(self._proven.get((layout, call_kind(split))))

    def prove(self, layout: RowLayout, split: RowSplit, strength: tuple) -> None:
        """Record that a call like ``split``, with ``strength``, matched its uncached output."""
        with self.lock:
            self._proven.setdefault((layout, call_kind(split)), []).append(strength)

    def claim_inference(self) -> bool:
        """Return True if this call may try to infer a layout now (then :meth:`end_inference` it)."""
        with self.lock:
            if self.layout is not None or not self.may_infer or self.inferring:
                return False
            self.inferring = True
            return True

    def end_inference(self, layout: RowLayout | None) -> None:
        """Adopt ``layout`` (its first check passed), or None; let another call infer again."""
        with self.lock:
            self.inferring = False
            if layout is None or not self.may_infer:
                return
            self.layout, self.source, self.may_infer = layout, INFERRED_SOURCE, False
        logger.info("Prompt-embed cache: %s rows follow %r (checked).", self.subject, layout.name)

    def refute(self, layout: RowLayout, why: str, *, inferred: bool = False) -> None:
        """Turn rows off for this class with ``layout``, in this process, with one warning."""
        source = INFERRED_SOURCE if inferred else self.source
        with self.lock:
            if inferred:
                self.may_infer = False
            elif self.layout is layout:
                self.layout = None
        refuted = (self.owner, _INFERRED if inferred else layout)
        with _REFUTED_LOCK:
            first = refuted not in _REFUTED
            _REFUTED.setdefault(refuted, why)
        if first:
            logger.warning(
                "Prompt-embed cache: row layout %r (%s) does not match %s: %s. That call was "
                "served from the uncached call; from now on its calls are keyed whole.",
                layout.name,
                source,
                self.subject,
                why,
            )


def call_kind(split: RowSplit) -> tuple:
    """Return what a layout check on ``split``'s call proves the layout for: calls with or without
    several copies, unbatched or not, and with row arguments of the same forms."""
    return (
        split.copies > 1,
        split.unbatched,
        tuple((name, _form(split.arguments[name])) for name in split.layout.rows),
    )


def row_strength(split: RowSplit, row_values: Sequence[Any]) -> tuple[tuple[bool, bool], ...]:
    """Return, per output, what a call's rows exercise: (two rows differ, two rows differ in length).

    Measured on the rows' own outputs, so a check is known to have tested copy order and padding
    only where its rows could tell them apart (see :class:`LayoutProof`).
    """
    distinct = list({id(value): value for value in row_values}.values())
    measured = []
    for position, output in enumerate(split.layout.outputs):
        tensors = [value[position] for value in distinct]
        first = tensors[0]
        differ = any(t.shape != first.shape or not torch.equal(t, first) for t in tensors[1:])
        lengths = output.pad_dim is not None and len({t.shape[output.pad_dim] for t in tensors}) > 1
        measured.append((differ, lengths))
    return tuple(measured)


def _form(value: Any) -> str:
    """Return what kind of value a row argument is, for a check's kind (see :func:`call_kind`)."""
    if isinstance(value, torch.Tensor):
        return f"tensor {value.dtype}"
    if isinstance(value, (list, tuple)) and value:
        return f"{type(value).__qualname__} of {type(value[0]).__qualname__}"
    return type(value).__qualname__


def _covers(checked: tuple, strength: tuple) -> bool:
    """Return True when a checked call exercised everything ``strength`` does, output by output."""
    return len(checked) == len(strength) and all(
        (not differ or checked_differ) and (not lengths or checked_lengths)
        for (checked_differ, checked_lengths), (differ, lengths) in zip(checked, strength, strict=True)
    )


def refuted_layouts(owner: str) -> dict[Any, str]:
    """Return the layouts a check refuted for the class ``owner`` in this process, with the reason."""
    with _REFUTED_LOCK:
        return {layout: why for (path, layout), why in _REFUTED.items() if path == owner}
