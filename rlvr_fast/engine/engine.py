"""``RolloutEngine``: the only place tokens are produced.

It owns, for the life of a run, one paged KV storage and one C++ ``BlockManager`` (at most
``kv_blocks`` blocks, or what ``kv_memory_fraction`` of the memory left by the engine's own
plan holds (``rlvr_fast.engine.memory``: free device memory on CUDA, available memory on the
CPU, less the engine's working sets); on CUDA the storage takes them all at once, on the CPU it
grows with the run's need: ``kv_storage``), a scheduler with
continuous batching, the model runner and, on CUDA, the decode CUDA graphs. Planners (flat
groups, evaluation, trees, parallel paths) build on three verbs and one loop:

    seq = engine.add(prompt_ids)                  # a prompt, nothing run yet
    rows = engine.fork(seq, n=8)                  # prefills the prompt once; 8 rows share it
    engine.free(seq)
    engine.run(rows, SamplingParams(), generator=g)   # rows[i].completion, .finish_reason

``fork(seq, num_tokens)`` branches any sequence at any length, sharing the blocks of its first
``num_tokens - 1`` tokens (all of them, and its next-token logits, when the sequence holds them),
so a branch costs no prefill and at most one copy-on-write block copy. ``extend(seq, ids)``
appends prompt tokens to a sequence (a judge's question after a shared prefix), and
``prefill(seqs)`` runs what is pending now and returns the next-token logits, batched. ``run`` prefills what is
pending, decodes every running sequence one token per step, retires a sequence the moment it
emits EOS, reaches its cap or meets its planner's stop rule, and admits waiting sequences as
blocks free up; when the cache fills it preempts and later recomputes, and a sequence that cannot
fit at all is a one-line ``OutOfBlocksError``. Each sequence samples from its own stream (its
seed; see ``token_sampler``), so its tokens do not depend on the rest of the batch. Whatever
happens inside ``run`` (an exception included), the sequences it was given hold no blocks
afterwards unless they finished with ``keep_cache``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Callable, Iterable, Sequence as Seq

import torch

from rlvr_fast.engine.counters import EngineCounters
from rlvr_fast.engine.cuda_graphs import DecodeGraphs
from rlvr_fast.engine.kv_storage import (
    PagedKVStorage,
    bytes_per_block,
    check_fits_device,
    free_memory,
)
from rlvr_fast.engine.memory import DEFAULT_MAX_PREFILL_TOKENS, plan_engine
from rlvr_fast.engine.model_runner import ModelRunner
from rlvr_fast.engine.scheduler import Batch, OutOfBlocksError, Scheduler, joins_prefill_pass
from rlvr_fast.engine.sequence import (
    FINISH_CAP,
    FINISH_EOS,
    FINISH_STOP,
    Sequence,
    Status,
    StopRule,
)
from rlvr_fast.engine.token_sampler import SamplingParams
from rlvr_fast.ops.paged_attention import default_backend
from rlvr_fast.utils.phases import profile_range

# RolloutEngine.shared: one default engine per model, dropped with the model.
_SHARED_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# The most rows one decode step runs, and the most sequences one fork makes (the trainer's
# max_batch bound): past them a fork's copies of the prefix alone reach gigabytes, and the CUDA
# graphs' block tables (max_batch x max_model_len / block_size) more.
MAX_BATCH = MAX_FORK = 1 << 16
MAX_MODEL_LEN = 1 << 20


class RolloutEngine:
    """``model``: a decoder with ``infer(input_ids, context)`` (``rlvr_fast.models``);
    ``eos_token_ids``: tokens that end a sequence; ``max_model_len``: the longest sequence a
    CUDA graph's block tables cover (longer ones decode eagerly; default: the model's
    ``max_position_embeddings``, at most 16,384); ``max_prefill_tokens``: the most tokens one
    prefill pass runs, padding included (a row longer than that runs alone)."""

    def __init__(
        self,
        model,
        *,
        kv_blocks: int | None = None,
        kv_memory_fraction: float = 0.5,
        block_size: int = 16,
        max_batch: int = 256,
        cuda_graphs: bool = True,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int | None = None,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
    ) -> None:
        from rlvr_fast._C import BlockManager  # built by setup.py; imported on first use

        config = model.config
        max_model_len = max_model_len or min(config.max_position_embeddings, 16384)
        _check_settings(
            kv_blocks, kv_memory_fraction, block_size, max_batch, max_model_len, max_prefill_tokens
        )
        weight = model.lm_head.weight
        self.model = model
        self.device, self.dtype = weight.device, weight.dtype
        self.eos_token_ids = frozenset(eos_token_ids)
        blocks_per_sequence = -(-max_model_len // block_size)
        if kv_blocks is not None:
            check_fits_device(config, kv_blocks, block_size, self.dtype, self.device)
        # Without kv_blocks, the engine's own plan: its working sets, then the KV cache.
        self.plan = None
        if kv_blocks is None:
            shape = (block_size, max_batch, max_prefill_tokens, max_model_len, cuda_graphs)
            self.plan = own_plan(model, kv_memory_fraction, *shape)
        num_blocks = kv_blocks or self.plan.kv_blocks
        self.storage = PagedKVStorage(
            config,
            num_blocks,
            block_size,
            dtype=self.dtype,
            device=self.device,
            growable=self.device.type != "cuda",
        )
        self.manager = BlockManager(num_blocks, block_size)
        self.backend = default_backend(self.device, self.dtype)
        graphs = (
            DecodeGraphs(
                model,
                self.storage,
                self.backend,
                max_batch=max_batch,
                table_width=blocks_per_sequence,
            )
            if cuda_graphs and self.device.type == "cuda"
            else None
        )
        self.runner = ModelRunner(model, self.storage, self.manager, self.backend, graphs)
        self.counters = EngineCounters()
        self.scheduler = Scheduler(
            self.manager, self.counters, max_batch=max_batch, max_prefill_tokens=max_prefill_tokens
        )
        self._windows: list[EngineCounters] = []

    @classmethod
    def for_policy(cls, policy, **settings) -> "RolloutEngine":
        """An engine for a ``Policy``: its decoder (the model, or with LoRA its merged twin),
        its tokenizer's end-of-sequence tokens."""
        return cls(policy.decoder, eos_token_ids=policy.tokenizer.eos_token_ids, **settings)

    @classmethod
    def shared(cls, policy) -> "RolloutEngine":
        """The policy's own engine with default settings, made on first use and kept while its
        model lives (its KV cache is sized once). A trainer that wants other settings makes its
        own with ``for_policy``."""
        engine = _SHARED_ENGINES.get(policy.model)
        if engine is None:
            engine = _SHARED_ENGINES[policy.model] = cls.for_policy(policy)
        return engine

    # ------------------------------------------------------------------ sequences
    def add(
        self,
        prompt_ids: Seq[int],
        *,
        seed: int | None = None,
        max_new_tokens: int | None = None,
        stop: StopRule | None = None,
        keep_cache: bool = False,
    ) -> Sequence:
        """A sequence of ``prompt_ids`` (nothing runs until it is forked or run)."""
        prompt = self._checked_tokens(prompt_ids, "add")
        return Sequence(
            prompt,
            len(prompt),
            seed=seed,
            max_new_tokens=max_new_tokens,
            stop=stop,
            keep_cache=keep_cache,
        )

    def _checked_tokens(self, token_ids: Seq[int], op: str) -> list[int]:
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise ValueError(f"{op}: needs at least one token")
        if min(tokens) < 0 or max(tokens) >= self.model.config.vocab_size:
            raise ValueError(f"{op}: token ids must lie in [0, {self.model.config.vocab_size})")
        return tokens

    def fork(
        self,
        seq: Sequence,
        num_tokens: int | None = None,
        n: int = 1,
        *,
        seeds: Seq[int] | None = None,
        max_new_tokens: int | None = None,
        stop: StopRule | None = None,
        keep_cache: bool = False,
    ) -> list[Sequence]:
        """``n`` new sequences whose tokens are the first ``num_tokens`` (default all) of
        ``seq``; their completions start there. A prompt not yet run is prefilled now, once."""
        total = len(seq.token_ids)
        num_tokens = total if num_tokens is None else num_tokens
        if not 1 <= num_tokens <= total or not 1 <= n <= MAX_FORK:
            raise ValueError(
                f"fork: need 1 <= num_tokens <= {total} and 1 <= n <= {MAX_FORK:,}, "
                f"got num_tokens={num_tokens}, n={n:,}"
            )
        if seq.status in (Status.WAITING, Status.RUNNING):
            raise ValueError("fork: the sequence is being run")
        if seeds is not None and len(seeds) != n:
            raise ValueError(f"fork: {n} seeds needed, got {len(seeds)}")
        if seq.num_cached == 0 or seq.num_pending > 1:
            self.prefill([seq])
        whole = num_tokens == total and seq.holds_logits
        shared = num_tokens if whole else num_tokens - 1
        children: list[Sequence] = []
        try:
            for i in range(n):
                child = Sequence(
                    seq.token_ids[:num_tokens],
                    num_tokens,
                    seed=None if seeds is None else seeds[i],
                    max_new_tokens=max_new_tokens,
                    stop=stop,
                    keep_cache=keep_cache,
                    num_cached=shared,
                    block_id=self.manager.fork(seq.block_id, shared),
                    logits=seq.logits if whole else None,
                )
                children.append(child)
        except BaseException:
            # All or nothing: a fork cut short (out of memory, interrupted) registers none.
            for child in children:
                self.scheduler.release(child)
            raise
        return children

    def extend(self, seq: Sequence, token_ids: Seq[int]) -> None:
        """Append prompt tokens to a sequence that is not being run (a judge's question after a
        shared prefix, say): they run in its next pass, and its completion starts after them."""
        if seq.status in (Status.WAITING, Status.RUNNING):
            raise ValueError("extend: the sequence is being run")
        seq.token_ids.extend(self._checked_tokens(token_ids, "extend"))
        seq.start = len(seq.token_ids)
        seq.logits = None
        seq.status, seq.finish_reason = Status.IDLE, None

    @torch.inference_mode()
    def prefill(self, seqs: Iterable[Sequence]) -> torch.Tensor:
        """Run the pending tokens of sequences that are not being run, now, in as few passes as
        ``max_prefill_tokens`` and the free blocks allow; returns each one's next-token logits
        [n, V] and keeps them on the sequence (its forks draw from them with no pass)."""
        seqs = list(seqs)
        if any(seq.status in (Status.WAITING, Status.RUNNING) for seq in seqs):
            raise ValueError("prefill: a sequence is being run")
        todo = [seq for seq in seqs if not seq.holds_logits]
        while todo:
            batch = self._prefill_batch(todo)
            todo = todo[len(batch) :]
            copies, slots = self.manager.append_many(
                [seq.block_id for seq in batch], [seq.num_pending for seq in batch]
            )
            self.counters.prefill_run += sum(seq.num_pending for seq in batch)
            self.counters.block_copies += len(copies)
            self._track_peak()
            try:
                reserve_written_blocks(self.storage, slots, copies)
                with self._range("engine prefill"):
                    logits = self.runner.prefill(Batch("prefill", batch, [], slots, copies))
            except BaseException:
                for seq in batch:
                    self.scheduler.release(seq)
                raise
            for seq, row in zip(batch, logits):
                seq.logits = row
        return torch.stack([seq.logits for seq in seqs]) if seqs else torch.empty(0)

    def _prefill_batch(self, todo: list[Sequence]) -> list[Sequence]:
        """The longest head of ``todo`` that one prefill pass takes (at least one sequence);
        gives each a block manager sequence."""
        batch, widest, reserved = [], 0, 0
        for seq in todo:
            needed = self.scheduler.blocks_needed(seq)
            pending = seq.num_pending
            if batch and (
                not joins_prefill_pass(
                    len(batch), widest, pending, self.scheduler.max_prefill_tokens
                )
                or reserved + needed > self.manager.num_free_blocks()
            ):
                break
            if needed > self.manager.num_free_blocks():
                raise OutOfBlocksError(self.scheduler.no_room_message(seq, needed))
            if seq.block_id is None:
                seq.block_id = self.manager.allocate(0)
            batch.append(seq)
            widest = max(widest, pending)
            reserved += needed
        return batch

    def free(self, seq: Sequence) -> None:
        """Give back a sequence's blocks (it cannot be forked or run afterwards without a new
        prefill)."""
        if seq.status in (Status.WAITING, Status.RUNNING):
            raise ValueError("free: the sequence is being run")
        self.scheduler.release(seq)

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def run(
        self,
        seqs: Iterable[Sequence],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        on_finish: Callable[[Sequence], None] | None = None,
    ) -> list[Sequence]:
        """Generate until every sequence finishes (see the module docstring); returns them.

        Sequences without a seed get one drawn from ``generator`` (torch's default generator
        when None), in the order given."""
        seqs = list(seqs)
        for seq in seqs:
            if seq.status != Status.IDLE:
                raise ValueError(
                    f"run: a sequence must be new (from add or fork), "
                    f"got one that is {seq.status.value}"
                )
            budget = seq.max_new_tokens or params.max_new_tokens
            if budget < 1:
                raise ValueError(f"run: a sequence's max_new_tokens must be >= 1, got {budget}")
        self._assign_seeds([seq for seq in seqs if seq.seed is None], generator)
        for seq in seqs:
            seq.finish_reason = None
            self.scheduler.add(seq)
        try:
            while self.scheduler.has_work:
                self._step(params, on_finish)
        except BaseException:
            self.scheduler.abort()
            for seq in seqs:
                self.scheduler.release(seq)
                seq.status = Status.IDLE
            raise
        return seqs

    def _step(self, params: SamplingParams, on_finish) -> None:
        batch = self.scheduler.schedule()
        self.counters.block_copies += len(batch.copies)
        self._track_peak()
        reserve_written_blocks(self.storage, batch.slots, batch.copies)
        parts = []
        if batch.kind == "prefill":
            self.counters.prefill_run += sum(seq.num_pending for seq in batch.rows)
            with self._range("engine prefill"):
                logits = self.runner.prefill(batch)
                parts.append(self.runner.draw(logits, batch.rows, params))
        elif batch.rows:
            self.counters.decode_rows += len(batch.rows)
            with self._range("engine decode"):
                parts.append(self.runner.decode(batch, params))
        if batch.drawn:
            logits = torch.stack([seq.logits for seq in batch.drawn])
            parts.append(self.runner.draw(logits, batch.drawn, params))
        # The step's one host read: the new tokens decide which rows finish.
        tokens = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
        for seq, token in zip(batch.rows + batch.drawn, tokens):
            self._append(seq, token, params, on_finish)

    def _append(self, seq: Sequence, token: int, params: SamplingParams, on_finish) -> None:
        seq.token_ids.append(token)
        seq.logits = None
        generated = seq.num_generated
        if token in self.eos_token_ids:
            seq.finish_reason = FINISH_EOS
        elif generated >= (seq.max_new_tokens or params.max_new_tokens):
            seq.finish_reason = FINISH_CAP
        elif seq.stop is not None and seq.stop(generated, token):
            seq.finish_reason = FINISH_STOP
        else:
            return
        self.scheduler.finish(seq)
        if on_finish is not None:
            on_finish(seq)

    def _assign_seeds(self, seqs: list[Sequence], generator: torch.Generator | None) -> None:
        if not seqs:
            return
        device = generator.device if generator is not None else "cpu"
        seeds = torch.randint(0, 2**62, (len(seqs),), generator=generator, device=device)
        for seq, seed in zip(seqs, seeds.tolist()):
            seq.seed = seed

    # ------------------------------------------------------------------ accounting
    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @property
    def blocks_in_use(self) -> int:
        return self.manager.num_blocks - self.manager.num_free_blocks()

    @contextlib.contextmanager
    def measure(self):
        """Yields an ``EngineCounters`` that holds, once the block exits, the work executed
        inside it (``peak_kv_blocks``: the most blocks in use at once inside it)."""
        window = EngineCounters(peak_kv_blocks=self.blocks_in_use)
        start = dataclasses.replace(self.counters)
        self._windows.append(window)
        try:
            yield window
        finally:
            self._windows = [w for w in self._windows if w is not window]
            for name in ("prefill_run", "decode_rows", "block_copies", "preemptions"):
                setattr(window, name, getattr(self.counters, name) - getattr(start, name))

    def _track_peak(self) -> None:
        in_use = self.blocks_in_use
        for counters in [self.counters, *self._windows]:
            counters.peak_kv_blocks = max(counters.peak_kv_blocks, in_use)

    def _range(self, name: str):
        """A profiler range (and an NVTX range on CUDA, for Nsight timelines)."""
        return profile_range(name, self.device)


