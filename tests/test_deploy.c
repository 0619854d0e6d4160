/* test_deploy.c — the deploy/ files are accepted by their tools: `systemd-analyze verify` on the
 * three units (ExecStart pointed at the freshly built binaries, since verify checks that they
 * exist), and `docker compose config` on the compose file; each unit's exposure by
 * `systemd-analyze security --offline=yes` is at most 4 and it runs as the rekv user with its
 * state directories; `make install DESTDIR=... PREFIX=...` installs the programs, the cuda
 * backend's object where the installed programs find it (PREFIX/lib/rekv, with CUDA), the units
 * pointed at them, the sysusers.d user and the environment file's example; the compose file gives
 * every service a `rekv status` healthcheck, the image carries the cuda backend's object beside
 * its programs, and .dockerignore keeps build outputs out of the image's context; and the
 * installed units boot under a real systemd in a virtual machine (systemd_boot). A part whose
 * tool is missing or cannot run here is skipped with a message saying so; what can be checked
 * from the files alone always is. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/metrics_scrape.h"
#include "tests/testutil.h"

static const char *const units[] = {"rekv-kvstore", "rekv-gpuworker", "rekv-coordinator"};

START_TEST(systemd_units_verify)
{
    if (tu_run("command -v systemd-analyze >/dev/null 2>&1", NULL) != 0) {
        fprintf(stderr, "   skip: systemd-analyze is not installed\n");
        return;
    }
    char *dir = tu_tmpdir();
    char cwd[2048];
    ck_assert_ptr_nonnull(getcwd(cwd, sizeof(cwd)));
    char bindir[4096];
    snprintf(bindir, sizeof(bindir), "%s/%s", cwd, tu_bin(""));
    char cmd[16384];
    size_t off = (size_t)snprintf(cmd, sizeof(cmd), "systemd-analyze verify");
    for (size_t i = 0; i < 3; i++) {
        char src[256], dst[4200];
        snprintf(src, sizeof(src), "deploy/systemd/%s.service", units[i]);
        snprintf(dst, sizeof(dst), "%s/%s.service", dir, units[i]);
        char *text = tu_read_file(src, NULL);
        ck_assert_msg(text != NULL, "%s is missing", src);
        ck_assert_msg(strstr(text, "Type=notify") && strstr(text, "Restart=on-failure") &&
                          strstr(text, "EnvironmentFile=-/etc/rekv/rekv.env") &&
                          strstr(text, "RuntimeDirectory=rekv"),
                      "%s lacks a required setting", src);
        FILE *f = fopen(dst, "w");
        ck_assert_ptr_nonnull(f);
        for (char *p = text; *p;) {
            char *hit = strstr(p, "/usr/bin/");
            if (hit == NULL) {
                fputs(p, f);
                break;
            }
            fwrite(p, 1, (size_t)(hit - p), f);
            fputs(bindir, f);
            p = hit + strlen("/usr/bin/");
        }
        fclose(f);
        free(text);
        off += (size_t)snprintf(cmd + off, sizeof(cmd) - off, " '%s'", dst);
    }
    snprintf(cmd + off, sizeof(cmd) - off, " 2>&1");
    char *out = NULL;
    int rc = tu_run(cmd, &out);
    if (rc != 0 && strstr(out, "Failed to") && strstr(out, "bus")) {
        fprintf(stderr, "   skip: systemd-analyze cannot run here: %s\n", out);
    } else {
        ck_assert_msg(rc == 0, "systemd-analyze verify failed:\n%s", out);
        ck_assert_msg(strstr(out, "rekv") == NULL, "systemd-analyze verify complains:\n%s", out);
    }
    free(out);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

START_TEST(compose_config)
{
    const char *tool = NULL;
    if (tu_run("docker compose version >/dev/null 2>&1", NULL) == 0)
        tool = "docker compose";
    else if (tu_run("docker-compose version >/dev/null 2>&1", NULL) == 0)
        tool = "docker-compose";
    if (tool == NULL) {
        ck_assert_msg(!tu_ci(), "neither `docker compose` nor docker-compose can run (CI=true)");
        fprintf(stderr, "   skip: neither `docker compose` nor docker-compose can run here "
                        "(deploy/debian-test-packages.txt installs the latter)\n");
        return;
    }
    static const char *const files[] = {"deploy/docker-compose.yml",
                                         "deploy/docker-compose.replicas.yml"};
    for (int i = 0; i < 2; i++) {
        char cmd[512], *out = NULL;
        snprintf(cmd, sizeof(cmd), "%s -f %s config -q 2>&1", tool, files[i]);
        int rc = tu_run(cmd, &out);
        ck_assert_msg(rc == 0, "%s config rejects %s:\n%s", tool, files[i], out);
        free(out);
    }
}
END_TEST

/* Each unit: the rekv user, no capabilities, the hardening the score rests on, its state
 * directories (the kvstore's spill directory, the coordinator's journal), the worker's GPU device
 * ACL; and, where systemd-analyze can score offline, an exposure of at most 4. */
