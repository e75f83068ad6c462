"""Where a pipeline's row layout comes from, and the layouts proven for known vLLM-Omni and verl-omni pipelines.

In order (the first that applies wins):

1. a user's declaration for the class (the ``prompt_embed_cache_row_layouts`` setting: a class
   path and a layout, for classes the user cannot edit);
2. the class's own ``prompt_embed_row_layout`` (:data:`~vllm_omni_prompt_cache.rows.layout_proofs.DECLARED_BY_CLASS`:
   served without a first-use check, like ``PromptEmbedCacheSettings(row_layout=...)``, unless a
   subclass replaced the ``encode_prompt`` it was declared for);
3. a layout of :data:`PROVEN_LAYOUTS` whose rule matches the class: each was written against
   that pipeline's real ``encode_prompt`` and is tested on it (``tests/test_layouts.py``);
4. none: the wrapper infers one from the first batched call (see :mod:`.layout_proofs`).

Names never decide alone: every layout from 1, 3 and 4 is checked against the uncached call on
the first call of each kind before a row is served. :func:`layout_proof` and
:func:`method_layout_proof` turn what is found into the :class:`~.layout_proofs.LayoutProof` a wrapped
method starts with. Nothing here imports vLLM-Omni; a pipeline of a vLLM-Omni class means its
module is already imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

from vllm_omni_prompt_cache.rows.layout import ROW_LAYOUT_ATTRIBUTE, RowLayout, RowOutput
from vllm_omni_prompt_cache.rows.layout_proofs import DECLARED_BY_CLASS, DECLARED_IN_CODE, LayoutProof
from vllm_omni_prompt_cache.settings.schema import ROW_LAYOUTS, PromptEmbedCacheConfigError

logger = logging.getLogger(__name__)

QWEN_IMAGE_MODULE = "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image"

#: vLLM-Omni's ``QwenImagePipeline`` text path (``prompt: str | list[str]``): embeddings hold each
#: prompt's copies together, the mask tiles the batch (``repeat(1, n, 1)``).
QWEN_IMAGE_TEXT = RowLayout(
    rows=("prompt",),
    copies="num_images_per_prompt",
    outputs=(RowOutput(pad_dim=1, copies="interleave"), RowOutput(pad_dim=1, copies="tile")),
    name="qwen-image-text",
)

#: Token-ID adapters ``(prompt_ids, attention_mask, num_images_per_prompt, max_sequence_length)``
#: returning ``(embeds [B*n, S, D], mask [B*n, S])`` right-padded to the longest attended row,
#: copies by ``repeat_interleave`` (this package's own ``tiny.token_id_pipeline``).
TOKEN_IDS = RowLayout(
    rows=("prompt_ids", "attention_mask"),
    mask="attention_mask",
    copies="num_images_per_prompt",
    outputs=(RowOutput(pad_dim=1, copies="interleave"), RowOutput(pad_dim=1, copies="interleave")),
    name="token-ids",
)

#: verl-omni's Qwen-Image token-ID ``encode_prompt`` (``QwenImageTokenIdPromptMixin`` and the
#: FlowGRPO, MixGRPO, DiffusionNFT, DPO and DualGRPO adapters): the same rows and outputs, with
#: ``prompt_embeds`` / ``prompt_embeds_mask`` (precomputed: a call giving them bypasses) and an
#: optional mask (``None``: every position attended).
QWEN_IMAGE_TOKEN_IDS = dataclasses.replace(TOKEN_IDS, name="qwen-image-token-ids")

#: verl-omni's Qwen-Image-Edit token-ID ``encode_prompt``: each row's condition image belongs to it.
QWEN_IMAGE_EDIT_TOKEN_IDS = dataclasses.replace(
    TOKEN_IDS, rows=("prompt_ids", "attention_mask", "condition_images"), name="qwen-image-edit-token-ids"
)

#: verl-omni's SD3 ``encode_prompt_from_token_ids(clip_prompt_ids, t5_prompt_ids, num_images_per_prompt,
#: max_sequence_length)`` (``SD3TokenIdPromptMixin``): one prompt per inner id list, each padded to its
#: encoder's fixed length, so every row has one shape; copies by ``repeat(1, n, 1).view(B * n, ...)``,
#: which keeps each prompt's copies together.
SD3_TOKEN_IDS = RowLayout(
    rows=("clip_prompt_ids", "t5_prompt_ids"),
    copies="num_images_per_prompt",
    outputs=(RowOutput(pad_dim=None, copies="interleave"), RowOutput(pad_dim=None, copies="interleave")),
    name="sd3-token-ids",
)

_TOKEN_ID_PARAMETERS = ("prompt_ids", "attention_mask", "num_images_per_prompt", "max_sequence_length")
_VERL_OMNI_PARAMETERS = (
    "prompt_ids",
    "attention_mask",
    "num_images_per_prompt",
    "prompt_embeds",
    "prompt_embeds_mask",
    "max_sequence_length",
)


def _qwen_image_class() -> type | None:
    return getattr(sys.modules.get(QWEN_IMAGE_MODULE), "QwenImagePipeline", None)


def _parameters(kind: type) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(kind.encode_prompt).parameters)[1:]  # without self
    except (TypeError, ValueError):
        return None


def _is_stock_qwen_text(kind: type) -> bool:
    qwen_image = _qwen_image_class()
    return (
        qwen_image is not None
        and issubclass(kind, qwen_image)
        and kind.encode_prompt is qwen_image.encode_prompt
        # Rows are independent only if the embeddings come from the stock batched text encoder.
        and kind._get_qwen_prompt_embeds is qwen_image._get_qwen_prompt_embeds
    )


def _qwen_subclass_with(parameters: tuple[str, ...]) -> Callable[[type], bool]:
    def matches(kind: type) -> bool:
        qwen_image = _qwen_image_class()
        return (
            qwen_image is not None
            and issubclass(kind, qwen_image)
            and kind.encode_prompt is not qwen_image.encode_prompt
            and _parameters(kind) == parameters
        )

    return matches


@dataclasses.dataclass(frozen=True)
class ProvenLayout:
    """A layout and the rule that says which pipeline classes it was written for."""

    layout: RowLayout
    matches: Callable[[type], bool]


#: Layouts written against a vLLM-Omni or verl-omni pipeline's real ``encode_prompt``, by name
#: (the names a user's declaration may give).
PROVEN_LAYOUTS: Mapping[str, ProvenLayout] = {
    proven.layout.name: proven
    for proven in (
        ProvenLayout(QWEN_IMAGE_TEXT, _is_stock_qwen_text),
        ProvenLayout(TOKEN_IDS, _qwen_subclass_with(_TOKEN_ID_PARAMETERS)),
        ProvenLayout(QWEN_IMAGE_TOKEN_IDS, _qwen_subclass_with(_VERL_OMNI_PARAMETERS)),
        ProvenLayout(QWEN_IMAGE_EDIT_TOKEN_IDS, _qwen_subclass_with((*_VERL_OMNI_PARAMETERS, "condition_images"))),
    )
}


def _parameters_start_with(method: str, names: tuple[str, ...]) -> Callable[[type], bool]:
    """Return the rule by which a class's ``method`` has the parameters a layout was written for."""

    def matches(kind: type) -> bool:
        try:
            parameters = list(inspect.signature(getattr(kind, method)).parameters)
        except (AttributeError, TypeError, ValueError):
            return False
        return tuple(parameters[1 : 1 + len(names)]) == names

    return matches


