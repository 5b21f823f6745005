// Balanced assignment of tokens to experts (BASE layers), the `_moe_helpers` extension module.
//
// balanced_assignment(scores float32[G, T, E], capacity) -> int64[G, T]
//   For each group g independently: the expert of every token such that no expert gets more than
//   `capacity` tokens and the total score sum_t scores[g, t, expert[t]] is maximal. Needs
//   T <= E * capacity. This is fairseq's BASE-layer routing (CPM-2-MoE copied it), which fairseq
//   also solves with an auction; here the auction is made exact and safe on any finite scores.
//
// The problem is an assignment of T tokens to S = E * c slots (c = min(capacity, T): an expert
// never needs more slots than there are tokens), the c slots of an expert having the same score.
// S - T "dummy" tokens of score 0 everywhere take the spare slots, which makes the problem
// symmetric: there, Bertsekas' forward auction with epsilon scaling is correct (prices are kept
// from one phase to the next, and so are the tokens still within the new epsilon of their best
// choice). Slots of one expert are "similar objects": a token bids for the cheapest slot of its
// best expert, and its second best value is the better of the next expert's cheapest slot and the
// second cheapest slot of the same expert, so a bid costs O(E + c), not O(S).
//
// Robustness. The scores of a group are mapped to [0, 1] by (x - min) / (max - min) in double (a
// group of equal scores uses a range of 1), so epsilon and every tolerance below are relative to
// the score range, whatever its magnitude. Epsilon goes from 1/20 down by kTheta = 4 per phase to
// max(1e-7 / S, 1e-12). Every bid raises a price by at least epsilon, and the prices stay below 3
// (they are shifted to a lowest price of 0 after each phase, when an assigned slot costs at most
// 1 + epsilon more than the cheapest; during a phase, while a token waits, some slot has had no
// bid yet), so epsilon stays over a thousand ulps above them: ties and equal scores cannot stall
// a phase. A phase that would still run past a bound of bids raises RuntimeError (a bug, never
// expected). A phase ends with every token within epsilon of its best choice (epsilon-CS), so the
// assignment is within S * epsilon of the optimum.
//
// Exactness. The assignment is optimal if and only if no cycle of moves improves it: a token of
// expert j1 moves to j2, one of j2 moves to j3, ..., and either the last one moves back to j1, or
// it lands in a spare slot (and j1 keeps a spare one). On the graph of experts plus a node "spare"
// (edge j -> k weighted by the best gain max_{t in j} score[t, k] - score[t, j]; j -> spare if j
// has a free slot, spare -> k if k has a token, both weighted 0), that is a positive cycle.
// Bellman-Ford for longest paths, started from the auction's prices (on which every edge is
// already within epsilon of tight), finds one or proves there is none. From epsilon <= 1/S on,
// each phase is followed by this check and the scaling stops as soon as it passes; after the last
// phase, positive cycles are cancelled one by one until none is left. Gains below 1e-12 of the
// score range per move are treated as rounding noise, so the result is optimal up to that.
//
// Complexity per group: O(T * E) when every token's best expert has room (then that is the
// answer); otherwise a phase costs O(bids * (E + c)), usually a few bids per token; a check
// costs O(T * E) plus O(E^2) per Bellman-Ford pass (few passes from the auction's prices) and
// O(E^2) memory. NaN or infinite scores, capacity < 1 and T > E * capacity raise ValueError. The
// GIL is released while the groups are solved (one after the other).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "cpm2_auction.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kTheta = 4.0;         // epsilon is divided by this after each phase
constexpr double kFirstEps = 0.05;     // in units of the score range
constexpr double kTolerance = 1e-12;   // gains below this (per move) are rounding noise
constexpr int64_t kMaxCancels = 1000000;

// Raises ValueError("balanced_assignment(): argument 'arg': ..."). Safe without the GIL: the
// Python exception is only set when pybind11 translates it, with the GIL held again.
template <typename... Args>
[[noreturn]] void fail(const char *arg, Args &&...args) {
  std::ostringstream msg;
  msg << "balanced_assignment(): argument '" << arg << "': ";
  (msg << ... << args);
  throw py::value_error(msg.str());
}

