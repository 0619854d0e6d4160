/* test_ctl_endpoint.c — where a client looks for the coordinator by default
 * (rekv_client_control_endpoint): the user's own socket ($XDG_RUNTIME_DIR/rekv/control) when a
 * coordinator listens there, else the system service's (/run/rekv/control) when one listens there,
 * else the user's. The system case needs to create /run/rekv: it runs as root where no /run/rekv
 * exists (no deployed service to disturb), and is skipped, saying so, elsewhere. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "coordinator/coordinator.h"
#include "tests/testutil.h"

/* A unix socket listening at path; returns its fd. */
static int listen_at(const char *path)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    ck_assert(strlen(path) < sizeof(sa.sun_path));
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    ck_assert_int_ge(fd, 0);
    ck_assert_msg(bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0, "bind %s: %s", path,
                  strerror(errno));
    ck_assert_int_eq(listen(fd, 4), 0);
    return fd;
}

static char *user_dir(void)
{
    char *d = tu_tmpdir(), p[4096];
    setenv("XDG_RUNTIME_DIR", d, 1);
    snprintf(p, sizeof(p), "%s/rekv", d);
    ck_assert_int_eq(mkdir(p, 0700), 0);
    return d;
}

static void endpoint(char *buf, size_t len)
{
    rekv_err err = {0};
    ck_assert_msg(rekv_client_control_endpoint(buf, len, &err) == 0, "%s", err.msg);
}

/* Nobody listens anywhere: the user's socket, the one `rekv run` would make. */
START_TEST(none_listening_names_the_users)
{
    char *d = user_dir(), want[4200], got[4200];
    snprintf(want, sizeof(want), "ipc://%s/rekv/control", d);
    if (access("/run/rekv/control", F_OK) == 0)
        fprintf(stderr, "   note: /run/rekv/control exists here\n");
    else {
        endpoint(got, sizeof(got));
        ck_assert_str_eq(got, want);
    }
    tu_rmrf(d);
    free(d);
}
END_TEST

/* The user's own coordinator wins, whatever the system runs. */
START_TEST(users_own_first)
{
    char *d = user_dir(), path[4200], want[4300], got[4300];
    snprintf(path, sizeof(path), "%s/rekv/control", d);
    int fd = listen_at(path);
    snprintf(want, sizeof(want), "ipc://%s", path);
    endpoint(got, sizeof(got));
    ck_assert_str_eq(got, want);
    close(fd);
    tu_rmrf(d);
    free(d);
}
END_TEST

/* No coordinator of the user's (a stale socket file included), the system's listening: the
 * system's. */
START_TEST(falls_back_to_the_system_service)
{
    if (geteuid() != 0 || access("/run/rekv", F_OK) == 0) {
        fprintf(stderr, "   skip: needs root and no /run/rekv (a deployed service) to test the "
                        "fallback\n");
        return;
    }
    char *d = user_dir(), stale[4200], got[4300];
    snprintf(stale, sizeof(stale), "%s/rekv/control", d);
    close(listen_at(stale)); /* a socket file nobody listens on, as a killed `rekv run` leaves */
    ck_assert_int_eq(mkdir("/run/rekv", 0750), 0);
    int fd = listen_at("/run/rekv/control");
    endpoint(got, sizeof(got));
    close(fd);
    unlink("/run/rekv/control");
    rmdir("/run/rekv");
    ck_assert_str_eq(got, "ipc:///run/rekv/control");
    tu_rmrf(d);
    free(d);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("ctl_endpoint");
    TCase *tc = tcase_create("ctl_endpoint");
    tcase_add_test(tc, none_listening_names_the_users);
    tcase_add_test(tc, users_own_first);
    tcase_add_test(tc, falls_back_to_the_system_service);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