#: Layouts written against an encode method other than ``encode_prompt``, by method name.
PROVEN_METHOD_LAYOUTS: Mapping[str, tuple[ProvenLayout, ...]] = {
    "encode_prompt_from_token_ids": (
        # verl-omni's SD3 FlowGRPO token path (sd3_flow_grpo/common.py), recognised by its parameters.
        ProvenLayout(
            SD3_TOKEN_IDS,
            _parameters_start_with(
                "encode_prompt_from_token_ids",
                ("clip_prompt_ids", "t5_prompt_ids", "num_images_per_prompt", "max_sequence_length"),
            ),
        ),
    ),
}


def find_method_layout(kind: type, method: str) -> tuple[RowLayout | None, str]:
    """Return ``(layout, where it came from)`` for ``kind``'s encode method ``method`` (not
    ``encode_prompt``), or ``(None, why none)``; it is checked on first use like any found by name."""
    for proven in PROVEN_METHOD_LAYOUTS.get(method, ()):
        if proven.matches(kind):
            return proven.layout, f"proven layout {proven.layout.name!r}"
    return None, "no layout known"


def find_row_layout(pipeline: Any, declared: Mapping[str, RowLayout]) -> tuple[RowLayout | None, str]:
    """Return ``(layout, where it came from)`` for ``pipeline``, or ``(None, why none)``.

    ``declared``: the user's layouts by class path (``module.QualName``); a declaration for a base
    class applies to its subclasses, the nearest one first.
    """
    kind = type(pipeline)
    for ancestor in kind.__mro__:
        path = f"{ancestor.__module__}.{ancestor.__qualname__}"
        if path in declared:
            return declared[path], f"declared for {path} by the prompt_embed_cache_row_layouts setting"
    own = getattr(kind, ROW_LAYOUT_ATTRIBUTE, None)
    if own is not None:
        declaring = next(c for c in kind.__mro__ if ROW_LAYOUT_ATTRIBUTE in vars(c))
        encoding = next((c for c in kind.__mro__ if "encode_prompt" in vars(c)), declaring)
        if issubclass(declaring, encoding):  # declared beside (or below) the encode_prompt it describes
            return own, DECLARED_BY_CLASS
        # Inherited by a class that replaced encode_prompt: found, not vouched for; checked on first use.
        return own, f"declared by {declaring.__qualname__} for an encode_prompt {kind.__qualname__} overrides"
    for name, proven in PROVEN_LAYOUTS.items():
        if proven.matches(kind):
            return proven.layout, f"proven layout {name!r}"
    return None, "no layout known"


