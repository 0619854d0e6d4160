/* fixture.h — a model loaded for compute with a private kvstore beside it: what the pipeline
 * tests (test_pipeline on cpu, test_cuda on cuda) run every mode against. */
#ifndef REKV_TESTS_FIXTURE_H
#define REKV_TESTS_FIXTURE_H

#include <sys/types.h>

#include "gpuworker/gpuworker.h"
#include "gpuworker/pipeline.h"
#include "kvstore/kvstore.h"

typedef struct tu_fixture {
    rekv_model *m;
    rekv_engine *e;
    rekv_backend *be; /* a cpu backend */
    pid_t store_pid;
    rekv_kvstore_client *store;
    char *dir;
} tu_fixture;

/* Opens model_path, creates its engine and a cpu backend, and spawns a private kvstore (256 MiB,
 * cache dtype `cache`, push backend push_backend: NULL for a store that cannot push) in a fresh
 * temporary directory, connected. Fails the test on any error. */
void tu_fixture_open(tu_fixture *f, const char *model_path, rekv_dtype cache,
                     const char *push_backend);
/* Stops the store (which must exit cleanly) and frees everything. */
void tu_fixture_close(tu_fixture *f);

#endif
