"""The GRPO driver: config, arms (presets), the trainer's loop and its components, and the memory
plan that sizes a run to its device before anything is allocated (``memory_plan``)."""
