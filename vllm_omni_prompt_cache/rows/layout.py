"""What a row of a batched ``encode_prompt`` call is, and how cached rows become its output.

A request-batched forward calls ``encode_prompt`` once with B prompts. Keyed as a whole, such a
call misses whenever its batch differs from an earlier one, and K siblings of one prompt in one
batch are encoded K times. A :class:`RowLayout` says how a call splits into rows and how its
outputs are laid out, so each row is cached on its own and the output is assembled exactly as
the uncached call would lay it out.

A row is encoded *alone*: the original function is called with a batch of one, and with one copy
(``num_images_per_prompt=1``). Its embedding therefore never depends on the other rows of the
batch, and an assembled output is bit-identical to encoding each row alone and concatenating.
Against one uncached call on the full batch it is as close as the kernels are batch-invariant
(docs/benchmarks.md gives the measured difference).

A token row is trimmed of its trailing masked positions (the padding a batch adds to its shorter
rows): the same prompt padded to two batch widths is one row. Masked positions before the last
attended one stay in the row, ids included.

A call the layout cannot split exactly is keyed as a whole, with the reason counted. Nothing
here knows about vLLM-Omni.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

#: The attribute a pipeline class sets to declare its layout (see :class:`RowLayout`).
ROW_LAYOUT_ATTRIBUTE = "prompt_embed_row_layout"

#: How an output holds each row's copies: ``"interleave"`` is r0, r0, r1, r1 (``repeat_interleave``),
#: ``"tile"`` is r0, r1, r0, r1 (``repeat``); ``None``: not declared, so a call with several rows and
#: several copies is keyed as a whole.
CopyOrder = Literal["interleave", "tile"] | None


class LayoutMismatch(Exception):
    """A row's output does not have the form its layout declares: the layout is wrong for this function."""


class UnstackableRows(Exception):
    """This call's rows cannot be stacked into one output (their dtypes, devices or shapes differ)."""


@dataclasses.dataclass(frozen=True)
class RowOutput:
    """One tensor of ``encode_prompt``'s returned tuple: its row dimension is 0.

    ``pad_dim``: rows may differ in length along this dimension and are right-padded with zeros to
    the longest row of the batch; ``None`` when every row has the same shape. ``copies``: how the
    uncached call orders each row's copies (see :data:`CopyOrder`); left undeclared, a call with
    several rows and several copies is keyed whole rather than guessed.
    """

    pad_dim: int | None = 1
    copies: CopyOrder = None

    def __post_init__(self) -> None:
        if self.pad_dim is not None and (type(self.pad_dim) is not int or self.pad_dim < 1):
            raise ValueError(f"RowOutput.pad_dim must be None or an integer >= 1, got {self.pad_dim!r}")
        if self.copies not in ("interleave", "tile", None):
            raise ValueError(f"RowOutput.copies must be 'interleave', 'tile' or None, got {self.copies!r}")


