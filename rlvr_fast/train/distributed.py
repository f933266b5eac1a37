"""Data-parallel GRPO on ``torch.distributed``: every process-group call the trainer makes.

Launch (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT):

    torchrun --nproc_per_node N -m rlvr_fast.cli train --set questions_per_step=Q ...
    rlvr-fast train --nproc N ...          # the same, torchrun on this host (``launch``)

A run of W ranks is a multi-question step of Q questions (``questions_per_step``, a multiple of
W) split over the ranks: rank r takes the step's questions r Q/W .. (r + 1) Q/W - 1, a function
of the step alone (``shard``), so the run is reproducible for a given W and its ledger lists the
questions in the order one process would take them. Every rank draws the sampling seeds of all
Q questions from its own copy of the run's generator (all copies stay in step) and keeps its
own, so a question samples the same rollouts on any rank.

Per step: each rank counts its questions whose rewards vary and the counts are summed
(``sum_over_ranks``, an all_reduce): the step is active iff the sum n > 0, so the decision is
collective; an active step gives every rank's p.grad = sum over its contributing questions of
g_q / (n |g_q|) (zeros on a rank with none: a homogeneous rank still joins) and the all_reduce
SUM of those (``all_reduce_gradients``, flat buckets) is the single-process average, up to the
order of the additions; only when n = 0 does every rank take the zero-gradient AdamW step (or
none, as ``zero_var_step`` says). Rank 0 alone writes the run directory: it gathers every rank's
question records (``gather_step``) into the ledger line, and evaluation is sharded the same
contiguous way and gathered back in the original order (``evaluate_sharded``).

Backends: NCCL when the device is CUDA (rank r on cuda:LOCAL_RANK), gloo on CPUs. Every
collective runs under the process group's timeout (``--dist-timeout``): a rank that dies closes
its sockets and the others fail at their next collective, one that stops answering makes them
fail after the timeout; either way each raises ``ProcessGroupError`` (the CLI prints it as one
line and exits with status 3) and ``--resume`` continues from the last checkpoint, which records
the world size. With no torchrun environment (or WORLD_SIZE 1) there is no process group and
every function here returns what one process has, without communicating.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Sequence

import torch
import torch.distributed as dist

from rlvr_fast.engine import EngineCounters
from rlvr_fast.rollouts.evaluation import EvalResult, evaluate

DEFAULT_TIMEOUT_S = 600.0
# Gradient buckets of about this many bytes: one all_reduce each (DDP's default bucket size).
BUCKET_BYTES = 25 * 2**20
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# The process group's timeout, which ``init`` sets (the barrier's and error messages' figure).
_STATE: dict = {"timeout_s": DEFAULT_TIMEOUT_S}


class ProcessGroupError(RuntimeError):
    """A collective failed: another rank died, or did not answer within the timeout."""


def launched() -> bool:
    """Whether torchrun started this process as one of several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def select_device(device: str | torch.device) -> None:
    """Make a CUDA ``device`` with an index the current device: Triton launches, CUDA-graph
    capture and new streams use the current device, so a run on cuda:N would otherwise put
    them on cuda:0."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def init(device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Join the process group torchrun's environment describes (nothing without one) and return
    the device this rank uses: ``device`` on one process; cuda:LOCAL_RANK (NCCL) for "cuda" and
    the CPU (gloo) for "cpu" on several."""
    if not launched() or dist.is_initialized():
        select_device(device)
        return device
    if timeout_s <= 0:
        raise ValueError(f"--dist-timeout must be > 0 seconds, got {timeout_s}")
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ValueError(
            f"WORLD_SIZE is set but not {', '.join(missing)}: launch with torchrun "
            f"or rlvr-fast train --nproc N"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = _guarded(
        "joining the process group", lambda: next(dist.rendezvous("env://", timeout=timeout))
    )
    store.set_timeout(timeout)
    check_one_device_type(store, rank, world, "cuda" if device.startswith("cuda") else "cpu")
    if device.startswith("cuda"):
        if device != "cuda":
            raise ValueError(
                f"--device {device} with several ranks: give --device cuda, each "
                f"rank takes cuda:LOCAL_RANK"
            )
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    # (the store prefixed as init_process_group prefixes the one it makes)
    _guarded(
        "joining the process group",
        dist.init_process_group,
        backend,
        store=dist.PrefixStore("default_pg", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    _STATE["timeout_s"] = timeout_s
    return device


def check_one_device_type(store, rank: int, world: int, device_type: str) -> None:
    """Refuse, on every rank, ranks on mixed devices (some CUDA, some CPU), before their
    backends (NCCL, gloo) would wait for each other until the timeout: each rank's device type
    exchanged through the rendezvous store."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"rlvr_fast/{attempt}/device_type/"
    store.set(f"{key}{rank}", device_type)
    types = [store.get(f"{key}{r}").decode() for r in range(world)]
    if len(set(types)) > 1:
        listed = ", ".join(f"rank {r}: {t}" for r, t in enumerate(types))
        raise ValueError(
            f"the ranks run on mixed devices ({listed}): one process group needs one device "
            "type (cuda: NCCL, cpu: gloo); give every rank the same --device"
        )


def shutdown() -> None:
    """Leave the process group once every rank is done with it."""
    if dist.is_initialized():
        barrier("finishing the run")
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0, which alone writes the run directory and prints."""
    return rank() == 0


def shard(count: int) -> slice:
    """This rank's contiguous share of ``count`` items (shares differ by at most one item; rank
    order is item order)."""
    r, w = rank(), world_size()
    return slice(r * count // w, (r + 1) * count // w)


def check_step_split(questions_per_step: int, generation_steps: int) -> None:
    """A step's questions are split evenly over the ranks, and a generation serving several steps
    runs on one process."""
    w = world_size()
    if questions_per_step % w:
        raise ValueError(
            f"a {w}-rank run splits each step's questions over its ranks: "
            f"questions_per_step must be a multiple of {w}, got "
            f"{questions_per_step} (--set questions_per_step=...)"
        )
    if generation_steps > 1 and w > 1:
        raise ValueError(
            "generation_steps > 1 runs on one process: the shuffle of a generation over "
            "several ranks is not built"
        )


def check_world_size(recorded: int, where) -> None:
    """Refuse to resume a checkpoint written by another number of ranks (each rank's share of a
    step's questions depends on it; resharding is not implemented)."""
    if recorded != world_size():
        raise ValueError(
            f"{where} was written by a run of {recorded} rank(s); resume it with "
            f"{recorded} (this run has {world_size()}): a step's questions are "
            f"split by rank, so another world size would not continue that run"
        )


def agree(value, what: str) -> None:
    """Raise on every rank unless all ranks hold the same ``value`` (say, the step a checkpoint
    resumes from: --out must be one directory that every rank reads)."""
    values = all_gather(value)
    if any(v != values[0] for v in values):
        listed = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise ValueError(
            f"the ranks disagree on {what} ({listed}); --out must be a directory "
            f"every rank reads (a shared file system across nodes)"
        )


def sum_over_ranks(value: int) -> int:
    """The sum of an integer over the ranks (an all_reduce; the step's collective decision)."""
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    _guarded("the step's all_reduce of contributing questions", dist.all_reduce, tensor)
    return int(tensor.item())


def max_over_ranks(value: int, what: str = "the step's passes") -> int:
    """The largest of an integer over the ranks (an all_reduce; ``what`` it is, for its
    error)."""
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    _guarded(f"the all_reduce of {what}", dist.all_reduce, tensor, dist.ReduceOp.MAX)
    return int(tensor.item())


def all_reduce_gradients(params: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
    """p.grad summed over the ranks, in place, through flat buckets of about ``bucket_bytes``
    (consecutive parameters of one dtype): one all_reduce per bucket, not per tensor."""
    if world_size() == 1:
        return
    for bucket in _buckets([p.grad for p in params], bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        _guarded("the gradients' all_reduce", dist.all_reduce, flat)
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _buckets(grads: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    buckets, size = [], 0
    for grad in grads:
        if grad is None:
            raise ValueError(
                "all_reduce_gradients: every parameter needs a .grad (zeros on a "
                "rank with nothing to add)"
            )
        nbytes = grad.numel() * grad.element_size()
        if not buckets or size + nbytes > bucket_bytes or buckets[-1][0].dtype != grad.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += nbytes
    return buckets


def broadcast_parameters(model: torch.nn.Module, masters=None) -> None:
    """Rank 0's weights on every rank (as DDP starts): the replicas begin identical. Under
    bf16-mixed its fp32 ``masters`` (``MasterWeights``) are what is sent, then rounded into
    each rank's model: equal bf16 weights can hide masters that differ."""
    if world_size() == 1:
        return
    covered = set(masters.live) if masters is not None else set()
    sent = [] if masters is None else masters.parameters()
    sent += [p for name, p in model.named_parameters() if name not in covered]
    with torch.no_grad():
        for tensor in sent + list(model.buffers()):
            _guarded("the weights' broadcast", dist.broadcast, tensor, 0)
    if masters is not None:
        masters.publish()


def all_gather(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    _guarded("gathering the ranks' results", dist.all_gather_object, out, obj)
    return out


def gather_step(
    questions: list, lines: list[dict], executed: EngineCounters, loss: float | None
) -> tuple[list, list[dict], EngineCounters, float | None]:
    """A multi-question step's per-question records and rollouts lines of every rank, in
    question order; the engine's work summed over the ranks (``peak_kv_blocks``: the ranks'
    peaks summed); the loss summed (each rank's part of the surrogate)."""
    if world_size() == 1:
        return questions, lines, executed, loss
    parts = all_gather((questions, lines, executed, loss))
    counts = {
        name: sum(getattr(part[2], name) for part in parts)
        for name in EngineCounters.__dataclass_fields__
    }
    losses = [part[3] for part in parts]
    return (
        [q for part in parts for q in part[0]],
        [line for part in parts for line in part[1]],
        EngineCounters(**counts),
        None if losses[0] is None else sum(losses),
    )


def evaluate_sharded(policy, problems: Sequence, **settings) -> EvalResult:
    """``evaluation.evaluate`` (``settings`` are its keywords) on this rank's contiguous shard
    of ``problems``; every rank's items gathered back into one result in the original order."""
    if world_size() == 1:
        return evaluate(policy, problems, **settings)
    mine = list(problems)[shard(len(problems))]
    items = evaluate(policy, mine, **settings).items if mine else []
    return EvalResult([item for part in all_gather(items) for item in part])


def barrier(what: str) -> None:
    """Wait for every rank; on gloo a monitored barrier, whose error names the missing rank."""
    if world_size() == 1:
        return
    if dist.get_backend() == "gloo":
        _guarded(
            what,
            dist.monitored_barrier,
            timeout=datetime.timedelta(seconds=_STATE["timeout_s"]),
            wait_all_ranks=True,
        )
    else:
        _guarded(what, dist.barrier)


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def _guarded(what: str, collective, *args, **kwargs):
    """Run a collective; a backend failure becomes one clear ``ProcessGroupError``."""
    try:
        return collective(*args, **kwargs)
    except (RuntimeError, dist.DistError) as err:
        cause = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        if cause.startswith("[") and "] " in cause:  # gloo prefixes its source location
            cause = cause.split("] ", 1)[1]
        cause = cause.split(". ")[0].rstrip(".")  # and appends advice to read the logs
        where = f"rank {rank()} of {world_size()}" if dist.is_initialized() else "this rank"
        raise ProcessGroupError(
            f"{where}: {what} failed: another rank died or did not answer within "
            f"{_STATE['timeout_s']:g} s ({cause.strip()}); continue with --resume"
        ) from err


def launch(argv: Sequence[str], nproc: int) -> int:
    """``rlvr-fast ... --nproc N``: run ``python -m rlvr_fast.cli ARGV`` as N ranks on this host
    through torchrun (``torch.distributed.run``, standalone rendezvous); the exit status."""
    if launched():
        raise ValueError("--nproc inside a torchrun launch: give one or the other")
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--module", "rlvr_fast.cli", *argv]
    )
    try:
        run(args)
    except ChildFailedError as err:
        failed = ", ".join(
            f"rank {r} (exit status {f.exitcode})" for r, f in sorted(err.failures.items())
        )
        print(
            f"rlvr-fast: error: of {nproc} ranks, {failed} failed; their errors are above",
            file=sys.stderr,
        )
        return next((f.exitcode for f in err.failures.values() if f.exitcode > 0), 1)
    return 0
