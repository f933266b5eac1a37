"""C++ BlockManager: unit cases, a random-operation state machine (100 runs of up to 200
random allocate / append / append_batch / fork (whole or prefix) / free calls: about 1.9 x 10^4
checked operations per test run), and every entry point fed huge and negative counts and ids."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rlvr_fast._C import BlockManager

BLOCK_SIZE, NUM_BLOCKS = 4, 24


def test_fork_shares_blocks_and_copy_on_write_copies_the_partial_last_block():
    manager = BlockManager(10, 4)
    parent = manager.allocate(6)  # blocks 0 (full) and 1 (2 of 4 slots)
    assert manager.block_table(parent).tolist() == [0, 1]
    child = manager.fork(parent)
    assert manager.block_table(child).tolist() == [0, 1]
    assert manager.ref_count(0) == manager.ref_count(1) == 2
    assert manager.num_free_blocks() == 8, "forking costs no block"
    assert manager.append(child, 1) == [(1, 2)], "one block copy for the shared partial block"
    assert manager.block_table(child).tolist() == [0, 2]
    assert manager.ref_count(1) == 1 and manager.ref_count(0) == 2
    assert manager.append(parent, 1) == [], "parent now owns block 1 alone"
    manager.check_invariants()


def test_full_shared_last_block_needs_no_copy():
    manager = BlockManager(10, 4)
    parent = manager.allocate(8)
    child = manager.fork(parent)
    assert manager.append(child, 3) == []
    assert manager.block_table(child).tolist() == [0, 1, 2]


def test_prefix_fork_shares_only_the_blocks_of_the_prefix():
    manager = BlockManager(10, 4)
    parent = manager.allocate(10)  # blocks 0, 1, 2
    child = manager.fork(parent, 5)
    assert manager.block_table(child).tolist() == [0, 1] and manager.num_tokens(child) == 5
    assert [manager.ref_count(b) for b in range(3)] == [2, 2, 1]
    assert manager.append(child, 1) == [(1, 3)], "the shared partial block is copied first"
    empty = manager.fork(parent, 0)
    assert manager.block_table(empty).tolist() == []
    with pytest.raises(ValueError, match="has 10 tokens, not 11"):
        manager.fork(parent, 11)
    manager.check_invariants()


def test_append_batch_replays_copy_on_write_in_order_and_returns_slots():
    manager = BlockManager(10, 4)
    parent = manager.allocate(6)  # blocks 0, 1 (2 of 4 slots used)
    child = manager.fork(parent)
    copies, slots = manager.append_batch([parent, child], 1)
    # The first writer copies the shared partial block; the second then holds it alone.
    assert copies == [(1, 2)]
    assert slots.tolist() == [[2 * 4 + 2], [1 * 4 + 2]]
    assert manager.block_tables([parent, child]).tolist() == [[0, 2], [0, 1]]
    assert manager.block_tables([child], min_width=4).tolist() == [[0, 1, 0, 0]]
    with pytest.raises(ValueError, match="appears twice"):
        manager.append_batch([parent, parent], 1)
    with pytest.raises(RuntimeError, match="append_batch: out of KV blocks"):
        manager.append_batch([parent, child], 40)
    assert manager.num_tokens(parent) == manager.num_tokens(child) == 7, (
        "failed call changed nothing"
    )
    manager.check_invariants()


def test_append_many_takes_a_count_per_sequence_all_or_nothing():
    manager = BlockManager(6, 4)
    first, second = manager.allocate(3), manager.allocate(4)
    copies, slots = manager.append_many([first, second], [2, 5])
    # first: slot 3 of block 0, then block 2; second: blocks 3 and 4 after its full block 1
    assert copies == [] and slots.tolist() == [3, 8, 12, 13, 14, 15, 16]
    assert (manager.num_tokens(first), manager.num_tokens(second)) == (5, 9)
    before = manager.block_tables([first, second]).tolist(), manager.num_free_blocks()
    with pytest.raises(RuntimeError, match="append_many: out of KV blocks"):
        manager.append_many([first, second], [1, 20])
    assert (manager.block_tables([first, second]).tolist(), manager.num_free_blocks()) == before
    assert manager.num_tokens(first) == 5, "the first row's append was not kept"
    with pytest.raises(ValueError, match="one count per sequence"):
        manager.append_many([first], [1, 2])
    manager.check_invariants()


def test_blocks_needed_counts_what_append_many_takes_without_changing_anything():
    manager = BlockManager(10, 4)
    parent = manager.allocate(6)  # blocks 0, 1 (partial)
    first, second = manager.fork(parent), manager.fork(parent)
    free = manager.num_free_blocks()
    # Each fork copies the shared partial block before appending into it ...
    assert manager.blocks_needed([first, second], [1, 1]) == 2
    # ... except the last holder, which by then owns it alone.
    assert manager.blocks_needed([first, second, parent], [1, 1, 1]) == 2
    assert manager.blocks_needed([second], [3]) == 1 + 1, "a copy, then a block for token 9"
    assert manager.blocks_needed([first], [0]) == 0
    assert manager.num_free_blocks() == free, "asking changes nothing"
    copies, _ = manager.append_many([first, second], [1, 3])
    assert free - manager.num_free_blocks() == 3 and len(copies) == 2
    with pytest.raises(ValueError, match="appears twice"):
        manager.blocks_needed([first, first], [1, 1])
    with pytest.raises(ValueError, match="one count per sequence"):
        manager.blocks_needed([first], [1, 1])
    manager.check_invariants()


def test_block_table_is_an_int32_tensor():
    manager = BlockManager(64, 16)
    seq = manager.allocate(100)
    table = manager.block_table(seq)
    assert table.dtype == torch.int32 and table.shape == (7,)


def test_failures_are_clear_and_change_nothing():
    manager = BlockManager(4, 4)
    seq = manager.allocate(10)
    before = (manager.num_free_blocks(), manager.block_table(seq).tolist(), manager.num_tokens(seq))
    with pytest.raises(RuntimeError, match="append: out of KV blocks \\(2 needed, 1 free of 4\\)"):
        manager.append(seq, 7)
    with pytest.raises(RuntimeError, match="allocate: out of KV blocks"):
        manager.allocate(20)
    with pytest.raises(KeyError, match="no sequence 7"):
        manager.fork(7)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        manager.append(seq, -1)
    assert (
        manager.num_free_blocks(),
        manager.block_table(seq).tolist(),
        manager.num_tokens(seq),
    ) == before
    manager.check_invariants()
    with pytest.raises(ValueError, match="need 1 <= num_blocks"):
        BlockManager(0, 16)


class RandomOperations(RuleBasedStateMachine):
    """allocate / append / fork / free at random, checked against a Python model."""

    def __init__(self):
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.tokens: dict[int, int] = {}

    def blocks_needed(self, tokens):
        return -(-tokens // BLOCK_SIZE)

    def snapshot(self):
        return (
            self.manager.num_free_blocks(),
            {s: self.manager.block_table(s).tolist() for s in self.tokens},
        )

    @rule(tokens=st.integers(0, 40))
    def allocate(self, tokens):
        if self.blocks_needed(tokens) > self.manager.num_free_blocks():
            before = self.snapshot()
            with pytest.raises(RuntimeError, match="out of KV blocks"):
                self.manager.allocate(tokens)
            assert self.snapshot() == before
            return
        seq = self.manager.allocate(tokens)
        self.tokens[seq] = tokens
        assert all(self.manager.ref_count(b) == 1 for b in self.manager.block_table(seq).tolist())

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), tokens=st.integers(0, 20))
    def append(self, data, tokens):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        table = self.manager.block_table(seq).tolist()
        old = self.tokens[seq]
        partial_shared = tokens > 0 and old % BLOCK_SIZE and self.manager.ref_count(table[-1]) > 1
        needed = self.blocks_needed(old + tokens) - len(table) + (1 if partial_shared else 0)
        if needed > self.manager.num_free_blocks():
            before = self.snapshot()
            with pytest.raises(RuntimeError, match="out of KV blocks"):
                self.manager.append(seq, tokens)
            assert self.snapshot() == before
            return
        copies = self.manager.append(seq, tokens)
        assert copies == (
            [(table[-1], self.manager.block_table(seq).tolist()[len(table) - 1])]
            if partial_shared
            else []
        )
        self.tokens[seq] = old + tokens
        new_table = self.manager.block_table(seq).tolist()
        # Every slot written by this append lies in a block no other sequence holds.
        for position in range(old, old + tokens):
            assert self.manager.ref_count(new_table[position // BLOCK_SIZE]) == 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), tokens=st.integers(1, 4))
    def append_batch(self, data, tokens):
        seqs = data.draw(
            st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=6, unique=True)
        )
        tables = {s: self.manager.block_table(s).tolist() for s in seqs}
        refs = [self.manager.ref_count(b) for b in range(NUM_BLOCKS)]
        needed = 0
        for seq in seqs:  # the copy-on-write decisions, replayed in call order
            old = self.tokens[seq]
            if old % BLOCK_SIZE and refs[tables[seq][-1]] > 1:
                refs[tables[seq][-1]] -= 1
                needed += 1
            needed += self.blocks_needed(old + tokens) - len(tables[seq])
        if needed > self.manager.num_free_blocks():
            before = self.snapshot()
            with pytest.raises(RuntimeError, match="out of KV blocks"):
                self.manager.append_batch(seqs, tokens)
            assert self.snapshot() == before
            return
        _, slots = self.manager.append_batch(seqs, tokens)
        assert len(set(slots.flatten().tolist())) == slots.numel(), "no slot written twice"
        for seq, row in zip(seqs, slots.tolist()):
            old = self.tokens[seq]
            self.tokens[seq] = old + tokens
            table = self.manager.block_table(seq).tolist()
            for position, slot in zip(range(old, old + tokens), row):
                assert slot == table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
                assert self.manager.ref_count(slot // BLOCK_SIZE) == 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = data.draw(st.one_of(st.just(-1), st.integers(0, self.tokens[seq])))
        free = self.manager.num_free_blocks()
        child = self.manager.fork(seq, tokens)
        kept = self.tokens[seq] if tokens < 0 else tokens
        assert self.manager.num_free_blocks() == free, "forking allocates nothing"
        assert (
            self.manager.block_table(child).tolist()
            == self.manager.block_table(seq).tolist()[: self.blocks_needed(kept)]
        )
        self.tokens[child] = kept

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(seq)
        del self.tokens[seq]
        with pytest.raises(KeyError):
            self.manager.block_table(seq)

    @invariant()
    def ref_counts_and_free_list_are_exact(self):
        self.manager.check_invariants()
        holders = [0] * NUM_BLOCKS
        for seq, tokens in self.tokens.items():
            table = self.manager.block_table(seq).tolist()
            assert len(table) == self.blocks_needed(tokens)
            assert self.manager.num_tokens(seq) == tokens
            for block in table:
                holders[block] += 1
        assert [self.manager.ref_count(b) for b in range(NUM_BLOCKS)] == holders
        assert self.manager.num_free_blocks() == holders.count(0), "no leaked block"

    def teardown(self):
        for seq in list(self.tokens):
            self.manager.free(seq)
        assert self.manager.num_free_blocks() == NUM_BLOCKS


TestRandomOperations = RandomOperations.TestCase
TestRandomOperations.settings = settings(
    max_examples=50, stateful_step_count=150, deadline=None, derandomize=True
)


INT64_MAX = 2**63 - 1
# Values at and around every boundary the manager computes with, and any int64.
EXTREME = st.sampled_from(
    [-INT64_MAX - 1, -2, -1, 0, 1, 2, 3, 2**31 - 1, 2**31, 2**32, 2**62, INT64_MAX - 1, INT64_MAX]
) | st.integers(-INT64_MAX - 1, INT64_MAX)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(num_blocks=EXTREME, block_size=EXTREME)
def test_a_shape_that_overflows_is_refused(num_blocks, block_size):
    """Regression: BlockManager(-1, 4) and shapes whose slots overflow int64 were accepted."""
    fits = 1 <= num_blocks <= 2**31 - 1 and 1 <= block_size and num_blocks * block_size <= INT64_MAX
    if not fits:
        with pytest.raises(ValueError, match="need 1 <= num_blocks <= 2.31 - 1"):
            BlockManager(num_blocks, block_size)
        return
    assume(num_blocks <= 4096)  # a valid manager of 2^31 blocks takes 24 GB
    manager = BlockManager(num_blocks, block_size)
    assert manager.num_free_blocks() == num_blocks and manager.block_size == block_size


def snapshot(manager, seqs):
    return (
        manager.num_free_blocks(),
        manager.num_sequences,
        {s: (manager.num_tokens(s), manager.block_table(s).tolist()) for s in seqs},
    )


@settings(max_examples=300, deadline=None, derandomize=True)
@given(block_size=st.sampled_from([1, 4, 2**40, 2**58]), data=st.data())
def test_huge_and_negative_counts_and_ids_raise_and_change_nothing(block_size, data):
    """Regression: allocate(2**63 - 1) overflowed blocks_for and the token slots and then crashed
    the process, and a huge append made the token count negative. Every call here either
    succeeds with the invariants intact or raises a Python error and changes nothing."""
    manager = BlockManager(16, block_size)
    seqs = [manager.allocate(block_size + 1), manager.allocate(1)]
    seqs.append(manager.fork(seqs[0]))
    calls = {
        "allocate": lambda: manager.allocate(data.draw(EXTREME)),
        "append": lambda: manager.append(
            data.draw(st.sampled_from(seqs) | EXTREME), data.draw(EXTREME)
        ),
        "append_batch": lambda: manager.append_batch(
            data.draw(st.lists(st.sampled_from(seqs) | EXTREME, max_size=3)), data.draw(EXTREME)
        ),
        "append_many": lambda: manager.append_many(
            data.draw(st.lists(st.sampled_from(seqs), min_size=1, max_size=3, unique=True)),
            data.draw(st.lists(EXTREME, min_size=1, max_size=3)),
        ),
        "blocks_needed": lambda: manager.blocks_needed(seqs, [data.draw(EXTREME)] * len(seqs)),
        "fork": lambda: manager.fork(
            data.draw(st.sampled_from(seqs) | EXTREME), data.draw(EXTREME)
        ),
        "free": lambda: manager.free(data.draw(EXTREME.filter(lambda i: i not in seqs))),
        "block_tables": lambda: manager.block_tables(seqs, data.draw(EXTREME)),
        "ref_count": lambda: manager.ref_count(data.draw(EXTREME)),
        "num_tokens": lambda: manager.num_tokens(data.draw(EXTREME)),
    }
    for name in data.draw(st.lists(st.sampled_from(sorted(calls)), min_size=1, max_size=6)):
        before = snapshot(manager, seqs)
        try:
            result = calls[name]()
        except (ValueError, KeyError, IndexError, RuntimeError):
            assert snapshot(manager, seqs) == before, f"a failed {name} changed the manager"
            continue
        if name in ("allocate", "fork"):
            assert manager.num_tokens(result) >= 0
        manager.check_invariants()
        for seq in seqs:
            assert 0 <= manager.num_tokens(seq) and len(manager.block_table(seq)) <= 16