def layout_proof(
    pipeline: Any,
    signature: inspect.Signature,
    tag: str,
    row_layout: RowLayout | None,
    row_layouts: Mapping[str, RowLayout] | None,
) -> LayoutProof:
    """Return where ``pipeline``'s ``encode_prompt`` row layout comes from, checked for use with ``signature``:
    ``row_layout`` (given in code), else :func:`find_row_layout` with the user's ``row_layouts``."""
    kind = type(pipeline)
    if row_layout is not None:
        layout, source = row_layout, DECLARED_IN_CODE
    else:
        layout, source = find_row_layout(pipeline, row_layouts or {})
    trusted = source in (DECLARED_BY_CLASS, DECLARED_IN_CODE)
    if layout is not None and not isinstance(layout, RowLayout):
        logger.warning(
            "Prompt-embed cache: %s's row layout (%s) is a %s, not a RowLayout; calls are keyed whole.",
            tag,
            source,
            type(layout).__qualname__,
        )
        return LayoutProof(kind, None, source, may_infer=False)
    if layout is not None:
        why = layout.unusable_with(signature)
        if why is not None:
            logger.warning(
                "Prompt-embed cache: row layout %r (%s) does not fit %s (%s); calls are keyed whole.",
                layout.name,
                source,
                tag,
                why,
            )
            return LayoutProof(kind, None, source, may_infer=False)
    return LayoutProof(kind, layout, source, may_infer=layout is None, trusted=trusted)


def method_layout_proof(pipeline: Any, method: str, signature: inspect.Signature, tag: str) -> LayoutProof:
    """Return where the row layout of ``pipeline``'s encode method ``method`` (not ``encode_prompt``) comes from."""
    layout, source = find_method_layout(type(pipeline), method)
    if layout is not None and (why := layout.unusable_with(signature)) is not None:
        logger.warning(
            "Prompt-embed cache: row layout %r (%s) does not fit %s.%s (%s); its rows are inferred, then checked.",
            layout.name,
            source,
            tag,
            method,
            why,
        )
        layout = None
    return LayoutProof(type(pipeline), layout, source, may_infer=layout is None, method=method)


def row_layout_for(pipeline: Any) -> RowLayout | None:
    """Return the layout :func:`find_row_layout` finds for ``pipeline`` with no user declarations."""
    return find_row_layout(pipeline, {})[0]


def resolve_declared_layouts(references: Mapping[str, str | RowLayout], source: str) -> dict[str, RowLayout]:
    """Return the user's layouts by class path: each reference a proven layout's name or ``module:NAME`` (or,
    given in code, the layout itself).

    Raises PromptEmbedCacheConfigError naming the setting, ``source`` and what is allowed.
    """
    layouts: dict[str, RowLayout] = {}
    for class_path, reference in references.items():
        if isinstance(reference, RowLayout):  # given in code: the layout itself
            layouts[class_path] = reference
            continue
        where = f"invalid {ROW_LAYOUTS.name} entry {class_path}={reference} from {source}"
        if ":" not in reference:
            proven = PROVEN_LAYOUTS.get(reference)
            if proven is None:
                raise PromptEmbedCacheConfigError(
                    f"{where}: no proven layout is named {reference!r}; expected one of "
                    f"{', '.join(PROVEN_LAYOUTS)} or pkg.module:NAME of a RowLayout"
                )
            layouts[class_path] = proven.layout
            continue
        module_name, _, attribute = reference.partition(":")
        try:
            found: Any = importlib.import_module(module_name)
            for part in attribute.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError) as error:
            raise PromptEmbedCacheConfigError(f"{where}: {reference} cannot be imported ({error})") from error
        if not isinstance(found, RowLayout):
            raise PromptEmbedCacheConfigError(
                f"{where}: {reference} is a {type(found).__qualname__}, expected a RowLayout"
            )
        layouts[class_path] = found
    return layouts
