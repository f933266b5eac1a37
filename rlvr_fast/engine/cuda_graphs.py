"""``DecodeGraphs``: decode passes, and the draw of each row's next token, replayed from CUDA
graphs.

One graph per (batch bucket, greedy or sampled), captured the first time the engine decodes that
many rows in that mode. Buckets are the powers of two below ``max_batch``, then ``max_batch``: a
batch of R rows runs in the smallest bucket >= R; its padding rows are reset on every replay to
token 0 at position 0 with the scratch block as their whole block table, so they write their keys
and values to the scratch slot only and attend to that one slot (not to a stale length through a
stale table left by an earlier, larger batch). Every input lives in a static device buffer that
a step overwrites in place (token ids, positions, slots and seeds in one packed copy, the block
tables in another), the temperature, top-p, top-k and min-p are 0-d device tensors (the same
graph serves every setting), and the block tables have
the fixed width of ``max_model_len``; the Triton decode kernel reads each row's length at run
time, so a short row costs its own length. Prefill passes stay eager. Capture and replay run
with the storage's device made current (graphs, streams and Triton launches use the current
device).

``cuda`` is the CUDA runtime the graphs use (``torch.cuda``; the tests pass a CPU stand-in whose
replay re-runs the captured operations on the same static buffers).
"""

from __future__ import annotations

import torch

from rlvr_fast.engine.kv_storage import PagedKVStorage
from rlvr_fast.engine.token_sampler import SamplingParams, sample_tokens
from rlvr_fast.models.context import ForwardContext
from rlvr_fast.utils.phases import profile_range

TOKEN_IDS, POSITIONS, SLOTS, SEEDS = range(4)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, ... below max_batch, then max_batch."""
    return [1 << i for i in range((max_batch - 1).bit_length())] + [max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model,
        storage: PagedKVStorage,
        backend: str,
        *,
        max_batch: int,
        table_width: int,
        cuda=torch.cuda,
    ) -> None:
        self.model = model
        self.storage = storage
        self.backend = backend
        self.cuda = cuda
        self.buckets = batch_buckets(max_batch)
        self.device = device = storage.data.device
        self.inputs = torch.zeros((4, max_batch), dtype=torch.long, device=device)
        # What a padding row holds: token 0 at position 0, its one key in the scratch slot.
        self.padding_row = torch.tensor(
            [0, 0, storage.scratch_slot, 0], dtype=torch.long, device=device
        )[:, None]
        self.block_tables = torch.full(
            (max_batch, table_width), storage.scratch_block, dtype=torch.int32, device=device
        )
        self.temperature = torch.ones((), device=device)
        self.top_p = torch.ones((), device=device)
        self.top_k = torch.zeros((), device=device)
        self.min_p = torch.zeros((), device=device)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def fits(self, inputs) -> bool:
        return (
            inputs.rows <= self.buckets[-1]
            and inputs.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(self, inputs, params: SamplingParams) -> torch.Tensor:
        """Token ids [R] drawn after one decode pass of ``inputs`` (a ``DecodeInputs``)."""
        rows = inputs.rows
        bucket = next(b for b in self.buckets if b >= rows)
        key = (bucket, params.is_greedy)
        with self.cuda.device(self.device):
            if key not in self.graphs:
                self.graphs[key] = self._capture(bucket, params.is_greedy)
            self._load(inputs, bucket, params)
            graph, tokens = self.graphs[key]
            with profile_range(f"graph replay b={bucket}", self.device):
                graph.replay()
        return tokens[:rows]

    def _load(self, inputs, bucket: int, params: SamplingParams) -> None:
        """Write one pass's inputs into the static buffers; reset the padding rows."""
        rows = inputs.rows
        packed = torch.stack((inputs.token_ids, inputs.positions, inputs.slots, inputs.seeds))
        self.inputs[:, :rows].copy_(packed, non_blocking=True)
        # Padding rows must not write into a slot a live sequence owns, nor attend further.
        self.inputs[:, rows:bucket].copy_(self.padding_row.expand(-1, bucket - rows))
        self.block_tables[rows:bucket].fill_(self.storage.scratch_block)
        width = inputs.block_tables.shape[1]
        self.block_tables[:rows, :width].copy_(inputs.block_tables, non_blocking=True)
        self.temperature.fill_(params.temperature)
        self.top_p.fill_(params.top_p)
        self.top_k.fill_(params.top_k)
        self.min_p.fill_(params.min_p)

    def _step(self, bucket: int, greedy: bool) -> torch.Tensor:
        positions = self.inputs[POSITIONS, :bucket]
        context = ForwardContext(
            positions=positions[:, None],
            kv_cache=self.storage.layers,
            slot_mapping=self.inputs[SLOTS, :bucket],
            context_lens=positions[:, None] + 1,
            block_tables=self.block_tables[:bucket],
            backend=self.backend,
        )
        logits = self.model.infer(self.inputs[TOKEN_IDS, :bucket, None], context)
        return sample_tokens(
            logits,
            self.inputs[SEEDS, :bucket],
            positions + 1,
            self.temperature,
            self.top_p,
            greedy=greedy,
            top_k=self.top_k,
            min_p=self.min_p,
        )

    def _capture(self, bucket: int, greedy: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up runs execute for real: point every row at the scratch slot first.
        self.inputs[SLOTS].fill_(self.storage.scratch_slot)
        self.inputs[POSITIONS].zero_()
        cuda = self.cuda
        side = cuda.Stream()
        side.wait_stream(cuda.current_stream())
        with cuda.stream(side):
            for _ in range(2):  # compiles the Triton kernels, sizes the allocator's blocks
                self._step(bucket, greedy)
        cuda.current_stream().wait_stream(side)
        graph = cuda.CUDAGraph()
        with cuda.graph(graph, pool=self.pool):
            tokens = self._step(bucket, greedy)
        self.pool = graph.pool()
        return graph, tokens
