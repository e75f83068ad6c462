"""A stand-in of vLLM-Omni's ``tests/helpers/mark.py`` ``hardware_test`` (not part of the proposed change).

``upstream/check/run_series.py`` writes it into the scratch tree as ``tests/helpers/mark.py`` when the tree has
none (a wheel ships no tests), so the series' CUDA test imports as it would in vLLM-Omni's checkout. Upstream's
decorator marks a test with the hardware it needs, and its CI runs such tests only on that hardware; here that
is a skip where CUDA is absent, so the check runs on CPU-only machines and runs the test where a GPU is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch


def hardware_test(res: dict[str, str], num_cards: int | dict[str, int] = 1) -> Callable[[Any], Any]:
    """Mark a test with the accelerators ``res`` names; skip it where none of them is available."""
    wanted = num_cards if isinstance(num_cards, int) else max(num_cards.values())

    def mark(test: Any) -> Any:
        for platform in res:
            test = getattr(pytest.mark, platform)(test)
        available = torch.cuda.device_count() if "cuda" in res else 0
        reason = f"needs {wanted} of {', '.join(f'{p} {kind}' for p, kind in res.items())}"
        return pytest.mark.skipif(available < wanted, reason=reason)(test)

    return mark
