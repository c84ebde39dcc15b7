// The native serving core of an overlaybd image (docs/native.md).
//
// One `Core` per open image: the merged read-only index (built once per stack in Python and
// handed over as int64 arrays), the layers' file descriptors, and the writable upper (its
// in-memory index, the append position of upper.data, the index log). It does the per-request
// work without the GIL: index lookups, preadv/pwrite, zero and hole filling, upper appends and
// index-log entries byte-identical to storage/upper.py (the reference). `serve` runs an NBD
// transmission loop over a connected socket on the calling thread with the GIL released; the
// rest of the core knows nothing of NBD, so another front end (ublk) can call the same paths.
//
// Python owns every file descriptor and the control plane: it quiesces the core (pause /
// resume), takes the upper's state back (export_upper) for a seal, a resize or a close, and
// binds the new stack (configure). The core reads plain and ZFile layers (LZ4 decoded here,
// ZSTD through libzstd), local or remote (from the node's chunk cache); what it cannot read
// itself (remote chunk misses, a ZFile block that fails its check) goes through a Python
// callable, with the GIL.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int64_t SECTOR = 512;
constexpr int64_t ZEROED = -1;
constexpr int64_t HT_BLOCK = 4096;
constexpr int64_t MAX_IO_SIZE = 4 << 20;
constexpr int64_t MAX_LENGTH = 16383;
constexpr uint64_t M50 = (uint64_t(1) << 50) - 1;
constexpr uint64_t M55 = (uint64_t(1) << 55) - 1;

struct Extent {
    int64_t end;
    int64_t moffset;
    int64_t layer;  // 0: upper data, ZEROED: zeroed
};

struct Mapping {
    int64_t start, length, moffset, layer;
};

struct RemoteLayer;
struct ZLayer;

struct Layer {
    int fd;
    int64_t base;
    bool foreign;  // read through the Python callable (a remote layer without a map)
    std::shared_ptr<RemoteLayer> remote;  // a remote layer's blob in the chunk cache
    std::shared_ptr<ZLayer> z;            // a ZFile layer (local, or remote with `remote`)
};

// What a write refused for space reports: the disk's cap (UpperFull's fields), or the node's
// budget (node: `used` is the filesystem's free bytes, `limit` the reserve; NodeDiskFull's).
struct Full {
    int64_t used = 0, need = 0, limit = 0;
    bool set = false, node = false;
};

enum PieceKind { HOLE, ZERO, UPPER, LOWER };

// Set on threads running Core.serve: a failed foreign read there is logged and answered with
// EIO; elsewhere (a Python caller) its exception is kept and raised to the caller.
thread_local bool serving = false;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int pwrite_all(int fd, const char* p, int64_t n, int64_t pos) {
    while (n > 0) {
        ssize_t w = pwrite(fd, p, size_t(n), pos);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        p += w;
        n -= w;
        pos += w;
    }
    return 0;
}

// Reads up to n bytes; returns how many (short at EOF) or -errno.
int64_t pread_full(int fd, char* p, int64_t n, int64_t pos) {
    int64_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, p + got, size_t(n - got), pos + got);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) break;
        got += r;
    }
    return got;
}

void put_mapping(std::string& out, int64_t offset, int64_t length, int64_t moffset, bool zeroed,
                 int tag) {
    uint64_t lo = (uint64_t(offset) & M50) | (uint64_t(length) << 50);
    uint64_t hi = (uint64_t(moffset) & M55) | (uint64_t(zeroed) << 55) | (uint64_t(tag & 0xFF) << 56);
    char b[16];
    for (int i = 0; i < 8; i++) b[i] = char((lo >> (8 * i)) & 0xFF);
    for (int i = 0; i < 8; i++) b[8 + i] = char((hi >> (8 * i)) & 0xFF);
    out.append(b, 16);
}

// Admits requests unless paused; pause() waits for the admitted ones.
class Gate {
   public:
    void enter() {
        std::unique_lock<std::mutex> g(m_);
        cv_.wait(g, [this] { return !paused_; });
        inflight_++;
    }
    void leave() {
        std::lock_guard<std::mutex> g(m_);
        if (--inflight_ == 0) cv_.notify_all();
    }
    void pause() {
        std::unique_lock<std::mutex> g(m_);
        cv_.wait(g, [this] { return !paused_; });
        paused_ = true;
        cv_.wait(g, [this] { return inflight_ == 0; });
    }
    void resume() {
        std::lock_guard<std::mutex> g(m_);
        paused_ = false;
        cv_.notify_all();
    }

   private:
    std::mutex m_;
    std::condition_variable cv_;
    int inflight_ = 0;
    bool paused_ = false;
};

// -- coalesced lower reads -----------------------------------------------------------------
//
// A sequential read of a stack whose upper random writes shredded meets, per MiB, hundreds of
// short runs of a lower between the upper's 4 KiB pieces, and those runs lie close together
// in the lower's file. `LowerBatch` reads such neighbours with one preadv: each piece straight
// to its place in the caller's buffer, the gaps between them (at most COALESCE_GAP bytes
// each) into a scratch sink. `LowerBatches` keeps one per file for the lowers a read
// interleaves.

constexpr int64_t COALESCE_GAP = 32 * 1024;
constexpr size_t COALESCE_IOV = 256;

class LowerBatch {
   public:
    // Queue `n` bytes of `fd` at `fpos` for `dst`; what was queued is read first when this
    // piece cannot join it (another file, backwards, too far, too many pieces).
    int add(int fd, int64_t fpos, char* dst, int64_t n) {
        if (!pieces_.empty() && (fd != fd_ || fpos < end_ || fpos - end_ > COALESCE_GAP ||
                                 iov_.size() + 2 > COALESCE_IOV)) {
            if (int r = flush()) return r;
        }
        if (pieces_.empty()) {
            fd_ = fd;
            start_ = end_ = fpos;
        }
        if (fpos > end_) iov_.push_back(iovec{sink(), size_t(fpos - end_)});
        iov_.push_back(iovec{dst, size_t(n)});
        pieces_.push_back(Piece{dst, fpos, n});
        end_ = fpos + n;
        return 0;
    }

    // Read what is queued; bytes past the file's end read as zeros (like pread_full's users).
    int flush() {
        if (pieces_.empty()) return 0;
        int64_t total = end_ - start_, got = 0;
        size_t first = 0;
        while (got < total) {
            ssize_t r = preadv(fd_, iov_.data() + first, int(iov_.size() - first), start_ + got);
            if (r < 0) {
                if (errno == EINTR) continue;
                int err = -errno;
                clear();
                return err;
            }
            if (r == 0) break;
            got += r;
            for (size_t k = size_t(r); k > 0;) {  // step over what this call filled
                if (k >= iov_[first].iov_len) {
                    k -= iov_[first].iov_len;
                    first++;
                } else {
                    iov_[first].iov_base = static_cast<char*>(iov_[first].iov_base) + k;
                    iov_[first].iov_len -= k;
                    k = 0;
                }
            }
        }
        if (got < total) {
            for (const Piece& p : pieces_) {
                int64_t have = std::min(std::max<int64_t>(start_ + got - p.fpos, 0), p.n);
                if (have < p.n) memset(p.dst + have, 0, size_t(p.n - have));
            }
        }
        preads_ += 1;
        clear();
        return 0;
    }

    int64_t preads() const { return preads_; }
    int fd() const { return pieces_.empty() ? -1 : fd_; }

   private:
    struct Piece {
        char* dst;
        int64_t fpos, n;
    };
    // Where gap bytes go: shared by every gap of every batch on this thread (never read).
    static char* sink() {
        static thread_local std::vector<char> s = std::vector<char>(size_t(COALESCE_GAP));
        return s.data();
    }
    void clear() {
        iov_.clear();
        pieces_.clear();
    }

    int fd_ = -1;
    int64_t start_ = 0, end_ = 0, preads_ = 0;
    std::vector<iovec> iov_;
    std::vector<Piece> pieces_;
};

// One batch per lower file a read meets (a stack's layers interleave: the bottom layer's runs
// between the pieces of the layers above), up to LOWER_BATCHES files at once.
constexpr size_t LOWER_BATCHES = 4;

class LowerBatches {
   public:
    int add(int fd, int64_t fpos, char* dst, int64_t n) {
        LowerBatch* idle = nullptr;
        for (LowerBatch& b : batches_) {
            if (b.fd() == fd) return b.add(fd, fpos, dst, n);
            if (idle == nullptr && b.fd() < 0) idle = &b;
        }
        if (idle == nullptr) {  // all busy with other files: read the oldest one's pieces
            idle = &batches_[next_];
            next_ = (next_ + 1) % LOWER_BATCHES;
            if (int r = idle->flush()) return r;
        }
        return idle->add(fd, fpos, dst, n);
    }
    int flush() {
        for (LowerBatch& b : batches_)
            if (int r = b.flush()) return r;
        return 0;
    }
    int64_t preads() const {
        int64_t n = 0;
        for (const LowerBatch& b : batches_) n += b.preads();
        return n;
    }

   private:
    LowerBatch batches_[LOWER_BATCHES];
    size_t next_ = 0;
};

// -- remote layers: the chunk cache's presence map ------------------------------------------
//
// A remote layer's bytes live in the node's chunk cache (blockd/remote/cache.py): the blob's
// sparse data file, and one mark per chunk (0 absent, else present). The cache keeps the
// marks in a `ChunkMap` (this file's Python type): atomics both sides read and write without
// the GIL. The core reads a present chunk's bytes itself and calls Python only for a miss.
//
// Python marks a chunk present only after its bytes are written to the data file, and an
// eviction clears the mark and bumps the chunk's generation before it punches the hole. A
// reader takes the generation, checks the mark, preads, and checks the generation again: if
// an eviction ran meanwhile its bytes may be a punched hole, and the read is a miss after all
// (the Python path pins the chunk instead). So no native read returns evicted bytes, and the
// eviction never waits for a native reader.
//
// Native hits are told to the eviction policy afterwards (`take_hits`, folded under the
// cache's lock before it picks victims): per chunk the lowest offset and furthest end read
// since the last fold, and whether a read went back below the furthest end (a re-read: 2Q
// promotes such a chunk).

struct ChunkMapData {
    explicit ChunkMapData(size_t count)
        : n(count),
          marks(new std::atomic<uint8_t>[count]),
          gen(new std::atomic<uint32_t>[count]),
          lo(new std::atomic<int32_t>[count]),
          hi(new std::atomic<int32_t>[count]),
          reread(new std::atomic<uint8_t>[count]) {
        for (size_t i = 0; i < n; i++) {
            marks[i].store(0, std::memory_order_relaxed);
            gen[i].store(0, std::memory_order_relaxed);
            lo[i].store(INT32_MAX, std::memory_order_relaxed);
            hi[i].store(-1, std::memory_order_relaxed);
            reread[i].store(0, std::memory_order_relaxed);
        }
    }

    void set(size_t i, uint8_t mark) {
        if (mark == 0) {
            marks[i].store(0, std::memory_order_seq_cst);
            gen[i].fetch_add(1, std::memory_order_seq_cst);
        } else {
            marks[i].store(mark, std::memory_order_seq_cst);
        }
    }

    // A native read of [o, e) inside chunk i.
    void note_hit(size_t i, int32_t o, int32_t e) {
        hits.fetch_add(1, std::memory_order_relaxed);
        int32_t old = hi[i].load(std::memory_order_relaxed);
        while (old < e && !hi[i].compare_exchange_weak(old, e, std::memory_order_relaxed)) {
        }
        if (o < old) reread[i].store(1, std::memory_order_relaxed);
        int32_t low = lo[i].load(std::memory_order_relaxed);
        while (o < low && !lo[i].compare_exchange_weak(low, o, std::memory_order_relaxed)) {
        }
    }

    const size_t n;
    std::unique_ptr<std::atomic<uint8_t>[]> marks;
    std::unique_ptr<std::atomic<uint32_t>[]> gen;
    std::unique_ptr<std::atomic<int32_t>[]> lo, hi;
    std::unique_ptr<std::atomic<uint8_t>[]> reread;
    std::atomic<int64_t> hits{0};
};

// A plain (not ZFile) remote layer: its LSMT stream is bytes [base, base + stream_size) of
// the blob (Layer.base), held chunk by chunk in `fd` (the cache's data file, Python's).
struct RemoteLayer {
    std::shared_ptr<ChunkMapData> map;
    int fd;
    int64_t chunk_size;
    int64_t stream_size;
};

// Reads chunk `idx`'s bytes [co, co + n) at blob offset `bpos` into dst when present and not
// evicted meanwhile; false for a miss.
bool read_cached_chunk(const RemoteLayer& R, size_t idx, int64_t co, int64_t bpos, char* dst,
                       int64_t n) {
    ChunkMapData& m = *R.map;
    if (idx >= m.n) return false;
    uint32_t g = m.gen[idx].load(std::memory_order_seq_cst);
    if (m.marks[idx].load(std::memory_order_seq_cst) == 0) return false;
    int64_t got = pread_full(R.fd, dst, n, bpos);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (got != n || m.gen[idx].load(std::memory_order_seq_cst) != g) return false;
    m.note_hit(idx, int32_t(co), int32_t(co + n));
    return true;
}