// One group: T tokens, E experts, c slots per expert, scores mapped to [0, 1].
struct Problem {
  int64_t tokens, experts, capacity;
  std::vector<double> score;  // [tokens, experts]

  double at(int64_t t, int64_t j) const { return score[t * experts + j]; }
};

// The forward auction on the symmetric problem: persons 0..T-1 are the tokens, T..S-1 the dummy
// tokens (score 0 for every expert); slot s belongs to expert s / c.
class Auction {
 public:
  explicit Auction(const Problem &p)
      : p_(p),
        slots_(p.experts * p.capacity),
        price_(slots_, 0.0),
        owner_(slots_, -1),
        slot_of_(slots_, -1),
        cheapest_(p.experts, 0.0),
        cheapest_slot_(p.experts) {
    for (int64_t j = 0; j < p.experts; ++j) cheapest_slot_[j] = j * p.capacity;
  }

  // Runs the auction at `eps` from the current prices: persons still within eps of their best
  // slot keep it (prices only rise, so they stay so), the others bid until every person holds a
  // slot. On return every person is within eps of its best slot at the final prices.
  void run_phase(double eps) {
    std::vector<int64_t> queue(slots_);  // a ring of the unassigned persons, never more than S
    int64_t waiting = 0;
    for (int64_t i = 0; i < slots_; ++i) {
      const int64_t s = slot_of_[i];
      if (s >= 0 && satisfied(i, s, eps)) continue;
      if (s >= 0) owner_[s] = -1;
      slot_of_[i] = -1;
      queue[waiting++] = i;
    }
    int64_t head = 0;
    // Bertsekas' bound for a phase is O(S^2 * theta) bids; anything far past it is a bug.
    const double max_bids = 4.0 * kTheta * static_cast<double>(slots_) * (slots_ + 1) + 1e6;
    double bids = 0;
    while (waiting > 0) {
      const int64_t i = queue[head];
      head = (head + 1) % slots_;
      --waiting;
      const int64_t evicted = bid(i, eps);
      if (evicted >= 0) {
        queue[(head + waiting) % slots_] = evicted;
        ++waiting;
      }
      if (++bids > max_bids) {
        throw std::runtime_error("balanced_assignment(): the auction did not converge (a bug)");
      }
    }
    // Only price differences matter: shifting them keeps them small, so eps stays far above their
    // rounding.
    const double lowest = *std::min_element(cheapest_.begin(), cheapest_.end());
    for (double &price : price_) price -= lowest;
    for (double &price : cheapest_) price -= lowest;
  }

  // Lowest slot price of each expert: potentials for the optimality check.
  const std::vector<double> &cheapest() const { return cheapest_; }
  int64_t expert_of(int64_t token) const { return slot_of_[token] / p_.capacity; }

 private:
  double value(int64_t i, int64_t j) const { return i < p_.tokens ? p_.at(i, j) : 0.0; }

  // Whether person i, holding slot s, is within eps of its best slot.
  bool satisfied(int64_t i, int64_t s, double eps) const {
    const double held = value(i, s / p_.capacity) - price_[s];
    for (int64_t j = 0; j < p_.experts; ++j) {
      if (value(i, j) - cheapest_[j] > held + eps) return false;
    }
    return true;
  }

  // Person i takes the cheapest slot of its best expert and raises its price so that i is
  // indifferent (up to eps) to its second best slot; returns the person it evicted, or -1.
  int64_t bid(int64_t i, double eps) {
    const int64_t c = p_.capacity;
    double best = -kInf, second = -kInf;
    int64_t j_best = 0;
    for (int64_t j = 0; j < p_.experts; ++j) {
      const double v = value(i, j) - cheapest_[j];
      if (v > best) {
        second = best;
        best = v;
        j_best = j;
      } else if (v > second) {
        second = v;
      }
    }
    const int64_t s = cheapest_slot_[j_best];
    double next_price = kInf;  // second cheapest slot of j_best
    int64_t next_slot = s;
    for (int64_t q = j_best * c; q < (j_best + 1) * c; ++q) {
      if (q != s && price_[q] < next_price) {
        next_price = price_[q];
        next_slot = q;
      }
    }
    second = std::max(second, value(i, j_best) - next_price);
    // second is -inf only with a single slot in all, which then goes to whoever bids.
    const double raise = second == -kInf ? eps : best - second + eps;
    const double old_price = price_[s];
    price_[s] += raise;
    if (!(price_[s] > old_price) || !std::isfinite(price_[s])) {
      throw std::runtime_error("balanced_assignment(): a price stopped rising (a bug)");
    }
    if (next_price < price_[s]) {
      cheapest_[j_best] = next_price;
      cheapest_slot_[j_best] = next_slot;
    } else {
      cheapest_[j_best] = price_[s];
    }
    const int64_t evicted = owner_[s];
    owner_[s] = i;
    slot_of_[i] = s;
    if (evicted >= 0) slot_of_[evicted] = -1;
    return evicted;
  }

