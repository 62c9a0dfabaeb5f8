// All-reduce (sum) of a float32 tensor between the tensor-parallel ranks of one machine, over a
// shared-memory segment every rank has mapped (vLLM's CPU backend does the same): a few
// microseconds where gloo's loopback TCP takes 0.4-0.7 ms, which TP pays twice per layer.
//
// Segment layout (bytes; `slot` = the per-rank buffer size):
//   [0, 64 * world)                   flags: rank r's int64 at 64 * r, the last sequence
//                                     number whose data r has posted (own cache line each)
//   [64 * world + (b * world + r) * slot, ... + slot)
//                                     buffer b (0 or 1) of rank r
//
// Protocol for the call with sequence number s (1, 2, 3, ... the same on every rank; a tensor
// larger than a slot takes one number per slot-sized chunk):
//   1. copy the chunk into buffer s % 2 of this rank, then store-release flag[rank] = s;
//   2. wait until every flag >= s (load-acquire);
//   3. sum the world buffers s % 2 in rank order 0..world-1 into the tensor: every rank gets
//      the same bits.
// Why two buffers: a rank may write buffer s % 2 again at s + 2 only after every rank posted
// s + 1, which each does only after it finished reading the buffers of s.
// A peer that does not arrive within `timeout_s` (dead or out of step) raises instead of
// hanging; the executor then stops every worker. A waiting rank spins, yielding its core every
// SHM_YIELD_EVERY pauses (a few µs): with more ranks than cores a pure spin would hold the core
// the awaited peer needs until the scheduler's time slice ends (measured: 3 ranks on 2 cores,
// a batch-1 decode step with its 60 all-reduces took 224 ms); with a core per rank the peer
// arrives within the first spins and nothing yields.
#pragma once
#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <immintrin.h>
#include <sched.h>

constexpr int64_t SHM_YIELD_EVERY = 256;

inline void shm_wait_all(volatile int64_t* flags_base, int64_t world, int64_t seq,
                         double timeout_s) {
  auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < world; ++r) {
    int64_t* flag = (int64_t*)((char*)flags_base + 64 * r);
    int64_t spins = 0;
    while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) < seq) {
      _mm_pause();
      if (++spins % SHM_YIELD_EVERY == 0) sched_yield();
      if (spins % 4096 == 0) {
        double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                            .count();
        TORCH_CHECK(waited < timeout_s, "shared-memory all-reduce: rank ", r, " did not arrive "
                    "within ", timeout_s, " s (sequence ", seq, ")");
      }
    }
  }
}

// x (any shape, contiguous float32) <- sum over ranks; returns the last sequence number used.
inline int64_t shm_all_reduce_(torch::Tensor x, torch::Tensor segment, int64_t rank,
                               int64_t world, int64_t slot_bytes, int64_t seq,
                               double timeout_s) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "shm_all_reduce_: x must be a contiguous float32 CPU tensor");
  TORCH_CHECK(segment.scalar_type() == torch::kUInt8 &&
                  segment.numel() >= 64 * world + 2 * world * slot_bytes,
              "shm_all_reduce_: the segment is too small");
  char* base = (char*)segment.data_ptr<uint8_t>();
  char* buffers = base + 64 * world;
  float* data = x.data_ptr<float>();
  const int64_t per_chunk = slot_bytes / (int64_t)sizeof(float);
  const int64_t n = x.numel();  // the same on every rank
  for (int64_t off = 0; off < n; off += per_chunk) {
    ++seq;
    const int64_t len = std::min(per_chunk, n - off);
    const int64_t b = seq & 1;
    float* mine = (float*)(buffers + (b * world + rank) * slot_bytes);
    std::memcpy(mine, data + off, len * sizeof(float));
    __atomic_store_n((int64_t*)(base + 64 * rank), seq, __ATOMIC_RELEASE);
    shm_wait_all((volatile int64_t*)base, world, seq, timeout_s);
    float* out = data + off;
    const float* first = (const float*)(buffers + (b * world) * slot_bytes);
    for (int64_t i = 0; i < len; ++i) out[i] = first[i];
    for (int64_t r = 1; r < world; ++r) {
      const float* other = (const float*)(buffers + (b * world + r) * slot_bytes);
      for (int64_t i = 0; i < len; ++i) out[i] += other[i];
    }
  }
  return seq;
}