// Blob bytes [bpos, bpos + n) from the cache when every chunk they touch is held (and none
// was evicted meanwhile); false otherwise, dst then partly filled.
bool read_blob(const RemoteLayer& R, int64_t bpos, char* dst, int64_t n) {
    for (int64_t done = 0; done < n;) {
        int64_t at = bpos + done;
        int64_t idx = at / R.chunk_size, co = at - idx * R.chunk_size;
        int64_t take = std::min(n - done, R.chunk_size - co);
        if (!read_cached_chunk(R, size_t(idx), co, at, dst + done, take)) return false;
        done += take;
    }
    return true;
}

// -- ZFile layers (LZ4, ZSTD) ------------------------------------------------------------
//
// storage/zfile.py is the reference: blocks of `block_size` bytes, each compressed (an LZ4
// block, or one ZSTD frame) and followed, when the file verifies, by the raw CRC-32C (salt
// 100007) of its compressed bytes; a jump table gives where each starts (`offs`, absolute in
// the file or blob). The core decodes both itself (local files, and remote blobs whose chunks
// the cache holds): LZ4 with its own decoder, ZSTD with libzstd (one decompression context per
// serving thread). Anything unexpected (a CRC or a block that does not decode to its size, a
// remote chunk missing) hands the rest of the piece to Python's ZFileReader, which fetches
// what is missing or raises the reference's error.

constexpr uint32_t ZF_BLOCK_SALT = 100007;
// Compressed bytes read per pread: enough to amortise the call, small because each serving
// thread keeps its buffer (a host has hundreds of connections).
constexpr int64_t ZF_READ_BATCH = 128 << 10;

struct ZLayer {
    std::vector<int64_t> offs;  // nblocks + 1 block starts (the last: the jump table's start)
    int64_t block_size;
    int64_t size;  // uncompressed stream bytes
    bool verify;
    bool zstd;  // blocks are ZSTD frames (else LZ4 blocks)
};

uint32_t crc32c_table[8][256];

void crc32c_init() {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
        crc32c_table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (uint32_t i = 0; i < 256; i++)
            crc32c_table[t][i] = (crc32c_table[t - 1][i] >> 8) ^ crc32c_table[0][crc32c_table[t - 1][i] & 0xFF];
}

