// The on-demand subset construction of automata/byte_nfa.py (`Determinizer`) in native code
// (compiler/native.py builds it into the library beside row_walk.cpp and wraps it as `Subset`; the
// Python construction stays the reference and the fallback, and the tests hold the two equal).
//
// A GmSubset mirrors the part of the byte NFA built so far: per NFA state its kind (a byte state
// with (first class, last class, target) spans in class order, pushed as (first byte, last byte,
// target) ranges and read through the byte classes; a split with epsilon targets, the
// match state, or pending: not built yet) and, where some states cannot reach the match over the
// alphabet, its liveness (gm_subset_live: the NFA is then built whole). Python logs states as it
// builds them (`ByteNFA.log`: records of {state, kind, count, payload...}, a later record of a
// state replacing its earlier one) and pushes the log (gm_subset_push). An epsilon closure that
// meets a pending state calls `expand` (Python builds what that state's closure reaches and stages
// the log's new records in io: address and length), reads the staged records and goes on.
//
// DFA states are sets of NFA states (sorted), numbered 1, 2, ... in the order they are found (the
// dead state is 0); a row is computed as the Python one is: one byte state's spans, or the segments
// between the members' class boundaries, each segment's targets memoized to the DFA state of their
// closures' union, new states numbered in the order of the first class leading to each. The rows,
// accepting and live flags go straight into the ByteDFA's numpy arrays, whose addresses `io` holds:
// io = {table, accepting, live, capacity (states the arrays hold), max_states, num_states, rows
// computed, error, staged records' address, their count}. When a new state needs more room, `grow` has Python replace the arrays (and
// update io). A row's class 0 (NUL: always the dead state) is written last, with release order:
// lock-free readers take a row as known once that entry is no longer UNKNOWN.
//
// Errors: a callback that raised (Python keeps the exception) sets io[7] = 1, a state past
// max_states io[7] = 2; the call in progress returns -1 (or NULL) and nothing half-made is kept
// (a row is written only once complete), so it can be retried.

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace {

enum : int8_t { KIND_BYTE = 0, KIND_SPLIT = 1, KIND_MATCH = 2, KIND_PENDING = 3 };
enum : int64_t { IO_TABLE, IO_ACCEPTING, IO_LIVE, IO_CAPACITY, IO_MAX_STATES, IO_STATES, IO_ROWS, IO_ERROR, IO_LOG,
                 IO_LOG_LENGTH };

typedef int32_t (*gm_expand)(int32_t nfa_state);
typedef int32_t (*gm_grow)(void);

struct SetHash {
    size_t operator()(const std::vector<int32_t>& v) const {
        uint64_t h = 1469598103934665603ull;
        for (int32_t x : v) {
            h ^= static_cast<uint32_t>(x);
            h *= 1099511628211ull;
        }
        return static_cast<size_t>(h);
    }
};

typedef std::unordered_map<std::vector<int32_t>, int32_t, SetHash> SetIds;

}  // namespace

struct GmSubset {
    int32_t num_classes;
    int32_t classes[256];
    bool all_live;
    int64_t* io;
    gm_expand expand;
    gm_grow grow;
    // The NFA mirror, per NFA state.
    std::vector<int8_t> kind;
    std::vector<std::vector<int32_t>> spans;
    std::vector<std::vector<int32_t>> eps;
    std::vector<uint8_t> live;
    std::vector<std::vector<int32_t>> closure;
    std::vector<uint8_t> closed;
    std::vector<uint32_t> stamp;  // the closure search's visited marks
    uint32_t epoch = 0;
    // The DFA: ids of NFA sets, each state's set (cleared once its row is computed), the sets by id.
    SetIds ids;
    std::vector<std::vector<int32_t>> members;
    std::vector<uint8_t> done;
    std::vector<const std::vector<int32_t>*> named;
    SetIds by_targets;  // the targets of a row's segment (in member order) -> the state of their closures
    int64_t bytes = 0;  // heap bytes of the sets, closures and spans (roughly: `gm_subset_bytes`)
};

