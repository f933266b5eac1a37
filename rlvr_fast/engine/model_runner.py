"""``ModelRunner``: turns a scheduled batch into one ``ForwardContext`` and one model pass, and
draws the next tokens.

Prefill passes run eagerly: rows right-padded to the longest pending suffix, padding written to
the scratch slot; rows with nothing cached attend densely within the pass, otherwise through the
paged cache. Decode passes run one token per row, through the paged cache; on CUDA they are
replayed from CUDA graphs (``DecodeGraphs``) when the engine captured them, except under a
repetition penalty, whose per-row history changes shape every step (those decode eagerly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlvr_fast.engine.kv_storage import PagedKVStorage
from rlvr_fast.engine.scheduler import Batch
from rlvr_fast.engine.sequence import Sequence
from rlvr_fast.engine.token_sampler import (
    SamplingParams,
    default_sampler_backend,
    history_of,
    sample_tokens,
)
from rlvr_fast.models.context import ForwardContext


class ModelRunner:
    def __init__(self, model, storage: PagedKVStorage, manager, backend: str, graphs=None) -> None:
        self.model = model
        self.storage = storage
        self.manager = manager
        self.backend = backend
        self.graphs = graphs
        self.device = storage.data.device
        self.sampler = default_sampler_backend(self.device)
        # The torch sampler gets temperature and top-p as 0-d device tensors, as the graphs
        # hold them: on CUDA, x / float is computed as x * (1 / float), x / tensor exactly, and
        # the two differ in the last bit, which would let graph and eager decode draw apart.
        self.temperature = torch.ones((), device=self.device)
        self.top_p = torch.ones((), device=self.device)
        self.top_k = torch.zeros((), device=self.device)
        self.min_p = torch.zeros((), device=self.device)

    def prefill(self, batch: Batch) -> torch.Tensor:
        """Run every row's pending tokens; logits [R, V] after each row's last one."""
        self.storage.copy_blocks(batch.copies)
        rows = batch.rows
        starts = torch.tensor([seq.num_cached for seq in rows])
        counts = torch.tensor([seq.num_pending for seq in rows])
        width = int(counts.max())
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for row, seq in enumerate(rows):
            ids[row, : seq.num_pending] = torch.tensor(seq.token_ids[seq.num_cached :])
        offsets = torch.arange(width)
        valid = offsets[None, :] < counts[:, None]
        # Padding queries repeat their row's last position, so each sees >= 1 cached key.
        positions = starts[:, None] + torch.minimum(offsets[None, :], counts[:, None] - 1)
        slot_mapping = torch.full((len(rows) * width,), self.storage.scratch_slot, dtype=torch.long)
        slot_mapping[valid.flatten()] = batch.slots
        fresh = bool((starts == 0).all())
        context = ForwardContext(
            positions=self._to_device(positions),
            kv_cache=self.storage.layers,
            slot_mapping=self._to_device(slot_mapping),
            context_lens=None if fresh else self._to_device(positions + 1),
            block_tables=None if fresh else self._tables(rows),
            fresh=fresh,
            backend=self.backend,
            logits_index=self._to_device(torch.arange(len(rows)) * width + counts - 1),
        )
        logits = self.model.infer(self._to_device(ids), context)
        for seq in rows:
            seq.num_cached = len(seq.token_ids)
        return logits

    def decode(self, batch: Batch, params: SamplingParams) -> torch.Tensor:
        """Run every row's one pending token and draw its next: token ids [R] on the device."""
        self.storage.copy_blocks(batch.copies)
        rows = batch.rows
        inputs = DecodeInputs(
            token_ids=torch.tensor([seq.token_ids[-1] for seq in rows]),
            positions=torch.tensor([len(seq.token_ids) - 1 for seq in rows]),
            slots=batch.slots,
            block_tables=self.manager.block_tables([seq.block_id for seq in rows], 0),
            seeds=seeds_of(rows),
            history=self._history(rows, params),
        )
        for seq in rows:
            seq.num_cached = len(seq.token_ids)
        if self.graphs is not None and inputs.history is None and self.graphs.fits(inputs):
            return self.graphs.run(inputs, params)
        return self.decode_eager(inputs, params)

    def decode_eager(self, inputs: "DecodeInputs", params: SamplingParams) -> torch.Tensor:
        positions = self._to_device(inputs.positions)
        context = ForwardContext(
            positions=positions[:, None],
            kv_cache=self.storage.layers,
            slot_mapping=self._to_device(inputs.slots),
            context_lens=positions[:, None] + 1,
            block_tables=self._to_device(inputs.block_tables),
            backend=self.backend,
        )
        logits = self.model.infer(self._to_device(inputs.token_ids)[:, None], context)
        return sample_tokens(
            logits,
            self._to_device(inputs.seeds),
            positions + 1,
            *self._sampling_scalars(params),
            greedy=params.is_greedy,
            backend=self.sampler,
            **self._sampling_options(params, inputs.history),
        )

    def draw(
        self, logits: torch.Tensor, rows: list[Sequence], params: SamplingParams
    ) -> torch.Tensor:
        """Next tokens [R] of rows whose next-token logits [R, V] are known."""
        positions = torch.tensor([len(seq.token_ids) for seq in rows])
        return sample_tokens(
            logits,
            self._to_device(seeds_of(rows)),
            self._to_device(positions),
            *self._sampling_scalars(params),
            greedy=params.is_greedy,
            backend=self.sampler,
            **self._sampling_options(params, self._history(rows, params)),
        )

    def _history(self, rows: list[Sequence], params: SamplingParams) -> torch.Tensor | None:
        """The rows' tokens so far [R, L], only under a repetition penalty."""
        if not params.penalizes_repeats:
            return None
        return history_of([seq.token_ids for seq in rows])

    def _sampling_options(self, params: SamplingParams, history) -> dict:
        """top_k, min_p (numbers for C++, else the runner's 0-d device tensors, filled now) and
        the repetition penalty with its history on the device."""
        options = dict(repetition_penalty=params.repetition_penalty)
        if params.penalizes_repeats:
            options["history"] = self._to_device(history)
        if self.sampler == "cpp" or params.is_greedy:
            return dict(options, top_k=params.top_k, min_p=params.min_p)
        self.top_k.fill_(params.top_k)
        self.min_p.fill_(params.min_p)
        return dict(options, top_k=self.top_k, min_p=self.min_p)

    def _sampling_scalars(self, params: SamplingParams) -> tuple:
        """(temperature, top_p) as the sampler backend takes them: floats for C++, else the
        runner's 0-d device tensors, filled now."""
        if self.sampler == "cpp" or params.is_greedy:
            return params.temperature, params.top_p
        self.temperature.fill_(params.temperature)
        self.top_p.fill_(params.top_p)
        return self.temperature, self.top_p

    def _tables(self, rows: list[Sequence]) -> torch.Tensor:
        return self._to_device(self.manager.block_tables([seq.block_id for seq in rows], 0))

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":  # skips a no-op dispatch: CPU decode is dispatch-bound
            return tensor
        return tensor.to(self.device, non_blocking=True)


@dataclass
class DecodeInputs:
    """One decode pass's host-side inputs, R rows: token_ids, positions, slots, seeds [R] int64,
    block_tables [R, M] int32, and under a repetition penalty each row's tokens so far
    (history [R, L] int64, else None)."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    seeds: torch.Tensor
    history: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.token_ids.shape[0]


def seeds_of(rows: list[Sequence]) -> torch.Tensor:
    return torch.tensor([seq.seed for seq in rows], dtype=torch.long)
