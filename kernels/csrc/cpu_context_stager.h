// ContextStager: the KV cache blocks of the context a decode-attention thread attends next, requested into L2
// a few cache lines at a time while the current context is being computed.
//
// Why: a sequence's context lies in 16-token blocks scattered over the pool (6 KB a block of keys on SmolLM2), so
// the hardware prefetchers, which follow one address stream within a page, see a new stream every block, and a
// task that reads its head's rows of each block (two cache lines of every six) waits on memory for most of each
// block. Measured on a 2-core Zen 5 guest (`structgen bench decode-attention`: 32 sequences of 250-500 tokens,
// SmolLM2's heads, a layer): ~1,020 us on scattered blocks against ~240 on blocks in cache, and reading the
// same scattered blocks alone ~500. Requesting the whole blocks of the next context, spread evenly over the
// current one's passes, keeps the memory system busy while the compute runs on blocks already in L2: ~540 us.
// Requests go to L2, not L1 (to L1 they evicted the rows being computed on: ~750 us). A context larger than L2
// is still staged, up to a budget: what L2 cannot keep waits in L3.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>

namespace structgen_cpu {

enum CacheLevel { kLevel2, kLevel3 };

// The size of a cache level per sysconf, or `fallback` where the C library does not say.
inline int64_t cache_bytes(CacheLevel level, int64_t fallback) {
  long bytes = -1;
#if defined(_SC_LEVEL2_CACHE_SIZE) && defined(_SC_LEVEL3_CACHE_SIZE)
  bytes = sysconf(level == kLevel2 ? _SC_LEVEL2_CACHE_SIZE : _SC_LEVEL3_CACHE_SIZE);
#endif
  return bytes > 0 ? static_cast<int64_t>(bytes) : fallback;
}

// The most bytes of one context (keys and values) staged ahead. Blocks staged past L2 still wait in L3, which
// is what made staging a longer context pay (16 sequences of 1,000-2,000 tokens: ~1,950 -> ~1,300 us a layer, with
// a budget of L3's share; with a third of L2, ~1,900): a thread's share of half the L3, at least the L2.
inline int64_t stage_budget_bytes(int64_t threads) {
  static const int64_t l2 = cache_bytes(kLevel2, int64_t{1} << 20), l3 = cache_bytes(kLevel3, int64_t{8} << 20);
  return std::max<int64_t>(l2, l3 / (2 * std::max<int64_t>(threads, 1)));
}

// A stream of one context's blocks (every head's rows of each block: whole blocks, keys and values) requested
// into L2 over a number of steps.
class BlockStream {
 public:
  // The context's first `blocks` blocks, as many as `budget` bytes hold (at least one), over `steps` steps.
  void start(const void* keys, const void* values, const int32_t* table, int64_t blocks, int64_t block_bytes,
             int64_t steps, int64_t budget) {
    keys_ = static_cast<const char*>(keys);
    values_ = static_cast<const char*>(values);
    table_ = table;
    block_bytes_ = block_bytes;
    blocks_ = std::min<int64_t>(blocks, std::max<int64_t>(1, budget / (2 * block_bytes)));
    block_ = offset_ = 0;
    respread(steps);
  }

  void clear() { block_ = blocks_ = 0; }

  // What is left, spread over `steps` steps from now.
  void respread(int64_t steps) {
    const int64_t left = (blocks_ - block_) * lines_per_block() - offset_ / kLine;
    steps = std::max<int64_t>(steps, 1);
    per_step_ = std::max<int64_t>(left, 0) / steps + 1;
  }

  // `lines` more cache lines (a key line and its value line count as one).
  void issue(int64_t lines) {
    while (lines > 0 && block_ < blocks_) {
      const int64_t at = static_cast<int64_t>(table_[block_]) * block_bytes_;
      for (; offset_ < block_bytes_ && lines > 0; offset_ += kLine, --lines) {
        // Locality 1: prefetcht2 on x86, which fills L2 (and L3), not L1.
        __builtin_prefetch(keys_ + at + offset_, 0, 1);
        __builtin_prefetch(values_ + at + offset_, 0, 1);
      }
      if (offset_ >= block_bytes_) {
        ++block_;
        offset_ = 0;
      }
    }
  }

  void step() { issue(per_step_); }
  int64_t lines_per_block() const { return (block_bytes_ + kLine - 1) / kLine; }

 private:
  static constexpr int64_t kLine = 64;
  const char* keys_ = nullptr;
  const char* values_ = nullptr;
  const int32_t* table_ = nullptr;
  int64_t block_bytes_ = 0, blocks_ = 0, block_ = 0, offset_ = 0, per_step_ = 0;
};

// A decode-attention thread's two streams: the context it is computing, when it was not staged ahead (a thread's
// first), a few blocks ahead of its first pass; and the context it takes next, spread over the current one's passes.
class ContextStager {
 public:
  // The run about to be computed: `staged` if it was the `next` of the run before; otherwise its first blocks
  // are requested now and the rest one block a step of its first pass (`first_pass_steps`), staying ahead.
  void begin(const void* keys, const void* values, const int32_t* table, int64_t blocks, int64_t block_bytes,
             bool staged, int64_t first_pass_steps, int64_t budget) {
    if (staged) {
      current_ = next_;  // what is left of it, if anything, goes out as it would have
      current_.respread(first_pass_steps);
    } else {
      current_.start(keys, values, table, blocks, block_bytes, first_pass_steps, budget);
    }
    next_.clear();
    current_.issue(kLeadBlocks * current_.lines_per_block());
  }

  // The run this thread takes next, spread over `steps` steps of the current one.
  void stage_next(const void* keys, const void* values, const int32_t* table, int64_t blocks, int64_t block_bytes,
                  int64_t steps, int64_t budget) {
    next_.start(keys, values, table, blocks, block_bytes, steps, budget);
  }

  // Called once a block of each pass of the kernel.
  void step() {
    current_.step();
    next_.step();
  }

 private:
  // How far the current run's requests start ahead of its first pass, in blocks.
  static constexpr int64_t kLeadBlocks = 4;
  BlockStream current_, next_;
};

}  // namespace structgen_cpu
