// Paged KV-cache block manager: fixed-size blocks, per-sequence block tables, reference counts,
// fork (share every block) and copy-on-write of a shared, partially filled last block.
//
// A sequence of n tokens owns ceil(n / block_size) blocks. fork() copies the block table (or
// the part of it covering a prefix) and raises each block's reference count, so branches share
// their prefix with no copy. When a sequence appends into a partial last block that another
// sequence also holds, the manager gives it a fresh block and reports (src, dst) so the caller
// copies those KV slots before writing: no two sequences ever write the same slot. Every
// operation checks that it can succeed before it changes anything, so a failed call (out of
// blocks, unknown sequence) leaves the manager as it was and raises a Python exception.
//
// Every count and id from Python is checked before it is used: block ids are int32 (the block
// tables the kernels read), so at most 2^31 - 1 blocks; token counts and cache slots are int64,
// and every sum of them is checked against overflow, so a huge or negative number raises a
// ValueError instead of wrapping around.
//
// Threading model: none inside. A BlockManager is plain data owned by one sampler; calls from
// several Python threads must be serialised by the caller (the GIL is held throughout each call,
// so two calls never interleave inside the manager).

#include "torch_api.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();
constexpr int64_t kMaxBlocks = std::numeric_limits<int32_t>::max();
// The slots one append_batch / append_many call returns (128 MiB of int64): far above any
// prefill pass, far below a size whose allocation would take the machine down.
constexpr int64_t kMaxSlotsPerCall = int64_t{1} << 24;

// a + b for counts already known to be >= 0, or a ValueError naming `op`.
int64_t checked_sum(int64_t a, int64_t b, const char* op) {
  if (b > kMaxInt64 - a) {
    throw pybind11::value_error(std::string(op) + ": token count overflows int64 (" +
                                std::to_string(a) + " + " + std::to_string(b) + ")");
  }
  return a + b;
}

struct Sequence {
  std::vector<int32_t> blocks;
  int64_t num_tokens = 0;
};

class BlockManager {
 public:
  BlockManager(int64_t num_blocks, int64_t block_size)
      : block_size_(checked_shape(num_blocks, block_size)), ref_counts_(num_blocks, 0) {
    // Hand out low block ids first: pop from the back of a descending list.
    for (int64_t b = num_blocks - 1; b >= 0; --b) {
      free_.push_back(static_cast<int32_t>(b));
    }
  }

  int64_t allocate(int64_t num_tokens) {
    if (num_tokens < 0) {
      throw pybind11::value_error("allocate: num_tokens must be >= 0");
    }
    require_free(blocks_for(num_tokens), "allocate");
    Sequence seq;
    seq.num_tokens = num_tokens;
    for (int64_t i = 0; i < blocks_for(num_tokens); ++i) {
      seq.blocks.push_back(take_block());
    }
    return add_sequence(std::move(seq));
  }

  // Returns the (src, dst) block copies the caller must perform before writing.
  std::vector<std::pair<int32_t, int32_t>> append(int64_t seq_id, int64_t num_tokens) {
    if (num_tokens < 0) {
      throw pybind11::value_error("append: num_tokens must be >= 0");
    }
    Sequence& seq = find(seq_id);
    const int64_t new_total = checked_sum(seq.num_tokens, num_tokens, "append");
    const bool copy_last = num_tokens > 0 && seq.num_tokens % block_size_ != 0 &&
                           ref_counts_[seq.blocks.back()] > 1;
    const int64_t extra = blocks_for(new_total) - static_cast<int64_t>(seq.blocks.size());
    require_free(extra + (copy_last ? 1 : 0), "append");
    std::vector<std::pair<int32_t, int32_t>> copies;
    if (copy_last) {
      const int32_t src = seq.blocks.back();
      const int32_t dst = take_block();
      --ref_counts_[src];
      seq.blocks.back() = dst;
      copies.emplace_back(src, dst);
    }
    for (int64_t i = 0; i < extra; ++i) {
      seq.blocks.push_back(take_block());
    }
    seq.num_tokens = new_total;
    return copies;
  }

