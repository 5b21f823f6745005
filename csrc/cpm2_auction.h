// CPM-2-MoE's balanced assignment (csrc/cpm2_auction.cpp says how it is computed).
#pragma once

#include <cstdint>

namespace cpm2 {

// One group: scores [jobs, workers] float32 row-major, jobs % workers == 0, all finite.
// Writes jobs token indices to `out`, expert by expert (jobs / workers each); returns the rounds.
int64_t auction(const float *job_and_worker, int64_t jobs, int64_t workers, int64_t *out);

}  // namespace cpm2
