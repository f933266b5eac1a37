"""The GRPO training driver: configuration, arms, the loop, step kinds, losses, and the memory plan
that sizes a run to its device before anything is allocated (``memory_plan``)."""
