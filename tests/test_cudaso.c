/* test_cudaso.c — the CUDA libraries only where the GPU is driven (issue 17 item 4): the cuda
 * backend is a shared object (librekv_cuda.so, gpuworker/device/backend_cuda.h) that a process
 * loads on first use of that backend, so no program maps libcudart or libcublas otherwise. The
 * same checks hold OpenBLAS and LAPACKE, which only skewing and benchmarks load
 * (gpuworker/blas.h), out of every process below.
 *
 * - the real daemons (a cpu-only kvstore, the coordinator, a worker on the cpu backend), started
 *   and idle with the worker joined: none maps a CUDA library or the object (/proc/PID/maps), and
 *   the coordinator and the store each stay under 30 MB of RSS (a count of pages, not a time);
 * - every program's --version, the CLI's client command (`rekv status`) and a local run on the
 *   cpu backend load none (the dynamic loader's own account of every object it opens,
 *   LD_DEBUG=files, dlopen included);
 * - where the build has CUDA, the object loads here through the programs' path (beside the test:
 *   build/tests/../lib/rekv) and its entry point gives the module of this build — the CUDA
 *   libraries are then mapped, so the checks above could see them; without a GPU only its
 *   constructor fails (-ENODEV); `auto` on a machine without an NVIDIA device node never loads it;
 * - a missing, broken or foreign object is a clear error for `cuda` (naming the path) and `auto`
 *   falls back to cpu; `rekv generate --local --backend cuda` says the same and exits non-zero. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpuworker/device/backend.h"
#include "gpuworker/device/backend_cuda.h"
#include "gpuworker/kernels.h"
#include "tests/testutil.h"

/* The libraries loaded on first use: CUDA's and the object, which a process that does not drive a
 * GPU must not have, and OpenBLAS and LAPACKE (gpuworker/blas.h), which only skewing, benchmarks
 * and tests load — no process here skews. */
static const char *const first_use_libs[] = {"libcudart", "libcublas", REKV_CUDA_LIBRARY_NAME,
                                             "libopenblas", "liblapacke"};

/* The first of them named in text, or NULL. */
static const char *first_use_lib_in(const char *text)
{
    for (size_t i = 0; i < sizeof(first_use_libs) / sizeof(first_use_libs[0]); i++)
        if (text && strstr(text, first_use_libs[i]))
            return first_use_libs[i];
    return NULL;
}

static void assert_no_cuda_mapped(pid_t pid, const char *what)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
    char *maps = tu_read_file(path, NULL);
    ck_assert_msg(maps != NULL, "%s: cannot read %s", what, path);
    const char *lib = first_use_lib_in(maps);
    ck_assert_msg(lib == NULL, "%s maps %s", what, lib);
    free(maps);
}

/* VmRSS of pid in kB. */
static long rss_kb(pid_t pid)
{
    long kb = tu_proc_status_kb(pid, "VmRSS");
    ck_assert_msg(kb >= 0, "no VmRSS for pid %d", (int)pid);
    return kb;
}

/* Runs cmd (a shell command; its stdout is dropped) under LD_DEBUG=files and fails when the
 * loader opened one of first_use_libs; returns the command's exit status. */
static int run_without_cuda(const char *cmd, const char *what)
{
    char full[9000], *out = NULL;
    snprintf(full, sizeof(full), "LD_DEBUG=files %s 2>&1 >/dev/null", cmd);
    int rc = tu_run(full, &out);
    ck_assert_msg(strstr(out, "file=") != NULL, "%s: LD_DEBUG reported nothing:\n%.2000s", what,
                  out);
    const char *lib = first_use_lib_in(out);
    ck_assert_msg(lib == NULL, "%s loads %s", what, lib);
    free(out);
    return rc;
}

static void synth_model(const char *dir)
{
    char cmd[4500];
    snprintf(cmd, sizeof(cmd),
             "%s synth --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --ffn 128 "
             "--vocab 256 --max-pos 128 --dtype f32 %s >/dev/null",
             tu_bin("rekv-loader"), dir);
    ck_assert_int_eq(tu_run(cmd, NULL), 0);
}

