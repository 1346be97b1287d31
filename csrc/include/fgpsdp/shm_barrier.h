// The shared-memory barrier (csrc/cpu/shm_barrier_cpu.cpp), bound in csrc/bindings.cpp.
#pragma once

#include <cstdint>

namespace fgpsdp {
namespace cpu {

// Whether this build has the barrier (Linux: futex and record locks).
bool shm_barrier_supported();
// Publish arrival `target` of `rank` in the area at address `area` and wait until
// every rank's count is >= target. Returns 0: passed; 1: the failure flag byte at
// `flag_addr` is set; 2: the exit byte at `exit_addr` is set; 3: `timeout_s` passed;
// 100 + r: rank r's lock on byte r of the file open as `lock_fd` is gone.
int64_t shm_barrier_wait(int64_t area, int64_t rank, int64_t size, int64_t target, int64_t lock_fd,
                         int64_t flag_addr, int64_t exit_addr, double timeout_s);

}  // namespace cpu
}  // namespace fgpsdp