START_TEST(systemd_units_hardened)
{
    static const char *const common[] = {"User=rekv",
                                         "CapabilityBoundingSet=\n",
                                         "NoNewPrivileges=yes",
                                         "ProtectSystem=strict",
                                         "ProtectHome=yes",
                                         "PrivateTmp=yes",
                                         "RestrictAddressFamilies=",
                                         "SystemCallFilter=@system-service",
                                         "Group=rekv",
                                         /* the rekv group reaches the control socket */
                                         "RuntimeDirectoryMode=0750\n",
                                         "LimitMEMLOCK=infinity"};
    /* each serves its metrics on loopback: TCP to localhost only (no private network: the host's
     * Prometheus must reach it) */
    static const char *const own[3][5] = {
        {"StateDirectory=rekv/spill", "--spill-dir ${REKV_SPILL_DIR}", "IPAddressAllow=localhost",
         "IPAddressDeny=any", "--metrics ${REKV_KVSTORE_METRICS}"},
        {"DevicePolicy=closed", "DeviceAllow=char-nvidia-frontend rw",
         "DeviceAllow=char-nvidia-uvm rw", "IPAddressAllow=localhost",
         "--metrics ${REKV_GPUWORKER_METRICS}"},
        {"StateDirectory=rekv/journal", "IPAddressAllow=localhost", "MemoryDenyWriteExecute=yes",
         "IPAddressDeny=any", "--metrics ${REKV_METRICS}"}};
    for (size_t i = 0; i < 3; i++) {
        char src[256];
        snprintf(src, sizeof(src), "deploy/systemd/%s.service", units[i]);
        char *text = tu_read_file(src, NULL);
        ck_assert_msg(text != NULL, "%s is missing", src);
        for (size_t k = 0; k < sizeof(common) / sizeof(common[0]); k++)
            if (k + 1 < sizeof(common) / sizeof(common[0]) || i != 2)
                ck_assert_msg(strstr(text, common[k]), "%s lacks %s", src, common[k]);
        for (size_t k = 0; k < 5; k++)
            ck_assert_msg(strstr(text, own[i][k]), "%s lacks %s", src, own[i][k]);
        ck_assert_msg(strstr(text, "REKV_SPILL_DIR=/var/lib/rekv/spill") || i != 0,
                      "%s: the spill directory is not its StateDirectory", src);
        free(text);
    }
    if (tu_run("command -v systemd-analyze >/dev/null 2>&1", NULL) != 0) {
        fprintf(stderr, "   skip: the exposure scores: systemd-analyze is not installed\n");
        return;
    }
    for (size_t i = 0; i < 3; i++) {
        char cmd[512], *out = NULL, want[128];
        snprintf(cmd, sizeof(cmd),
                 "systemd-analyze security --offline=yes deploy/systemd/%s.service 2>&1", units[i]);
        int rc = tu_run(cmd, &out);
        snprintf(want, sizeof(want), "Overall exposure level for %s.service: ", units[i]);
        const char *at = strstr(out, want);
        if (at == NULL && strstr(out, "offline")) { /* systemd < 250: no --offline */
            fprintf(stderr, "   skip: this systemd-analyze cannot score a unit file offline: %s\n",
                    out);
            free(out);
            return;
        }
        ck_assert_msg(at != NULL, "systemd-analyze security (exit %d) gave no score:\n%s", rc, out);
        double score = strtod(at + strlen(want), NULL);
        ck_assert_msg(score <= 4.0, "%s.service: exposure %.1f > 4:\n%s", units[i], score, out);
        fprintf(stderr, "   %s.service: exposure %.1f\n", units[i], score);
        free(out);
    }
}
END_TEST