START_TEST(daemons_idle_without_cuda)
{
    char *d = tu_tmpdir();
    char model[4200], kv[4200], control[4200], workers[4200], log[4200], status[9000];
    snprintf(model, sizeof(model), "%s/m", d);
    snprintf(kv, sizeof(kv), "ipc://%s/kv", d);
    snprintf(control, sizeof(control), "ipc://%s/control", d);
    snprintf(workers, sizeof(workers), "ipc://%s/workers", d);
    snprintf(log, sizeof(log), "%s/log", d);
    synth_model(model);
    char kv_bin[4200], co_bin[4200], w_bin[4200];
    snprintf(kv_bin, sizeof(kv_bin), "%s", tu_bin("rekv-kvstore"));
    snprintf(co_bin, sizeof(co_bin), "%s", tu_bin("rekv-coordinator"));
    snprintf(w_bin, sizeof(w_bin), "%s", tu_bin("rekv-gpuworker"));
    const char *kv_args[] = {kv_bin,         "--endpoint", kv,           "--model", model,
                             "--host-bytes", "16M",        "--no-spill", NULL};
    pid_t kv_pid = tu_spawn(kv_args, log, NULL);
    ck_assert_msg(kv_pid > 0, "the kvstore did not start (see %s)", log);
    const char *co_args[] = {co_bin, "--control", control, "--workers", workers, NULL};
    pid_t co_pid = tu_spawn(co_args, log, NULL);
    ck_assert_msg(co_pid > 0, "the coordinator did not start (see %s)", log);
    const char *w_args[] = {w_bin, "--model",   model, "--coordinator", workers,   "--kvstore",
                            kv,    "--backend", "cpu", "--mode",        "offload", "--name",
                            "w0",  NULL};
    pid_t w_pid = tu_spawn(w_args, log, NULL);
    ck_assert_msg(w_pid > 0, "the worker did not start (see %s)", log);
    rekv_ctl *c = tu_ctl_open(control);
    tu_ctl_wait_workers(c, 1);
    rekv_ctl_close(c);

    /* idle, every connection made: what each maps now is what it runs with */
    assert_no_cuda_mapped(kv_pid, "rekv-kvstore (no --push-backend)");
    assert_no_cuda_mapped(co_pid, "rekv-coordinator");
    assert_no_cuda_mapped(w_pid, "rekv-gpuworker --backend cpu");
    long co_kb = rss_kb(co_pid), kv_kb = rss_kb(kv_pid);
    fprintf(stderr, "   idle RSS: coordinator %ld kB, kvstore %ld kB\n", co_kb, kv_kb);
    ck_assert_msg(co_kb < 30 * 1024, "the idle coordinator holds %ld kB (>= 30 MB)", co_kb);
    ck_assert_msg(kv_kb < 30 * 1024, "the idle cpu-only kvstore holds %ld kB (>= 30 MB)", kv_kb);

    /* the CLI's client command against them */
    snprintf(status, sizeof(status), "%s status --socket %s", tu_bin("rekv"), control);
    ck_assert_int_eq(run_without_cuda(status, "rekv status"), 0);

    tu_stop(w_pid);
    tu_stop(co_pid);
    tu_stop(kv_pid);
    tu_rmrf(d);
    free(d);
}
END_TEST

START_TEST(programs_start_without_cuda)
{
    const char *progs[] = {"rekv", "rekv-coordinator", "rekv-kvstore", "rekv-gpuworker",
                           "rekv-loader"};
    char cmd[4600];
    for (size_t i = 0; i < sizeof(progs) / sizeof(progs[0]); i++) {
        snprintf(cmd, sizeof(cmd), "%s --version", tu_bin(progs[i]));
        ck_assert_msg(run_without_cuda(cmd, progs[i]) == 0, "%s --version failed", progs[i]);
    }
    /* a local run on the cpu backend: the CLI links every room, and still loads no CUDA */
    char *d = tu_tmpdir(), model[4200];
    snprintf(model, sizeof(model), "%s/m", d);
    synth_model(model);
    snprintf(cmd, sizeof(cmd),
             "%s generate --local --backend cpu --model %s --prompt-ids 1,2,3 "
             "--max-new-tokens 4 --ignore-eos",
             tu_bin("rekv"), model);
    ck_assert_int_eq(run_without_cuda(cmd, "rekv generate --local --backend cpu"), 0);
    tu_rmrf(d);
    free(d);
}
END_TEST

/* Whether this process maps a CUDA runtime library now. */
static int cuda_mapped_here(void)
{
    char *maps = tu_read_file("/proc/self/maps", NULL);
    int has = maps && strstr(maps, "libcudart") != NULL;
    free(maps);
    return has;
}

START_TEST(module_loads_beside_the_program)
{
    const rekv_cuda_module *m = NULL;
    rekv_err err = {0};
    unsetenv("REKV_CUDA_LIBRARY");
    int rc = rekv_cuda_module_load(&m, &err);
#if !REKV_CUDA
    ck_assert_int_eq(rc, -ENOTSUP);
    fprintf(stderr, "   skip: built without CUDA, there is no %s\n", REKV_CUDA_LIBRARY_NAME);
    return;
#endif
    char path[4200];
    ck_assert_int_eq(rekv_cuda_module_path(path, sizeof(path), &err), 0);
    ck_assert_msg(strstr(path, "/tests/../lib/rekv/" REKV_CUDA_LIBRARY_NAME) != NULL, "%s", path);
    ck_assert_msg(rc == 0, "%s", err.msg);
    ck_assert_ptr_eq(rekv_cuda_module_loaded(), m);
    ck_assert_uint_eq(m->abi, REKV_CUDA_MODULE_ABI);
    ck_assert_uint_eq(m->backend_iface_size, sizeof(rekv_backend_iface));
    ck_assert_uint_eq(m->kernel_iface_size, sizeof(rekv_kernel_iface));
    ck_assert_ptr_nonnull(m->kernels);
    ck_assert_ptr_nonnull(m->kernels->linear);
    ck_assert_ptr_nonnull(m->kernels->spec_scores);
    /* the object brings the CUDA runtime: what the other tests look for is real */
    ck_assert_msg(cuda_mapped_here(), "librekv_cuda.so loaded but libcudart is not mapped");
    rekv_backend *be = NULL;
    rc = rekv_backend_cuda_create(0, &be, &err);
    if (rc == -ENODEV) {
        fprintf(stderr, "   no GPU here: %s\n", err.msg);
        return;
    }
    ck_assert_msg(rc == 0, "%s", err.msg);
    ck_assert_str_eq(be->iface->name, "cuda");
    ck_assert_ptr_eq(rekv_kernels_of(be), m->kernels);
    rekv_backend_destroy(be);
}
END_TEST

