"""The main job: a GRPO-shaped rollout through vLLM-Omni with the cache off, stock, and ours."""