// The raw CRC-32C (no inversions) of p[0, n) from register `crc` (slicing by 8).
uint32_t crc32c_soft(uint32_t crc, const unsigned char* p, size_t n) {
    while (n >= 8) {
        uint32_t lo = crc ^ (uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24);
        crc = crc32c_table[7][lo & 0xFF] ^ crc32c_table[6][(lo >> 8) & 0xFF] ^
              crc32c_table[5][(lo >> 16) & 0xFF] ^ crc32c_table[4][lo >> 24] ^
              crc32c_table[3][p[4]] ^ crc32c_table[2][p[5]] ^ crc32c_table[1][p[6]] ^
              crc32c_table[0][p[7]];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ crc32c_table[0][(crc ^ *p++) & 0xFF];
    return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_hw(uint32_t crc, const unsigned char* p, size_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = uint32_t(c);
    while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
const bool crc32c_has_hw = __builtin_cpu_supports("sse4.2");
#endif

uint32_t crc32c_raw(uint32_t crc, const char* p, size_t n) {
    const unsigned char* u = reinterpret_cast<const unsigned char*>(p);
#if defined(__x86_64__)
    if (crc32c_has_hw) return crc32c_hw(crc, u, n);
#endif
    return crc32c_soft(crc, u, n);
}

// Decodes one ZSTD frame into exactly `want` bytes; false when it is malformed or does not
// decode to exactly that. One context per thread: a context is not shareable and costs
// about 100 KiB, created once per serving thread.
bool zstd_decode(const char* src, int64_t n, char* dst, int64_t want) {
    struct Free {
        void operator()(ZSTD_DCtx* c) const { ZSTD_freeDCtx(c); }
    };
    static thread_local std::unique_ptr<ZSTD_DCtx, Free> ctx(ZSTD_createDCtx());
    // exactly one frame, filling the block: anything else is for the reference to judge
    if (!ctx || ZSTD_findFrameCompressedSize(src, size_t(n)) != size_t(n)) return false;
    size_t got = ZSTD_decompressDCtx(ctx.get(), dst, size_t(want), src, size_t(n));
    return !ZSTD_isError(got) && got == size_t(want);
}

// Decodes one LZ4 block (the block format: sequences of literals and back-references) into
// exactly `want` bytes; false when the input is malformed or does not decode to exactly that.
bool lz4_decode(const char* src, int64_t n, char* dst, int64_t want) {
    const unsigned char* ip = reinterpret_cast<const unsigned char*>(src);
    const unsigned char* const iend = ip + n;
    int64_t op = 0;
    auto more = [&](int64_t& len) -> bool {  // a length's extension bytes
        unsigned char b;
        do {
            if (ip >= iend) return false;
            b = *ip++;
            len += b;
        } while (b == 255);
        return true;
    };
    while (ip < iend) {
        unsigned token = *ip++;
        int64_t lit = token >> 4;
        if (lit == 15 && !more(lit)) return false;
        if (lit > iend - ip || lit > want - op) return false;
        memcpy(dst + op, ip, size_t(lit));
        ip += lit;
        op += lit;
        if (ip == iend) break;  // the last sequence has literals only
        if (iend - ip < 2) return false;
        int64_t off = int64_t(ip[0]) | int64_t(ip[1]) << 8;
        ip += 2;
        int64_t len = token & 15;
        if (len == 15 && !more(len)) return false;
        len += 4;
        if (off == 0 || off > op || len > want - op) return false;
        char* d = dst + op;
        const char* m = d - off;
        if (off >= len) {
            memcpy(d, m, size_t(len));
        } else {
            for (int64_t i = 0; i < len; i++) d[i] = m[i];  // overlapping: a repeated pattern
        }
        op += len;
    }
    return op == want;
}

struct Stats {
    std::atomic<int64_t> reads{0}, writes{0}, bytes_read{0}, bytes_written{0}, flushes{0},
        trims{0}, zeroes{0}, errors{0}, enospc{0};
};

struct Engine {
    // Configured while paused (configure), read by requests.
    bool closed = true;
    int64_t vsize = 0;
    std::vector<int64_t> rs, re, rm, rl;  // merged read-only index, sectors
    std::vector<Layer> layers;
    bool has_foreign = false;          // some layer is read through Python
    PyObject* foreign_read = nullptr;  // callable(slot, pos, memoryview, serving) -> int
    PyObject* on_full = nullptr;       // callable(used, need, limit, node) -> exception

    bool has_upper = false;
    bool writable = false;
    int dfd = -1, ifd = -1;
    int64_t data_eof = 0, index_eof = 0, log_entries = 0;
    int64_t limit = -1;
    // Bytes of upper growth the node's disk budget (below) granted and this upper has not used
    // yet: appends within it cost no filesystem check. Written by the one writer (wlock),
    // read by other engines' grants.
    std::atomic<int64_t> grant_left{0};
    int rw_tag = 0;
    bool reuse = true;
    int64_t log_buffer = 0;
    std::string pending_log;
    std::map<int64_t, Extent> upper;  // key: start sector

    // A read-only shared mapping of upper.data, larger than the file so appends land inside
    // it: reads of the upper's pieces are a memcpy instead of a pread each (a 1 MiB read of
    // a randomly written upper meets ~250 of them). Replaced (doubled) when the file outgrows
    // it; replaced mappings stay until the next configure, as readers may still copy from
    // them. Only bytes below data_eof are read, and upper.data is never truncated.
    std::atomic<char*> umap{nullptr};
    std::atomic<int64_t> umap_len{0};
    std::mutex umap_lock;
    std::vector<std::pair<char*, int64_t>> umaps;

    // What reads cost: preadv calls on lowers (coalesced), and calls into Python for layer
    // bytes (ZFile pieces, remote chunk misses). Read by tests and benchmarks (io_counts).
    std::atomic<int64_t> lower_preads{0}, python_reads{0};

    std::mutex wlock;           // serialises writers
    std::shared_mutex ilock;    // guards `upper` against readers
    Gate gate;
    Stats stats;

    // -- upper index --------------------------------------------------------------------

    void insert(int64_t start, int64_t end, int64_t moffset, int64_t layer) {
        if (end <= start) return;
        auto it = upper.upper_bound(start);
        if (it != upper.begin()) {
            auto prev = std::prev(it);
            if (prev->second.end > start) it = prev;
        }
        while (it != upper.end() && it->first < end) {
            int64_t s = it->first;
            Extent x = it->second;
            it = upper.erase(it);
            if (s < start) upper.emplace(s, Extent{start, x.moffset, x.layer});
            if (x.end > end) {
                int64_t m = x.layer == ZEROED ? x.moffset : x.moffset + (end - s);
                it = upper.emplace(end, Extent{x.end, m, x.layer}).first;
                break;
            }
        }
        upper[start] = Extent{end, moffset, layer};
    }

    void lookup(int64_t start, int64_t end, std::vector<Mapping>& out) const {
        out.clear();
        auto it = upper.upper_bound(start);
        if (it != upper.begin()) {
            auto prev = std::prev(it);
            if (prev->second.end > start) it = prev;
        }
        for (; it != upper.end() && it->first < end; ++it) {
            int64_t s = std::max(it->first, start);
            int64_t e = std::min(it->second.end, end);
            int64_t lay = it->second.layer;
            int64_t m = lay == ZEROED ? it->second.moffset : it->second.moffset + (s - it->first);
            out.push_back(Mapping{s, e - s, m, lay});
        }
    }

    // -- reads ---------------------------------------------------------------------------

    // Calls f(ps, pe, kind, layer, file_pos) for consecutive pieces covering [pos, end).
    template <class F>
    int walk_ro(int64_t pos, int64_t end, F& f) const {
        size_t n = rs.size();
        size_t i = size_t(std::upper_bound(re.begin(), re.end(), pos >> 9) - re.begin());
        while (pos < end) {
            if (i >= n || (rs[i] << 9) >= end) return f(pos, end, HOLE, 0, 0);
            int64_t s = rs[i] << 9;
            if (s > pos) {
                if (int r = f(pos, s, HOLE, 0, 0)) return r;
                pos = s;
            }
            int64_t e = std::min(re[i] << 9, end);
            int64_t lay = rl[i];
            int r = lay >= 0 ? f(pos, e, LOWER, lay, (rm[i] << 9) + pos - s) : f(pos, e, ZERO, 0, 0);
            if (r) return r;
            pos = e;
            i++;
        }
        return 0;
    }

    template <class F>
    int walk(int64_t pos, int64_t end, F& f) {
        std::vector<Mapping> pieces;
        if (has_upper) {
            std::shared_lock<std::shared_mutex> g(ilock);
            if (!upper.empty()) lookup(pos >> 9, (end + SECTOR - 1) >> 9, pieces);
        }
        for (const Mapping& p : pieces) {
            int64_t ps = std::max(p.start << 9, pos);
            int64_t pe = std::min((p.start + p.length) << 9, end);
            if (ps > pos) {
                if (int r = walk_ro(pos, ps, f)) return r;
            }
            int r = p.layer == ZEROED ? f(ps, pe, ZERO, 0, 0)
                                      : f(ps, pe, UPPER, 0, (p.moffset << 9) + ps - (p.start << 9));
            if (r) return r;
            pos = pe;
        }
        if (pos < end) return walk_ro(pos, end, f);
        return 0;
    }

    // The mapping when it covers [fpos, fpos + n), else a new bigger one, else nullptr.
    const char* upper_view(int64_t fpos, int64_t n) {
        if (fpos + n <= umap_len.load(std::memory_order_acquire)) return umap.load();
        std::lock_guard<std::mutex> g(umap_lock);
        int64_t len = umap_len.load();
        if (fpos + n <= len) return umap.load();
        struct stat st;
        if (fstat(dfd, &st) < 0 || st.st_size < fpos + n) return nullptr;
        int64_t want = std::max<int64_t>({int64_t(st.st_size) * 2, len * 2, 64 << 20});
        void* p = mmap(nullptr, size_t(want), PROT_READ, MAP_SHARED, dfd, 0);
        if (p == MAP_FAILED) return nullptr;
        umaps.emplace_back(static_cast<char*>(p), want);
        umap.store(static_cast<char*>(p));
        umap_len.store(want, std::memory_order_release);
        return static_cast<char*>(p);
    }

    void unmap_upper() {
        std::lock_guard<std::mutex> g(umap_lock);
        for (auto& m : umaps) munmap(m.first, size_t(m.second));
        umaps.clear();
        umap_len.store(0);
        umap.store(nullptr);
    }

    Engine();
    ~Engine();

    int64_t read_foreign(int64_t slot, int64_t fpos, char* dst, int64_t n) {
        python_reads.fetch_add(1, std::memory_order_relaxed);
        PyGILState_STATE st = PyGILState_Ensure();
        int64_t got = -EIO;
        PyObject* mv = PyMemoryView_FromMemory(dst, n, PyBUF_WRITE);
        if (mv != nullptr) {
            PyObject* r = PyObject_CallFunction(foreign_read, "LLOO", (long long)slot,
                                                (long long)fpos, mv,
                                                serving ? Py_True : Py_False);
            if (r != nullptr) {
                got = PyLong_AsLongLong(r);
                Py_DECREF(r);
            }
            // dst is ours only for this call: a view the callee kept must not reach it later.
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyObject* released = PyObject_CallMethod(mv, "release", nullptr);
            if (released == nullptr) {
                PyErr_Clear();  // a slice of it is still alive: refuse its bytes
                if (type == nullptr) got = -EIO;
            } else {
                Py_DECREF(released);
            }
            PyErr_Restore(type, value, tb);
            Py_DECREF(mv);
        }
        if (PyErr_Occurred()) {
            if (serving) PyErr_WriteUnraisable(foreign_read);  // the callable logs; never here
            got = -EIO;
        } else if (got < 0 || got > n) {
            got = -EIO;
        }
        PyGILState_Release(st);
        return got;
    }

    // A remote layer's stream bytes [fpos, fpos + n): present chunks from the cache file,
    // and from the first miss on, the rest through Python (which fetches every chunk it
    // misses at once). Returns the bytes filled (short past the stream's end) or -errno.
    int64_t read_remote(int64_t slot, const Layer& L, int64_t fpos, char* dst, int64_t n) {
        const RemoteLayer& R = *L.remote;
        int64_t end = std::min(fpos + n, R.stream_size);
        for (int64_t pos = fpos; pos < end;) {
            int64_t bpos = L.base + pos;
            int64_t idx = bpos / R.chunk_size, co = bpos - idx * R.chunk_size;
            int64_t take = std::min(end - pos, R.chunk_size - co);
            if (!read_cached_chunk(R, size_t(idx), co, bpos, dst + (pos - fpos), take)) {
                int64_t got = read_foreign(slot, pos, dst + (pos - fpos), end - pos);
                return got < 0 ? got : pos - fpos + got;
            }
            pos += take;
        }
        return std::max<int64_t>(end - fpos, 0);
    }

    // A ZFile layer's stream bytes [pos, pos + n), decoded here; from the first thing
    // that is not plainly right (a remote chunk missing, a CRC, a block), the rest through
    // Python. Returns the bytes filled (short past the stream's end) or -errno.
    int64_t read_zfile(int64_t slot, const Layer& L, int64_t pos, char* dst, int64_t n) {
        const ZLayer& Z = *L.z;
        const int64_t end = std::min(pos + n, Z.size), bs = Z.block_size;
        if (pos >= end) return 0;
        static thread_local std::vector<char> comp, block;
        int64_t out = 0;
        for (int64_t b = pos / bs, last = (end - 1) / bs; b <= last;) {
            int64_t stop = b;
            while (stop < last && Z.offs[size_t(stop) + 2] - Z.offs[size_t(b)] <= ZF_READ_BATCH) stop++;
            int64_t a = Z.offs[size_t(b)], nbytes = Z.offs[size_t(stop) + 1] - a;
            if (comp.size() < size_t(nbytes)) comp.resize(size_t(nbytes));
            bool got = L.remote ? read_blob(*L.remote, a, comp.data(), nbytes)
                                : pread_full(L.fd, comp.data(), nbytes, a) == nbytes;
            for (int64_t k = b; got && k <= stop; k++) {
                const char* c = comp.data() + (Z.offs[size_t(k)] - a);
                int64_t clen = Z.offs[size_t(k) + 1] - Z.offs[size_t(k)];
                if (Z.verify) {
                    if (clen < 5) break;
                    clen -= 4;
                    uint32_t stored;
                    memcpy(&stored, c + clen, 4);  // little-endian, as the hosts we build for
                    if (crc32c_raw(ZF_BLOCK_SALT, c, size_t(clen)) != stored) break;
                }
                int64_t bstart = k * bs, blen = std::min(bs, Z.size - bstart);
                int64_t s = std::max<int64_t>(pos - bstart, 0), e = std::min(end - bstart, blen);
                bool whole = s == 0 && e == blen;
                if (!whole && block.size() < size_t(bs)) block.resize(size_t(bs));
                char* target = whole ? dst + out : block.data();
                if (!(Z.zstd ? zstd_decode(c, clen, target, blen)
                             : lz4_decode(c, clen, target, blen)))
                    break;
                if (!whole) memcpy(dst + out, target + s, size_t(e - s));
                out += e - s;
                b = k + 1;
            }
            if (b <= stop) {  // stopped early: the rest through the reference reader
                int64_t r = read_foreign(slot, pos + out, dst + out, end - pos - out);
                return r < 0 ? r : out + r;
            }
        }
        return out;
    }

    // Bytes [pos, end) into dst. The caller holds the gate; GIL released unless a foreign
    // layer is read (or a remote chunk missed).
    int fill(int64_t pos, int64_t end, char* dst) {
        const int64_t start = pos;
        LowerBatches batch;
        auto f = [&](int64_t ps, int64_t pe, int kind, int64_t lay, int64_t fpos) -> int {
            char* p = dst + (ps - start);
            int64_t n = pe - ps;
            int64_t got = 0;
            if (kind == UPPER) {
                const char* view = upper_view(fpos, n);
                if (view != nullptr) {
                    memcpy(p, view + fpos, size_t(n));
                    got = n;
                } else {
                    got = pread_full(dfd, p, n, fpos);
                }
            } else if (kind == LOWER) {
                const Layer& L = layers[size_t(lay)];
                if (L.z) got = read_zfile(lay, L, fpos, p, n);
                else if (L.remote) got = read_remote(lay, L, fpos, p, n);
                else if (L.foreign) got = read_foreign(lay, fpos, p, n);
                else return batch.add(L.fd, L.base + fpos, p, n);
            }
            if (got < 0) return int(got);
            if (got < n) memset(p + got, 0, size_t(n - got));  // holes, zeroes, past a layer's EOF
            return 0;
        };
        int r = walk(pos, end, f);
        if (!r) r = batch.flush();
        lower_preads.fetch_add(batch.preads(), std::memory_order_relaxed);
        return r;
    }

    // (length, has_data) runs over [pos, end), neighbours of one kind merged.
    void allocation(int64_t pos, int64_t end, size_t max_runs,
                    std::vector<std::pair<int64_t, bool>>& runs) {
        runs.clear();
        auto f = [&](int64_t ps, int64_t pe, int kind, int64_t, int64_t) -> int {
            bool data = kind == UPPER || kind == LOWER;
            if (!runs.empty() && runs.back().second == data) {
                runs.back().first += pe - ps;
            } else {
                if (runs.size() >= max_runs) return 1;
                runs.emplace_back(pe - ps, data);
            }
            return 0;
        };
        walk(pos, end, f);
    }

    // -- writes (the caller holds wlock) -------------------------------------------------

    int64_t used_bytes() const { return data_eof - HT_BLOCK + 16 * log_entries; }

    int reserve(int64_t data_bytes, int64_t entries, Full* full) {
        int64_t need = data_bytes + 16 * entries;
        if (need == 0) return 0;  // an in-place rewrite: no growth, nothing to refuse
        if (limit >= 0 && used_bytes() + need > limit) {
            if (full) *full = Full{used_bytes(), need, limit, true, false};
            return -ENOSPC;
        }
        int64_t left = grant_left.load(std::memory_order_relaxed);
        if (need <= left) {
            grant_left.store(left - need, std::memory_order_relaxed);
            return 0;
        }
        return take_grant(need, full);
    }

    int take_grant(int64_t need, Full* full);

    int write_log() {
        if (pending_log.empty()) return 0;
        int r = pwrite_all(ifd, pending_log.data(), int64_t(pending_log.size()), index_eof);
        if (r) return r;
        index_eof += int64_t(pending_log.size());
        pending_log.clear();
        return 0;
    }

    int append_log(const std::string& entries) {
        pending_log += entries;
        log_entries += int64_t(entries.size() / 16);
        if (int64_t(pending_log.size()) >= log_buffer) return write_log();
        return 0;
    }

    int append(int64_t sector, const char* data, int64_t n) {
        std::string entries;
        std::vector<Mapping> inserts;
        int64_t pos = 0;
        while (pos < n) {
            int64_t k = std::min(n - pos, MAX_IO_SIZE);
            int64_t at = data_eof;
            if (int r = pwrite_all(dfd, data + pos, k, at)) return r;
            data_eof = at + k;
            int64_t s = sector + pos / SECTOR;
            put_mapping(entries, s, k / SECTOR, at / SECTOR, false, rw_tag);
            inserts.push_back(Mapping{s, k / SECTOR, at / SECTOR, 0});
            pos += k;
        }
        int r = append_log(entries);
        std::unique_lock<std::shared_mutex> g(ilock);
        for (const Mapping& m : inserts) insert(m.start, m.start + m.length, m.moffset, 0);
        return r;
    }

    // upper.py Upper.write_extent: sector-aligned data at `sector`.
    int write_extent(int64_t sector, const char* data, int64_t n, Full* full) {
        if (reuse) {
            int64_t end = sector + n / SECTOR;
            std::vector<Mapping> found, own;
            lookup(sector, end, found);  // only writers change the index, and we are the one
            for (const Mapping& m : found)
                if (m.layer == 0) own.push_back(m);
            if (!own.empty()) {
                std::vector<std::pair<int64_t, int64_t>> gaps;
                int64_t pos = sector;
                for (const Mapping& m : own) {
                    if (m.start > pos) gaps.emplace_back(pos, m.start - pos);
                    pos = m.start + m.length;
                }
                if (pos < end) gaps.emplace_back(pos, end - pos);
                int64_t bytes = 0, entries = 0;
                for (auto& g : gaps) {
                    bytes += g.second * SECTOR;
                    entries += ceil_div(g.second * SECTOR, MAX_IO_SIZE);
                }
                if (int r = reserve(bytes, entries, full)) return r;
                for (const Mapping& m : own) {
                    int64_t rel = (m.start - sector) * SECTOR;
                    if (int r = pwrite_all(dfd, data + rel, m.length * SECTOR, m.moffset * SECTOR))
                        return r;
                }
                for (auto& g : gaps) {
                    int64_t rel = (g.first - sector) * SECTOR;
                    if (int r = append(g.first, data + rel, g.second * SECTOR)) return r;
                }
                return 0;
            }
        }
        if (int r = reserve(n, ceil_div(n, MAX_IO_SIZE), full)) return r;
        return append(sector, data, n);
    }

    // Image.write: any alignment; unaligned edges are read-modify-write.
    int write(int64_t offset, const char* data, int64_t n, Full* full) {
        if (n == 0) return 0;
        int64_t end = offset + n;
        int64_t a = offset & ~(SECTOR - 1);
        int64_t b = (end + SECTOR - 1) & ~(SECTOR - 1);
        if (a == offset && b == end) return write_extent(a >> 9, data, n, full);
        std::vector<char> buf(size_t(b - a), 0);
        if (a != offset) {
            if (int r = fill(a, a + SECTOR, buf.data())) return r;
        }
        if (b != end && (b - SECTOR >= a + SECTOR || a == offset)) {
            if (int r = fill(b - SECTOR, b, buf.data() + (b - SECTOR - a))) return r;
        }
        memcpy(buf.data() + (offset - a), data, size_t(n));
        return write_extent(a >> 9, buf.data(), b - a, full);
    }

    int zero_extent(int64_t sector, int64_t count, Full* full) {
        if (int r = reserve(0, ceil_div(count, MAX_LENGTH), full)) return r;
        std::string entries;
        std::vector<Mapping> inserts;
        int64_t mo = data_eof / SECTOR;
        while (count > 0) {
            int64_t k = std::min(count, MAX_LENGTH);
            put_mapping(entries, sector, k, mo, true, rw_tag);
            inserts.push_back(Mapping{sector, k, mo, ZEROED});
            sector += k;
            count -= k;
        }
        int r = append_log(entries);
        std::unique_lock<std::shared_mutex> g(ilock);
        for (const Mapping& m : inserts) insert(m.start, m.start + m.length, m.moffset, ZEROED);
        return r;
    }

    // Image._zero_range (discard and write-zeroes).
    int zero(int64_t offset, int64_t length, Full* full) {
        int64_t end = offset + length;
        int64_t a = (offset + SECTOR - 1) & ~(SECTOR - 1);
        int64_t b = end & ~(SECTOR - 1);
        if (a >= b) {
            if (!length) return 0;
            std::vector<char> z(size_t(length), 0);
            return write(offset, z.data(), length, full);
        }
        static const char zeros[SECTOR] = {0};
        if (a > offset) {
            if (int r = write(offset, zeros, a - offset, full)) return r;
        }
        if (end > b) {
            if (int r = write(b, zeros, end - b, full)) return r;
        }
        return zero_extent(a >> 9, (b - a) >> 9, full);
    }

    // Data first, then the index log (upper.py Upper.flush).
    int flush() {
        if (!has_upper || !writable) return 0;
        if (fsync(dfd) < 0) return -errno;
        {
            std::lock_guard<std::mutex> g(wlock);
            if (int r = write_log()) return r;
        }
        if (fsync(ifd) < 0) return -errno;
        return 0;
    }
};

// -- the node's disk budget (storage/budget.py is the Python path's twin) ---------------------
//
// One per process (blockd): while on, an upper grows only within a grant, and a grant is given
// only while the upper's filesystem keeps `reserve` bytes free after every grant outstanding
// (fstatvfs once per grant, not per write). A grant is `grant` bytes (or the request, if
// larger); when that would cut into the reserve, only the request. A write that cannot be
// granted gets ENOSPC: the guest sees a full disk, the host filesystem never fills past the
// reserve. Other writers on that filesystem (the node's memory layers, pulls) check the reserve
// themselves before they write.
struct Budget {
    std::mutex m;
    std::atomic<int64_t> reserve{-1};  // -1: off
    int64_t grant = 0;
    std::set<Engine*> engines;
};

Budget budget;

Engine::Engine() {
    std::lock_guard<std::mutex> g(budget.m);
    budget.engines.insert(this);
}

Engine::~Engine() {
    unmap_upper();
    std::lock_guard<std::mutex> g(budget.m);
    budget.engines.erase(this);
}

int Engine::take_grant(int64_t need, Full* full) {
    int64_t reserve = budget.reserve.load(std::memory_order_relaxed);
    if (reserve < 0) return 0;
    std::lock_guard<std::mutex> g(budget.m);
    struct statvfs st;
    if (fstatvfs(dfd, &st) < 0) return -errno;
    int64_t free_bytes = int64_t(st.f_bavail) * int64_t(st.f_frsize);
    int64_t outstanding = 0;
    for (Engine* other : budget.engines)
        if (other != this) outstanding += other->grant_left.load(std::memory_order_relaxed);
    int64_t room = free_bytes - outstanding - reserve;
    if (room < need) {
        grant_left.store(0, std::memory_order_relaxed);
        if (full) *full = Full{free_bytes, need, reserve, true, true};
        return -ENOSPC;
    }
    grant_left.store(std::min(std::max(budget.grant, need), room) - need,
                     std::memory_order_relaxed);
    return 0;
}

// -- NBD transmission (docs: blockd/nbd.py holds negotiation and the Python twin) ----------

constexpr uint32_t REQUEST_MAGIC = 0x25609513;
constexpr uint32_t SIMPLE_REPLY_MAGIC = 0x67446698;
constexpr uint32_t STRUCTURED_REPLY_MAGIC = 0x668E33EF;
constexpr int64_t MAX_REQUEST = 32 * 1024 * 1024;
constexpr int64_t SEND_AT = 256 * 1024;
constexpr size_t MAX_STATUS_RUNS = 4096;
enum { CMD_READ, CMD_WRITE, CMD_DISC, CMD_FLUSH, CMD_TRIM, CMD_CACHE, CMD_WRITE_ZEROES,
       CMD_BLOCK_STATUS };
constexpr uint16_t FLAG_FUA = 1, FLAG_REQ_ONE = 1 << 3;
constexpr uint16_t REPLY_FLAG_DONE = 1;
constexpr uint16_t REPLY_TYPE_NONE = 0, REPLY_TYPE_OFFSET_DATA = 1, REPLY_TYPE_BLOCK_STATUS = 5,
                   REPLY_TYPE_ERROR = (1 << 15) + 1;
constexpr uint32_t NBD_EPERM = 1, NBD_EIO = 5, NBD_ENOMEM = 12, NBD_EINVAL = 22, NBD_ENOSPC = 28,
                   NBD_EOVERFLOW = 75;
constexpr uint32_t BASE_ALLOCATION_ID = 1;
constexpr uint32_t STATE_HOLE_ZERO = 3;

uint32_t nbd_errno(int r) {
    if (r == -ENOSPC || r == -EDQUOT) return NBD_ENOSPC;
    if (r == -ENOMEM) return NBD_ENOMEM;
    return NBD_EIO;
}

uint16_t rd16(const unsigned char* p) { return uint16_t((p[0] << 8) | p[1]); }
uint32_t rd32(const unsigned char* p) {
    return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3];
}
uint64_t rd64(const unsigned char* p) { return (uint64_t(rd32(p)) << 32) | rd32(p + 4); }

// A byte buffer that grows geometrically and never zero-fills: a 1 MiB read reply is written
// over by the read itself, so clearing it first (std::vector's resize) would only add a
// memset and, on growth, a copy of the whole capacity.
class Buf {
   public:
    char* tail(size_t k) {
        if (cap_ < n_ + k) regrow(std::max(cap_ * 2, n_ + k));
        return p_.get() + n_;
    }
    void grow(size_t k) { n_ += k; }
    void put(const void* p, size_t k) {
        memcpy(tail(k), p, k);
        n_ += k;
    }
    void truncate(size_t k) { n_ = k; }
    // Drop the first k bytes (consumed input), keeping the rest at the front.
    void consume(size_t k) {
        memmove(p_.get(), p_.get() + k, n_ - k);
        n_ -= k;
    }
    // Empty it, giving back the memory a rare big request (up to 32 MiB) made it take: a
    // host has one buffer pair per connection. KEEP holds a common 4 MiB read and its header,
    // so the usual sizes never reallocate.
    void reset() {
        n_ = 0;
        if (cap_ > KEEP) {
            p_.reset(new char[KEEP]);
            cap_ = KEEP;
        }
    }
    size_t size() const { return n_; }
    char* data() { return p_.get(); }

   private:
    static constexpr size_t KEEP = (4 << 20) + 4096;
    void regrow(size_t cap) {
        std::unique_ptr<char[]> q(new char[cap]);  // default-initialised: not cleared
        if (n_) memcpy(q.get(), p_.get(), n_);
        p_ = std::move(q);
        cap_ = cap;
    }
    std::unique_ptr<char[]> p_;
    size_t cap_ = 0;
    size_t n_ = 0;
};

void be16(Buf& o, uint16_t v) {
    char b[2] = {char(v >> 8), char(v)};
    o.put(b, 2);
}
void be32(Buf& o, uint32_t v) {
    char b[4] = {char(v >> 24), char(v >> 16), char(v >> 8), char(v)};
    o.put(b, 4);
}
void be64(Buf& o, uint64_t v) {
    be32(o, uint32_t(v >> 32));
    be32(o, uint32_t(v));
}

// Splits one big read over a few threads (the caller plus helpers started on first use), so
// a connection's 1 MiB reads of a fragmented upper use more than one core. Requests still run
// one after another: only the pieces of one read run at once.
class ReadSplitter {
   public:
    static constexpr int64_t MIN_SPLIT = 256 * 1024;

    explicit ReadSplitter(Engine& e) : e_(e) {}
    ~ReadSplitter() {
        {
            std::lock_guard<std::mutex> g(m_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : threads_) t.join();
    }

    static int helpers_wanted() {
        int cores = int(std::thread::hardware_concurrency());
        return std::max(0, std::min(3, cores - 1));
    }

    int fill(int64_t pos, int64_t end, char* dst) {
        // A stack with a layer read through Python is read on the caller alone: each of its
        // pieces takes the GIL, so helpers would only queue for it. (A remote layer's misses
        // may go to Python from a helper: they wait for the network, not for the GIL.)
        int parts = e_.has_foreign ? 1 : 1 + std::min<int>(helpers_wanted(),
                                                            int((end - pos) / MIN_SPLIT) - 1);
        if (parts <= 1) return e_.fill(pos, end, dst);
        while (int(threads_.size()) < parts - 1) threads_.emplace_back([this] { run(); });
        int64_t chunk = ((end - pos) / parts + 4095) & ~int64_t(4095);
        {
            std::lock_guard<std::mutex> g(m_);
            jobs_.clear();
            next_ = 0;
            result_ = 0;
            for (int64_t a = pos + chunk; a < end; a += chunk)
                jobs_.push_back(Job{a, std::min(end, a + chunk), dst + (a - pos)});
            pending_ = jobs_.size();
        }
        cv_.notify_all();
        int r = e_.fill(pos, std::min(end, pos + chunk), dst);
        std::unique_lock<std::mutex> g(m_);
        done_.wait(g, [this] { return pending_ == 0; });
        return r ? r : result_;
    }

   private:
    struct Job {
        int64_t a, b;
        char* dst;
    };

    void run() {
        serving = true;  // a remote miss read through Python here is the connection's
        for (;;) {
            Job job;
            {
                std::unique_lock<std::mutex> g(m_);
                cv_.wait(g, [this] { return stop_ || next_ < jobs_.size(); });
                if (stop_) return;
                job = jobs_[next_++];
            }
            int r = e_.fill(job.a, job.b, job.dst);
            std::lock_guard<std::mutex> g(m_);
            if (r && !result_) result_ = r;
            if (--pending_ == 0) done_.notify_all();
        }
    }

    Engine& e_;
    std::mutex m_;
    std::condition_variable cv_, done_;
    std::vector<std::thread> threads_;
    std::vector<Job> jobs_;
    size_t next_ = 0, pending_ = 0;
    int result_ = 0;
    bool stop_ = false;
};

class Conn {
   public:
    Conn(Engine& e, int fd, const std::string& prefix, bool structured, bool base_alloc,
         bool readonly)
        : e_(e), fd_(fd), structured_(structured), base_alloc_(base_alloc), readonly_(readonly) {
        in_.put(prefix.data(), prefix.size());
    }

    // Returns why the loop ended: "disc", "eof", "error: ..." or "protocol: ...".
    std::string run() {
        for (;;) {
            if (ipos_ == in_.size()) {  // all consumed: start the buffer over
                in_.reset();
                ipos_ = 0;
            }
            if (in_.size() - ipos_ < 28) {
                if (!send_out()) return err_;
                if (!fill_in(28)) return err_;
            }
            const unsigned char* h = reinterpret_cast<const unsigned char*>(in_.data() + ipos_);
            uint32_t magic = rd32(h);
            uint16_t flags = rd16(h + 4), cmd = rd16(h + 6);
            uint64_t handle = rd64(h + 8), offset = rd64(h + 16);
            uint32_t length = rd32(h + 24);
            ipos_ += 28;
            if (magic != REQUEST_MAGIC) {
                send_out();
                return "protocol: bad request magic";
            }
            uint64_t size = uint64_t(e_.vsize);
            bool beyond = offset > size || length > size - offset;
            if (cmd == CMD_WRITE) {
                if (length > MAX_REQUEST) {
                    error(handle, NBD_EINVAL, false, 0);
                    send_out();
                    return "protocol: write larger than the maximum request";
                }
                if (!fill_in(length)) return err_;
                const char* data = in_.data() + ipos_;
                ipos_ += length;
                if (readonly_) error(handle, NBD_EPERM, false, 0);
                else if (beyond) error(handle, NBD_ENOSPC, false, 0);
                else finish(handle, do_write(int64_t(offset), data, length, flags & FLAG_FUA), false, 0);
            } else if (cmd == CMD_READ) {
                if (length > MAX_REQUEST) error(handle, NBD_EOVERFLOW, true, offset);
                else if (beyond) error(handle, NBD_EINVAL, true, offset);
                else read(handle, offset, length);
            } else if (cmd == CMD_BLOCK_STATUS && base_alloc_) {
                if (beyond || length == 0) error(handle, NBD_EINVAL, true, 0);
                else block_status(handle, offset, length, flags & FLAG_REQ_ONE);
            } else if (cmd == CMD_FLUSH) {
                int r = run_gated([&] { return e_.flush(); });
                finish(handle, r, false, 0);
                if (!r) e_.stats.flushes++;
            } else if (cmd == CMD_TRIM || cmd == CMD_WRITE_ZEROES) {
                if (readonly_) error(handle, NBD_EPERM, false, 0);
                else if (beyond) error(handle, NBD_ENOSPC, false, 0);
                else {
                    int r = run_gated([&] {
                        Full full;
                        int r = 0;
                        {
                            std::lock_guard<std::mutex> g(e_.wlock);
                            r = e_.zero(int64_t(offset), length, &full);
                        }
                        if (!r && (flags & FLAG_FUA)) r = e_.flush();
                        return r;
                    });
                    finish(handle, r, false, 0);
                    if (!r) (cmd == CMD_TRIM ? e_.stats.trims : e_.stats.zeroes)++;
                }
            } else if (cmd == CMD_CACHE) {
                if (beyond) error(handle, NBD_EINVAL, false, 0);
                else reply(handle, 0);
            } else if (cmd == CMD_DISC) {
                send_out();
                return "disc";
            } else {
                error(handle, NBD_EINVAL, false, 0);
            }
            if (out_.size() >= size_t(SEND_AT) && !send_out()) return err_;
        }
    }

   private:
    template <class F>
    int run_gated(F&& f) {
        e_.gate.enter();
        int r = e_.closed ? -ESHUTDOWN : f();
        e_.gate.leave();
        return r;
    }

    int do_write(int64_t offset, const char* data, int64_t n, bool fua) {
        int r = run_gated([&] {
            Full full;
            int r;
            {
                std::lock_guard<std::mutex> g(e_.wlock);
                r = e_.write(offset, data, n, &full);
            }
            if (!r && fua) r = e_.flush();
            return r;
        });
        if (!r) {
            e_.stats.writes++;
            e_.stats.bytes_written += n;
        }
        return r;
    }

    void finish(uint64_t handle, int r, bool is_read, uint64_t offset) {
        if (r) {
            if (r == -ENOSPC || r == -EDQUOT) e_.stats.enospc++;
            error(handle, nbd_errno(r), is_read, offset);
        } else {
            reply(handle, 0);
        }
    }

    void reply(uint64_t handle, uint32_t error) {
        be32(out_, SIMPLE_REPLY_MAGIC);
        be32(out_, error);
        be64(out_, handle);
    }

    void error(uint64_t handle, uint32_t code, bool is_read, uint64_t) {
        e_.stats.errors++;
        if (structured_ && is_read) {
            static const char msg[] = "request failed";
            be32(out_, STRUCTURED_REPLY_MAGIC);
            be16(out_, REPLY_FLAG_DONE);
            be16(out_, REPLY_TYPE_ERROR);
            be64(out_, handle);
            be32(out_, uint32_t(6 + sizeof(msg) - 1));
            be32(out_, code);
            be16(out_, uint16_t(sizeof(msg) - 1));
            out_.put(msg, sizeof(msg) - 1);
        } else {
            reply(handle, code);
        }
    }

    void read(uint64_t handle, uint64_t offset, uint32_t length) {
        if (length == 0) {
            if (structured_) {
                be32(out_, STRUCTURED_REPLY_MAGIC);
                be16(out_, REPLY_FLAG_DONE);
                be16(out_, REPLY_TYPE_NONE);
                be64(out_, handle);
                be32(out_, 0);
            } else {
                reply(handle, 0);
            }
            return;
        }
        size_t mark = out_.size();
        if (structured_) {
            be32(out_, STRUCTURED_REPLY_MAGIC);
            be16(out_, REPLY_FLAG_DONE);
            be16(out_, REPLY_TYPE_OFFSET_DATA);
            be64(out_, handle);
            be32(out_, 8 + length);
            be64(out_, offset);
        } else {
            reply(handle, 0);
        }
        char* dst = out_.tail(length);
        int r = run_gated([&] { return split_.fill(int64_t(offset), int64_t(offset + length), dst); });
        if (r) {
            out_.truncate(mark);
            error(handle, nbd_errno(r), true, offset);
            return;
        }
        out_.grow(length);
        e_.stats.reads++;
        e_.stats.bytes_read += length;
    }

    void block_status(uint64_t handle, uint64_t offset, uint32_t length, bool one) {
        std::vector<std::pair<int64_t, bool>> runs;
        run_gated([&] {
            e_.allocation(int64_t(offset), int64_t(offset + length), one ? 1 : MAX_STATUS_RUNS, runs);
            return 0;
        });
        be32(out_, STRUCTURED_REPLY_MAGIC);
        be16(out_, REPLY_FLAG_DONE);
        be16(out_, REPLY_TYPE_BLOCK_STATUS);
        be64(out_, handle);
        be32(out_, uint32_t(4 + 8 * runs.size()));
        be32(out_, BASE_ALLOCATION_ID);
        for (auto& run : runs) {
            be32(out_, uint32_t(run.first));
            be32(out_, run.second ? 0 : STATE_HOLE_ZERO);
        }
    }

    bool wait_fd(short events) {
        struct pollfd p = {fd_, events, 0};
        for (;;) {
            int r = poll(&p, 1, -1);
            if (r > 0) return true;
            if (r < 0 && errno != EINTR) {
                err_ = std::string("error: poll: ") + strerror(errno);
                return false;
            }
        }
    }

    // Ensures `need` unread bytes are buffered.
    bool fill_in(size_t need) {
        if (ipos_ > 0 && in_.size() - ipos_ < need) {  // a partial request: move it up front
            in_.consume(ipos_);
            ipos_ = 0;
        }
        while (in_.size() - ipos_ < need) {
            size_t want = std::max<size_t>(need - (in_.size() - ipos_), 256 * 1024);
            ssize_t r = recv(fd_, in_.tail(want), want, 0);
            if (r > 0) {
                in_.grow(size_t(r));
                continue;
            }
            if (r == 0) {
                err_ = "eof";
                return false;
            }
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (!wait_fd(POLLIN)) return false;
                continue;
            }
            err_ = std::string("error: recv: ") + strerror(errno);
            return false;
        }
        return true;
    }

    bool send_out() {
        size_t pos = 0;
        while (pos < out_.size()) {
            ssize_t r = send(fd_, out_.data() + pos, out_.size() - pos, MSG_NOSIGNAL);
            if (r >= 0) {
                pos += size_t(r);
                continue;
            }
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (!wait_fd(POLLOUT)) return false;
                continue;
            }
            err_ = std::string("error: send: ") + strerror(errno);
            out_.reset();
            return false;
        }
        out_.reset();
        return true;
    }

    Engine& e_;
    ReadSplitter split_{e_};
    int fd_;
    Buf in_;
    size_t ipos_ = 0;
    Buf out_;
    std::string err_;
    bool structured_, base_alloc_, readonly_;
};

// -- Python binding ------------------------------------------------------------------------

// -- ChunkMap: the chunk cache's presence marks, shared with the cores --------------------
//
// A sequence of one small int per chunk (0 absent, 1 verified, 2 unverified; cache.py):
// `m[i]`, `m[i] = mark` (0 clears it and bumps the chunk's generation), `m[a:b]` (bytes),
// `len(m)`, `mark in m`, iteration; `take_hits()` gives the native hits since the last call.

struct ChunkMapObject {
    PyObject_HEAD std::shared_ptr<ChunkMapData>* d;
};

PyTypeObject ChunkMapType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* ChunkMap_new(PyTypeObject* type, PyObject* args, PyObject*) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b)) return nullptr;
    ChunkMapObject* self = reinterpret_cast<ChunkMapObject*>(type->tp_alloc(type, 0));
    if (self != nullptr) {
        auto data = std::make_shared<ChunkMapData>(size_t(b.len));
        const unsigned char* src = static_cast<const unsigned char*>(b.buf);
        for (Py_ssize_t i = 0; i < b.len; i++) data->marks[i].store(src[i]);
        self->d = new std::shared_ptr<ChunkMapData>(std::move(data));
    }
    PyBuffer_Release(&b);
    return reinterpret_cast<PyObject*>(self);
}