START_TEST(auto_without_gpu_node_loads_nothing)
{
    if (access("/dev/nvidiactl", F_OK) == 0 || access("/dev/dxg", F_OK) == 0) {
        fprintf(stderr, "   skip: this machine has an NVIDIA device node, auto may load CUDA\n");
        return;
    }
    rekv_backend *be = NULL;
    rekv_err err = {0};
    char note[512];
    ck_assert_msg(rekv_backend_create("auto", NULL, &be, note, sizeof(note), &err) == 0, "%s",
                  err.msg);
    ck_assert_str_eq(be->iface->name, "cpu");
    ck_assert_msg(strstr(note, "cpu backend") != NULL, "%s", note);
    ck_assert_ptr_null(rekv_cuda_module_loaded());
    ck_assert_msg(!cuda_mapped_here(), "auto without a GPU mapped libcudart");
    rekv_backend_destroy(be);
}
END_TEST

/* In a child (the load is once per process): with $REKV_CUDA_LIBRARY = lib, `cuda` must fail with
 * code and a message naming lib and holding want; `auto` must give cpu. */
static void check_bad_library(const char *lib, int code, const char *want)
{
    fflush(stderr);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        setenv("REKV_CUDA_LIBRARY", lib, 1);
        rekv_backend *be = NULL;
        rekv_err err = {0};
        char note[1200];
        int rc = rekv_backend_create("cuda", NULL, &be, note, sizeof(note), &err);
        if (rc != code || !strstr(err.msg, lib) || !strstr(err.msg, want)) {
            fprintf(stderr, "%s: cuda gave %d (want %d): \"%s\" (want \"%s\")\n", lib, rc, code,
                    err.msg, want);
            _exit(1);
        }
        rekv_err_clear(&err);
        if (rekv_backend_create("auto", NULL, &be, note, sizeof(note), &err) != 0 ||
            strcmp(be->iface->name, "cpu") != 0) {
            fprintf(stderr, "%s: auto did not fall back to cpu: %s\n", lib, err.msg);
            _exit(1);
        }
        rekv_backend_destroy(be);
        _exit(0);
    }
    int st = 0;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: see the line above", lib);
}

START_TEST(bad_library_is_a_clear_error)
{
#if !REKV_CUDA
    fprintf(stderr, "   skip: built without CUDA, `cuda` is refused before any load\n");
    return;
#endif
    char *d = tu_tmpdir(), missing[4200], text[4200], cmd[9000], *out = NULL;
    snprintf(missing, sizeof(missing), "%s/missing/librekv_cuda.so", d);
    snprintf(text, sizeof(text), "%s/librekv_cuda.so", d);
    FILE *f = fopen(text, "w");
    ck_assert_ptr_nonnull(f);
    fputs("not an ELF object\n", f);
    fclose(f);
    /* a real shared object without the entry point: the C library this test runs on */
    Dl_info info;
    ck_assert(dladdr((void *)&fopen, &info) != 0 && info.dli_fname != NULL);
    check_bad_library(missing, -ENOENT, "No such file");
    check_bad_library(text, -ELIBBAD, "cannot load");
    check_bad_library(info.dli_fname, -ELIBACC, "has no " REKV_CUDA_MODULE_SYMBOL);

    /* and through a program: a usage-level failure naming the path, not a crash or a silent cpu */
    char model[4200];
    snprintf(model, sizeof(model), "%s/m", d);
    synth_model(model);
    snprintf(cmd, sizeof(cmd),
             "REKV_CUDA_LIBRARY='%s' %s generate --local --backend cuda --model %s "
             "--prompt-ids 1,2,3 --max-new-tokens 2 2>&1",
             missing, tu_bin("rekv"), model);
    int rc = tu_run(cmd, &out);
    ck_assert_msg(rc != 0 && strstr(out, missing) != NULL,
                  "rekv generate --backend cuda with no object: exit %d:\n%s", rc, out);
    free(out);
    tu_rmrf(d);
    free(d);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("cudaso");
    TCase *tc = tcase_create("cudaso");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, daemons_idle_without_cuda);
    tcase_add_test(tc, programs_start_without_cuda);
    tcase_add_test(tc, module_loads_beside_the_program);
    tcase_add_test(tc, auto_without_gpu_node_loads_nothing);
    tcase_add_test(tc, bad_library_is_a_clear_error);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
