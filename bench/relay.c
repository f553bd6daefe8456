/* relay: the cheapest proxy, a floor for bench.gateway's throughput ratio.
 *
 * A TCP relay on loopback: every accepted connection gets one upstream connection of
 * its own, to the replicas given on the command line in turn (round-robin by accept
 * order), and bytes are copied both ways with read and write - no HTTP parsing, no
 * headers added. One thread, epoll (level-triggered), non-blocking sockets with
 * TCP_NODELAY. A pair's bytes that the receiver cannot take yet wait in that side's
 * buffer; the side is not read again until they are written. Either side closing or
 * failing closes both.
 *
 * Usage: relay 127.0.0.1:PORT 127.0.0.1:PORT1 [127.0.0.1:PORT2 ...]
 * PORT 0 takes a free port; the first line on stdout says which ("listening on ...").
 * Every address must be in 127.0.0.0/8: it refuses to start otherwise.
 */
#define _GNU_SOURCE /* accept4 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define BUF 16384
#define MAX_EVENTS 64

struct pair;
struct end {             /* one socket of a pair, and the bytes read from it not yet sent on */
    int fd;
    struct pair *pair;
    size_t off, len;
    char buf[BUF];
};
struct pair {
    struct end side[2];  /* 0: downstream (accepted), 1: upstream (to a replica) */
    int dead;
    struct pair *next_dead;
};

static int ep;

static int parse(const char *text, struct sockaddr_in *addr) {
    char host[64];
    const char *colon = strrchr(text, ':');
    char *rest;
    long port;
    if (!colon || (size_t)(colon - text) >= sizeof host) return -1;
    memcpy(host, text, (size_t)(colon - text));
    host[colon - text] = '\0';
    memset(addr, 0, sizeof *addr);
    addr->sin_family = AF_INET;
    port = strtol(colon + 1, &rest, 10);
    if (inet_pton(AF_INET, host, &addr->sin_addr) != 1 || *rest || rest == colon + 1 ||
        port < 0 || port > 65535)
        return -1;
    if ((ntohl(addr->sin_addr.s_addr) >> 24) != 127) return -2;
    addr->sin_port = htons((unsigned short)port);
    return 0;
}

static struct end *peer(struct end *e) {
    return &e->pair->side[e == &e->pair->side[0]];
}

/* Read from e while its buffer is empty; write to e while its peer's buffer is not. */
static void watch(struct end *e, int op) {
    struct epoll_event ev;
    ev.events = (e->len ? 0 : EPOLLIN) | (peer(e)->len ? EPOLLOUT : 0);
    ev.data.ptr = e;
    if (epoll_ctl(ep, op, e->fd, &ev) < 0 && op == EPOLL_CTL_ADD) perror("epoll_ctl");
}

/* Send from's waiting bytes to its peer: 0 when all went, 1 when some must wait, -1 on error. */
static int flush(struct end *from) {
    struct end *to = peer(from);
    while (from->off < from->len) {
        ssize_t n = write(to->fd, from->buf + from->off, from->len - from->off);
        if (n < 0) return errno == EAGAIN || errno == EINTR ? 1 : -1;
        from->off += (size_t)n;
    }
    from->off = from->len = 0;
    return 0;
}

static void kill_pair(struct pair *p, struct pair **dead) {
    if (p->dead) return;
    p->dead = 1;
    close(p->side[0].fd);
    close(p->side[1].fd);
    p->next_dead = *dead;
    *dead = p;
}

static void nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static void take(int listener, const struct sockaddr_in *ups, int n_ups, unsigned *next) {
    for (;;) {
        int fd = accept4(listener, NULL, NULL, SOCK_NONBLOCK), up;
        struct pair *p;
        if (fd < 0) return; /* EAGAIN: all taken; anything else: try at the next wake-up */
        up = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        p = calloc(1, sizeof *p);
        if (up < 0 || !p ||
            (connect(up, (const struct sockaddr *)&ups[*next % (unsigned)n_ups],
                     sizeof ups[0]) < 0 && errno != EINPROGRESS)) {
            perror("relay: upstream");
            close(fd);
            if (up >= 0) close(up);
            free(p);
            continue;
        }
        ++*next;
        nodelay(fd);
        nodelay(up);  /* bytes written while the connect is under way wait for EPOLLOUT */
        p->side[0].fd = fd;
        p->side[1].fd = up;
        p->side[0].pair = p->side[1].pair = p;
        watch(&p->side[0], EPOLL_CTL_ADD);
        watch(&p->side[1], EPOLL_CTL_ADD);
    }
}

int main(int argc, char **argv) {
    struct sockaddr_in where, *ups;
    struct epoll_event events[MAX_EVENTS], ev;
    socklen_t size = sizeof where;
    unsigned next = 0;
    int listener, one = 1, i;
    if (argc < 3) {
        fprintf(stderr, "usage: %s 127.0.0.1:PORT 127.0.0.1:UPSTREAM...\n", argv[0]);
        return 2;
    }
    ups = calloc((size_t)argc, sizeof *ups);
    if (!ups) return 1;
    for (i = 1; i < argc; i++) {
        int bad = parse(argv[i], i == 1 ? &where : &ups[i - 2]);
        if (bad) {
            fprintf(stderr, "relay: %s: %s\n", argv[i],
                    bad == -2 ? "not a loopback address (127.0.0.0/8 only)" : "not IPv4:PORT");
            return 2;
        }
    }
    signal(SIGPIPE, SIG_IGN);
    listener = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(listener, (struct sockaddr *)&where, sizeof where) < 0 || listen(listener, 512) < 0 ||
        getsockname(listener, (struct sockaddr *)&where, &size) < 0) {
        perror("relay: listen");
        return 1;
    }
    printf("listening on 127.0.0.1:%d\n", ntohs(where.sin_port));
    fflush(stdout);
    if ((ep = epoll_create1(0)) < 0) {
        perror("relay: epoll");
        return 1;
    }
    ev.events = EPOLLIN;
    ev.data.ptr = NULL;
    epoll_ctl(ep, EPOLL_CTL_ADD, listener, &ev);
    for (;;) {
        struct pair *dead = NULL;
        int n = epoll_wait(ep, events, MAX_EVENTS, -1);
        for (i = 0; i < n; i++) {
            struct end *e = events[i].data.ptr;
            if (!e) {
                take(listener, ups, argc - 2, &next);
                continue;
            }
            if (e->pair->dead) continue;
            if (events[i].events & EPOLLOUT) { /* the peer's waiting bytes may go now */
                int r = flush(peer(e));
                if (r < 0) { kill_pair(e->pair, &dead); continue; }
                if (r == 0) { watch(e, EPOLL_CTL_MOD); watch(peer(e), EPOLL_CTL_MOD); }
            }
            if (events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) {
                ssize_t got;
                int r;
                if (e->len) { kill_pair(e->pair, &dead); continue; } /* error, bytes waiting */
                got = read(e->fd, e->buf, BUF);
                if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
                if (got <= 0) { kill_pair(e->pair, &dead); continue; }
                e->len = (size_t)got;
                r = flush(e);
                if (r < 0) { kill_pair(e->pair, &dead); continue; }
                if (r > 0) { watch(e, EPOLL_CTL_MOD); watch(peer(e), EPOLL_CTL_MOD); }
            }
        }
        while (dead) {
            struct pair *p = dead;
            dead = p->next_dead;
            free(p);
        }
    }
}
