/* 4 KiB O_DIRECT I/O at queue depth 1 on a block device, for bench/disk_bus_bench.py (run
 * inside the test guest, which has no fio): diskio MODE DEVICE COUNT SPAN_MIB, MODE one of
 * seqread seqwrite randread randwrite. Prints "MODE IOPS". */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: diskio seqread|seqwrite|randread|randwrite DEVICE COUNT SPAN_MIB\n");
        return 2;
    }
    const char *mode = argv[1];
    int write_mode = strstr(mode, "write") != NULL, random_mode = strncmp(mode, "rand", 4) == 0;
    long count = atol(argv[3]), blocks = atol(argv[4]) * 256;
    int fd = open(argv[2], (write_mode ? O_WRONLY : O_RDONLY) | O_DIRECT);
    if (fd < 0 || count <= 0 || blocks <= 0) {
        perror(argv[2]);
        return 1;
    }
    void *buf;
    if (posix_memalign(&buf, 4096, 4096)) return 1;
    memset(buf, 0x5a, 4096);
    unsigned long x = 88172645463325252UL; /* xorshift: the same offsets for every run */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < count; i++) {
        long block = i % blocks;
        if (random_mode) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            block = (long)(x % (unsigned long)blocks);
        }
        ssize_t n = write_mode ? pwrite(fd, buf, 4096, block * 4096L) : pread(fd, buf, 4096, block * 4096L);
        if (n != 4096) {
            perror(mode);
            return 1;
        }
    }
    if (write_mode && fdatasync(fd)) {
        perror("fdatasync");
        return 1;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    printf("%s %.0f\n", mode, (double)count / s);
    return 0;
}
