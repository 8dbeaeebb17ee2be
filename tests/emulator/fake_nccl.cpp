// A fake NCCL for tests/gpu_path_emulated.rs, beside the fake CUDA driver: the calls ferrotron
// makes, for ranks that are threads of one process (device memory is host memory there, so a
// "device pointer" is a host address every rank can read). Linked into the fake libcuda.so and
// found as libnccl.so.
//
// A communicator is (the shared state of its unique id, this member's rank). Like the fake
// driver, every call is synchronous: the k-th collective of each member of a communicator meets
// the others' k-th; the last to arrive computes every member's result from the send buffers *in
// rank order* in float (bf16 rounded once at the end, as the local hub does), and each member
// copies its own result out. A send is buffered (it never waits for its receive); a receive
// waits for its message. Calls between ncclGroupStart and ncclGroupEnd run at the end, sends
// first. A wait gives up after FERROTRON_FAKE_NCCL_TIMEOUT_S seconds (default 60), or at once
// when a member it needs has called ncclCommAbort (a rank that failed, or one that finished and
// will never send): no test hangs.
//
// Across processes (FERROTRON_FAKE_NCCL_DIR set: ranks that are processes, which cannot read each
// other's memory), a communicator is a folder of that directory named by its unique id, and its
// calls are files: each member writes its send buffer as c<call>.<rank> (whole: written aside,
// then renamed), waits until every member's file is there, and computes its own result from them
// in rank order, as above. A message is m<from>.<to>.<n>, removed by its receiver; an abort
// leaves gone.<rank>.
#include <chrono>
#include <condition_variable>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <sys/stat.h>
#include <thread>
#include <tuple>
#include <unistd.h>
#include <vector>

namespace {
typedef int Result;
const Result SUCCESS = 0, SYSTEM_ERROR = 2, INVALID_ARGUMENT = 4, INVALID_USAGE = 5;
const int FLOAT32 = 7, BFLOAT16 = 9;
const int SUM = 0, MAX = 2, AVG = 4;
enum Kind { ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST };

struct Call {
    Kind kind;
    size_t count;
    int type, op, root;
    int arrived = 0, left = 0;
    bool computed = false;
    std::vector<const void*> sends;
    std::vector<std::vector<char>> results;
};

struct Shared {
    int nranks;
    std::mutex m;
    std::condition_variable changed;
    std::map<long, Call> calls;
    std::map<std::tuple<int, int, long>, std::vector<char>> mail; // (from, to, message number)
    std::vector<bool> gone;                                         // members that aborted
};

struct Comm {
    Shared* shared; // null across processes: then `folder` holds the calls
    int rank;
    long calls = 0;
    std::map<int, long> sent, received;
    std::string folder;
    int nranks = 0;
};

std::mutex registry;
std::map<std::string, Shared*> by_id;
long ids = 0;

thread_local int group_depth = 0;
thread_local std::vector<std::function<Result()>> deferred_sends, deferred_recvs;

std::chrono::seconds timeout() {
    const char* s = getenv("FERROTRON_FAKE_NCCL_TIMEOUT_S");
    return std::chrono::seconds(s ? atoi(s) : 60);
}

size_t element_size(int type) { return type == FLOAT32 ? 4 : 2; }

float load(const void* p, int type, size_t i) {
    if (type == FLOAT32) return ((const float*)p)[i];
    uint32_t bits = (uint32_t)((const uint16_t*)p)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

void store(void* p, int type, size_t i, float f) {
    if (type == FLOAT32) {
        ((float*)p)[i] = f;
        return;
    }
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) u = 0x7fc00000; // NaN stays NaN
    else u += 0x7fff + ((u >> 16) & 1);                 // round to nearest even
    ((uint16_t*)p)[i] = (uint16_t)(u >> 16);
}

// Waits on `done` under `lock`; false after the timeout or as soon as `hopeless` (a member the
// call needs has aborted its communicator).
template <class D, class H>
bool wait_for(Shared* s, std::unique_lock<std::mutex>& lock, D done, H hopeless, const char* what) {
    bool ok = s->changed.wait_for(lock, timeout(), [&] { return done() || hopeless(); });
    if (done()) return true;
    fprintf(stderr, "fake NCCL: %s: %s\n", what, ok ? "a member it needs aborted the communicator" : "timed out");
    return false;
}

// Every member's result of call `c`, from the members' send buffers in rank order.
void compute(Call& c, int n) {
    size_t size = element_size(c.type);
    size_t in = c.kind == REDUCE_SCATTER ? c.count * n : c.count; // elements each member sends
    size_t out = c.kind == ALL_GATHER ? c.count * n : c.count;    // elements each member gets
    std::vector<float> reduced(in);
    if (c.kind == ALL_REDUCE || c.kind == REDUCE_SCATTER) {
        for (size_t i = 0; i < in; i++) {
            float acc = load(c.sends[0], c.type, i);
            for (int r = 1; r < n; r++) {
                float x = load(c.sends[r], c.type, i);
                acc = c.op == MAX ? (acc > x ? acc : x) : acc + x;
            }
            reduced[i] = c.op == AVG ? acc / (float)n : acc;
        }
    }
    c.results.assign(n, std::vector<char>(out * size));
    for (int r = 0; r < n; r++) {
        void* o = c.results[r].data();
        for (size_t i = 0; i < out; i++) switch (c.kind) {
            case ALL_REDUCE: store(o, c.type, i, reduced[i]); break;
            case REDUCE_SCATTER: store(o, c.type, i, reduced[r * c.count + i]); break;
            case ALL_GATHER: store(o, c.type, i, load(c.sends[i / c.count], c.type, i % c.count)); break;
            case BROADCAST: store(o, c.type, i, load(c.sends[c.root], c.type, i)); break;
            }
    }
    c.computed = true;
}

// --- across processes: files in the communicator's folder ---

bool write_whole(const std::string& path, const std::vector<char>& data) {
    std::string aside = path + ".part";
    FILE* f = fopen(aside.c_str(), "wb");
    if (!f) return false;
    bool ok = fwrite(data.data(), 1, data.size(), f) == data.size();
    ok = fclose(f) == 0 && ok;
    return ok && rename(aside.c_str(), path.c_str()) == 0;
}

bool read_whole(const std::string& path, std::vector<char>& out) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) return false;
    fseek(f, 0, SEEK_END);
    out.resize((size_t)ftell(f));
    fseek(f, 0, SEEK_SET);
    bool ok = fread(out.data(), 1, out.size(), f) == out.size();
    fclose(f);
    return ok;
}