namespace {

bool fail(GmSubset* d, int64_t code) {
    d->io[IO_ERROR] = code;
    return false;
}

void resize(GmSubset* d, size_t size) {
    d->kind.resize(size, KIND_PENDING);
    d->spans.resize(size);
    d->eps.resize(size);
    d->closure.resize(size);
    d->closed.resize(size, 0);
    d->stamp.resize(size, 0u);
    d->live.resize(size, 0);
}

void push(GmSubset* d, const int32_t* records, int64_t length) {
    int64_t i = 0;
    while (i < length) {
        const int32_t s = records[i], k = records[i + 1], n = records[i + 2];
        const int32_t* payload = records + i + 3;
        i += 3 + n;
        if (static_cast<size_t>(s) >= d->kind.size()) resize(d, static_cast<size_t>(s) + 1);
        d->kind[s] = static_cast<int8_t>(k);
        std::vector<int32_t>& into = k == KIND_BYTE ? d->spans[s] : d->eps[s];
        into.assign(payload, payload + n);
        if (k == KIND_BYTE) {
            for (int32_t j = 0; j < n; j += 3) {
                into[j] = d->classes[into[j]];
                into[j + 1] = d->classes[into[j + 1]];
            }
        }
        d->bytes += static_cast<int64_t>(n) * 4 + 64;
    }
}

// After `expand` returned: the records it staged read.
void take_staged(GmSubset* d) {
    const int64_t n = d->io[IO_LOG_LENGTH];
    if (n > 0) {
        d->io[IO_LOG_LENGTH] = 0;
        push(d, reinterpret_cast<const int32_t*>(d->io[IO_LOG]), n);
    }
}

// The closure of NFA state q (byte states and the match state reachable by epsilon moves, sorted)
// into d->closure[q]; false when expanding a pending state failed.
bool close(GmSubset* d, int32_t q) {
    if (d->closed[q]) return true;
    std::vector<int32_t> out;
    if (d->kind[q] == KIND_BYTE) {
        out.push_back(q);
    } else {
        if (++d->epoch == 0) {
            std::fill(d->stamp.begin(), d->stamp.end(), 0u);
            d->epoch = 1;
        }
        std::vector<int32_t> stack(1, q);
        d->stamp[q] = d->epoch;
        while (!stack.empty()) {
            const int32_t s = stack.back();
            stack.pop_back();
            if (d->kind[s] == KIND_PENDING) {
                if (d->expand(s) != 0) return fail(d, 1);
                take_staged(d);  // new states: the vectors may move
                if (d->kind[s] == KIND_PENDING) return fail(d, 1);
            }
            if (d->kind[s] != KIND_SPLIT) {
                out.push_back(s);
                continue;
            }
            for (int32_t t : d->eps[s]) {
                if (d->stamp[t] != d->epoch) {
                    d->stamp[t] = d->epoch;
                    stack.push_back(t);
                }
            }
        }
        std::sort(out.begin(), out.end());
    }
    d->bytes += static_cast<int64_t>(out.size()) * 4 + 24;
    d->closure[q].swap(out);
    d->closed[q] = 1;
    return true;
}

// The DFA state of a sorted set of NFA states, added on first sight; -1 on failure.
int32_t state_of(GmSubset* d, std::vector<int32_t>& set) {
    SetIds::iterator hit = d->ids.find(set);
    if (hit != d->ids.end()) return hit->second;
    const int64_t sid = d->io[IO_STATES] + 1;
    if (sid > d->io[IO_MAX_STATES]) return fail(d, 2), -1;
    if (sid >= d->io[IO_CAPACITY] && (d->grow() != 0 || sid >= d->io[IO_CAPACITY])) return fail(d, 1), -1;
    bool accepting = false, live = d->all_live;
    for (int32_t m : set) {
        accepting = accepting || d->kind[m] == KIND_MATCH;
        live = live || d->live[m];
    }
    reinterpret_cast<uint8_t*>(d->io[IO_ACCEPTING])[sid] = accepting;
    reinterpret_cast<uint8_t*>(d->io[IO_LIVE])[sid] = live;
    d->bytes += 2 * (static_cast<int64_t>(set.size()) * 4 + 24) + 64;
    SetIds::iterator made = d->ids.emplace(set, static_cast<int32_t>(sid)).first;
    d->members.push_back(set);
    d->done.push_back(0);
    d->named.push_back(&made->first);
    d->io[IO_STATES] = sid;
    return static_cast<int32_t>(sid);
}

// The DFA state of the union of the closures of `targets` (memoized by the targets); -1 on failure.
int32_t state_of_targets(GmSubset* d, const std::vector<int32_t>& targets) {
    SetIds::iterator hit = d->by_targets.find(targets);
    if (hit != d->by_targets.end()) return hit->second;
    for (int32_t t : targets) {
        if (!close(d, t)) return -1;
    }
    std::vector<int32_t> set;
    if (targets.size() == 1) {
        set = d->closure[targets[0]];
    } else {
        for (int32_t t : targets) set.insert(set.end(), d->closure[t].begin(), d->closure[t].end());
        std::sort(set.begin(), set.end());
        set.erase(std::unique(set.begin(), set.end()), set.end());
    }
    const int32_t sid = state_of(d, set);
    if (sid < 0) return -1;
    d->by_targets.emplace(targets, sid);
    d->bytes += static_cast<int64_t>(targets.size()) * 4 + 64;
    return sid;
}

// Computes the row of DFA state q into the table; false on failure (nothing written then).
bool compute_row(GmSubset* d, int32_t q) {
    const std::vector<int32_t> set = d->members[q];  // a copy: new states may move the vector
    std::vector<int32_t> moving;
    for (int32_t s : set) {
        if (d->kind[s] == KIND_BYTE) moving.push_back(s);
    }
    std::vector<int32_t> row(d->num_classes, 0);
    std::vector<int32_t> key(1);
    if (moving.size() == 1) {
        const std::vector<int32_t> spans = d->spans[moving[0]];
        for (size_t i = 0; i < spans.size(); i += 3) {
            key[0] = spans[i + 2];
            const int32_t sid = state_of_targets(d, key);
            if (sid < 0) return false;
            std::fill(row.begin() + spans[i], row.begin() + spans[i + 1] + 1, sid);
        }
    } else if (!moving.empty()) {
        // Between two class boundaries of the members' spans every member has one target or none.
        std::vector<int32_t> starts;
        for (int32_t s : moving) {
            const std::vector<int32_t>& spans = d->spans[s];
            for (size_t i = 0; i < spans.size(); i += 3) {
                starts.push_back(spans[i]);
                starts.push_back(spans[i + 1] + 1);
            }
        }
        std::sort(starts.begin(), starts.end());
        starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
        std::vector<std::vector<int32_t>> segments(starts.size());
        for (int32_t s : moving) {
            const std::vector<int32_t>& spans = d->spans[s];
            for (size_t i = 0; i < spans.size(); i += 3) {
                const size_t a = std::lower_bound(starts.begin(), starts.end(), spans[i]) - starts.begin();
                const size_t b = std::lower_bound(starts.begin(), starts.end(), spans[i + 1] + 1) - starts.begin();
                for (size_t k = a; k < b; ++k) segments[k].push_back(spans[i + 2]);
            }
        }
        for (size_t k = 0; k + 1 < starts.size(); ++k) {
            if (segments[k].empty()) continue;
            const int32_t sid = state_of_targets(d, segments[k]);
            if (sid < 0) return false;
            std::fill(row.begin() + starts[k], row.begin() + starts[k + 1], sid);
        }
    }
    int32_t* out = reinterpret_cast<int32_t*>(d->io[IO_TABLE]) + static_cast<int64_t>(q) * d->num_classes;
    std::copy(row.begin() + 1, row.end(), out + 1);
    __atomic_store_n(out, row[0], __ATOMIC_RELEASE);
    d->done[q] = 1;
    d->bytes -= static_cast<int64_t>(d->members[q].size()) * 4;
    std::vector<int32_t>().swap(d->members[q]);
    d->io[IO_ROWS] += 1;
    return true;
}

}  // namespace

