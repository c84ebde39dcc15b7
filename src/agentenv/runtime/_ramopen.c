/* Loaded into QEMU with LD_PRELOAD (runtime/qemu.py, "The RAM file is read-only to QEMU"):
 * QEMU opens its guest RAM file read-write when free-page reporting may discard pages
 * (`readonly=off`; with `readonly=on` it refuses every discard), though it never writes it:
 * it maps it MAP_PRIVATE and the jail's seccomp filter turns the one write-like call it makes,
 * fallocate(PUNCH_HOLE), into a no-op. A RAM file is shared: by every VM of a snapshot (one
 * page cache) and by every boot of a size (the zero file). So the open of exactly the file
 * named by AENV_RAM_FILE is made read-only here: QEMU holds no descriptor that could write it,
 * whatever code it later runs, and the file's mode and the jail's read-only bind refuse a new
 * writable open. Everything else is passed through unchanged. Not a Python module: no PyInit. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

static const char *ram_file(void) {
    static const char *name;
    static int looked;
    if (!looked) {
        name = getenv("AENV_RAM_FILE");
        looked = 1;
    }
    return name;
}

static int read_only(const char *path, int flags) {
    const char *name = ram_file();
    if (name == NULL || path == NULL || strcmp(path, name) != 0) return flags;
    return (flags & ~O_ACCMODE) | O_RDONLY;
}

static mode_t mode_of(int flags, va_list ap) {
    return (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE ? va_arg(ap, mode_t) : 0;
}

#define FORWARD_OPEN(fn)                                                          \
    int fn(const char *path, int flags, ...) {                                    \
        static int (*real)(const char *, int, ...);                               \
        va_list ap;                                                               \
        va_start(ap, flags);                                                      \
        mode_t mode = mode_of(flags, ap);                                         \
        va_end(ap);                                                               \
        if (!real) real = (int (*)(const char *, int, ...))dlsym(RTLD_NEXT, #fn); \
        return real(path, read_only(path, flags), mode);                          \
    }

#define FORWARD_OPENAT(fn)                                                             \
    int fn(int dirfd, const char *path, int flags, ...) {                              \
        static int (*real)(int, const char *, int, ...);                               \
        va_list ap;                                                                    \
        va_start(ap, flags);                                                           \
        mode_t mode = mode_of(flags, ap);                                              \
        va_end(ap);                                                                    \
        if (!real) real = (int (*)(int, const char *, int, ...))dlsym(RTLD_NEXT, #fn); \
        return real(dirfd, path, read_only(path, flags), mode);                        \
    }

#define FORWARD_OPEN_2(fn)                                                           \
    int fn(const char *path, int flags) {                                            \
        static int (*real)(const char *, int);                                       \
        if (!real) real = (int (*)(const char *, int))dlsym(RTLD_NEXT, #fn);         \
        return real(path, read_only(path, flags));                                   \
    }

FORWARD_OPEN(open)
FORWARD_OPEN(open64)
FORWARD_OPENAT(openat)
FORWARD_OPENAT(openat64)
FORWARD_OPEN_2(__open_2)
FORWARD_OPEN_2(__open64_2)
