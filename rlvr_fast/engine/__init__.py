"""The rollout engine: the only place tokens are produced (``RolloutEngine``)."""

from rlvr_fast.engine.counters import EngineCounters
from rlvr_fast.engine.engine import RolloutEngine
from rlvr_fast.engine.scheduler import OutOfBlocksError
from rlvr_fast.engine.sequence import FINISH_CAP, FINISH_EOS, FINISH_STOP, Sequence
from rlvr_fast.engine.token_sampler import SamplingParams

__all__ = [
    "EngineCounters",
    "FINISH_CAP",
    "FINISH_EOS",
    "FINISH_STOP",
    "OutOfBlocksError",
    "RolloutEngine",
    "SamplingParams",
    "Sequence",
]
