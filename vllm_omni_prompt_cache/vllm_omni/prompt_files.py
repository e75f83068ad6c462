"""The prompt files ``precompute`` reads: JSON lines or parquet, each prompt once, in order, each named by a digest.

A JSON line is what a run sends as a request's prompt (a string, token ids, or an object passed as is); with
``--prompt-column`` a line's object gives that field instead. A parquet file gives its prompt column (a string,
token ids, or a chat-message list, whose last ``user`` message's text is taken) and, if asked, a negative
prompt column. A bad line or row raises :class:`PromptFileError` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash


class PromptFileError(ValueError):
    """A prompt file line that is not a prompt."""


def read_prompts(
    path: str | Path, *, prompt_column: str | None = None, negative_prompt_column: str | None = None
) -> list[Any]:
    """Return the file's prompts in order, each once; raise :class:`PromptFileError` naming a bad line, row,
    or column (see the module for what a file may hold)."""
    rows = _parquet_rows if str(path).endswith(".parquet") else _json_lines
    prompts: list[Any] = []
    seen: set[str] = set()
    for prompt in rows(Path(path), prompt_column, negative_prompt_column):
        digest = prompt_digest(prompt)
        if digest not in seen:
            seen.add(digest)
            prompts.append(prompt)
    return prompts


def _json_lines(path: Path, prompt_column: str | None, negative_prompt_column: str | None) -> Iterator[Any]:
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                raise PromptFileError(f"{path}:{number}: not JSON ({error.msg})") from None
            where = f"{path}:{number}"
            if prompt_column is None and negative_prompt_column is None:
                prompt = _as_prompt(value)
                if prompt is None:
                    raise PromptFileError(
                        f"{where}: expected a JSON string (a text prompt), a list of integers (token ids) or an "
                        f'object (a request prompt, e.g. {{"prompt_token_ids": [...]}}), got {line.strip()[:60]!r}'
                    )
                yield prompt
                continue
            if not isinstance(value, dict):
                raise PromptFileError(f"{where}: --prompt-column needs a JSON object a line, got {line.strip()[:60]!r}")
            yield _from_columns(value, where, prompt_column or "prompt", negative_prompt_column)


def _parquet_rows(path: Path, prompt_column: str | None, negative_prompt_column: str | None) -> Iterator[Any]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise PromptFileError(
            f"{path}: reading parquet needs pyarrow (pip install pyarrow, or this package's [parquet] extra)"
        ) from None
    try:
        table = parquet.read_table(path)
    except Exception as error:
        raise PromptFileError(f"{path}: not a parquet file ({type(error).__qualname__}: {error})") from None
    columns = [name for name in (prompt_column or "prompt", negative_prompt_column) if name is not None]
    missing = [name for name in columns if name not in table.column_names]
    if missing:
        raise PromptFileError(f"{path}: no column {missing[0]!r}; its columns: {', '.join(table.column_names)}")
    for number, row in enumerate(table.select(columns).to_pylist()):
        yield _from_columns(row, f"{path} row {number}", prompt_column or "prompt", negative_prompt_column)


def _from_columns(row: dict, where: str, prompt_column: str, negative_prompt_column: str | None) -> Any:
    """The request prompt a row's columns give (see the module)."""
    if prompt_column not in row:
        raise PromptFileError(f"{where}: no {prompt_column!r} field (--prompt-column)")
    prompt = _cell(row[prompt_column], where, prompt_column)
    if negative_prompt_column is None:
        return prompt if isinstance(prompt, (dict, str)) else {"prompt_token_ids": prompt}
    if negative_prompt_column not in row:
        raise PromptFileError(f"{where}: no {negative_prompt_column!r} field (--negative-prompt-column)")
    negative = _cell(row[negative_prompt_column], where, negative_prompt_column)
    if isinstance(prompt, str) and isinstance(negative, str):
        return {"prompt": prompt, "negative_prompt": negative}
    if isinstance(prompt, list) and isinstance(negative, list):
        return {"prompt_token_ids": prompt, "negative_prompt_ids": negative}
    raise PromptFileError(f"{where}: {prompt_column!r} and {negative_prompt_column!r} must both be text or token ids")


def _cell(value: Any, where: str, column: str) -> Any:
    """A text, token ids or request object from one cell: a chat-message list gives its last user message's text."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(type(item) is int for item in value):
        return value
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        users = [item.get("content") for item in value if item.get("role") == "user"]
        if users and isinstance(users[-1], str) and users[-1]:
            return users[-1]
    if isinstance(value, dict) and value:
        return value
    raise PromptFileError(
        f"{where}: column {column!r} holds {str(value)[:60]!r}: expected a text, token ids, a chat-message list "
        "with a user message, or a request object"
    )


def _as_prompt(value: Any) -> Any:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(type(item) is int for item in value):
        return {"prompt_token_ids": value}
    if isinstance(value, dict) and value:
        return value
    return None


def prompt_digest(prompt: Any) -> str:
    """Return a stable digest of one prompt (what a ledger records)."""
    return xxhash.xxh3_128_hexdigest(json.dumps(prompt, sort_keys=True).encode())