  // A new sequence sharing the first num_tokens tokens of seq_id (all of them when
  // num_tokens < 0): it holds the blocks covering them, each block's ref count + 1.
  int64_t fork(int64_t seq_id, int64_t num_tokens) {
    const Sequence& parent = find(seq_id);
    if (num_tokens > parent.num_tokens) {
      throw pybind11::value_error("fork: sequence " + std::to_string(seq_id) + " has " +
                                  std::to_string(parent.num_tokens) + " tokens, not " +
                                  std::to_string(num_tokens));
    }
    Sequence copy;
    copy.num_tokens = num_tokens < 0 ? parent.num_tokens : num_tokens;
    copy.blocks.assign(parent.blocks.begin(), parent.blocks.begin() + blocks_for(copy.num_tokens));
    for (int32_t b : copy.blocks) {
      ++ref_counts_[b];
    }
    return add_sequence(std::move(copy));
  }

  // append(seq, num_tokens) for every sequence in order, as one call that either succeeds
  // whole or changes nothing. Returns the block copies to perform first and the cache slot
  // (block * block_size + offset) of every new token, int64 [len(seq_ids), num_tokens].
  std::pair<std::vector<std::pair<int32_t, int32_t>>, at::Tensor> append_batch(
      const std::vector<int64_t>& seq_ids, int64_t num_tokens) {
    if (num_tokens < 0) {
      throw pybind11::value_error("append_batch: num_tokens must be >= 0");
    }
    auto result = append_rows(seq_ids, std::vector<int64_t>(seq_ids.size(), num_tokens),
                              "append_batch");
    result.second = result.second.view({static_cast<int64_t>(seq_ids.size()), num_tokens});
    return result;
  }

  // append(seq_ids[i], counts[i]) for every i in order, all or nothing; the slots of all new
  // tokens, row after row, as one flat int64 tensor [sum(counts)].
  std::pair<std::vector<std::pair<int32_t, int32_t>>, at::Tensor> append_many(
      const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& counts) {
    return append_rows(seq_ids, counts, "append_many");
  }

  void free(int64_t seq_id) {
    Sequence& seq = find(seq_id);
    for (int32_t b : seq.blocks) {
      if (--ref_counts_[b] == 0) {
        free_.push_back(b);
      }
    }
    sequences_.erase(seq_id);
  }

  at::Tensor block_table(int64_t seq_id) {
    const Sequence& seq = find(seq_id);
    auto table = at::empty({static_cast<int64_t>(seq.blocks.size())}, at::kInt);
    std::copy(seq.blocks.begin(), seq.blocks.end(), table.data_ptr<int32_t>());
    return table;
  }

  // Block tables of several sequences as one zero-padded int32 tensor
  // [len(seq_ids), max(min_width, longest table)].
  at::Tensor block_tables(const std::vector<int64_t>& seq_ids, int64_t min_width) {
    // No sequence holds more blocks than exist, so a wider table is padding only.
    if (min_width > num_blocks()) {
      throw pybind11::value_error("block_tables: min_width " + std::to_string(min_width) +
                                  " is more than the " + std::to_string(num_blocks()) + " blocks");
    }
    int64_t width = std::max<int64_t>(min_width, 0);
    std::vector<const Sequence*> rows;
    for (int64_t id : seq_ids) {
      rows.push_back(&find(id));
      width = std::max<int64_t>(width, static_cast<int64_t>(rows.back()->blocks.size()));
    }
    auto tables = at::zeros({static_cast<int64_t>(rows.size()), width}, at::kInt);
    int32_t* out = tables.data_ptr<int32_t>();
    for (const Sequence* seq : rows) {
      std::copy(seq->blocks.begin(), seq->blocks.end(), out);
      out += width;
    }
    return tables;
  }

  // How many free blocks append_many(seq_ids, counts) would take (copy-on-write copies
  // included), without changing anything: what a scheduler asks before admitting a batch.
  int64_t blocks_needed(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& counts) {
    return count_needed(seq_ids, counts, "blocks_needed");
  }

  int64_t num_tokens(int64_t seq_id) { return find(seq_id).num_tokens; }
  int64_t ref_count(int64_t block) {
    if (block < 0 || block >= static_cast<int64_t>(ref_counts_.size())) {
      throw pybind11::index_error("ref_count: no block " + std::to_string(block));
    }
    return ref_counts_[block];
  }
  int64_t num_free_blocks() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_blocks() const { return static_cast<int64_t>(ref_counts_.size()); }
  int64_t block_size() const { return block_size_; }
  int64_t num_sequences() const { return static_cast<int64_t>(sequences_.size()); }

