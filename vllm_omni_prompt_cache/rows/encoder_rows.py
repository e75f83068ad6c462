"""The rows of a batched text-encoder call: which inputs carry them, one row's inputs, and the output reassembled.

A call whose tensor inputs all have one leading size B >= 2, one of them integer ids of two dimensions, is B rows:
row r is the call with each of those tensors cut to ``[r:r+1]`` and every other argument shared. Its output splits
the same way when each of its tensors leads with B. Rows are cut as they come, padding included: a row padded to
another width is another row. Whether rows are independent is shown once per encoder, by comparing its first
batched call with its rows encoded alone (:func:`compare_outputs`). Nothing here knows about keys or the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def batch_size(args: tuple, kwargs: dict) -> int | None:
    """Return B when the call is B >= 2 rows (see the module docstring), else None."""
    sizes = set()
    ids = False
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                return None
            sizes.add(value.shape[0])
            ids = ids or (value.dim() == 2 and not value.is_floating_point() and value.dtype is not torch.bool)
    if not ids or len(sizes) != 1:
        return None
    size = sizes.pop()
    return size if size >= 2 else None


def rows_of(args: tuple, kwargs: dict, rows: list[int]) -> tuple[tuple, dict]:
    """Return the call's inputs cut to ``rows`` (in that order): a sub-batch, or one row."""
    if len(rows) == 1:
        row = rows[0]
        cut = lambda value: value[row : row + 1] if isinstance(value, torch.Tensor) else value  # noqa: E731
    else:
        picked: dict[torch.device, torch.Tensor] = {}

        def cut(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            index = picked.get(value.device)
            if index is None:
                index = picked[value.device] = torch.tensor(rows, device=value.device)
            return value.index_select(0, index)

    return tuple(cut(value) for value in args), {name: cut(value) for name, value in kwargs.items()}


#: Largest difference the first batched call of an encoder accepts between its rows encoded alone and the batch:
#: per row, the largest absolute difference over that row's largest absolute value in the batch's output. The
#: kernels' batch-invariance gap measured here is far below it (docs/design.md); rows that depend on each other
#: differ by the order of their own values. Integer and boolean outputs (masks) must be equal.
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
        if isinstance(assembled, torch.Tensor):
            assembled, expected = assembled.detach(), expected.detach()
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
