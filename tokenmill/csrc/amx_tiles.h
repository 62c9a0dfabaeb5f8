// What every AMX kernel here shares (linear_bf16_amx.h: bf16 weights; linear_block_tiles.h:
// Q8_0 and 4-bit blocks): whether the CPU has the tile unit and Linux granted this process
// its state, the tile configuration (LDTILECFG's 64 bytes), and the tile instructions with
// tile numbers as template arguments.
//
// The instructions are written as inline assembly (GCC's intrinsics paste literal digits
// into theirs, and need a target pragma around every caller). Loads and stores clobber
// memory, so the compiler keeps them in order with the vector code that writes what a tile
// reads (x's rounded rows) and reads what a tile stored (sums).
#pragma once
#include <array>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__) && defined(__x86_64__) && \
    defined(__linux__)
#define TM_HAVE_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace amx {

constexpr int kMaxRows = 16;  // rows of a tile register
#define TM_AMX_INLINE inline __attribute__((always_inline))

// CPUID 7.0 EDX bits: AMX-BF16 22, AMX-TILE 24, AMX-INT8 25.
enum Feature : unsigned { kBF16 = 1u << 22, kTile = 1u << 24, kInt8 = 1u << 25 };

// Whether the CPU has AMX-TILE and `feature` and Linux granted the tile state (XTILEDATA,
// asked once per process: it is off until a process requests it). TOKENMILL_AMX=0 declines
// (the vector kernels instead), as ONEDNN_MAX_CPU_ISA does for oneDNN.
inline bool available(Feature feature) {
  static const unsigned edx = [] {
    const char* env = std::getenv("TOKENMILL_AMX");
    if (env && std::string(env) == "0") return 0u;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & kTile)) return 0u;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0 ? d : 0u;
  }();
  return (edx & feature) != 0;
}

// LDTILECFG's 64 bytes, palette 1: each tile's rows and bytes a row.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// The tile registers of a thread, configured by `config` for the scope (the configuration
// is per thread, so each thread's part of a call sets it). `config` must outlive the scope
// and be a global: LDTILECFG reads all 64 bytes, which the compiler may not know of a local.
class Tiles {
 public:
  explicit Tiles(const TileConfig& config) {
    asm volatile("ldtilecfg %0" ::"m"(config) : "memory");
  }
  ~Tiles() { asm volatile("tilerelease" ::: "memory"); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

template <int T>
static TM_AMX_INLINE void zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(T));
}
template <int T>  // tile T's rows from p, `stride` bytes apart
static TM_AMX_INLINE void load(const void* p, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
}
template <int T>
static TM_AMX_INLINE void store(void* p, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
}

template <int... I, class F>
static TM_AMX_INLINE void unrolled(std::integer_sequence<int, I...>, F f) {
  (f(std::integral_constant<int, I>{}), ...);
}

}  // namespace amx
#endif