bool gone(Comm* comm, int r) { return access((comm->folder + "/gone." + std::to_string(r)).c_str(), F_OK) == 0; }

// Polls `ready` until it holds; false after the timeout or once `hopeless`.
template <class R, class H> bool poll(R ready, H hopeless, const char* what) {
    auto end = std::chrono::steady_clock::now() + timeout();
    while (!ready()) {
        if (hopeless() || std::chrono::steady_clock::now() > end) {
            fprintf(stderr, "fake NCCL: %s: %s\n", what, hopeless() ? "a member it needs aborted the communicator" : "timed out");
            return false;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
}

Result file_collective(Comm* comm, Call c, const void* send, void* recv) {
    int n = comm->nranks;
    size_t in = (c.kind == REDUCE_SCATTER ? c.count * n : c.count) * element_size(c.type);
    long head[3] = {(long)c.kind, (long)c.count, (long)c.type};
    std::vector<char> mine(sizeof head + in);
    memcpy(mine.data(), head, sizeof head);
    memcpy(mine.data() + sizeof head, send, in);
    std::string base = comm->folder + "/c" + std::to_string(++comm->calls) + ".";
    if (!write_whole(base + std::to_string(comm->rank), mine)) return SYSTEM_ERROR;
    std::vector<std::vector<char>> parts(n);
    auto all_there = [&] {
        for (int r = 0; r < n; r++)
            if (parts[r].empty() && !read_whole(base + std::to_string(r), parts[r])) return false;
        return true;
    };
    auto hopeless = [&] {
        for (int r = 0; r < n; r++)
            if (parts[r].empty() && gone(comm, r)) return true;
        return false;
    };
    if (!poll(all_there, hopeless, "collective")) return SYSTEM_ERROR;
    for (int r = 0; r < n; r++) {
        if (parts[r].size() != mine.size() || memcmp(parts[r].data(), head, sizeof head) != 0) {
            fprintf(stderr, "fake NCCL: call %ld: members called different collectives or sizes\n", comm->calls);
            return INVALID_USAGE;
        }
        c.sends.push_back(parts[r].data() + sizeof head);
    }
    compute(c, n);
    memcpy(recv, c.results[comm->rank].data(), c.results[comm->rank].size());
    return SUCCESS;
}

std::string message_file(Comm* comm, int from, int to, long number) {
    return comm->folder + "/m" + std::to_string(from) + "." + std::to_string(to) + "." + std::to_string(number);
}

Result file_send(Comm* comm, const void* buf, size_t bytes, int peer) {
    std::vector<char> data((const char*)buf, (const char*)buf + bytes);
    return write_whole(message_file(comm, comm->rank, peer, ++comm->sent[peer]), data) ? SUCCESS : SYSTEM_ERROR;
}

Result file_recv(Comm* comm, void* buf, size_t bytes, int peer) {
    std::string path = message_file(comm, peer, comm->rank, ++comm->received[peer]);
    std::vector<char> data;
    if (!poll([&] { return read_whole(path, data); }, [&] { return gone(comm, peer); }, "recv")) return SYSTEM_ERROR;
    unlink(path.c_str());
    if (data.size() != bytes) {
        fprintf(stderr, "fake NCCL: recv of %zu bytes, the message has %zu\n", bytes, data.size());
        return INVALID_USAGE;
    }
    memcpy(buf, data.data(), bytes);
    return SUCCESS;
}

// --- the calls ---

Result collective(Comm* comm, Kind kind, const void* send, void* recv, size_t count, int type, int op, int root) {
    if (type != FLOAT32 && type != BFLOAT16) return INVALID_ARGUMENT;
    if (!comm->shared) {
        Call call;
        call.kind = kind, call.count = count, call.type = type, call.op = op, call.root = root;
        return file_collective(comm, call, send, recv);
    }
    Shared* s = comm->shared;
    long number = ++comm->calls;
    std::unique_lock<std::mutex> lock(s->m);
    Call& c = s->calls[number];
    if (c.arrived == 0) {
        c.kind = kind, c.count = count, c.type = type, c.op = op, c.root = root;
        c.sends.assign(s->nranks, nullptr);
    } else if (c.kind != kind || c.count != count || c.type != type) {
        fprintf(stderr, "fake NCCL: call %ld: members called different collectives or sizes\n", number);
        return INVALID_USAGE;
    }
    c.sends[comm->rank] = send;
    if (++c.arrived == s->nranks) {
        compute(c, s->nranks);
        s->changed.notify_all();
    } else if (!wait_for(
                   s, lock, [&] { return c.computed; },
                   [&] {
                       for (int r = 0; r < s->nranks; r++)
                           if (s->gone[r] && !c.sends[r]) return true;
                       return false;
                   },
                   "collective")) {
        return SYSTEM_ERROR;
    }
    memcpy(recv, c.results[comm->rank].data(), c.results[comm->rank].size());
    if (++c.left == s->nranks) s->calls.erase(number);
    return SUCCESS;
}

Result send_now(Comm* comm, const void* buf, size_t count, int type, int peer) {
    if (!comm->shared) return file_send(comm, buf, count * element_size(type), peer);
    Shared* s = comm->shared;
    std::vector<char> data((const char*)buf, (const char*)buf + count * element_size(type));
    std::lock_guard<std::mutex> lock(s->m);
    s->mail[{comm->rank, peer, ++comm->sent[peer]}] = std::move(data);
    s->changed.notify_all();
    return SUCCESS;
}

Result recv_now(Comm* comm, void* buf, size_t count, int type, int peer) {
    if (!comm->shared) return file_recv(comm, buf, count * element_size(type), peer);
    Shared* s = comm->shared;
    std::tuple<int, int, long> key{peer, comm->rank, ++comm->received[peer]};
    std::unique_lock<std::mutex> lock(s->m);
    if (!wait_for(s, lock, [&] { return s->mail.count(key) > 0; }, [&] { return (bool)s->gone[peer]; }, "recv"))
        return SYSTEM_ERROR;
    std::vector<char>& data = s->mail[key];
    if (data.size() != count * element_size(type)) {
        fprintf(stderr, "fake NCCL: recv of %zu bytes, the message has %zu\n", count * element_size(type), data.size());
        return INVALID_USAGE;
    }
    memcpy(buf, data.data(), data.size());
    s->mail.erase(key);
    return SUCCESS;
}

// Runs `call` now, or at ncclGroupEnd inside a group (sends before receives).
Result now_or_at_group_end(std::function<Result()> call, bool is_send) {
    if (group_depth == 0) return call();
    (is_send ? deferred_sends : deferred_recvs).push_back(call);
    return SUCCESS;
}
} // namespace

extern "C" {
struct ncclUniqueId {
    char internal[128];
};

Result ncclGetVersion(int* v) { *v = 22700; return SUCCESS; }
const char* ncclGetErrorString(Result r) {
    switch (r) {
    case SUCCESS: return "no error";
    case SYSTEM_ERROR: return "fake NCCL: a wait timed out or a member aborted";
    case INVALID_ARGUMENT: return "fake NCCL: invalid argument (only float32 and bfloat16)";
    case INVALID_USAGE: return "fake NCCL: members called different collectives";
    default: return "fake NCCL: error";
    }
}

Result ncclGetUniqueId(ncclUniqueId* id) {
    std::lock_guard<std::mutex> lock(registry);
    memset(id->internal, 0, sizeof id->internal);
    snprintf(id->internal, sizeof id->internal, "fake-nccl-%ld-%ld", (long)getpid(), ++ids); // unique across processes
    return SUCCESS;
}

Result ncclCommInitRank(Comm** comm, int nranks, ncclUniqueId id, int rank) {
    if (nranks < 1 || rank < 0 || rank >= nranks) return INVALID_ARGUMENT;
    if (const char* dir = getenv("FERROTRON_FAKE_NCCL_DIR")) {
        std::string folder = std::string(dir) + "/" + std::string(id.internal, strnlen(id.internal, sizeof id.internal));
        mkdir(dir, 0700);
        if (mkdir(folder.c_str(), 0700) != 0 && errno != EEXIST) return SYSTEM_ERROR;
        *comm = new Comm{nullptr, rank};
        (*comm)->folder = folder, (*comm)->nranks = nranks;
        return SUCCESS;
    }
    std::lock_guard<std::mutex> lock(registry);
    Shared*& s = by_id[std::string(id.internal, sizeof id.internal)];
    if (!s) {
        s = new Shared();
        s->nranks = nranks;
        s->gone.assign(nranks, false);
    }
    if (s->nranks != nranks) return INVALID_USAGE;
    *comm = new Comm{s, rank};
    return SUCCESS;
}

Result ncclCommAbort(Comm* comm) {
    if (!comm->shared) {
        write_whole(comm->folder + "/gone." + std::to_string(comm->rank), {});
        delete comm;
        return SUCCESS;
    }
    Shared* s = comm->shared;
    {
        std::lock_guard<std::mutex> lock(s->m);
        s->gone[comm->rank] = true;
        s->changed.notify_all();
    }
    delete comm;
    return SUCCESS;
}
Result ncclCommDestroy(Comm* comm) { return ncclCommAbort(comm); }

Result ncclAllReduce(const void* send, void* recv, size_t count, int type, int op, Comm* comm, void*) {
    return collective(comm, ALL_REDUCE, send, recv, count, type, op, 0);
}
Result ncclAllGather(const void* send, void* recv, size_t count, int type, Comm* comm, void*) {
    return collective(comm, ALL_GATHER, send, recv, count, type, SUM, 0);
}
Result ncclReduceScatter(const void* send, void* recv, size_t count, int type, int op, Comm* comm, void*) {
    return collective(comm, REDUCE_SCATTER, send, recv, count, type, op, 0);
}
Result ncclBroadcast(const void* send, void* recv, size_t count, int type, int root, Comm* comm, void*) {
    return collective(comm, BROADCAST, send, recv, count, type, SUM, root);
}
Result ncclSend(const void* buf, size_t count, int type, int peer, Comm* comm, void*) {
    return now_or_at_group_end([=] { return send_now(comm, buf, count, type, peer); }, true);
}
Result ncclRecv(void* buf, size_t count, int type, int peer, Comm* comm, void*) {
    return now_or_at_group_end([=] { return recv_now(comm, buf, count, type, peer); }, false);
}
Result ncclGroupStart() { group_depth++; return SUCCESS; }
Result ncclGroupEnd() {
    if (group_depth == 0) return INVALID_USAGE;
    if (--group_depth > 0) return SUCCESS;
    std::vector<std::function<Result()>> calls;
    calls.swap(deferred_sends);
    calls.insert(calls.end(), deferred_recvs.begin(), deferred_recvs.end());
    deferred_recvs.clear();
    Result first = SUCCESS;
    for (auto& call : calls) {
        Result r = call();
        if (first == SUCCESS) first = r;
    }
    return first;
}
}