void ChunkMap_dealloc(ChunkMapObject* self) {
    delete self->d;  // the cores reading it keep their own reference
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

Py_ssize_t ChunkMap_len(ChunkMapObject* self) { return Py_ssize_t((*self->d)->n); }

PyObject* ChunkMap_item(ChunkMapObject* self, Py_ssize_t i) {
    ChunkMapData& m = **self->d;
    if (i < 0 || size_t(i) >= m.n) {
        PyErr_SetString(PyExc_IndexError, "chunk index out of range");
        return nullptr;
    }
    return PyLong_FromLong(m.marks[i].load());
}

PyObject* ChunkMap_subscript(ChunkMapObject* self, PyObject* key) {
    ChunkMapData& m = **self->d;
    if (PySlice_Check(key)) {
        Py_ssize_t start, stop, step;
        if (PySlice_Unpack(key, &start, &stop, &step) < 0) return nullptr;
        Py_ssize_t count = PySlice_AdjustIndices(Py_ssize_t(m.n), &start, &stop, step);
        PyObject* out = PyBytes_FromStringAndSize(nullptr, count);
        if (out == nullptr) return nullptr;
        char* o = PyBytes_AS_STRING(out);
        for (Py_ssize_t k = 0, i = start; k < count; k++, i += step) o[k] = char(m.marks[i].load());
        return out;
    }
    Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) return nullptr;
    if (i < 0) i += Py_ssize_t(m.n);
    return ChunkMap_item(self, i);
}