/* `make install` into a staging DESTDIR with a PREFIX: every program, runnable; the units with
 * ExecStart in PREFIX/bin; the rekv user; the environment file's example. */
START_TEST(make_install)
{
    if (tu_run("command -v make >/dev/null 2>&1", NULL) != 0) {
        fprintf(stderr, "   skip: make is not installed\n");
        return;
    }
    char *d = tu_tmpdir(), cmd[8192], path[4600], *out = NULL;
    const char *build = getenv("REKV_BUILD");
    /* the build is up to date (this test's programs are it); nothing but the install runs. The
     * outer make's jobserver is not ours. */
    snprintf(cmd, sizeof(cmd),
             "env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s install BUILD='%s' DESTDIR='%s' "
             "PREFIX=/opt/rekv SYSCONFDIR=/etc 2>&1",
             build && *build ? build : "build", d);
    int rc = tu_run(cmd, &out);
    ck_assert_msg(rc == 0, "make install failed:\n%s", out);
    free(out);
    const char *progs[] = {"rekv", "rekv-kvstore", "rekv-gpuworker", "rekv-coordinator",
                           "rekv-loader"};
    for (size_t i = 0; i < 5; i++) {
        snprintf(path, sizeof(path), "%s/opt/rekv/bin/%s", d, progs[i]);
        ck_assert_msg(access(path, X_OK) == 0, "make install did not install %s", path);
    }
    snprintf(cmd, sizeof(cmd), "'%s/opt/rekv/bin/rekv' --version", d);
    ck_assert_msg(tu_run(cmd, NULL) == 0, "the installed rekv does not run");
#if REKV_CUDA
    /* the installed CLI finds the installed object: `--backend cuda` gets as far as looking for
     * a GPU (runs where there is one) */
    snprintf(path, sizeof(path), "%s/opt/rekv/lib/rekv/librekv_cuda.so", d);
    ck_assert_msg(access(path, R_OK) == 0, "make install did not install %s", path);
    snprintf(cmd, sizeof(cmd),
             "'%s/opt/rekv/bin/rekv-loader' synth --arch llama --layers 1 --hidden 32 --heads 2 "
             "--ffn 64 --vocab 64 --max-pos 64 --dtype f32 '%s/m' >/dev/null && "
             "env -u REKV_CUDA_LIBRARY '%s/opt/rekv/bin/rekv' generate --local --backend cuda "
             "--model '%s/m' --prompt-ids 1,2 --max-new-tokens 2 --ignore-eos 2>&1",
             d, d, d, d);
    rc = tu_run(cmd, &out);
    ck_assert_msg(rc == 0 || strstr(out, "no CUDA device"),
                  "the installed rekv did not load its cuda backend (exit %d):\n%s", rc, out);
    free(out);
#endif
    for (size_t i = 0; i < 3; i++) {
        snprintf(path, sizeof(path), "%s/opt/rekv/lib/systemd/system/%s.service", d, units[i]);
        char *text = tu_read_file(path, NULL), want[256];
        ck_assert_msg(text != NULL, "make install did not install %s", path);
        snprintf(want, sizeof(want), "ExecStart=/opt/rekv/bin/%s ", units[i]);
        ck_assert_msg(strstr(text, want) && !strstr(text, "/usr/bin/"),
                      "%s: ExecStart does not point at PREFIX/bin", path);
        free(text);
    }
    const char *files[] = {"opt/rekv/lib/sysusers.d/rekv.conf", "etc/rekv/rekv.env.example"};
    for (size_t i = 0; i < 2; i++) {
        snprintf(path, sizeof(path), "%s/%s", d, files[i]);
        ck_assert_msg(access(path, R_OK) == 0, "make install did not install %s", path);
    }
    tu_rmrf(d);
    free(d);
}
END_TEST

