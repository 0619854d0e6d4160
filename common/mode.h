/* mode.h — the pipeline's modes by name and by property: the vocabulary the worker (which runs
 * them), the coordinator (which chooses and plans them) and the CLI share, on the command line and
 * on the wire (worker.proto's Hello.mode and Assign.mode). What each mode does is the engine's
 * (gpuworker/pipeline.h; each mode's functions are one entry of the pipeline's mode table,
 * gpuworker/mode_*.c); what a mode is — the properties the planner, the coordinator and the CLI
 * ask about instead of naming modes — is rekv_mode_info_of's table (mode.c). A new mode is a row
 * there and an entry in the pipeline's table. */
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
    REKV_MODE_COUNT = 7,     /* not a mode: how many there are */
} rekv_mode;

/* What a sequence's blocks hold in the kvstore. */
typedef enum rekv_mode_store {
    REKV_STORE_NONE = 0,    /* nothing: the cache stays on the device (resident) */
    REKV_STORE_KV = 1,      /* K,V blocks */
    REKV_STORE_ACT = 2,     /* ACT blocks (the attention input; K,V recomputed from it) */
    REKV_STORE_PATTERN = 3, /* KV and ACT blocks in the sequence's KV:ACT pattern, which the
                               planner picks per step for the sequences it makes (hybrid) */
} rekv_mode_store;

/* What a mode's split (cfg.split, Plan's split) counts. A mode with a split keeps every token's
 * activations beside its K,V (store sequence id + 1) when rekv_mode_keeps_act says so. */
typedef enum rekv_mode_split {
    REKV_SPLIT_NONE = 0,     /* no split */
    REKV_SPLIT_PREFIX = 1,   /* the context's tokens [0, split) are recomputed (kvpr; activations
                                always kept) */
    REKV_SPLIT_SELECTED = 2, /* up to split of the tokens a layer fetches are recomputed
                                (infinigen; activations kept only with a split > 0) */
} rekv_mode_split;

/* A mode's properties: data, not behaviour. */
typedef struct rekv_mode_info {
    const char *name;      /* on the command line and the wire */
    int approximate;       /* tokens may differ from resident's (opt-in: --approximate) */
    rekv_mode_store store; /* what the kvstore keeps; NONE: the mode streams nothing */
    rekv_mode_split split;
    int act_gpu;       /* may keep a sequence's first ACT blocks on the device (--act-gpu-blocks,
                          HybridServe's ACT_GPU): the exact modes that recompute */
    int device_part;   /* may keep each sequence's first tokens' K,V on the device
                          (cfg.device_tokens) beside what it streams */
    int speculates;    /* InfiniGen's speculation: partial keys, scores a layer ahead (needs the
                          model's skew) */
    int head_caches;   /* per KV head a cached top-k on the device, reused while the query stays
                          close (needs the model's head profile; counts hits and misses) */
    int layer_windows; /* a step whose blocks do not fit the kvstore's arena runs in layer
                          windows (else the whole step is pinned at once) */
    int selects;       /* its attention buffers hold the tokens a selection picks, not positions:
                          it cannot honour a model's sliding window */
} rekv_mode_info;

/* The properties of m, or NULL for anything that is not a mode. */
const rekv_mode_info *rekv_mode_info_of(rekv_mode m);

/* Whether a mode's tokens may differ from resident's (opt-in: --approximate); 0 for a non-mode. */
int rekv_mode_approximate(rekv_mode m);
/* Whether m streams the KV cache from the kvstore (every mode but resident). */
int rekv_mode_streams(rekv_mode m);
/* Whether m at this split keeps activations beside K,V (kvpr; infinigen with a split > 0). */
int rekv_mode_keeps_act(rekv_mode m, int split);

/* "resident", "offload", "kvpr", "act", "hybrid", "infinigen", "clo"; "?" for anything else. */
const char *rekv_mode_name(rekv_mode m);
/* 0 with *out set, or -EINVAL for a name that is not a mode. */
int rekv_mode_parse(const char *s, rekv_mode *out);

#endif
