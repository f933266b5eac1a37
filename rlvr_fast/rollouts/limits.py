"""Upper limits of the sizes a run allocates for. Past them a typo asks for more memory or time
than any machine has, rather than for a larger experiment; the settings that size a rollout are
checked against them before anything is allocated."""

MAX_GROUP_SIZE = 4096
MAX_BATCH = 1 << 16
MAX_NEW_TOKENS = 1 << 20
MAX_SEED = (1 << 63) - 1
MAX_QUESTIONS_PER_STEP = 1024
