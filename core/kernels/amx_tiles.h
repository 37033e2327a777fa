// specfw: what every AMX kernel needs before its first tile instruction (bf16_amx.cpp,
// w8a8_ops.cpp's amx build): the tile configuration's memory layout and Linux's permission.
#pragma once
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace specfw_amx {

// LDTILECFG's 64-byte operand, palette 1: per tile its bytes per row and its rows
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// LDTILECFG of cfg. Not _tile_loadconfig: GCC 12's names its operand as 8 bytes
// ("m"(*(const void**)p)), so the stores of rows and colsb past them may be dropped as dead
// (a benchmark built with -O2 ran tile instructions on an unconfigured palette: SIGILL); this
// operand is the whole 64 bytes.
inline void load_config(const TileConfig& cfg) {
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

// Linux: a process must ask for the AMX tile state (arch_prctl) before its first tile instruction
inline bool request_amx() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace specfw_amx