  const Problem &p_;
  int64_t slots_;
  std::vector<double> price_;          // [S]
  std::vector<int64_t> owner_;         // [S] person holding the slot, or -1
  std::vector<int64_t> slot_of_;       // [S persons] slot held, or -1
  std::vector<double> cheapest_;       // [E] lowest slot price of each expert
  std::vector<int64_t> cheapest_slot_; // [E] the slot with that price (lowest index on ties)
};

// The optimality check and cycle cancelling on an assignment of the real tokens.
class Improver {
 public:
  Improver(const Problem &p, std::vector<int64_t> &expert_of)
      : p_(p),
        expert_of_(expert_of),
        nodes_(p.experts + 1),
        gain_(p.experts * p.experts),
        mover_(p.experts * p.experts),
        count_(p.experts),
        dist_(nodes_),
        pred_(nodes_) {}

  // Looks for a cycle of moves that gains more than the tolerance, starting Bellman-Ford from
  // `potentials` (one per expert). Applies it and returns true if there is one.
  bool improve_once(const std::vector<double> &potentials) {
    build_graph();
    const int64_t E = p_.experts, spare = E;
    double lowest = kInf;
    for (int64_t j = 0; j < E; ++j) {
      dist_[j] = potentials[j];
      lowest = std::min(lowest, potentials[j]);
    }
    dist_[spare] = lowest;
    std::fill(pred_.begin(), pred_.end(), -1);
    std::vector<char> dirty(nodes_, 1);
    for (int64_t pass = 0; pass <= 2 * nodes_ + 2; ++pass) {
      bool changed = false;
      for (int64_t j = 0; j < nodes_; ++j) {
        if (!dirty[j]) continue;
        dirty[j] = 0;
        for (int64_t k = 0; k < nodes_; ++k) {
          const double w = edge(j, k);
          if (w == -kInf || !(dist_[j] + w > dist_[k] + kTolerance)) continue;
          dist_[k] = dist_[j] + w;
          pred_[k] = j;
          dirty[k] = 1;
          changed = true;
        }
      }
      if (!changed) return false;
      std::vector<int64_t> cycle = predecessor_cycle();
      if (!cycle.empty()) return apply(cycle);
    }
    return false;  // not reached: a graph without a positive cycle settles within nodes_ passes
  }

 private:
  // Weight of the edge j -> k, -inf if there is none (node E is "spare").
  double edge(int64_t j, int64_t k) const {
    const int64_t E = p_.experts;
    if (j == k) return -kInf;
    if (j == E) return count_[k] > 0 ? 0.0 : -kInf;
    if (k == E) return count_[j] < p_.capacity ? 0.0 : -kInf;
    return gain_[j * E + k];
  }

  void build_graph() {
    const int64_t E = p_.experts;
    std::fill(gain_.begin(), gain_.end(), -kInf);
    std::fill(count_.begin(), count_.end(), 0);
    for (int64_t t = 0; t < p_.tokens; ++t) {
      const int64_t j = expert_of_[t];
      ++count_[j];
      const double own = p_.at(t, j);
      for (int64_t k = 0; k < E; ++k) {
        const double g = p_.at(t, k) - own;
        if (k != j && g > gain_[j * E + k]) {
          gain_[j * E + k] = g;
          mover_[j * E + k] = t;
        }
      }
    }
  }