def check_room(engine: RolloutEngine, tokens: int) -> None:
    """Refuse, before any work, a run whose longest sequence (``tokens``: the longest prompt
    and max_new_tokens) could not fit ``engine``'s cache even alone: the same
    ``OutOfBlocksError`` decoding would raise."""
    block_size = engine.manager.block_size
    needed = -(-tokens // block_size)
    if needed > engine.num_blocks:
        raise OutOfBlocksError(
            f"out of KV blocks: the longest sequence (prompt and max_new_tokens) of {tokens} "
            f"tokens needs {needed} blocks of "
            f"{block_size} tokens and the engine has {engine.num_blocks}; raise kv_blocks or "
            "kv_memory_fraction"
        )


def reserve_written_blocks(
    storage: PagedKVStorage, slots: torch.Tensor | None, copies: list[tuple[int, int]]
) -> None:
    """Make the storage hold every block a pass writes (its slots, its copies' destinations);
    the blocks it only reads were written by earlier passes."""
    top = max((dst for _, dst in copies), default=-1)
    if slots is not None and slots.numel():
        top = max(top, int(slots.max()) // storage.block_size)
    storage.reserve(top + 1)


def own_plan(
    model,
    fraction: float,
    block_size: int,
    max_batch: int,
    max_prefill_tokens: int,
    max_model_len: int,
    cuda_graphs: bool,
):
    """The plan of an engine made without kv_blocks (``rlvr_fast.engine.memory``): its working
    sets come off the free memory, then ``fraction`` of the rest holds its KV blocks."""
    weight = model.lm_head.weight
    return plan_engine(
        model.config,
        element=weight.element_size(),
        device_type=weight.device.type,
        memory=free_memory(weight.device),
        block_bytes=bytes_per_block(model.config, block_size, weight.dtype),
        fraction=fraction,
        most=max_batch * (-(-max_model_len // block_size) + 1),
        max_batch=max_batch,
        max_prefill_tokens=max_prefill_tokens,
        max_model_len=max_model_len,
        cuda_graphs=cuda_graphs,
    )


def _check_settings(
    kv_blocks, fraction, block_size, max_batch, max_model_len, max_prefill_tokens
) -> None:
    checks = [
        (kv_blocks is None or kv_blocks >= 1, f"kv_blocks must be >= 1, got {kv_blocks}"),
        (0 < fraction <= 1, f"kv_memory_fraction must be in (0, 1], got {fraction}"),
        (
            block_size >= 1 and block_size & (block_size - 1) == 0,
            f"block_size must be a power of two, got {block_size}",
        ),
        (
            1 <= max_batch <= MAX_BATCH,
            f"max_batch must be in [1, {MAX_BATCH:,}], got {max_batch:,}",
        ),
        (
            1 <= max_model_len <= MAX_MODEL_LEN,
            f"max_model_len must be in [1, {MAX_MODEL_LEN:,}], got {max_model_len:,}",
        ),
        (max_prefill_tokens >= 1, f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"RolloutEngine: {message}")