/* The block of compose service `name` (its lines up to the next line indented as little). */
static char *service_block(const char *text, const char *name)
{
    char key[64];
    snprintf(key, sizeof(key), "\n  %s:\n", name);
    const char *a = strstr(text, key);
    if (a == NULL)
        return NULL;
    a += strlen(key);
    const char *b = a;
    while ((b = strchr(b, '\n')) != NULL && (b[1] == ' ' && b[2] == ' ' && b[3] == ' '))
        b++;
    size_t n = b ? (size_t)(b - a) : strlen(a);
    return strndup(a, n);
}

/* Every compose service has a healthcheck that runs `rekv status` (the store's with --kvstore,
 * the worker's with --min-workers), and .dockerignore keeps the build outputs out. */
START_TEST(compose_healthchecks)
{
    char *text = tu_read_file("deploy/docker-compose.yml", NULL);
    ck_assert_ptr_nonnull(text);
    const char *svc[] = {"kvstore", "coordinator", "gpuworker"};
    const char *probe[] = {"\"--kvstore\"", "\"--socket\"", "\"--min-workers\""};
    for (size_t i = 0; i < 3; i++) {
        char *b = service_block(text, svc[i]);
        ck_assert_msg(b != NULL, "compose has no service %s", svc[i]);
        const char *hc = strstr(b, "healthcheck:");
        ck_assert_msg(hc && strstr(hc, "\"status\"") && strstr(hc, probe[i]),
                      "service %s has no `rekv status %s` healthcheck:\n%s", svc[i], probe[i], b);
        if (i > 0)
            ck_assert_msg(strstr(b, "condition: service_healthy"),
                          "service %s does not wait for a healthy dependency", svc[i]);
        free(b);
    }
    free(text);
    /* the image carries the cuda backend's object where its programs look for it */
    char *df = tu_read_file("deploy/Dockerfile", NULL);
    ck_assert_ptr_nonnull(df);
    ck_assert_msg(strstr(df, "make install PREFIX=/usr/local") &&
                      strstr(df, "COPY --from=build /usr/local/lib/rekv/ /usr/local/lib/rekv/"),
                  "deploy/Dockerfile does not install and copy /usr/local/lib/rekv");
    free(df);
    char *ign = tu_read_file(".dockerignore", NULL);
    ck_assert_msg(ign != NULL, ".dockerignore is missing");
    ck_assert_msg(strstr(ign, "\nbuild/\n") && strstr(ign, ".git/"),
                  ".dockerignore does not exclude build/ and .git/");
    free(ign);
}
END_TEST

/* The compose services take their settings from deploy/rekv.env as the units do: every
 * ${REKV_X} of a unit's ExecStart is a $$REKV_X or $${REKV_X...} (expanded by the container's
 * shell) in its service's command, and every container gets the file (env_file). */
START_TEST(compose_reads_rekv_env)
{
    char *text = tu_read_file("deploy/docker-compose.yml", NULL);
    ck_assert_ptr_nonnull(text);
    ck_assert_msg(strstr(text, "env_file: ./rekv.env"), "compose does not read deploy/rekv.env");
    const char *svc[] = {"kvstore", "gpuworker", "coordinator"}; /* as units[] */
    for (size_t i = 0; i < 3; i++) {
        char src[256];
        snprintf(src, sizeof(src), "deploy/systemd/%s.service", units[i]);
        char *unit = tu_read_file(src, NULL), *b = service_block(text, svc[i]);
        ck_assert_msg(unit && b, "%s or compose service %s is missing", src, svc[i]);
        const char *exec = strstr(unit, "\nExecStart=");
        ck_assert_ptr_nonnull(exec);
        const char *end = strchr(exec + 1, '\n');
        int n = 0;
        for (const char *p = exec; (p = strstr(p, "${REKV_")) && p < end; p += 2, n++) {
            char var[64], plain[80], braced[80];
            size_t len = strcspn(p + 2, "}");
            ck_assert(len < sizeof(var));
            memcpy(var, p + 2, len);
            var[len] = '\0';
            snprintf(plain, sizeof(plain), "$$%s\"", var);
            snprintf(braced, sizeof(braced), "$${%s", var);
            ck_assert_msg(strstr(b, plain) || strstr(b, braced),
                          "compose service %s does not take %s (its unit's %s) from rekv.env:\n%s",
                          svc[i], var, src, b);
        }
        ck_assert_msg(n >= 4, "%s: only %d settings in ExecStart", src, n);
        free(unit);
        free(b);
    }
    free(text);
}
END_TEST

