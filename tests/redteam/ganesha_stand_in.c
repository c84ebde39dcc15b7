/* A stand-in for a ganesha taken over by a guest (tests/redteam/test_nfs_server_escape.py):
 * NfsServer starts it in ganesha's place, so it runs exactly as ganesha would (its jail, PID
 * namespace, capabilities, no_new_privs, seccomp filter, cgroup, argv and environment). It
 * reads its port and address from the configuration ganesha would read (-f FILE), listens
 * there as ganesha does, and runs one command a line from whoever connects:
 *
 *   tcp ADDR PORT          connect over TCP                      -> ok | errno
 *   abstract NAME          connect to an abstract unix socket    -> ok | errno
 *   bindabstract NAME      bind an abstract unix socket (kept)   -> ok | errno
 *   handle ROOT TYPE HEX   open_by_handle_at (ROOT: pidfs, nsfs or a path) -> opened | errno
 *   append PATH            open O_WRONLY|O_APPEND and write      -> ok | errno
 *   io_uring               io_uring_setup (kept open)            -> ok | errno
 *
 * errno as its number. Nothing but libc. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#ifndef FD_PIDFS_ROOT
#define FD_PIDFS_ROOT -10002
#endif
#ifndef FD_NSFS_ROOT
#define FD_NSFS_ROOT -10003
#endif

static void reply(int c, const char *text) {
    char line[256];
    int n = snprintf(line, sizeof line, "%s\n", text);
    (void)!write(c, line, n);
}

static void reply_errno(int c, int err) {
    char text[32];
    snprintf(text, sizeof text, "%d", err);
    reply(c, text);
}

static int abstract_addr(const char *name, struct sockaddr_un *a, socklen_t *len) {
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    size_t n = strlen(name);
    if (n + 1 > sizeof a->sun_path) return -1;
    memcpy(a->sun_path + 1, name, n);
    *len = offsetof(struct sockaddr_un, sun_path) + 1 + n;
    return 0;
}

static void command(int c, char *line) {
    char *verb = strtok(line, " \r\n");
    if (!verb) { reply(c, "?"); return; }
    if (!strcmp(verb, "tcp")) {
        char *addr = strtok(NULL, " \r\n"), *port = strtok(NULL, " \r\n");
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(port))};
        inet_pton(AF_INET, addr, &a.sin_addr);
        int s = socket(AF_INET, SOCK_STREAM, 0);
        if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) != 0) reply_errno(c, errno);
        else reply(c, "ok");
        if (s >= 0) close(s);
    } else if (!strcmp(verb, "abstract") || !strcmp(verb, "bindabstract")) {
        struct sockaddr_un a;
        socklen_t len = 0;
        abstract_addr(strtok(NULL, " \r\n"), &a, &len);
        int s = socket(AF_UNIX, SOCK_STREAM, 0);
        int r = verb[0] == 'a' ? connect(s, (struct sockaddr *)&a, len)
                               : bind(s, (struct sockaddr *)&a, len);
        if (s < 0 || r != 0) reply_errno(c, errno);
        else reply(c, "ok");
        if (s >= 0 && verb[0] == 'a') close(s);  /* a bound one is kept */
    } else if (!strcmp(verb, "handle")) {
        char *root = strtok(NULL, " \r\n"), *type = strtok(NULL, " \r\n");
        char *hex = strtok(NULL, " \r\n");
        size_t n = strlen(hex) / 2;
        struct file_handle *h = calloc(1, sizeof *h + n);
        h->handle_bytes = n;
        h->handle_type = atoi(type);
        for (size_t i = 0; i < n; i++) sscanf(hex + 2 * i, "%2hhx", &h->f_handle[i]);
        int mount_fd = !strcmp(root, "pidfs") ? FD_PIDFS_ROOT
                     : !strcmp(root, "nsfs") ? FD_NSFS_ROOT
                     : open(root, O_RDONLY | O_DIRECTORY);
        int fd = open_by_handle_at(mount_fd, h, O_RDONLY);
        if (fd < 0) reply_errno(c, errno);
        else { reply(c, "opened"); close(fd); }
        if (mount_fd >= 0) close(mount_fd);
        free(h);
    } else if (!strcmp(verb, "append")) {
        int fd = open(strtok(NULL, " \r\n"), O_WRONLY | O_APPEND);
        if (fd < 0 || write(fd, "#\n", 2) != 2) reply_errno(c, errno);
        else reply(c, "ok");
        if (fd >= 0) close(fd);
    } else if (!strcmp(verb, "io_uring")) {
        unsigned char params[120] = {0};  /* struct io_uring_params */
        long fd = syscall(425 /* io_uring_setup */, 8, params);
        if (fd < 0) reply_errno(c, errno);
        else reply(c, "ok");
    } else {
        reply(c, "?");
    }
}

static void end(int sig) { (void)sig; _exit(0); }

int main(int argc, char **argv) {
    signal(SIGTERM, end);  /* PID 1 of its namespace: no default action */
    const char *conf = NULL;
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "-f")) conf = argv[i + 1];
    FILE *f = conf ? fopen(conf, "r") : NULL;
    if (!f) { perror("config"); return 2; }
    char line[512], addr[64] = "0.0.0.0";
    int port = 0;
    while (fgets(line, sizeof line, f)) {
        sscanf(line, " NFS_Port = %d;", &port);
        sscanf(line, " Bind_addr = %63[0-9.];", addr);
    }
    fclose(f);
    int s = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, addr, &a.sin_addr);
    if (bind(s, (struct sockaddr *)&a, sizeof a) != 0 || listen(s, 8) != 0) {
        perror("listen");
        return 2;
    }
    for (;;) {
        int c = accept(s, NULL, NULL);
        if (c < 0) continue;
        FILE *in = fdopen(c, "r");
        while (fgets(line, sizeof line, in)) command(c, line);
        fclose(in);
    }
}
