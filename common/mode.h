/* mode.h — the pipeline's modes by name: the vocabulary the worker (which runs them), the
 * coordinator (which chooses and plans them) and the CLI share, on the command line and on the
 * wire (worker.proto's Hello.mode and Assign.mode). What each mode does is gpuworker/pipeline.h's.
 */
#ifndef REKV_COMMON_MODE_H
#define REKV_COMMON_MODE_H

typedef enum rekv_mode {
    REKV_MODE_RESIDENT = 0,  /* the KV cache on the device */
    REKV_MODE_OFFLOAD = 1,   /* the KV cache in the kvstore, fetched whole each step */
    REKV_MODE_KVPR = 2,      /* a prefix recomputed from activations, the rest fetched (KVPR) */
    REKV_MODE_ACT = 3,       /* activations only, every K,V recomputed */
    REKV_MODE_HYBRID = 4,    /* KV and ACT blocks in a KV:ACT pattern (HybridServe) */
    REKV_MODE_INFINIGEN = 5, /* approximate: only the KV rows a speculation one layer ahead selects
                                cross the link (InfiniGen) */
    REKV_MODE_CLO = 6,       /* approximate: per KV head a cached top-k on the device, reused while
                                the query stays close to the one it was chosen for (CLO) */
} rekv_mode;

/* Whether a mode's tokens may differ from resident's (opt-in: --approximate). */
int rekv_mode_approximate(rekv_mode m);

/* "resident", "offload", "kvpr", "act", "hybrid", "infinigen", "clo"; "?" for anything else. */
const char *rekv_mode_name(rekv_mode m);
/* 0 with *out set, or -EINVAL for a name that is not a mode. */
int rekv_mode_parse(const char *s, rekv_mode *out);

#endif
