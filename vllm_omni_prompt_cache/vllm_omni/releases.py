"""The vLLM-Omni releases this package is tested on, each with the vLLM release it runs with.

vLLM-Omni does not declare its vLLM; each release runs with the vLLM of the same minor version.
``make test`` runs the whole suite on :data:`SUITE_RELEASE` (the ``vllm-omni`` extra pins it);
``nox -s releases`` runs the release-sensitive tests on every one (``noxfile.py`` reads this file
without importing the package). This module imports nothing.
"""

#: vLLM-Omni release -> the vLLM release it is tested with, oldest first.
TESTED = {
    "0.27.0rc1": "0.27.0",  # verl-omni's pin
    "0.28.0": "0.28.0",  # UniRL's pin
    "0.30.0": "0.30.0",
    "0.32.0rc1": "0.32.0",  # the newest on the package index
}
SUITE_RELEASE = "0.30.0"


def is_tested(vllm_omni_version: str) -> bool:
    """Whether ``vllm_omni_version`` is one of the releases the tests run on."""
    return vllm_omni_version in TESTED


def tested_list() -> str:
    return ", ".join(TESTED)
