// Does a helper thread the caller never waits for beat OpenMP's team on CPUs that busy loops share?
// A probe for threads beside one busy loop per CPU, not engine code.
//
// The work: steps of LAYERS float32 matrix-vector products (ROWS x COLS, the default model's
// 576-wide shapes), each product's rows cut into CHUNKS. Modes:
//   one     one thread does every chunk
//   omp     an OpenMP team of 2, rows split statically, the region's end a barrier (what at::parallel_for
//           does): a team thread descheduled by a busy loop holds the other at the barrier
//   dynamic the same team, chunks handed out dynamically: a late thread's chunks go to the other, but
//           the barrier still waits for it to arrive
//   helper  the caller and one helper take chunks from a shared counter; the caller waits only for
//           chunks the helper has taken and not finished (a helper that has not woken takes none),
//           never for the helper to arrive
// Prints steps per second of each mode, run in turn, ROUNDS times.
//
//   g++ -O2 -march=native -fopenmp -pthread -o /tmp/optional_helper benchmarks/threads/optional_helper.cpp
//   /tmp/optional_helper [seconds per run] [rounds]
#include <omp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

constexpr int ROWS = 1536, COLS = 576, LAYERS = 30, CHUNKS = 48;

static std::vector<float> W(static_cast<size_t>(ROWS) * COLS), X(COLS), Y(ROWS);

static void rows(int r0, int r1) {
    for (int r = r0; r < r1; ++r) {
        const float* w = &W[static_cast<size_t>(r) * COLS];
        float s = 0;
        for (int c = 0; c < COLS; ++c) s += w[c] * X[c];
        Y[r] = s;
    }
}

static void chunk(int i) { rows(i * ROWS / CHUNKS, (i + 1) * ROWS / CHUNKS); }

struct Helper {  // one helper thread; jobs are one product each
    std::atomic<int> next{CHUNKS}, done{CHUNKS};
    std::atomic<unsigned> generation{0};
    std::atomic<bool> stop{false};
    std::mutex m;
    std::condition_variable cv;
    std::thread t;

    Helper() : t([this] { loop(); }) {}
    ~Helper() {
        stop = true;
        {
            std::lock_guard<std::mutex> lock(m);
            generation.fetch_add(1);
        }
        cv.notify_one();
        t.join();
    }
    void take_all() {  // whoever calls: take chunks until none is left
        for (int i; (i = next.fetch_add(1)) < CHUNKS;) {
            chunk(i);
            done.fetch_add(1, std::memory_order_release);
        }
    }
    void loop() {
        unsigned seen = 0;
        while (!stop) {
            for (int spin = 0; generation.load() == seen && spin < 20000; ++spin) {}  // spin a little
            if (generation.load() == seen) {
                std::unique_lock<std::mutex> lock(m);
                cv.wait(lock, [&] { return generation.load() != seen; });
            }
            seen = generation.load();
            take_all();
        }
    }
    void run() {  // one product: publish, work, wait only for chunks taken and not done
        done.store(0);
        next.store(0);
        {
            std::lock_guard<std::mutex> lock(m);  // so a helper about to sleep cannot miss it
            generation.fetch_add(1);
        }
        cv.notify_one();
        take_all();
        while (done.load(std::memory_order_acquire) < CHUNKS) {}
    }
};

static double steps_per_second(const char* mode, double seconds, Helper* helper) {
    auto start = std::chrono::steady_clock::now();
    long steps = 0;
    for (;;) {
        for (int l = 0; l < LAYERS; ++l) {
            if (mode[0] == 'o' && mode[1] == 'n') {
                rows(0, ROWS);
            } else if (mode[0] == 'o') {
#pragma omp parallel for num_threads(2) schedule(static)
                for (int i = 0; i < CHUNKS; ++i) chunk(i);
            } else if (mode[0] == 'd') {
#pragma omp parallel for num_threads(2) schedule(dynamic, 1)
                for (int i = 0; i < CHUNKS; ++i) chunk(i);
            } else {
                helper->run();
            }
        }
        ++steps;
        double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (t >= seconds) return steps / t;
    }
}

int main(int argc, char** argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 3.0;
    int rounds = argc > 2 ? atoi(argv[2]) : 3;
    for (size_t i = 0; i < W.size(); ++i) W[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.0f;
    for (int i = 0; i < COLS; ++i) X[i] = 1.0f / (1 + i);
    Helper helper;
    const char* modes[] = {"one", "omp", "dynamic", "helper"};
    for (int r = 0; r < rounds; ++r) {
        for (const char* mode : modes) {
            printf("round %d %-8s %8.1f steps/s\n", r + 1, mode, steps_per_second(mode, seconds, &helper));
            fflush(stdout);
        }
    }
    return 0;
}