int ChunkMap_ass_subscript(ChunkMapObject* self, PyObject* key, PyObject* value) {
    ChunkMapData& m = **self->d;
    if (value == nullptr) {
        PyErr_SetString(PyExc_TypeError, "chunk marks cannot be deleted");
        return -1;
    }
    Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) return -1;
    long mark = PyLong_AsLong(value);
    if (mark == -1 && PyErr_Occurred()) return -1;
    if (i < 0 || size_t(i) >= m.n || mark < 0 || mark > 255) {
        PyErr_Format(PyExc_ValueError, "chunk %zd mark %ld: index or mark out of range", i, mark);
        return -1;
    }
    m.set(size_t(i), uint8_t(mark));
    return 0;
}

int ChunkMap_contains(ChunkMapObject* self, PyObject* value) {
    long mark = PyLong_AsLong(value);
    if (mark == -1 && PyErr_Occurred()) return -1;
    ChunkMapData& m = **self->d;
    for (size_t i = 0; i < m.n; i++)
        if (m.marks[i].load(std::memory_order_relaxed) == mark) return 1;
    return 0;
}

// take_hits() -> (hits, [(chunk, lowest offset, furthest end, reread), ...]): what native
// reads hit since the last call.
PyObject* ChunkMap_take_hits(ChunkMapObject* self, PyObject*) {
    ChunkMapData& m = **self->d;
    PyObject* touched = PyList_New(0);
    if (touched == nullptr) return nullptr;
    for (size_t i = 0; i < m.n; i++) {
        if (m.hi[i].load(std::memory_order_relaxed) < 0) continue;
        int32_t hi = m.hi[i].exchange(-1);
        int32_t lo = m.lo[i].exchange(INT32_MAX);
        int reread = m.reread[i].exchange(0);
        PyObject* t = Py_BuildValue("(niiO)", Py_ssize_t(i), lo, hi, reread ? Py_True : Py_False);
        if (t == nullptr || PyList_Append(touched, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(touched);
            return nullptr;
        }
        Py_DECREF(t);
    }
    return Py_BuildValue("(LN)", (long long)m.hits.exchange(0), touched);
}

PyMethodDef ChunkMap_methods[] = {
    {"take_hits", (PyCFunction)ChunkMap_take_hits, METH_NOARGS, "native hits since last call"},
    {nullptr, nullptr, 0, nullptr}};

PySequenceMethods ChunkMap_as_sequence = {
    (lenfunc)ChunkMap_len, nullptr, nullptr, (ssizeargfunc)ChunkMap_item, nullptr, nullptr,
    nullptr, (objobjproc)ChunkMap_contains, nullptr, nullptr};

PyMappingMethods ChunkMap_as_mapping = {(lenfunc)ChunkMap_len, (binaryfunc)ChunkMap_subscript,
                                        (objobjargproc)ChunkMap_ass_subscript};

// A layer tuple's optional remote part: (ChunkMap, cache data fd, chunk size, stream size).
bool load_remote(PyObject* spec, std::shared_ptr<RemoteLayer>& out) {
    PyObject* map;
    int fd;
    long long chunk, stream_size;
    if (!PyArg_ParseTuple(spec, "O!iLL", &ChunkMapType, &map, &fd, &chunk, &stream_size))
        return false;
    if (chunk <= 0 || stream_size < 0 || fd < 0) {
        PyErr_SetString(PyExc_ValueError, "a remote layer needs a chunk size, a stream size "
                                          "and the cache file");
        return false;
    }
    out = std::make_shared<RemoteLayer>(
        RemoteLayer{*reinterpret_cast<ChunkMapObject*>(map)->d, fd, chunk, stream_size});
    return true;
}

struct CoreObject {
    PyObject_HEAD Engine* e;
};

PyObject* raise_errno(Engine* e, int r, const Full& full) {
    if (PyErr_Occurred()) return nullptr;  // a foreign layer's own error, for this caller
    if (r == -ENOSPC && e->on_full != nullptr && full.set) {
        PyObject* exc = PyObject_CallFunction(e->on_full, "LLLO", (long long)full.used,
                                              (long long)full.need, (long long)full.limit,
                                              full.node ? Py_True : Py_False);
        if (exc != nullptr) {
            PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
            Py_DECREF(exc);
        }
        return nullptr;
    }
    if (r == -ESHUTDOWN) {
        PyErr_SetString(PyExc_ValueError, "the native core is closed");
        return nullptr;
    }
    errno = -r;
    return PyErr_SetFromErrno(PyExc_OSError);
}

// Python callers are checked by NativeImage already; this keeps a direct caller of the core
// inside the disk too.
bool in_range(Engine* e, long long offset, long long length) {
    if (offset < 0 || length < 0 || offset > e->vsize || length > e->vsize - offset) {
        PyErr_Format(PyExc_ValueError, "I/O at [%lld, +%lld) is outside the %lld-byte image",
                     offset, length, (long long)e->vsize);
        return false;
    }
    return true;
}

bool load_array(PyObject* obj, std::vector<int64_t>& out) {
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, PyBUF_SIMPLE) < 0) return false;
    if (b.len % 8) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "index arrays are int64");
        return false;
    }
    out.resize(size_t(b.len / 8));
    memcpy(out.data(), b.buf, size_t(b.len));
    PyBuffer_Release(&b);
    return true;
}

// A layer tuple's optional ZFile part: (block starts as int64 bytes, block size, stream
// size, verify, zstd).
bool load_zfile(PyObject* spec, std::shared_ptr<ZLayer>& out) {
    PyObject* offs;
    long long block_size, size;
    int verify, zstd;
    if (!PyArg_ParseTuple(spec, "OLLpp", &offs, &block_size, &size, &verify, &zstd)) return false;
    auto z = std::make_shared<ZLayer>();
    if (!load_array(offs, z->offs)) return false;
    int64_t blocks = block_size > 0 ? (size + block_size - 1) / block_size : -1;
    if (block_size <= 0 || size < 0 || int64_t(z->offs.size()) != blocks + 1 ||
        !std::is_sorted(z->offs.begin(), z->offs.end())) {
        PyErr_SetString(PyExc_ValueError, "a ZFile layer needs one start per block and the end");
        return false;
    }
    z->block_size = block_size;
    z->size = size;
    z->verify = verify;
    z->zstd = zstd;
    out = std::move(z);
    return true;
}

PyObject* Core_new(PyTypeObject* type, PyObject*, PyObject*) {
    CoreObject* self = reinterpret_cast<CoreObject*>(type->tp_alloc(type, 0));
    if (self != nullptr) self->e = new Engine();
    return reinterpret_cast<PyObject*>(self);
}

