// CPM-2-MoE's balanced assignment (its src/libbase, fairseq's BASE-layer auction), step for step,
// for the `cpm2` router: the same tokens go to the same experts as in CPM-2's runs.
//
// cpm2_auction(scores float32[G, T, W]) -> int64[G, T]
//   For each group: T tokens ("jobs") over W experts ("workers"), k = T / W each (T % W == 0).
//   The result lists token indices expert by expert: entries e*k .. e*k+k-1 are expert e's tokens,
//   in the order of that expert's last top-(k+1) selection (its values descending).
//
// This is not the exact assignment of balanced_assignment.cpp: it is an auction with a fixed
// epsilon = max((max - min) / 50, 1e-4) in score units, which ends as soon as every token has a
// bidder in a round, and after 100 rounds lets a winner's value fall back to its score (CPM-2's
// "suboptimal approximation that converges quickly"). To give CPM-2's answer bit for bit, every
// step is done as their torch operations do it on the CPU, in float32:
// - a round: each expert takes its k + 1 largest values (torch's CPU topk: a queue of (value,
//   index) pairs in index order, std::partial_sort when 64 (k + 1) <= T, else std::nth_element
//   and a sort of the first k; the same comparator, so ties fall where torch's fall), and bids
//   (value_i - value_{k+1}) + epsilon on each of its first k;
// - from the second round to the hundredth, last round's winners get a bid of epsilon instead
//   (it overwrites their own bid), so they keep a job nobody else wants;
// - the highest bid per token wins (the first expert on equal bids, as torch's max over a
//   dimension); when every token has a bid, the round's selections are the answer;
// - else the price of each token rises by its highest bid, every value is score - price, and each
//   winner's value is set to the largest score (rounds 1-100) or to its own score (later).
// An assignment that has not ended after kMaxRounds rounds raises RuntimeError (CPM-2 would loop
// on; no such input is known). Memory: O(T * W) per group. The GIL is released.

#include "cpm2_auction.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace cpm2 {
namespace {

constexpr int64_t kExactRounds = 100;        // their max_iterations
constexpr int64_t kMaxRounds = 1000000;      // ours: a bound, never expected to be reached

using Entry = std::pair<float, int64_t>;

bool larger(const Entry &x, const Entry &y) {
  return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
}

// torch's CPU topk (largest, sorted) of one row: the first `k` entries of `queue` hold the
// result in torch's order, ties included.
void topk(const float *row, int64_t n, int64_t k, std::vector<Entry> &queue) {
  for (int64_t j = 0; j < n; ++j) queue[j] = Entry(row[j], j);
  if (k * 64 <= n) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), larger);
    std::sort(queue.begin(), queue.begin() + k - 1, larger);
  }
}

}  // namespace

int64_t auction(const float *job_and_worker, int64_t jobs, int64_t workers, int64_t *out) {
  const int64_t k = jobs / workers;
  const int64_t n = jobs;
  float highest = job_and_worker[0], lowest = job_and_worker[0];
  for (int64_t i = 1; i < jobs * workers; ++i) {
    highest = std::max(highest, job_and_worker[i]);
    lowest = std::min(lowest, job_and_worker[i]);
  }
  float epsilon = (highest - lowest) / 50.0f;
  epsilon = std::max(epsilon, 1e-4f);
  std::vector<float> score(workers * n);  // [worker, job]
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t w = 0; w < workers; ++w) score[w * n + j] = job_and_worker[j * workers + w];
  }
  std::vector<float> value(score), cost(n, 0.0f), high_bids(n);
  std::vector<int64_t> high_bidders(n), top_index(workers * (k + 1)), winner(n, -1);
  std::vector<float> top_values(workers * (k + 1));
  std::vector<Entry> queue(n);
  // The bids are sparse (k per expert, and last round's winners): torch's dense [W, T] bids
  // and its max over experts are replaced by a scan of the bids made, the lower expert
  // winning equal bids, which is the dense maximum's answer.
  auto offer = [&](int64_t j, int64_t w, float bid) {
    if (bid > high_bids[j] || (bid == high_bids[j] && w < high_bidders[j])) {
      high_bids[j] = bid;
      high_bidders[j] = w;
    }
  };
  for (int64_t round = 0;; ++round) {
    if (round >= kMaxRounds) {
      throw std::runtime_error("cpm2_auction(): no assignment after " +
                               std::to_string(kMaxRounds) + " rounds");
    }
    const bool retain = round > 0 && round < kExactRounds;
    std::fill(high_bids.begin(), high_bids.end(), 0.0f);
    std::fill(high_bidders.begin(), high_bidders.end(), 0);
    for (int64_t w = 0; w < workers; ++w) {
      topk(value.data() + w * n, n, k + 1, queue);
      for (int64_t i = 0; i <= k; ++i) {
        top_values[w * (k + 1) + i] = queue[i].first;
        top_index[w * (k + 1) + i] = queue[i].second;
      }
      const float last = top_values[w * (k + 1) + k];
      for (int64_t i = 0; i < k; ++i) {
        const int64_t j = top_index[w * (k + 1) + i];
        float increment = top_values[w * (k + 1) + i] - last;
        increment = increment + epsilon;
        offer(j, w, retain && winner[j] == w ? epsilon : increment);
      }
    }
    if (retain) {  // last round's winners bid epsilon (also where they made no bid this round)
      for (int64_t j = 0; j < n; ++j) {
        if (winner[j] >= 0) offer(j, winner[j], epsilon);
      }
    }
    bool all = true;
    for (int64_t j = 0; j < n && all; ++j) all = high_bids[j] > 0.0f;
    if (all) {
      for (int64_t w = 0; w < workers; ++w) {
        for (int64_t i = 0; i < k; ++i) out[w * k + i] = top_index[w * (k + 1) + i];
      }
      return round + 1;
    }
    for (int64_t j = 0; j < n; ++j) {
      cost[j] = cost[j] + high_bids[j];
      winner[j] = high_bids[j] > 0.0f ? high_bidders[j] : -1;
    }
    for (int64_t w = 0; w < workers; ++w) {
      float *row = value.data() + w * n;
      const float *own = score.data() + w * n;
      for (int64_t j = 0; j < n; ++j) row[j] = own[j] - cost[j];
    }
    for (int64_t j = 0; j < n; ++j) {
      if (winner[j] >= 0) {
        const int64_t flat = winner[j] * n + j;
        value[flat] = round < kExactRounds ? highest : score[flat];
      }
    }
  }
}

}  // namespace cpm2
