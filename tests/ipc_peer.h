/* ipc_peer.h — the other process of the IPC tests (test_ipc on the cpu backend, test_cuda on
 * cuda). `test_ipc --peer BACKEND SOCKET_FD FLAG_FD` plays the transfer engine of the push path,
 * written against backend.h only, one step per message over a SOCK_SEQPACKET socket; FLAG_FD is
 * a memfd page both processes map, whose first word is the flag. It is a program run with exec,
 * not a fork of the test: a process that has used CUDA must not fork and use CUDA again. */
#ifndef REKV_TESTS_IPC_PEER_H
#define REKV_TESTS_IPC_PEER_H

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpuworker/device/backend.h"

#define PEER_FLAG_BYTES 4096u

typedef enum peer_op {
    /* import buf and ev; enqueue delay_ms of other work, the pattern's copy into buf and a
     * record of ev; reply at once (the work still running), and again once it is done */
    PEER_PUSH_EVENT = 1,
    /* import buf; copy the pattern in, then write flag_value to the flag; reply when done */
    PEER_PUSH_FLAG = 2,
    /* import buf and ev, reply, and wait to be killed */
    PEER_HOLD = 3,
    /* export a buffer of `bytes` holding the pattern, and an event; reply with their handles;
     * they live until PEER_QUIT */
    PEER_EXPORT = 4,
    PEER_QUIT = 5,
} peer_op;

typedef struct peer_msg {
    uint32_t op;         /* peer_op */
    uint32_t seed;       /* the pattern: peer_pattern(seed, i) */
    uint32_t delay_ms;   /* PEER_PUSH_EVENT */
    uint32_t flag_value; /* PEER_PUSH_FLAG */
    uint64_t bytes;      /* buf's size */
    rekv_ipc_handle buf; /* a buffer's handle (to the peer, or back from PEER_EXPORT) */
    rekv_ipc_handle ev;  /* an event's handle */
    int32_t rc;          /* reply: 0 or a negative errno */
    char msg[1024];      /* reply: the error */
} peer_msg;

typedef struct peer {
    pid_t pid;
    int sock; /* the test's end */
} peer;

static inline uint8_t peer_pattern(uint32_t seed, size_t i)
{
    return (uint8_t)(seed * 29u + i * 131u + (i >> 9) * 7u);
}

/* A page of shared memory (memfd, inherited by the peer) whose first word is the flag. */
static inline int peer_flag_create(uint32_t **flag)
{
    int fd = (int)syscall(SYS_memfd_create, "test-ipc-flag", 0u); /* kept across exec */
    ck_assert_msg(fd >= 0, "memfd_create: %s", strerror(errno));
    ck_assert_int_eq(ftruncate(fd, PEER_FLAG_BYTES), 0);
    *flag = mmap(NULL, PEER_FLAG_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ck_assert(*flag != MAP_FAILED);
    return fd;
}

/* Runs `exe --peer backend FD FLAG_FD`. */
static inline void peer_start(peer *p, const char *exe, const char *backend, int flag_fd)
{
    int sv[2];
    char sfd[16], ffd[16];
    ck_assert_msg(access(exe, X_OK) == 0, "peer program %s: %s", exe, strerror(errno));
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    snprintf(sfd, sizeof(sfd), "%d", sv[1]);
    snprintf(ffd, sizeof(ffd), "%d", flag_fd);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        fcntl(sv[1], F_SETFD, 0); /* the peer's end survives exec */
        execl(exe, exe, "--peer", backend, sfd, ffd, (char *)NULL);
        _exit(127);
    }
    close(sv[1]);
    p->pid = pid;
    p->sock = sv[0];
}

static inline void peer_send(peer *p, const peer_msg *m)
{
    ck_assert_int_eq(send(p->sock, m, sizeof(*m), MSG_NOSIGNAL), (ssize_t)sizeof(*m));
}

/* The peer's next reply, within 30 s. */
static inline void peer_recv(peer *p, peer_msg *m)
{
    struct pollfd pf = {.fd = p->sock, .events = POLLIN};
    ck_assert_msg(poll(&pf, 1, 30000) == 1, "the peer did not answer within 30 s");
    ck_assert_msg(recv(p->sock, m, sizeof(*m), 0) == (ssize_t)sizeof(*m),
                  "the peer closed its socket (it died?)");
}

/* Sends m and waits for the reply, which must be a success. */
static inline void peer_call(peer *p, peer_msg *m)
{
    peer_send(p, m);
    peer_recv(p, m);
    ck_assert_msg(m->rc == 0, "peer: %s", m->msg);
}

/* Asks the peer to quit; it must exit 0. */
static inline void peer_stop(peer *p)
{
    peer_msg m = {.op = PEER_QUIT};
    int st = 0;
    peer_send(p, &m);
    ck_assert_int_eq(waitpid(p->pid, &st, 0), p->pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "peer exit status 0x%x", st);
    close(p->sock);
}

static inline void peer_kill(peer *p)
{
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    close(p->sock);
}

#endif
