"""``python -m vllm_omni_prompt_cache demo``."""

import sys

from vllm_omni_prompt_cache.cli import main

sys.exit(main())