/* The "generated_ids":[...] of a JSON result, as text (NULL when absent). */
static char *generated_ids(const char *json)
{
    const char *a = strstr(json, "\"generated_ids\":[");
    const char *b = a ? strchr(a, ']') : NULL;
    return b ? strndup(a, (size_t)(b - a + 1)) : NULL;
}

/* The units under a real systemd (tests/boot_systemd.sh: a virtual machine booting this machine's
 * own root read-only, rekv installed into it by `make install`): README's deployment steps bring
 * all three up as the rekv user, `rekv submit` gets the same tokens as `rekv generate --local`
 * for a short job and for one whose KV is larger than the store's arena (it spills; no spill
 * error), no unit is restarted past its watchdog, each scores at most 4 in `systemd-analyze
 * security` on the running system, each stops cleanly and none leaves shared memory. Skipped,
 * saying why, where qemu, a kernel with 9p or busybox-static is missing (deploy/
 * debian-test-packages.txt) — a failure instead when CI=true. */
START_TEST(systemd_boot)
{
    char *w = tu_tmpdir(), cmd[8192], *out = NULL;
    const char *build = getenv("REKV_BUILD");
    snprintf(cmd, sizeof(cmd), "tests/boot_systemd.sh '%s' '%s' 2>&1", w,
             build && *build ? build : "build");
    int rc = tu_run(cmd, &out);
    if (rc == 77) {
        ck_assert_msg(!tu_ci(), "the boot test cannot run (CI=true): %s", out);
        fprintf(stderr, "   %s", out);
        free(out);
        tu_rmrf(w);
        free(w);
        return;
    }
    ck_assert_msg(rc == 0, "tests/boot_systemd.sh failed (exit %d):\n%s", rc, out);
    free(out);

    char *log = tu_vm_out(w, "check.log");
    /* job3: a member of the rekv group submits through /run/rekv/control */
    const char *rcs[] = {"enable.rc", "job1.rc", "job2.rc", "job3.rc"};
    for (size_t i = 0; i < 4; i++) {
        char *t = tu_vm_out(w, rcs[i]);
        ck_assert_msg(strcmp(t, "0\n") == 0, "in the guest, %s is '%s'; its log ends:\n%s", rcs[i],
                      t, tu_log_end(log));
        free(t);
    }
    for (size_t i = 0; i < 3; i++) {
        char name[128];
        snprintf(name, sizeof(name), "%s.show", units[i]);
        char *show = tu_vm_out(w, name);
        ck_assert_msg(strstr(show, "ActiveState=active\n") && strstr(show, "NRestarts=0\n"),
                      "%s was not running, or was restarted, after the jobs:\n%s", units[i], show);
        free(show);
        snprintf(name, sizeof(name), "%s.user", units[i]);
        char *user = tu_vm_out(w, name);
        ck_assert_msg(strcmp(user, "rekv\n") == 0, "%s runs as '%s', not rekv", units[i], user);
        free(user);
        snprintf(name, sizeof(name), "%s.stopped", units[i]);
        char *stopped = tu_vm_out(w, name);
        ck_assert_msg(strstr(stopped, "ActiveState=inactive\n") &&
                          strstr(stopped, "Result=success\n"),
                      "%s did not stop cleanly:\n%s", units[i], stopped);
        free(stopped);
        snprintf(name, sizeof(name), "%s.security", units[i]);
        char *sec = tu_vm_out(w, name), *at = strstr(sec, "Overall exposure level for ");
        at = at ? strstr(at, ": ") : NULL;
        ck_assert_msg(at != NULL, "no exposure score for %s:\n%s", units[i], sec);
        double score = strtod(at + 2, NULL);
        ck_assert_msg(score <= 4.0, "%s: exposure %.1f > 4 on the running system", units[i], score);
        free(sec);
    }
    char *shm = tu_vm_out(w, "shm.after");
    ck_assert_msg(shm[0] == '\0', "shared memory left after the units stopped:\n%s", shm);
    free(shm);
    char *metrics = tu_vm_out(w, "kvstore.metrics");
    double writes = ms_value(metrics, "rekv_kvstore_spill_writes_total"),
           reads = ms_value(metrics, "rekv_kvstore_spill_reads_total"),
           errors = ms_value(metrics, "rekv_kvstore_spill_errors_total"),
           crc = ms_value(metrics, "rekv_kvstore_crc_errors_total");
    ck_assert_msg(writes > 0 && reads > 0, "the long job did not spill: %g writes, %g reads",
                  writes, reads);
    ck_assert_msg(errors == 0 && crc == 0, "the guest's kvstore: %g spill errors, %g CRC errors",
                  errors, crc);
    free(metrics);

    /* the jobs' tokens are the model's: the same prompts run here, in-process, resident */
    const char *prompts[] = {"1,7,42,9", NULL};
    char long_prompt[1200] = "";
    for (int i = 1; i <= 200; i++)
        snprintf(long_prompt + strlen(long_prompt), sizeof(long_prompt) - strlen(long_prompt),
                 "%s%d", i > 1 ? "," : "", i);
    prompts[1] = long_prompt;
    for (size_t i = 0; i < 2; i++) {
        char name[32];
        snprintf(name, sizeof(name), "job%zu.json", i + 1);
        char *served = tu_vm_out(w, name), *want_out = NULL;
        snprintf(cmd, sizeof(cmd),
                 "%s generate --local --model '%s/stage/var/lib/rekv/models/model' --prompt-ids "
                 "%s --max-new-tokens 8 --ignore-eos --json",
                 tu_bin("rekv"), w, prompts[i]);
        ck_assert_int_eq(tu_run(cmd, &want_out), 0);
        char *got = generated_ids(served), *want = generated_ids(want_out);
        ck_assert_msg(want && got && strcmp(got, want) == 0,
                      "job %zu: the served tokens %s differ from --local's %s", i + 1,
                      got ? got : served, want ? want : want_out);
        free(got);
        free(want);
        free(served);
        free(want_out);
    }
    /* the same prompt as job1 from a member of the rekv group: the same tokens; from a user
     * outside the group: refused (the socket's directory is /run/rekv, 0750 rekv) */
    char *job1 = tu_vm_out(w, "job1.json"), *job3 = tu_vm_out(w, "job3.json");
    char *ids1 = generated_ids(job1), *ids3 = generated_ids(job3);
    ck_assert_msg(ids1 && ids3 && strcmp(ids1, ids3) == 0,
                  "a rekv group member's job got %s, root's %s", ids3 ? ids3 : job3,
                  ids1 ? ids1 : job1);
    free(ids1);
    free(ids3);
    free(job1);
    free(job3);
    char *rc4 = tu_vm_out(w, "job4.rc"), *err4 = tu_vm_out(w, "job4.err");
    ck_assert_msg(strcmp(rc4, "0\n") != 0,
                  "a user outside the rekv group submitted to the service (exit %s): %s", rc4, err4);
    free(rc4);
    free(err4);
    free(log);
    tu_rmrf(w);
    free(w);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("deploy");
    TCase *tc = tcase_create("deploy");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, systemd_units_verify);
    tcase_add_test(tc, compose_config);
    tcase_add_test(tc, systemd_units_hardened);
    tcase_add_test(tc, make_install);
    tcase_add_test(tc, compose_healthchecks);
    tcase_add_test(tc, compose_reads_rekv_env);
    suite_add_tcase(s, tc);
    /* a virtual machine boots (emulated: about a minute on two cores, more when loaded) */
    TCase *boot = tcase_create("boot");
    tcase_set_tags(boot, "vm"); /* make test-vm */
    tcase_set_timeout(boot, 900);
    tcase_add_test(boot, systemd_boot);
    suite_add_tcase(s, boot);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