  // Raises RuntimeError naming the first broken invariant.
  void check_invariants() const {
    std::vector<int64_t> holders(ref_counts_.size(), 0);
    for (const auto& [id, seq] : sequences_) {
      if (static_cast<int64_t>(seq.blocks.size()) != blocks_for(seq.num_tokens)) {
        fail("sequence " + std::to_string(id) + " holds the wrong number of blocks");
      }
      for (int32_t b : seq.blocks) {
        ++holders[b];
      }
    }
    std::vector<bool> is_free(ref_counts_.size(), false);
    for (int32_t b : free_) {
      if (is_free[b]) fail("block " + std::to_string(b) + " is on the free list twice");
      is_free[b] = true;
    }
    for (size_t b = 0; b < ref_counts_.size(); ++b) {
      if (holders[b] != ref_counts_[b]) {
        fail("block " + std::to_string(b) + " has ref count " + std::to_string(ref_counts_[b]) +
             " but " + std::to_string(holders[b]) + " holders");
      }
      if (is_free[b] != (ref_counts_[b] == 0)) {
        fail("block " + std::to_string(b) + (is_free[b] ? " is free but held" : " leaked"));
      }
    }
  }

 private:
  // The all-or-nothing append of append_batch and append_many; `op` names the caller in errors.
  std::pair<std::vector<std::pair<int32_t, int32_t>>, at::Tensor> append_rows(
      const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& counts, const char* op) {
    require_free(count_needed(seq_ids, counts, op), op);
    int64_t total = 0;
    for (int64_t count : counts) {
      total = checked_sum(total, count, op);
    }
    if (total > kMaxSlotsPerCall) {
      throw pybind11::value_error(std::string(op) + ": " + std::to_string(total) +
                                  " new tokens in one call, more than " +
                                  std::to_string(kMaxSlotsPerCall));
    }
    std::vector<std::pair<int32_t, int32_t>> copies;
    auto slots = at::empty({total}, at::kLong);
    int64_t* slot = slots.data_ptr<int64_t>();
    for (size_t i = 0; i < seq_ids.size(); ++i) {
      Sequence& seq = sequences_.find(seq_ids[i])->second;
      const int64_t start = seq.num_tokens;
      for (const auto& copy : append(seq_ids[i], counts[i])) {
        copies.push_back(copy);
      }
      for (int64_t pos = start; pos < start + counts[i]; ++pos) {
        *slot++ = static_cast<int64_t>(seq.blocks[pos / block_size_]) * block_size_ +
                  pos % block_size_;
      }
    }
    return {copies, slots};
  }

  // Free blocks that append(seq_ids[i], counts[i]) for every i in order would take, replaying
  // the copy-on-write decisions in order: when two forks share a partial last block, the first
  // copies it and the second then holds it alone.
  int64_t count_needed(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& counts,
                       const char* op) {
    if (counts.size() != seq_ids.size()) {
      throw pybind11::value_error(std::string(op) + ": one count per sequence");
    }
    std::unordered_map<int32_t, int64_t> released;
    std::unordered_map<int64_t, bool> seen;
    int64_t needed = 0;
    for (size_t i = 0; i < seq_ids.size(); ++i) {
      const int64_t id = seq_ids[i];
      if (counts[i] < 0) {
        throw pybind11::value_error(std::string(op) + ": counts must be >= 0");
      }
      if (seen[id]) {
        throw pybind11::value_error(std::string(op) + ": sequence " + std::to_string(id) +
                                    " appears twice");
      }
      seen[id] = true;
      const Sequence& seq = find(id);
      if (counts[i] > 0 && seq.num_tokens % block_size_ != 0) {
        const int32_t last = seq.blocks.back();
        if (ref_counts_[last] - released[last] > 1) {
          ++released[last];
          ++needed;
        }
      }
      // At most num_blocks per term and per copy, so `needed` cannot overflow.
      needed += blocks_for(checked_sum(seq.num_tokens, counts[i], op)) -
                static_cast<int64_t>(seq.blocks.size());
    }
    return needed;
  }