extern "C" {

GmSubset* gm_subset_new(const int32_t* classes, int32_t all_live, int64_t* io, gm_expand expand, gm_grow grow) {
    GmSubset* d = new GmSubset();
    std::copy(classes, classes + 256, d->classes);
    d->num_classes = *std::max_element(classes, classes + 256) + 1;
    d->all_live = all_live != 0;
    d->io = io;
    d->expand = expand;
    d->grow = grow;
    d->members.emplace_back();  // the dead state
    d->done.push_back(1);
    d->named.push_back(nullptr);
    return d;
}

void gm_subset_free(GmSubset* d) { delete d; }

// Records {state, kind, count, payload[count]} (byte: ranges as first byte, last byte, target;
// split: targets), a later record of a state replacing the earlier one.
void gm_subset_push(GmSubset* d, const int32_t* records, int64_t length) { push(d, records, length); }

// Liveness of NFA states 0 .. n - 1 (where not all live: the NFA is built whole by then).
void gm_subset_live(GmSubset* d, const uint8_t* live, int64_t n) {
    if (static_cast<size_t>(n) > d->kind.size()) resize(d, static_cast<size_t>(n));
    std::copy(live, live + n, d->live.begin());
}

// The DFA state of NFA state q's closure (the initial state); -1 on failure.
int32_t gm_subset_start(GmSubset* d, int32_t q) {
    if (!close(d, q)) return -1;
    std::vector<int32_t> set = d->closure[q];
    return state_of(d, set);
}

// q's row computed (if it was not): the table's address, or NULL on failure. gm_walk's fetch.
const int32_t* gm_subset_fetch(void* ctx, int32_t q) {
    GmSubset* d = static_cast<GmSubset*>(ctx);
    if (!d->done[q] && !compute_row(d, q)) return nullptr;
    return reinterpret_cast<const int32_t*>(d->io[IO_TABLE]);
}

// DFA state q's NFA states while its row is unknown (`all` false), or ever (`all` true): the count
// (written to `out` where it fits `cap`), -1 once its row is computed (`all` false) or for an id
// that is no state.
int64_t gm_subset_members(GmSubset* d, int32_t q, int32_t all, int32_t* out, int64_t cap) {
    if (q < 0 || static_cast<size_t>(q) >= d->members.size()) return -1;  // no such state (yet)
    const std::vector<int32_t>* set = all ? d->named[q] : (d->done[q] ? nullptr : &d->members[q]);
    if (set == nullptr) return -1;
    const int64_t n = static_cast<int64_t>(set->size());
    if (n <= cap) std::copy(set->begin(), set->end(), out);
    return n;
}

int64_t gm_subset_bytes(GmSubset* d) {
    return d->bytes + static_cast<int64_t>(d->kind.size()) * 80 + static_cast<int64_t>(d->ids.size()) * 48
           + static_cast<int64_t>(d->by_targets.size()) * 48;
}

}  // extern "C"