  // A cycle of the predecessor graph (nodes in edge order), or empty if it has none.
  std::vector<int64_t> predecessor_cycle() const {
    std::vector<int64_t> seen(nodes_, -1);  // the walk that first reached each node
    for (int64_t start = 0; start < nodes_; ++start) {
      int64_t v = start;
      while (v >= 0 && seen[v] < 0) {
        seen[v] = start;
        v = pred_[v];
      }
      if (v < 0 || seen[v] != start) continue;
      std::vector<int64_t> cycle;  // v is on a cycle: walk it once
      int64_t u = v;
      do {
        cycle.push_back(u);
        u = pred_[u];
      } while (u != v);
      std::reverse(cycle.begin(), cycle.end());
      return cycle;
    }
    return {};
  }

  // Moves the tokens along the cycle if it gains more than the tolerance.
  bool apply(const std::vector<int64_t> &cycle) {
    const int64_t E = p_.experts, n = static_cast<int64_t>(cycle.size());
    double total = 0;
    for (int64_t i = 0; i < n; ++i) total += edge(cycle[i], cycle[(i + 1) % n]);
    if (!(total > kTolerance)) return false;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = cycle[i], k = cycle[(i + 1) % n];
      // Each expert is left once, so the movers are distinct tokens.
      if (j != E && k != E) expert_of_[mover_[j * E + k]] = k;
    }
    return true;
  }

  const Problem &p_;
  std::vector<int64_t> &expert_of_;
  int64_t nodes_;
  std::vector<double> gain_;    // [E, E] best gain of moving a token of j to k
  std::vector<int64_t> mover_;  // [E, E] the token with that gain
  std::vector<int64_t> count_;  // [E] tokens per expert
  std::vector<double> dist_;    // [E + 1] longest-path estimates
  std::vector<int64_t> pred_;   // [E + 1]
};

// Solves one group; `scores` is [T, E] float32, `out` gets [T] experts.
void assign_group(const float *scores, int64_t g, int64_t tokens, int64_t experts,
                  int64_t capacity, int64_t *out) {
  if (tokens == 0) return;
  double low = kInf, high = -kInf;
  for (int64_t i = 0; i < tokens * experts; ++i) {
    const double x = scores[i];
    if (!std::isfinite(x)) {
      fail("scores", "scores[", g, ", ", i / experts, ", ", i % experts, "] = ", x,
           ": scores must be finite (no NaN or inf)");
    }
    low = std::min(low, x);
    high = std::max(high, x);
  }
  // If every token's favourite expert has room, that is the optimum (large capacities).
  std::vector<int64_t> favourite(tokens), count(experts, 0);
  bool fits = true;
  for (int64_t t = 0; t < tokens && fits; ++t) {
    const float *row = scores + t * experts;
    favourite[t] = std::max_element(row, row + experts) - row;
    fits = ++count[favourite[t]] <= capacity;
  }
  if (fits) {
    std::copy(favourite.begin(), favourite.end(), out);
    return;
  }
  Problem p{tokens, experts, std::min(capacity, tokens), {}};
  const double range = high > low ? high - low : 1.0;
  p.score.resize(tokens * experts);
  for (int64_t i = 0; i < tokens * experts; ++i) p.score[i] = (scores[i] - low) / range;

  Auction auction(p);
  std::vector<int64_t> expert_of(tokens);
  const double slots = static_cast<double>(experts * p.capacity);
  const double last_eps = std::max(1e-7 / slots, 1e-12);
  bool optimal = false;
  for (double eps = kFirstEps;; eps /= kTheta) {
    eps = std::max(eps, last_eps);
    auction.run_phase(eps);
    for (int64_t t = 0; t < tokens; ++t) expert_of[t] = auction.expert_of(t);
    if (eps * slots <= 1.0) {
      Improver check(p, expert_of);
      if (!check.improve_once(auction.cheapest())) {
        optimal = true;
        break;
      }
    }
    if (eps == last_eps) break;
  }
  // Only reached with eps = last_eps, the assignment within 1e-7 of the range of the optimum.
  if (!optimal) {
    for (int64_t round = 0; round < kMaxCancels; ++round) {
      Improver improver(p, expert_of);
      if (!improver.improve_once(auction.cheapest())) break;
    }
  }
  std::copy(expert_of.begin(), expert_of.end(), out);
}