  // ceil(num_tokens / block_size) for num_tokens >= 0, without the overflow of the usual
  // (num_tokens + block_size - 1) / block_size near INT64_MAX.
  int64_t blocks_for(int64_t num_tokens) const {
    return num_tokens / block_size_ + (num_tokens % block_size_ != 0 ? 1 : 0);
  }

  // The block size, once the shape is known to fit: block ids in int32 and every cache slot
  // (block * block_size + offset) in int64.
  static int64_t checked_shape(int64_t num_blocks, int64_t block_size) {
    if (num_blocks < 1 || num_blocks > kMaxBlocks || block_size < 1 ||
        block_size > kMaxInt64 / num_blocks) {
      throw pybind11::value_error(
          "BlockManager: need 1 <= num_blocks <= 2^31 - 1 and 1 <= block_size with "
          "num_blocks * block_size <= 2^63 - 1, got " + std::to_string(num_blocks) + " and " +
          std::to_string(block_size));
    }
    return block_size;
  }

  int64_t add_sequence(Sequence&& seq) {
    if (next_id_ == kMaxInt64) {
      throw pybind11::value_error("BlockManager: sequence ids exhausted");
    }
    const int64_t id = next_id_++;
    sequences_.emplace(id, std::move(seq));
    return id;
  }

  void require_free(int64_t needed, const char* op) const {
    if (needed > static_cast<int64_t>(free_.size())) {
      throw std::runtime_error(std::string(op) + ": out of KV blocks (" + std::to_string(needed) +
                               " needed, " + std::to_string(free_.size()) + " free of " +
                               std::to_string(ref_counts_.size()) + ")");
    }
  }

  int32_t take_block() {
    const int32_t b = free_.back();
    free_.pop_back();
    ref_counts_[b] = 1;
    return b;
  }

  Sequence& find(int64_t seq_id) {
    auto it = sequences_.find(seq_id);
    if (it == sequences_.end()) {
      throw pybind11::key_error("no sequence " + std::to_string(seq_id));
    }
    return it->second;
  }

  [[noreturn]] static void fail(const std::string& message) {
    throw std::runtime_error("BlockManager invariant broken: " + message);
  }

  int64_t block_size_;
  std::vector<int64_t> ref_counts_;
  std::vector<int32_t> free_;
  std::unordered_map<int64_t, Sequence> sequences_;
  int64_t next_id_ = 0;
};

}  // namespace

void register_block_manager(pybind11::module& m) {
  pybind11::class_<BlockManager>(m, "BlockManager")
      .def(pybind11::init<int64_t, int64_t>(), pybind11::arg("num_blocks"),
           pybind11::arg("block_size") = 16)
      .def("allocate", &BlockManager::allocate, pybind11::arg("num_tokens"))
      .def("append", &BlockManager::append, pybind11::arg("seq_id"), pybind11::arg("num_tokens"))
      .def("append_batch", &BlockManager::append_batch, pybind11::arg("seq_ids"),
           pybind11::arg("num_tokens") = 1)
      .def("append_many", &BlockManager::append_many, pybind11::arg("seq_ids"),
           pybind11::arg("counts"))
      .def("blocks_needed", &BlockManager::blocks_needed, pybind11::arg("seq_ids"),
           pybind11::arg("counts"))
      .def("fork", &BlockManager::fork, pybind11::arg("seq_id"), pybind11::arg("num_tokens") = -1)
      .def("free", &BlockManager::free, pybind11::arg("seq_id"))
      .def("block_table", &BlockManager::block_table, pybind11::arg("seq_id"))
      .def("block_tables", &BlockManager::block_tables, pybind11::arg("seq_ids"),
           pybind11::arg("min_width") = 0)
      .def("num_tokens", &BlockManager::num_tokens, pybind11::arg("seq_id"))
      .def("ref_count", &BlockManager::ref_count, pybind11::arg("block"))
      .def("num_free_blocks", &BlockManager::num_free_blocks)
      .def("check_invariants", &BlockManager::check_invariants)
      .def_property_readonly("num_blocks", &BlockManager::num_blocks)
      .def_property_readonly("block_size", &BlockManager::block_size)
      .def_property_readonly("num_sequences", &BlockManager::num_sequences);
}
