/* redis_fixture.h — a real redis-server for a test: started on a free port with its own
** temporary directory (no persistence), stopped, restarted on the same port, frozen (SIGSTOP)
** and thawed.  Tests skip with a message when redis-server is not installed
** (scripts/bootstrap.sh installs it). */
#ifndef KVT_TEST_REDIS_FIXTURE_H
#define KVT_TEST_REDIS_FIXTURE_H

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

struct rfx {
    pid_t pid;
    int port;
    char dir[64];
    char url[64];
    char unix_url[128]; /* unix://DIR/redis.sock */
    char sock[96];
    char maxmemory[32]; /* "" = none; else with maxmemory-policy noeviction */
};

static inline int rfx_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *) &a, sizeof a) || getsockname(fd, (struct sockaddr *) &a, &len)) {
        if (fd >= 0) close(fd);
        return -1;
    }
    close(fd);
    return ntohs(a.sin_port);
}

static inline redisContext *rfx_connect(const struct rfx *r) {
    struct timeval tv = { 2, 0 };
    redisContext *c = redisConnectWithTimeout("127.0.0.1", r->port, tv);
    if (c && c->err) {
        redisFree(c);
        return NULL;
    }
    return c;
}

/* Start (or restart on the same port).  Returns 0, 1 if redis-server is not installed, -1 on
** failure (it never answered PING within 5 s). */
static inline int rfx_start(struct rfx *r) {
    if (!r->dir[0]) {
        strcpy(r->dir, "/tmp/kvt-test-redis-XXXXXX");
        if (!mkdtemp(r->dir)) return -1;
    }
    if (!r->port && (r->port = rfx_free_port()) < 0) return -1;
    snprintf(r->url, sizeof r->url, "redis://127.0.0.1:%d/0", r->port);
    snprintf(r->sock, sizeof r->sock, "%s/redis.sock", r->dir);
    snprintf(r->unix_url, sizeof r->unix_url, "unix://%s", r->sock);
    char port[16];
    snprintf(port, sizeof port, "%d", r->port);
    char *argv[28];
    int a = 0;
    argv[a++] = "redis-server";
    argv[a++] = "--port";
    argv[a++] = port;
    argv[a++] = "--bind";
    argv[a++] = "127.0.0.1";
    argv[a++] = "--dir";
    argv[a++] = r->dir;
    argv[a++] = "--save";
    argv[a++] = "";
    argv[a++] = "--appendonly";
    argv[a++] = "no";
    argv[a++] = "--logfile";
    argv[a++] = "redis.log";
    argv[a++] = "--unixsocket";
    argv[a++] = r->sock;
    if (r->maxmemory[0]) {
        argv[a++] = "--maxmemory";
        argv[a++] = r->maxmemory;
        argv[a++] = "--maxmemory-policy";
        argv[a++] = "noeviction";
    }
    argv[a] = NULL;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    int err = posix_spawnp(&r->pid, "redis-server", &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (err == ENOENT) return 1;
    if (err) return -1;
    for (int i = 0; i < 500; i++) {
        redisContext *c = rfx_connect(r);
        if (c) {
            redisReply *rep = redisCommand(c, "PING");
            bool ok = rep && rep->type == REDIS_REPLY_STATUS;
            if (rep) freeReplyObject(rep);
            redisFree(c);
            if (ok) return 0;
        }
        usleep(10000);
    }
    return -1;
}

static inline void rfx_stop(struct rfx *r) {
    if (r->pid <= 0) return;
    kill(r->pid, SIGCONT);
    kill(r->pid, SIGKILL);
    waitpid(r->pid, NULL, 0);
    r->pid = 0;
}

static inline void rfx_cleanup(struct rfx *r) {
    rfx_stop(r);
    if (r->dir[0]) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", r->dir);
        if (system(cmd)) {}
    }
}

/* Run a command on a fresh connection; returns the reply (caller frees) or NULL. */
static inline redisReply *rfx_cmd(const struct rfx *r, const char *fmt, ...) {
    redisContext *c = rfx_connect(r);
    if (!c) return NULL;
    va_list ap;
    va_start(ap, fmt);
    redisReply *rep = redisvCommand(c, fmt, ap);
    va_end(ap);
    redisFree(c);
    return rep;
}

static inline double rfx_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

#endif
