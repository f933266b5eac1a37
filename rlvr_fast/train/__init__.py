"""The GRPO driver: config, arms (presets), the trainer's loop and its components."""