void Core_dealloc(CoreObject* self) {
    if (self->e != nullptr) {
        Py_XDECREF(self->e->foreign_read);
        Py_XDECREF(self->e->on_full);
        delete self->e;
    }
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

// configure(vsize, ro: (starts, ends, moffsets, layers), layers: [(fd, base, foreign)],
//           foreign_read, upper: None | (data_fd, index_fd, data_eof, index_eof, log_entries,
//           rw_tag, (starts, ends, moffsets, layers), limit, reuse, log_buffer, writable),
//           on_full). Call while paused (or before serving).
PyObject* Core_configure(CoreObject* self, PyObject* args) {
    long long vsize;
    PyObject *ro, *layer_list, *foreign, *up, *on_full;
    if (!PyArg_ParseTuple(args, "LOOOOO", &vsize, &ro, &layer_list, &foreign, &up, &on_full))
        return nullptr;
    Engine* e = self->e;
    std::vector<int64_t> rs, re, rm, rl;
    if (!PyTuple_Check(ro) || PyTuple_GET_SIZE(ro) != 4) {
        PyErr_SetString(PyExc_ValueError, "the merged index is a 4-tuple of arrays");
        return nullptr;
    }
    if (!load_array(PyTuple_GET_ITEM(ro, 0), rs) || !load_array(PyTuple_GET_ITEM(ro, 1), re) ||
        !load_array(PyTuple_GET_ITEM(ro, 2), rm) || !load_array(PyTuple_GET_ITEM(ro, 3), rl))
        return nullptr;
    std::vector<Layer> layers;
    PyObject* seq = PySequence_Fast(layer_list, "layers must be a sequence");
    if (seq == nullptr) return nullptr;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        int fd, is_foreign;
        long long base;
        PyObject *remote = Py_None, *zf = Py_None;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "iLp|OO", &fd, &base, &is_foreign,
                              &remote, &zf)) {
            Py_DECREF(seq);
            return nullptr;
        }
        Layer layer{fd, base, bool(is_foreign), nullptr, nullptr};
        if ((remote != Py_None && !load_remote(remote, layer.remote)) ||
            (zf != Py_None && !load_zfile(zf, layer.z))) {
            Py_DECREF(seq);
            return nullptr;
        }
        layers.push_back(std::move(layer));
    }
    Py_DECREF(seq);
    for (int64_t lay : rl) {
        if (lay != ZEROED && (lay < 0 || size_t(lay) >= layers.size())) {
            PyErr_Format(PyExc_ValueError, "merged index names layer %lld of %zu", (long long)lay,
                         layers.size());
            return nullptr;
        }
    }
    if (rs.size() != re.size() || rs.size() != rm.size() || rs.size() != rl.size()) {
        PyErr_SetString(PyExc_ValueError, "merged index arrays differ in length");
        return nullptr;
    }
    bool has_upper = up != Py_None;
    int dfd = -1, ifd = -1, rw_tag = 0, reuse = 1, writable = 0;
    long long data_eof = 0, index_eof = 0, log_entries = 0, limit = -1, log_buffer = 0;
    std::vector<int64_t> us, ue, um, ul;
    if (has_upper) {
        PyObject* uix;
        if (!PyArg_ParseTuple(up, "iiLLLiOLpLp", &dfd, &ifd, &data_eof, &index_eof, &log_entries,
                              &rw_tag, &uix, &limit, &reuse, &log_buffer, &writable))
            return nullptr;
        if (!PyTuple_Check(uix) || PyTuple_GET_SIZE(uix) != 4) {
            PyErr_SetString(PyExc_ValueError, "upper index is a 4-tuple of arrays");
            return nullptr;
        }
        if (!load_array(PyTuple_GET_ITEM(uix, 0), us) || !load_array(PyTuple_GET_ITEM(uix, 1), ue) ||
            !load_array(PyTuple_GET_ITEM(uix, 2), um) || !load_array(PyTuple_GET_ITEM(uix, 3), ul))
            return nullptr;
    }
    e->unmap_upper();  // paused: no reader holds a mapping
    std::lock_guard<std::mutex> g(e->wlock);
    std::unique_lock<std::shared_mutex> gi(e->ilock);
    e->vsize = vsize;
    e->rs.swap(rs);
    e->re.swap(re);
    e->rm.swap(rm);
    e->rl.swap(rl);
    e->layers.swap(layers);
    e->has_foreign = std::any_of(e->layers.begin(), e->layers.end(),
                                 [](const Layer& L) { return L.foreign; });
    Py_XINCREF(foreign);
    Py_XSETREF(e->foreign_read, foreign);
    Py_XINCREF(on_full);
    Py_XSETREF(e->on_full, on_full);
    e->has_upper = has_upper;
    e->writable = has_upper && writable;
    e->dfd = dfd;
    e->ifd = ifd;
    e->data_eof = data_eof;
    e->index_eof = index_eof;
    e->log_entries = log_entries;
    e->rw_tag = rw_tag;
    e->limit = limit;
    e->grant_left.store(0, std::memory_order_relaxed);  // a new upper asks anew
    e->reuse = reuse;
    e->log_buffer = log_buffer;
    e->pending_log.clear();
    e->upper.clear();
    for (size_t i = 0; i < us.size(); i++) e->upper.emplace_hint(e->upper.end(), us[i], Extent{ue[i], um[i], ul[i]});
    e->closed = false;
    Py_RETURN_NONE;
}

PyObject* bytes_of(const std::vector<int64_t>& v) {
    return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(v.data()),
                                     Py_ssize_t(v.size() * 8));
}

// export_upper() -> (data_eof, index_eof, log_entries, (starts, ends, moffsets, layers)):
// the upper's state for Python, after writing the queued index-log entries. Call while paused.
PyObject* Core_export_upper(CoreObject* self, PyObject*) {
    Engine* e = self->e;
    std::vector<int64_t> s, en, m, l;
    int r;
    Py_BEGIN_ALLOW_THREADS std::lock_guard<std::mutex> g(e->wlock);
    {
        r = e->has_upper && e->writable ? e->write_log() : 0;
        for (auto& kv : e->upper) {
            s.push_back(kv.first);
            en.push_back(kv.second.end);
            m.push_back(kv.second.moffset);
            l.push_back(kv.second.layer);
        }
    }
    Py_END_ALLOW_THREADS if (r) return raise_errno(e, r, Full());
    return Py_BuildValue("LLL(NNNN)", (long long)e->data_eof, (long long)e->index_eof,
                         (long long)e->log_entries, bytes_of(s), bytes_of(en), bytes_of(m), bytes_of(l));
}

PyObject* Core_close(CoreObject* self, PyObject*) {
    Py_BEGIN_ALLOW_THREADS std::lock_guard<std::mutex> g(self->e->wlock);
    self->e->closed = true;
    self->e->grant_left.store(0, std::memory_order_relaxed);  // back to the node's budget
    self->e->unmap_upper();  // paused: no reader holds a mapping
    Py_END_ALLOW_THREADS
    // The callables are the image's bound methods: dropping them breaks the reference cycle
    // image -> core -> image. Nothing calls them once closed.
    Py_CLEAR(self->e->foreign_read);
    Py_CLEAR(self->e->on_full);
    Py_RETURN_NONE;
}

PyObject* Core_pause(CoreObject* self, PyObject*) {
    Py_BEGIN_ALLOW_THREADS self->e->gate.pause();
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

PyObject* Core_resume(CoreObject* self, PyObject*) {
    self->e->gate.resume();
    Py_RETURN_NONE;
}

PyObject* Core_readinto(CoreObject* self, PyObject* args) {
    long long offset;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "Lw*", &offset, &b)) return nullptr;
    Engine* e = self->e;
    if (!in_range(e, offset, b.len)) {
        PyBuffer_Release(&b);
        return nullptr;
    }
    int r;
    Py_BEGIN_ALLOW_THREADS e->gate.enter();
    r = e->closed ? -ESHUTDOWN : e->fill(offset, offset + b.len, static_cast<char*>(b.buf));
    e->gate.leave();
    Py_END_ALLOW_THREADS Py_ssize_t n = b.len;
    PyBuffer_Release(&b);
    if (r) return raise_errno(e, r, Full());
    return PyLong_FromSsize_t(n);
}

PyObject* Core_read(CoreObject* self, PyObject* args) {
    long long offset, length;
    if (!PyArg_ParseTuple(args, "LL", &offset, &length)) return nullptr;
    if (!in_range(self->e, offset, length)) return nullptr;
    PyObject* out = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(length));
    if (out == nullptr) return nullptr;
    Engine* e = self->e;
    char* dst = PyBytes_AS_STRING(out);
    int r;
    Py_BEGIN_ALLOW_THREADS e->gate.enter();
    r = e->closed ? -ESHUTDOWN : e->fill(offset, offset + length, dst);
    e->gate.leave();
    Py_END_ALLOW_THREADS if (r) {
        Py_DECREF(out);
        return raise_errno(e, r, Full());
    }
    return out;
}

PyObject* Core_write(CoreObject* self, PyObject* args) {
    long long offset;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "Ly*", &offset, &b)) return nullptr;
    Engine* e = self->e;
    if (!in_range(e, offset, b.len)) {
        PyBuffer_Release(&b);
        return nullptr;
    }
    Full full;
    int r;
    Py_BEGIN_ALLOW_THREADS e->gate.enter();
    if (e->closed) {
        r = -ESHUTDOWN;
    } else {
        std::lock_guard<std::mutex> g(e->wlock);
        r = e->write(offset, static_cast<const char*>(b.buf), b.len, &full);
    }
    e->gate.leave();
    Py_END_ALLOW_THREADS PyBuffer_Release(&b);
    if (r) return raise_errno(e, r, full);
    Py_RETURN_NONE;
}

PyObject* Core_zero(CoreObject* self, PyObject* args) {
    long long offset, length;
    if (!PyArg_ParseTuple(args, "LL", &offset, &length)) return nullptr;
    Engine* e = self->e;
    if (!in_range(e, offset, length)) return nullptr;
    Full full;
    int r;
    Py_BEGIN_ALLOW_THREADS e->gate.enter();
    if (e->closed) {
        r = -ESHUTDOWN;
    } else {
        std::lock_guard<std::mutex> g(e->wlock);
        r = e->zero(offset, length, &full);
    }
    e->gate.leave();
    Py_END_ALLOW_THREADS if (r) return raise_errno(e, r, full);
    Py_RETURN_NONE;
}

PyObject* Core_flush(CoreObject* self, PyObject*) {
    Engine* e = self->e;
    int r;
    Py_BEGIN_ALLOW_THREADS e->gate.enter();
    r = e->closed ? -ESHUTDOWN : e->flush();
    e->gate.leave();
    Py_END_ALLOW_THREADS if (r) return raise_errno(e, r, Full());
    Py_RETURN_NONE;
}

PyObject* Core_allocation(CoreObject* self, PyObject* args) {
    long long offset, length, max_runs;
    if (!PyArg_ParseTuple(args, "LLL", &offset, &length, &max_runs)) return nullptr;
    Engine* e = self->e;
    if (!in_range(e, offset, length)) return nullptr;
    std::vector<std::pair<int64_t, bool>> runs;
    Py_BEGIN_ALLOW_THREADS e->gate.enter();
    if (!e->closed) e->allocation(offset, offset + length, size_t(max_runs), runs);
    e->gate.leave();
    Py_END_ALLOW_THREADS PyObject* out = PyList_New(Py_ssize_t(runs.size()));
    if (out == nullptr) return nullptr;
    for (size_t i = 0; i < runs.size(); i++)
        PyList_SET_ITEM(out, Py_ssize_t(i),
                        Py_BuildValue("(LO)", (long long)runs[i].first, runs[i].second ? Py_True : Py_False));
    return out;
}