class SingleRow(NamedTuple):
    """A call that is its own only row: the arguments its row key reads, and the numpy views of host
    tensors already made to judge it (by ``id(tensor)``, for the key to reuse; None: none).
    ``text``: the row is a text prompt, which a string and a list of one share (token ids have one form)."""

    arguments: Mapping[str, Any]
    host_views: dict[int, np.ndarray] | None
    text: bool = False


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How one ``encode_prompt`` signature batches rows. Declare it on the pipeline class::

        class MyPipeline(...):
            prompt_embed_row_layout = RowLayout(
                rows=("prompt_ids", "attention_mask"),
                mask="attention_mask",
                copies="num_images_per_prompt",
                outputs=(RowOutput(pad_dim=1, copies="interleave"), RowOutput(pad_dim=1, copies="interleave")),
            )

    ``rows``: the arguments that carry one entry per row: tensors (row dimension 0) or lists and
    tuples; a lone ``str`` is one row; ``None`` is shared by every row. ``mask``: a ``[B, L]``
    tensor among them; each row drops its trailing masked columns from every tensor row argument,
    which must then all be ``[B, L, ...]``, and 1-D tensors are one unbatched row. ``copies``: the
    integer argument that repeats each row in the outputs. ``outputs``: the returned tuple, one
    entry per tensor. Every other argument is shared by the rows and enters each row's key.

    A layout claims that a row's output does not depend on the other rows of its batch beyond
    padding, and that ``copies`` only repeats rows. Unless the pipeline class declares it itself,
    the claim is checked against the uncached call before a row is served (see :mod:`.layout_proofs`).
    """

    rows: tuple[str, ...]
    outputs: tuple[RowOutput, ...]
    mask: str | None = None
    copies: str | None = None
    name: str = "declared"

    def __post_init__(self) -> None:
        if not self.rows or not all(type(name) is str for name in self.rows):
            raise ValueError(f"RowLayout.rows must name at least one argument, got {self.rows!r}")
        if not self.outputs or not all(isinstance(output, RowOutput) for output in self.outputs):
            raise ValueError(f"RowLayout.outputs must be a non-empty tuple of RowOutput, got {self.outputs!r}")
        if self.mask is not None and self.mask not in self.rows:
            raise ValueError(f"RowLayout.mask {self.mask!r} must be one of its rows {self.rows!r}")
        if self.copies is not None and self.copies in self.rows:
            raise ValueError(f"RowLayout.copies {self.copies!r} cannot also be a row argument")

    def unusable_with(self, signature: inspect.Signature) -> str | None:
        """Return why this layout cannot describe ``signature``, or None when it can."""
        parameters = signature.parameters
        for name in (*self.rows, *(n for n in (self.copies,) if n is not None)):
            parameter = parameters.get(name)
            if parameter is None:
                return f"encode_prompt has no parameter {name!r}"
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                return f"parameter {name!r} is variadic"
        return None

    def split(self, arguments: Mapping[str, Any]) -> RowSplit | str:
        """Return the call's rows, or the reason it must be keyed as a whole.

        A row argument that is ``None`` is shared by every row (an optional mask left out). With a
        ``mask`` layout, 1-D tensors are one unbatched row: each becomes ``[1, L]`` for its row call.
        """
        present = [name for name in self.rows if arguments[name] is not None]
        if not present:
            return "every row argument is None"
        unbatched = self.mask is not None and all(
            isinstance(arguments[name], torch.Tensor) and arguments[name].dim() == 1 for name in present
        )
        if unbatched:
            arguments = {**arguments, **{name: arguments[name].unsqueeze(0) for name in present}}
        sizes = set()
        for name in present:
            value = arguments[name]
            size = _row_count(value)
            if size is None:
                return f"argument {name!r} is a {type(value).__qualname__}, not rows"
            sizes.add(size)
        if len(sizes) != 1:
            return f"row arguments disagree on the batch size: {sorted(sizes)}"
        (batch,) = sizes
        if batch == 0:
            return "empty batch"
        copies = 1
        if self.copies is not None:
            copies = arguments[self.copies]
            if type(copies) is not int or copies < 1:
                return f"argument {self.copies!r} is {copies!r}, not an integer >= 1"
            if batch > 1 and copies > 1 and any(output.copies is None for output in self.outputs):
                return f"{self.copies}={copies} with {batch} rows: the outputs' copy order is not declared"
        lengths = None
        if self.mask is not None and arguments[self.mask] is not None:
            mask = arguments[self.mask]
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
                return f"mask {self.mask!r} is not a [B, L] tensor"
            width = mask.shape[1]
            for name in present:
                value = arguments[name]
                if isinstance(value, (list, tuple)) and not any(isinstance(item, (list, tuple)) for item in value):
                    continue  # one item per row (an edit's image): cut, never trimmed; token lists are not
                if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != width:
                    return f"argument {name!r} is not a [B, {width}, ...] tensor to trim with {self.mask!r}"
            # Every row attending its last column (the common case: no padding) trims nothing; that
            # one check costs a few microseconds, the per-row lengths tens.
            attended = _mask_array(mask)
            if width == 0 or not attended[:, -1].all():
                lengths = _attended_lengths(attended)
                if min(lengths) == 0:
                    return f"a row of {self.mask!r} attends to no position"
        return RowSplit(self, arguments, present, batch, copies, lengths, unbatched)

    def check_row(self, value: Any) -> Any:
        """Return ``value`` (one row's output) if it has the declared form; raise LayoutMismatch if not."""
        outputs = self.outputs
        if not isinstance(value, (tuple, list)) or len(value) != len(outputs):
            raise LayoutMismatch(
                f"a row returned {type(value).__qualname__}"
                + (f" of {len(value)}" if isinstance(value, (tuple, list)) else "")
                + f", the layout declares a tuple of {len(outputs)} tensors"
            )
        for position, (tensor, output) in enumerate(zip(value, outputs, strict=True)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.shape[0] != 1:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__qualname__
                raise LayoutMismatch(f"output {position} of a one-row call is {shape}, expected a [1, ...] tensor")
            if output.pad_dim is not None and tensor.dim() <= output.pad_dim:
                raise LayoutMismatch(f"output {position} has no dimension {output.pad_dim} to pad")
        return value

    def is_single_row(self, arguments: Mapping[str, Any]) -> bool:
        """Return True when the call is its own only row (see :meth:`single_row_key`)."""
        return self.single_row_key(arguments) is not None

    def single_row_key(self, arguments: Mapping[str, Any]) -> SingleRow | None:
        """Return the arguments a call's row key reads when the call is its own only row, else None.

        That is one ``[1, ...]`` tensor row with nothing to trim, or one prompt (a string, or its
        text or token ids in a list of one), with one copy (every call at ``max_num_seqs`` 1). The
        arguments come back as :meth:`RowSplit.key_arguments` would cut the row: a list of one holds
        its bare item, and a tensor on a device is read to the host once, for its key (the mask
        first: a padded row reads nothing else). The numpy view made to read the mask's last column
        goes to the key too (:attr:`SingleRow.host_views`). A cheap test, so that case costs about
        what a whole call costs; None sends the call through :meth:`split`.
        """
        if self.copies is not None and (type(copies := arguments[self.copies]) is not int or copies != 1):
            return None
        width = None
        prompts = False  # a row argument is a prompt: a string, or a list of one
        text = False  # one is text: a string and a list of one share its row
        cut: dict[str, Any] | None = None  # row arguments as the key reads them, where that differs
        on_device: list[str] = []  # tensor rows to read to the host, once the mask says the row is whole
        for name in self.rows:
            value = arguments[name]
            kind = type(value)
            if kind is torch.Tensor:
                shape = value.shape
                if len(shape) < 2 or shape[0] != 1 or (width is not None and shape[1] != width):
                    return None
                width = shape[1]
                if not value.is_cpu:
                    on_device.append(name)
            elif value is None:  # shared by every row
                continue
            elif kind is str:  # one prompt, keyed as given
                prompts = text = True
            elif (
                (kind is list or kind is tuple) and len(value) == 1 and (type(value[0]) is str or _token_list(value[0]))
            ):
                prompts = True
                text = text or type(value[0]) is str
                cut = {**(cut or {}), name: value[0]}
            else:
                return None
        if width is None:  # prompts only: nothing to trim (token ids are as the caller cut them)
            return SingleRow({**arguments, **(cut or {})}, None, text=text) if prompts and self.mask is None else None
        if prompts:
            return None  # prompts beside tensor rows: split() decides
        host_views = None
        mask = None if self.mask is None else arguments[self.mask]  # a [1, width, ...] tensor row, or None
        if mask is not None:
            if width == 0 or len(mask.shape) != 2:
                return None
            if not mask.is_cpu:  # read first: a padded row goes to split() with nothing else read
                mask = mask.detach().cpu()
            view = _host_view(mask)
            if not (view[0, -1] if view is not None else _mask_array(mask[:, -1:])[0, 0]):
                return None
            host_views = None if view is None else {id(mask): view}
        if on_device:
            cut = {name: mask if name == self.mask else arguments[name].detach().cpu() for name in on_device}
        return SingleRow(arguments if cut is None else {**arguments, **cut}, host_views)

    def batch_size(self, arguments: Mapping[str, Any]) -> int | None:
        """Return how many rows the call holds, or None when its row arguments do not say."""
        present = [arguments[name] for name in self.rows if arguments[name] is not None]
        if self.mask is not None and present and all(isinstance(v, torch.Tensor) and v.dim() == 1 for v in present):
            return 1  # one unbatched row, as split() reads it
        sizes = {_row_count(value) for value in present}
        return sizes.pop() if len(sizes) == 1 else None


def _token_list(value: Any) -> bool:
    """Return True for one prompt's token ids: a non-empty list or tuple of ints."""
    return (type(value) is list or type(value) is tuple) and bool(value) and all(type(item) is int for item in value)


def _row_count(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() >= 1 else None
    if isinstance(value, str):
        return 1
    if isinstance(value, (list, tuple)):
        if value and all(type(item) is int for item in value):
            return None  # one prompt's token ids, not rows of them: keyed whole
        return len(value)
    return None


def _attended_lengths(mask: np.ndarray) -> list[int]:
    """Return, per row of a ``[B, L]`` mask, one past its last attended (non-zero) column; 0 for none."""
    attended = mask if mask.dtype == np.bool_ else mask != 0
    if attended.shape[1] == 0:
        return [0] * attended.shape[0]
    last = attended.shape[1] - np.argmax(attended[:, ::-1], axis=1)
    return np.where(attended.any(axis=1), last, 0).tolist()


def _host_view(mask: torch.Tensor) -> np.ndarray | None:
    """Return a contiguous host mask of integers or booleans as numpy (what its key reads too), else None."""
    if (mask.dtype is torch.bool or not (mask.is_floating_point() or mask.is_complex())) and mask.is_contiguous():
        return mask.numpy()  # no autograd to refuse: only floating tensors require grad
    return None


def _mask_array(mask: torch.Tensor) -> np.ndarray:
    """Return ``mask`` as a numpy array of what is attended: numpy takes microseconds where torch takes tens."""
    if mask.dtype is torch.bool or not (mask.is_floating_point() or mask.is_complex()):
        return mask.detach().cpu().numpy()
    return (mask.detach() != 0).cpu().numpy()  # bf16 and other floats have no numpy view


class RowSplit:
    """One call cut into rows: each row's arguments for its key and for the encoder, and the assembly."""

    def __init__(
        self,
        layout: RowLayout,
        arguments: Mapping[str, Any],
        present: list[str],
        batch: int,
        copies: int,
        lengths: list[int] | None,
        unbatched: bool,
    ) -> None:
        self.layout = layout
        self.arguments = arguments
        self.present = present  # row arguments the call gives (the others are None, shared)
        self.batch = batch
        self.copies = copies
        self.lengths = lengths  # per row, its length after trimming; None when no row is trimmed
        self.unbatched = unbatched  # 1-D rows were given, and viewed as [1, L]
        self._cpu_copies: dict[str, torch.Tensor] | None = None

    @property
    def _on_cpu(self) -> dict[str, torch.Tensor]:
        # Keys read CPU bytes: each batched tensor crosses to the CPU once, not once per row.
        if self._cpu_copies is None:
            self._cpu_copies = {
                name: value.detach().cpu()
                for name in self.present
                if isinstance(value := self.arguments[name], torch.Tensor) and not value.is_cpu
            }
        return self._cpu_copies

    def _row(self, value: Any, index: int, *, for_key: bool) -> Any:
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple)):
            # A key holds the bare item, so a lone string and a list of one share a row.
            if for_key:
                return value[index]
            return [value[index]] if isinstance(value, list) else (value[index],)
        row = value[index : index + 1]
        if self.lengths is not None:  # split() checked every row argument is [B, L, ...]
            row = row[:, : self.lengths[index]]
        return row

    def key_arguments(self, index: int) -> dict[str, Any]:
        """Return row ``index``'s arguments as its key reads them (CPU tensors, one copy)."""
        return self._arguments(index, for_key=True)

    def call_arguments(self, index: int) -> dict[str, Any]:
        """Return row ``index``'s arguments for the original function (the caller's devices, one copy)."""
        return self._arguments(index, for_key=False)

    def _arguments(self, index: int, *, for_key: bool) -> dict[str, Any]:
        row_arguments = dict(self.arguments)  # signature order is kept: keys depend on it
        for name in self.present:
            value = self._on_cpu.get(name, self.arguments[name]) if for_key else self.arguments[name]
            row_arguments[name] = self._row(value, index, for_key=for_key)
        if self.layout.copies is not None:
            row_arguments[self.layout.copies] = 1
        return row_arguments

    def check_row(self, value: Any) -> Any:
        """Return ``value`` (one row's output) if it has the declared form; raise LayoutMismatch if not."""
        return self.layout.check_row(value)

    def assemble(self, row_values: Sequence[Any]) -> Any:
        """Return the call's output from each row's one-copy output (``row_values[i]`` for row i).

        Raises UnstackableRows when the rows' dtypes, devices or other dimensions differ.
        """
        if self.batch == 1 and self.copies == 1:
            return row_values[0]  # already laid out; returned as stored, like a whole-call hit
        assembled = [
            self._assemble_output(position, output, [value[position] for value in row_values])
            for position, output in enumerate(self.layout.outputs)
        ]
        kind = type(row_values[0])
        if kind is tuple or kind is list:
            return kind(assembled)
        return kind(*assembled) if hasattr(kind, "_fields") else kind(assembled)  # named tuples too

    def _assemble_output(self, position: int, output: RowOutput, rows: list[torch.Tensor]) -> torch.Tensor:
        first = rows[0]
        for row in rows[1:]:
            same_rest = row.shape[1:] == first.shape[1:] if output.pad_dim is None else _same_except(row, first, output)
            if row.dtype != first.dtype or row.device != first.device or not same_rest:
                raise UnstackableRows(
                    f"output {position}: rows of {tuple(first.shape)} {first.dtype} and "
                    f"{tuple(row.shape)} {row.dtype} cannot be stacked as declared"
                )
        if output.pad_dim is None:
            batch = torch.cat(rows)
        else:
            dim = output.pad_dim
            longest = max(row.shape[dim] for row in rows)
            shape = list(first.shape)
            shape[0], shape[dim] = len(rows), longest
            batch = first.new_zeros(shape)
            for index, row in enumerate(rows):
                batch[index : index + 1].narrow(dim, 0, row.shape[dim]).copy_(row)
        if self.copies == 1:
            return batch
        if output.copies == "tile" and self.batch > 1:
            return batch.repeat(self.copies, *([1] * (batch.dim() - 1)))
        return batch.repeat_interleave(self.copies, dim=0)


def _same_except(row: torch.Tensor, first: torch.Tensor, output: RowOutput) -> bool:
    if row.dim() != first.dim():
        return False
    return all(
        a == b for d, (a, b) in enumerate(zip(row.shape, first.shape, strict=True)) if d not in (0, output.pad_dim)
    )
