"""Stand-ins of user code copied into a fresh module under names no code of the package has seen.

A stand-in's source is rewritten word by word (its classes and its encode method renamed), written
to a new module in a temporary folder and imported from there, so its classes are defined in a
module nobody listed and its encode method has a name nobody listed. The engine runs in this
process, so ``custom_pipeline_args={"pipeline_class": "<module>.<class>"}`` finds it.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

_FOLDER = Path(tempfile.mkdtemp(prefix="renamed-adapters-"))


def renamed_module(original: ModuleType, renames: Mapping[str, str], name: str) -> ModuleType:
    """Return ``original`` rewritten with every whole-word ``old`` replaced by ``renames[old]``, as module ``name``."""
    source = inspect.getsource(original)
    for old, new in renames.items():
        source, count = re.subn(rf"\b{re.escape(old)}\b", new, source)
        assert count, f"{old} is not in {original.__name__}"
    (_FOLDER / f"{name}.py").write_text(source)
    if str(_FOLDER) not in sys.path:
        sys.path.insert(0, str(_FOLDER))
    return importlib.import_module(name)