PyObject* Core_set_limit(CoreObject* self, PyObject* args) {
    long long limit;
    if (!PyArg_ParseTuple(args, "L", &limit)) return nullptr;
    Py_BEGIN_ALLOW_THREADS std::lock_guard<std::mutex> g(self->e->wlock);
    self->e->limit = limit;
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

PyObject* Core_upper_used(CoreObject* self, void*) {
    Engine* e = self->e;
    long long used;
    Py_BEGIN_ALLOW_THREADS std::lock_guard<std::mutex> g(e->wlock);
    used = e->has_upper ? e->used_bytes() : 0;
    Py_END_ALLOW_THREADS return PyLong_FromLongLong(used);
}

// take_stats() -> (reads, writes, bytes_read, bytes_written, flushes, trims, zeroes, errors,
// enospc) counted by serve() since the last call.
PyObject* Core_take_stats(CoreObject* self, PyObject*) {
    Stats& s = self->e->stats;
    return Py_BuildValue("(LLLLLLLLL)", (long long)s.reads.exchange(0), (long long)s.writes.exchange(0),
                         (long long)s.bytes_read.exchange(0), (long long)s.bytes_written.exchange(0),
                         (long long)s.flushes.exchange(0), (long long)s.trims.exchange(0),
                         (long long)s.zeroes.exchange(0), (long long)s.errors.exchange(0),
                         (long long)s.enospc.exchange(0));
}

// io_counts() -> (lower preadv calls, calls into Python for layer bytes) since the start.
PyObject* Core_io_counts(CoreObject* self, PyObject*) {
    return Py_BuildValue("(LL)", (long long)self->e->lower_preads.load(),
                         (long long)self->e->python_reads.load());
}

// serve(fd, buffered, structured, base_allocation, readonly, thread_name) -> reason: run the
// NBD transmission phase on this thread, GIL released, until the client disconnects or the
// socket is shut down. `buffered` is input already read past the negotiation. fd stays open.
PyObject* Core_serve(CoreObject* self, PyObject* args) {
    int fd, structured, base_alloc, readonly;
    Py_buffer prefix;
    const char* name;
    if (!PyArg_ParseTuple(args, "iy*pppz", &fd, &prefix, &structured, &base_alloc, &readonly, &name))
        return nullptr;
    std::string pre(static_cast<const char*>(prefix.buf), size_t(prefix.len));
    PyBuffer_Release(&prefix);
    if (name != nullptr) {
        char comm[16];
        snprintf(comm, sizeof(comm), "%s", name);
        pthread_setname_np(pthread_self(), comm);
    }
    std::string reason;
    Py_BEGIN_ALLOW_THREADS serving = true;
    Conn conn(*self->e, fd, pre, structured, base_alloc, readonly);
    reason = conn.run();
    serving = false;
    Py_END_ALLOW_THREADS return PyUnicode_FromStringAndSize(reason.data(), Py_ssize_t(reason.size()));
}

PyMethodDef Core_methods[] = {
    {"configure", (PyCFunction)Core_configure, METH_VARARGS, "bind the stack (while paused)"},
    {"export_upper", (PyCFunction)Core_export_upper, METH_NOARGS, "the upper's state"},
    {"close", (PyCFunction)Core_close, METH_NOARGS, "refuse further requests"},
    {"pause", (PyCFunction)Core_pause, METH_NOARGS, "wait for in-flight requests, hold new ones"},
    {"resume", (PyCFunction)Core_resume, METH_NOARGS, "admit requests again"},
    {"read", (PyCFunction)Core_read, METH_VARARGS, "read(offset, length) -> bytes"},
    {"readinto", (PyCFunction)Core_readinto, METH_VARARGS, "readinto(offset, buffer) -> int"},
    {"write", (PyCFunction)Core_write, METH_VARARGS, "write(offset, data)"},
    {"zero", (PyCFunction)Core_zero, METH_VARARGS, "zero(offset, length): discard/write-zeroes"},
    {"flush", (PyCFunction)Core_flush, METH_NOARGS, "fsync data, then the index log"},
    {"allocation", (PyCFunction)Core_allocation, METH_VARARGS, "(length, has_data) runs"},
    {"set_limit", (PyCFunction)Core_set_limit, METH_VARARGS, "cap on the upper (-1: none)"},
    {"take_stats", (PyCFunction)Core_take_stats, METH_NOARGS, "serve() counters since last call"},
    {"serve", (PyCFunction)Core_serve, METH_VARARGS, "NBD transmission loop on this thread"},
    {"io_counts", (PyCFunction)Core_io_counts, METH_NOARGS, "(lower preadv, Python reads)"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef Core_getset[] = {
    {"upper_used", (getter)Core_upper_used, nullptr, "bytes the cap counts", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject CoreType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// set_disk_budget(reserve, grant): turn the node's disk budget on for every core of this
// process (reserve < 0: off). Grants already given stand.
PyObject* set_disk_budget(PyObject*, PyObject* args) {
    long long reserve, grant;
    if (!PyArg_ParseTuple(args, "LL", &reserve, &grant)) return nullptr;
    if (grant <= 0) {
        PyErr_SetString(PyExc_ValueError, "a grant is a positive number of bytes");
        return nullptr;
    }
    {
        std::lock_guard<std::mutex> g(budget.m);
        budget.grant = grant;
    }
    budget.reserve.store(reserve < 0 ? -1 : reserve);
    Py_RETURN_NONE;
}

// -- memory capture: written pages of QEMU's guest RAM into a layer (runtime/memory.py) ----
//
// `capture_pages` does the per-page work of a pause on threads without the GIL: scan
// /proc/PID/pagemap for pages written since the mapping was made, read them out of QEMU with
// process_vm_readv into the caller's buffers batch by batch, classify zero pages (runs shorter
// than min_zero_pages among data are kept as data), and pwritev each batch's data densely
// from `pos` on writer threads (O_DIRECT fd, or the buffered fd where O_DIRECT is refused).
// It returns the extents; Python's LayerBuilder records them (reserve_extents lays the data
// out densely in the same order) and writes index and trailer: the format stays Python's.
// The batching is runtime/memory.py's reference pipeline's, so the layers are byte-identical.

constexpr int64_t CAP_PAGE = 4096;
constexpr size_t CAP_IOV_MAX = 1024;

double now_s() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

// Page numbers (ascending, from the mapping's start) of pages present and not file-backed
// (an anonymous copy-on-write copy), or swapped.
int capture_scan(int pagemap_fd, uint64_t addr, int64_t npages, std::vector<int64_t>& out) {
    std::vector<uint64_t> buf(size_t(std::min<int64_t>(npages, 1 << 16)));
    int64_t first = int64_t(addr / CAP_PAGE);
    for (int64_t i = 0; i < npages;) {
        int64_t n = std::min<int64_t>(npages - i, int64_t(buf.size()));
        int64_t got = pread_full(pagemap_fd, reinterpret_cast<char*>(buf.data()), n * 8, (first + i) * 8);
        if (got < 0) return int(got);
        if (got < n * 8) return -EIO;
        for (int64_t j = 0; j < n; j++) {
            uint64_t e = buf[size_t(j)];
            if ((((e >> 63) & 1) && !((e >> 61) & 1)) || ((e >> 62) & 1)) out.push_back(i + j);
        }
        i += n;
    }
    return 0;
}

struct CaptureBatch {
    size_t first = 0, end = 0;  // indexes into the page list
    char* buf = nullptr;
    int64_t pos = 0;            // file byte position of its data
    std::vector<std::pair<int64_t, int64_t>> runs;  // data runs: [lo, hi) bytes of buf
    bool written = false;
};

class Capture {
   public:
    Capture(int pid, uint64_t addr, const std::vector<int64_t>& pages, std::vector<char*> bufs,
            int64_t batch_pages, int64_t min_zero_pages, int direct_fd, int buffered_fd)
        : pid_(pid), addr_(addr), pages_(pages), bufs_(std::move(bufs)), batch_pages_(batch_pages),
          min_zero_(min_zero_pages), direct_fd_(direct_fd), buffered_fd_(buffered_fd) {}

    std::vector<int64_t> offsets, lengths, zeroed;
    int64_t zero_pages = 0, direct_bytes = 0, buffered_bytes = 0;
    double busy_read = 0, busy_classify = 0, busy_write = 0;
    std::string error;
    int err = 0;

    int run(int64_t pos, int writers) {
        size_t n = pages_.size();
        for (size_t i = 0; i < n; i += size_t(batch_pages_)) {
            CaptureBatch b;
            b.first = i;
            b.end = std::min(n, i + size_t(batch_pages_));
            batches_.push_back(std::move(b));
        }
        std::vector<std::thread> threads;
        for (int w = 0; w < writers && size_t(w) < batches_.size(); w++)
            threads.emplace_back([this] { write_loop(); });
        for (size_t k = 0; k < batches_.size(); k++) {
            if (k >= bufs_.size() && !wait_written(k - bufs_.size())) break;  // its buffer is free
            CaptureBatch& b = batches_[k];
            b.buf = bufs_[k % bufs_.size()];
            double t0 = now_s();
            std::string what;
            int r = read_batch(b, what);
            double t1 = now_s();
            if (r) {
                fail(r, what);
                break;
            }
            classify(b);
            b.pos = pos;
            for (auto& run : b.runs) pos += run.second - run.first;
            busy_read += t1 - t0;
            busy_classify += now_s() - t1;
            std::lock_guard<std::mutex> g(m_);
            queue_.push_back(k);
            cv_.notify_all();
        }
        {
            std::lock_guard<std::mutex> g(m_);
            done_ = true;
            cv_.notify_all();
        }
        for (auto& t : threads) t.join();
        return err;
    }

   private:
    int pid_;
    uint64_t addr_;
    const std::vector<int64_t>& pages_;
    std::vector<char*> bufs_;
    int64_t batch_pages_, min_zero_;
    int direct_fd_, buffered_fd_;
    std::vector<CaptureBatch> batches_;
    std::vector<size_t> queue_;
    bool done_ = false;
    std::mutex m_;
    std::condition_variable cv_;

    void fail(int r, const std::string& what) {
        std::lock_guard<std::mutex> g(m_);
        if (!err) {
            err = r;
            error = what;
        }
        cv_.notify_all();
    }

    bool wait_written(size_t k) {
        std::unique_lock<std::mutex> g(m_);
        cv_.wait(g, [&] { return batches_[k].written || err; });
        return !err;
    }

    int read_batch(CaptureBatch& b, std::string& what) {
        std::vector<struct iovec> remote;
        int64_t done = 0;
        auto flush = [&]() -> int {
            if (remote.empty()) return 0;
            int64_t total = 0;
            for (auto& v : remote) total += int64_t(v.iov_len);
            struct iovec local = {b.buf + done, size_t(total)};
            ssize_t got = process_vm_readv(pid_, &local, 1, remote.data(), remote.size(), 0);
            if (got != total) {
                int e = got < 0 ? errno : EIO;
                char msg[200];
                snprintf(msg, sizeof(msg), "process_vm_readv from QEMU pid %d read %lld of %lld bytes: %s",
                         pid_, (long long)got, (long long)total, got < 0 ? strerror(e) : "short read");
                what = msg;
                return -e;
            }
            done += total;
            remote.clear();
            return 0;
        };
        size_t i = b.first;
        while (i < b.end) {
            size_t j = i + 1;
            while (j < b.end && pages_[j] == pages_[j - 1] + 1) j++;
            remote.push_back({reinterpret_cast<void*>(addr_ + uint64_t(pages_[i]) * CAP_PAGE),
                              size_t(int64_t(j - i) * CAP_PAGE)});
            if (remote.size() == CAP_IOV_MAX) {
                if (int r = flush()) return r;
            }
            i = j;
        }
        return flush();
    }

    bool page_nonzero(const char* p) const {
        const uint64_t* w = reinterpret_cast<const uint64_t*>(p);
        if (w[0]) return true;
        for (size_t i = 1; i < CAP_PAGE / 8; i++)
            if (w[i]) return true;
        return false;
    }

    // memory.py: _nonzero_pages, _with_short_zero_gaps, then runs of one kind.
    void classify(CaptureBatch& b) {
        size_t n = b.end - b.first;
        std::vector<uint8_t> data(n);
        for (size_t i = 0; i < n; i++) data[i] = page_nonzero(b.buf + int64_t(i) * CAP_PAGE);
        auto run_end = [&](size_t i, const std::vector<uint8_t>& kind) {
            size_t j = i + 1;
            while (j < n && pages_[b.first + j] == pages_[b.first + j - 1] + 1 && kind[j] == kind[i]) j++;
            return j;
        };
        std::vector<uint8_t> keep(data);
        for (size_t i = 0; i < n;) {
            size_t j = run_end(i, data);
            if (!data[i] && int64_t(j - i) < min_zero_) std::fill(keep.begin() + long(i), keep.begin() + long(j), 1);
            i = j;
        }
        for (size_t i = 0; i < n;) {
            size_t j = run_end(i, keep);
            offsets.push_back(pages_[b.first + i] * CAP_PAGE);
            lengths.push_back(int64_t(j - i) * CAP_PAGE);
            zeroed.push_back(!keep[i]);
            if (keep[i]) b.runs.emplace_back(int64_t(i) * CAP_PAGE, int64_t(j) * CAP_PAGE);
            else zero_pages += int64_t(j - i);
            i = j;
        }
    }

    // Positional writes of a batch's runs (IOV_MAX at a time); -errno on failure.
    static int pwritev_all(int fd, const char* buf, const std::vector<std::pair<int64_t, int64_t>>& runs,
                           int64_t pos) {
        std::vector<struct iovec> iov;
        for (auto& r : runs) iov.push_back({const_cast<char*>(buf + r.first), size_t(r.second - r.first)});
        size_t at = 0;
        while (at < iov.size()) {
            int cnt = int(std::min(iov.size() - at, CAP_IOV_MAX));
            ssize_t w = pwritev(fd, iov.data() + at, cnt, pos);
            if (w < 0) {
                if (errno == EINTR) continue;
                return -errno;
            }
            pos += w;
            while (at < iov.size() && size_t(w) >= iov[at].iov_len) w -= ssize_t(iov[at++].iov_len);
            if (at < iov.size() && w > 0) {
                iov[at].iov_base = static_cast<char*>(iov[at].iov_base) + w;
                iov[at].iov_len -= size_t(w);
            }
        }
        return 0;
    }

    void write_loop() {
        for (;;) {
            size_t k;
            {
                std::unique_lock<std::mutex> g(m_);
                cv_.wait(g, [&] { return !queue_.empty() || done_ || err; });
                if (err || queue_.empty()) return;
                k = queue_.front();
                queue_.erase(queue_.begin());
            }
            CaptureBatch& b = batches_[k];
            int64_t bytes = 0;
            for (auto& r : b.runs) bytes += r.second - r.first;
            double t0 = now_s();
            int r = -EINVAL;
            bool direct = direct_fd_ >= 0;
            if (direct) r = pwritev_all(direct_fd_, b.buf, b.runs, b.pos);
            if (r == -EINVAL) {  // no O_DIRECT for this write: through the page cache
                direct = false;
                r = pwritev_all(buffered_fd_, b.buf, b.runs, b.pos);
                if (!r) sync_file_range(buffered_fd_, 0, 0, SYNC_FILE_RANGE_WRITE);
            }
            std::lock_guard<std::mutex> g(m_);
            busy_write += now_s() - t0;
            if (r) {
                if (!err) {
                    err = r;
                    error = std::string("writing the layer's data: ") + strerror(-r);
                }
            } else {
                (direct ? direct_bytes : buffered_bytes) += bytes;
            }
            b.written = true;
            cv_.notify_all();
        }
    }
};

// capture_pages(pid, addr, size, pagemap_fd, buffers, batch_pages, min_zero_pages, pos,
//               direct_fd, buffered_fd, writers)
//   -> (offsets, lengths, zeroed: int64 arrays as bytes, written_pages, zero_pages,
//       data_bytes, direct_bytes, buffered_bytes, (scan, read, classify, write) seconds)
PyObject* capture_pages(PyObject*, PyObject* args) {
    int pid, pagemap_fd, direct_fd, buffered_fd, writers;
    unsigned long long addr;
    long long size, batch_pages, min_zero, pos;
    PyObject* buffer_list;
    if (!PyArg_ParseTuple(args, "iKLiOLLLiii", &pid, &addr, &size, &pagemap_fd, &buffer_list,
                          &batch_pages, &min_zero, &pos, &direct_fd, &buffered_fd, &writers))
        return nullptr;
    if (size < 0 || size % CAP_PAGE || addr % CAP_PAGE || batch_pages <= 0 || writers <= 0 || pos < 0) {
        PyErr_SetString(PyExc_ValueError, "capture_pages: size and addr page aligned, batch_pages, "
                                          "writers and pos positive");
        return nullptr;
    }
    PyObject* seq = PySequence_Fast(buffer_list, "buffers must be a sequence");
    if (seq == nullptr) return nullptr;
    Py_ssize_t nbufs = PySequence_Fast_GET_SIZE(seq);
    std::vector<Py_buffer> views(static_cast<size_t>(nbufs));
    std::vector<char*> bufs;
    bool ok = nbufs > 0;
    if (!ok) PyErr_SetString(PyExc_ValueError, "capture_pages needs buffers");
    for (Py_ssize_t i = 0; ok && i < nbufs; i++) {
        Py_buffer& v = views[size_t(i)];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &v, PyBUF_WRITABLE) < 0) {
            ok = false;
            break;
        }
        bufs.push_back(static_cast<char*>(v.buf));  // acquired: released below
        if (v.len < batch_pages * CAP_PAGE) {
            PyErr_SetString(PyExc_ValueError, "a capture buffer is smaller than a batch");
            ok = false;
        }
    }
    PyObject* out = nullptr;
    if (ok) {
        std::vector<int64_t> pages;
        int r;
        double t0 = now_s(), t1 = t0;
        Capture* cap = nullptr;
        int64_t start = pos;
        Py_BEGIN_ALLOW_THREADS r = capture_scan(pagemap_fd, addr, size / CAP_PAGE, pages);
        t1 = now_s();
        if (!r) {
            cap = new Capture(pid, addr, pages, bufs, batch_pages, min_zero, direct_fd, buffered_fd);
            r = cap->run(start, writers);
        }
        Py_END_ALLOW_THREADS if (r) {
            std::string what = cap && !cap->error.empty() ? cap->error
                                                          : std::string("reading /proc/pid/pagemap: ") + strerror(-r);
            PyObject* exc = Py_BuildValue("(is)", -r, what.c_str());
            if (exc != nullptr) {
                PyErr_SetObject(PyExc_OSError, exc);
                Py_DECREF(exc);
            }
        } else {
            int64_t data_bytes = 0;
            for (size_t i = 0; i < cap->lengths.size(); i++)
                if (!cap->zeroed[i]) data_bytes += cap->lengths[i];
            out = Py_BuildValue("(NNNLLLLL(dddd))", bytes_of(cap->offsets), bytes_of(cap->lengths),
                                bytes_of(cap->zeroed), (long long)pages.size(), (long long)cap->zero_pages,
                                (long long)data_bytes, (long long)cap->direct_bytes,
                                (long long)cap->buffered_bytes, t1 - t0, cap->busy_read,
                                cap->busy_classify, cap->busy_write);
        }
        delete cap;
    }
    for (size_t i = 0; i < bufs.size(); i++) PyBuffer_Release(&views[i]);
    Py_DECREF(seq);
    return out;
}

// -- memfs: FUSE reads of memory stacks (blockd/memfs.py, docs/native.md) ------------------
//
// memfs mounts with libfuse's high-level API (through mfusepy) and keeps every operation in
// Python except `read`, the one on the page-fault path: its slot in the operations table is
// `memfs_read` (address from `memfs_read_address()`), called on libfuse's worker threads
// without the GIL. Python registers each opened stack under its path ("/<key>") with its core,
// size and trace file, and unregisters it before closing the image. A read looks the path up,
// records the 1 MiB chunks it touches for the first time (uint32 LE chunk numbers appended to
// the trace file: the startup pack's source) and fills libfuse's buffer from the core.

constexpr int64_t MEMFS_CHUNK = 1 << 20;

struct MemoryFile {
    CoreObject* core;  // a reference, dropped at unregister once no read uses it
    int64_t size;
    int trace_fd;      // Python's: O_APPEND, or -1
    std::unique_ptr<std::atomic<uint8_t>[]> seen;  // per chunk: touched by a read
    std::mutex trace_lock;
    int inflight = 0;  // reads using this entry, guarded by memfs_lock
    std::condition_variable idle;
    std::atomic<int64_t> reads{0}, bytes{0}, errors{0};
};

std::mutex memfs_lock;
std::map<std::string, MemoryFile*> memfs_files;

void memfs_trace(MemoryFile* f, const char* entries, int count) {
    if (count == 0 || f->trace_fd < 0) return;
    std::lock_guard<std::mutex> g(f->trace_lock);
    (void)!write(f->trace_fd, entries, size_t(4 * count));  // best effort, like the Python twin
}

void memfs_note(MemoryFile* f, int64_t pos, int64_t n) {
    char fresh[4 * 16];
    int count = 0;
    for (int64_t c = pos / MEMFS_CHUNK; c <= (pos + n - 1) / MEMFS_CHUNK; c++) {
        std::atomic<uint8_t>& seen = f->seen[size_t(c)];
        if (seen.load(std::memory_order_relaxed) || seen.exchange(1)) continue;
        for (int i = 0; i < 4; i++) fresh[4 * count + i] = char((uint32_t(c) >> (8 * i)) & 0xFF);
        if (++count == 16) {
            memfs_trace(f, fresh, count);
            count = 0;
        }
    }
    memfs_trace(f, fresh, count);
}

// libfuse 3 high-level `read`: bytes read, or -errno.
int memfs_read(const char* path, char* buf, size_t size, off_t offset, void* /*fuse_file_info*/) {
    MemoryFile* f = nullptr;
    {
        std::lock_guard<std::mutex> g(memfs_lock);
        auto it = path ? memfs_files.find(path) : memfs_files.end();
        if (it == memfs_files.end()) return -ENOENT;
        f = it->second;
        f->inflight++;
    }
    int64_t pos = offset, end = std::min<int64_t>(int64_t(offset) + int64_t(size), f->size);
    int r = 0;
    if (pos < 0) {
        r = -EINVAL;
    } else if (pos < end) {
        memfs_note(f, pos, end - pos);
        Engine* e = f->core->e;
        serving = true;  // a failed foreign (remote) piece is logged and answered with EIO
        e->gate.enter();
        r = e->closed ? -EIO : e->fill(pos, end, buf);
        e->gate.leave();
        serving = false;
        if (r) {
            f->errors++;
        } else {
            f->reads++;
            f->bytes += end - pos;
        }
    }
    {
        std::lock_guard<std::mutex> g(memfs_lock);
        if (--f->inflight == 0) f->idle.notify_all();
    }
    if (r) return r == -ENOSPC ? -EIO : r;
    return pos < end ? int(end - pos) : 0;
}

// memfs_register(path, core, size, trace_fd): serve reads of `path` from `core`.
PyObject* memfs_register(PyObject*, PyObject* args) {
    const char* path;
    PyObject* core;
    long long size;
    int trace_fd;
    if (!PyArg_ParseTuple(args, "sO!Li", &path, &CoreType, &core, &size, &trace_fd)) return nullptr;
    if (size < 0 || size > reinterpret_cast<CoreObject*>(core)->e->vsize) {
        PyErr_Format(PyExc_ValueError, "memory file size %lld is outside the core's image", size);
        return nullptr;
    }
    auto* f = new MemoryFile();
    f->core = reinterpret_cast<CoreObject*>(core);
    f->size = size;
    f->trace_fd = trace_fd;
    size_t chunks = size_t(ceil_div(std::max<int64_t>(size, 1), MEMFS_CHUNK));
    f->seen.reset(new std::atomic<uint8_t>[chunks]);
    for (size_t i = 0; i < chunks; i++) f->seen[i].store(0);
    bool taken;
    {
        std::lock_guard<std::mutex> g(memfs_lock);
        taken = !memfs_files.emplace(path, f).second;
    }
    if (taken) {
        delete f;
        PyErr_Format(PyExc_ValueError, "memory file %s is registered already", path);
        return nullptr;
    }
    Py_INCREF(core);
    Py_RETURN_NONE;
}

// memfs_unregister(path) -> (reads, bytes, errors) | None: stop serving `path`; returns once
// no read uses its core any more.
PyObject* memfs_unregister(PyObject*, PyObject* args) {
    const char* path;
    if (!PyArg_ParseTuple(args, "s", &path)) return nullptr;
    MemoryFile* f = nullptr;
    Py_BEGIN_ALLOW_THREADS {
        std::unique_lock<std::mutex> g(memfs_lock);
        auto it = memfs_files.find(path);
        if (it != memfs_files.end()) {
            f = it->second;
            memfs_files.erase(it);
            f->idle.wait(g, [f] { return f->inflight == 0; });
        }
    }
    Py_END_ALLOW_THREADS if (f == nullptr) Py_RETURN_NONE;
    PyObject* out = Py_BuildValue("(LLL)", (long long)f->reads.load(), (long long)f->bytes.load(),
                                  (long long)f->errors.load());
    Py_DECREF(reinterpret_cast<PyObject*>(f->core));
    delete f;
    return out;
}

PyObject* memfs_read_address(PyObject*, PyObject*) {
    return PyLong_FromVoidPtr(reinterpret_cast<void*>(&memfs_read));
}

PyMethodDef module_methods[] = {
    {"memfs_register", (PyCFunction)memfs_register, METH_VARARGS,
     "memfs_register(path, core, size, trace_fd): serve FUSE reads of path from core"},
    {"memfs_unregister", (PyCFunction)memfs_unregister, METH_VARARGS,
     "memfs_unregister(path) -> (reads, bytes, errors) | None, once no read uses it"},
    {"memfs_read_address", (PyCFunction)memfs_read_address, METH_NOARGS,
     "address of the libfuse 3 high-level read callback serving registered paths"},
    {"capture_pages", (PyCFunction)capture_pages, METH_VARARGS,
     "a pause's written pages of QEMU's RAM into a layer's data (see the source)"},
    {"set_disk_budget", (PyCFunction)set_disk_budget, METH_VARARGS,
     "set_disk_budget(reserve, grant): the node's disk budget for every core (reserve < 0: off)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef native_module = {PyModuleDef_HEAD_INIT, "_native",
                             "The native serving core of an overlaybd image.", -1,
                             module_methods};

}  // namespace

PyMODINIT_FUNC PyInit__native(void) {
    CoreType.tp_name = "agentenv.storage._native.Core";
    CoreType.tp_basicsize = sizeof(CoreObject);
    CoreType.tp_flags = Py_TPFLAGS_DEFAULT;
    CoreType.tp_doc = "One image's native serving core (see the module source).";
    CoreType.tp_new = Core_new;
    CoreType.tp_dealloc = (destructor)Core_dealloc;
    CoreType.tp_methods = Core_methods;
    CoreType.tp_getset = Core_getset;
    if (PyType_Ready(&CoreType) < 0) return nullptr;
    crc32c_init();
    ChunkMapType.tp_name = "agentenv.storage._native.ChunkMap";
    ChunkMapType.tp_basicsize = sizeof(ChunkMapObject);
    ChunkMapType.tp_flags = Py_TPFLAGS_DEFAULT;
    ChunkMapType.tp_doc = "A chunk cache blob's presence marks, shared with the cores.";
    ChunkMapType.tp_new = ChunkMap_new;
    ChunkMapType.tp_dealloc = (destructor)ChunkMap_dealloc;
    ChunkMapType.tp_methods = ChunkMap_methods;
    ChunkMapType.tp_as_sequence = &ChunkMap_as_sequence;
    ChunkMapType.tp_as_mapping = &ChunkMap_as_mapping;
    if (PyType_Ready(&ChunkMapType) < 0) return nullptr;
    PyObject* m = PyModule_Create(&native_module);
    if (m == nullptr) return nullptr;
    Py_INCREF(&ChunkMapType);
    if (PyModule_AddObject(m, "ChunkMap", reinterpret_cast<PyObject*>(&ChunkMapType)) < 0) {
        Py_DECREF(&ChunkMapType);
        Py_DECREF(m);
        return nullptr;
    }
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", reinterpret_cast<PyObject*>(&CoreType)) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