py::array_t<int64_t> balanced_assignment(const py::object &scores_obj, int64_t capacity) {
  if (!py::isinstance<py::array>(scores_obj)) {
    fail("scores", "must be a numpy.ndarray of float32, got ", Py_TYPE(scores_obj.ptr())->tp_name);
  }
  auto a = py::reinterpret_borrow<py::array>(scores_obj);
  if (!py::array_t<float>::check_(a)) {
    fail("scores", "must have dtype float32 (native byte order), got ",
         std::string(py::str(a.dtype())));
  }
  if (a.ndim() != 3) fail("scores", "must be 3-D [groups, tokens, experts], got ", a.ndim(), "-D");
  if (!(a.flags() & py::array::c_style)) {
    fail("scores", "must be C-contiguous (use numpy.ascontiguousarray)");
  }
  if (!(a.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_)) fail("scores", "must be aligned");
  const int64_t groups = a.shape(0), tokens = a.shape(1), experts = a.shape(2);
  if (capacity < 1) fail("capacity", "must be >= 1, got ", capacity);
  if (experts < tokens / capacity + (tokens % capacity != 0)) {  // T > E * capacity, no overflow
    if (experts == 0) fail("scores", tokens, " tokens cannot be assigned to 0 experts");
    fail("capacity", tokens, " tokens do not fit in ", experts, " experts x capacity ", capacity,
         " = ", experts * capacity, " slots: the capacity must be at least ceil(tokens / experts)",
         " = ", tokens / experts + (tokens % experts != 0));
  }
  const auto scores = py::reinterpret_borrow<py::array_t<float>>(a);
  py::array_t<int64_t> out({groups, tokens});
  const float *in = scores.data();
  int64_t *expert = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    for (int64_t g = 0; g < groups; ++g) {
      assign_group(in + g * tokens * experts, g, tokens, experts, capacity, expert + g * tokens);
    }
  }
  return out;
}

py::array_t<int64_t> cpm2_auction(const py::object &scores_obj) {
  if (!py::isinstance<py::array>(scores_obj) ||
      !py::array_t<float>::check_(py::reinterpret_borrow<py::array>(scores_obj))) {
    fail("scores", "must be a numpy.ndarray of float32");
  }
  auto a = py::reinterpret_borrow<py::array>(scores_obj);
  if (a.ndim() != 3) fail("scores", "must be 3-D [groups, tokens, experts], got ", a.ndim(), "-D");
  if (!(a.flags() & py::array::c_style)) fail("scores", "must be C-contiguous");
  const int64_t groups = a.shape(0), tokens = a.shape(1), experts = a.shape(2);
  if (experts < 1 || tokens < experts || tokens % experts) {
    fail("scores", tokens, " tokens cannot be split into equal shares of ", experts,
         " experts: CPM-2's assignment needs a positive multiple of the experts");
  }
  const auto scores = py::reinterpret_borrow<py::array_t<float>>(a);
  const float *in = scores.data();
  for (int64_t i = 0; i < groups * tokens * experts; ++i) {
    if (!std::isfinite(in[i])) fail("scores", "holds NaN or infinite values");
  }
  py::array_t<int64_t> out({groups, tokens});
  int64_t *order = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    for (int64_t g = 0; g < groups; ++g) {
      cpm2::auction(in + g * tokens * experts, tokens, experts, order + g * tokens);
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_moe_helpers, m) {
  m.doc() = "Balanced token-to-expert assignment for BASE layers (csrc/balanced_assignment.cpp).";
  m.def("balanced_assignment", &balanced_assignment, py::arg("scores"), py::arg("capacity"),
        "balanced_assignment(scores float32[G, T, E], capacity) -> int64[G, T]: for each group, "
        "the expert of every token, at most `capacity` tokens per expert, with the largest total "
        "score. Needs T <= E * capacity; raises ValueError on NaN or inf scores.");
  m.def("cpm2_auction", &cpm2_auction, py::arg("scores"),
        "cpm2_auction(scores float32[G, T, E]) -> int64[G, T]: CPM-2-MoE's balanced assignment "
        "(src/libbase), T / E tokens per expert, listed expert by expert (csrc/cpm2_auction.cpp).");
}
