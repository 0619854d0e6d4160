/* pipeline_internal.h — the decode pipeline's structs (the pipeline, its sequences, one step and
 * its memory) and the functions its files call across; each function is documented where it is
 * defined. Private to gpuworker. The files: pipeline.c (the step; its opening comment is the data
 * flow), pipeline_create.c, pipeline_buffers.c, pipeline_kvstore.c, pipeline_generate.c,
 * pipeline_graph.c; the modes' table (pl_mode_ops, below) in pipeline_modes.c and each mode's
 * entry in its file: mode_resident.c, mode_stream.c (offload, kvpr, act, hybrid), mode_infinigen.c
 * (with the speculation it shares with clo, pipeline_infinigen.c), mode_clo.c. */
#ifndef REKV_GPUWORKER_PIPELINE_INTERNAL_H
#define REKV_GPUWORKER_PIPELINE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "gpuworker/engine_internal.h"
#include "gpuworker/kernels.h"
#include "gpuworker/kv_pool.h"
#include "gpuworker/pipeline.h"

/* ------------------------------------------------------------------ small helpers */

/* A grow-only device buffer (reallocated only between steps, after the streams are idle). */
typedef struct dbuf {
    void *p;
    size_t cap;
} dbuf;

/* Memory kernels read directly (positions, descriptors, convert lists): chunks of the backend's
 * host_alloc memory (pinned and mapped on cuda; malloc on cpu), kept across steps and handed out
 * again from the start of each step. */
typedef struct meta_chunk {
    uint8_t *p;
    size_t cap, used;
    void *dev; /* its device copy for graphed steps (pipeline_graph.c), cap bytes; NULL until one */
} meta_chunk;

typedef struct meta_arena {
    rekv_backend *be;
    meta_chunk *chunks;
    size_t n, cap;
    size_t cur; /* the chunk being handed out */
} meta_arena;

/* One step's memory: metadata from the arena, and host-only lists (copy pieces, which the backend
 * copies at enqueue) adopted from malloc; all of it released when the step ends. */
typedef struct step_mem {
    meta_arena *meta;
    void **blocks; /* adopted malloc'd lists */
    size_t n, cap;
    int failed;
} step_mem;

/* A growable array of copy pieces (host side, kept until the step ends). */
typedef struct piece_list {
    rekv_copy_piece *v;
    size_t n, cap;
} piece_list;

typedef struct conv_list {
    rekv_convert_piece *v;
    size_t n, cap;
} conv_list;

/* Makes room for `more` entries; 0 or -ENOMEM. */
#define RESERVE(list, more)                                                                        \
    pl_reserve_bytes((void **)&(list)->v, &(list)->cap, (list)->n + (more), sizeof(*(list)->v))

/* A step's device work as recorded (pipeline_graph.c): the calls, by value, in order. */
typedef struct pl_log {
    uint8_t *p;
    size_t len, cap;
    int failed; /* out of memory, or a stream synchronised meanwhile */
} pl_log;
/* this step's recording, the last step's, the graph's, and the one issued with its metadata on
 * the device */
enum { PL_LOG_STEP, PL_LOG_LAST, PL_LOG_GRAPH, PL_LOG_DEV, PL_LOGS };

/* ------------------------------------------------------------------ the pipeline */

enum { MAX_GPU_BATCHES = 64 };

/* Buffers of one GPU batch, alive for a whole step. Sizes in rows T of the batch. */
typedef struct gbatch {
    dbuf x;      /* [T][max(hidden, embed)] residual stream */
    dbuf h;      /* [T][max(hidden, embed)] attention / FFN input */
    dbuf q;      /* [T][q_dim] */
    dbuf k, v;   /* [T][kv_dim] new rows */
    dbuf att;    /* [T][q_dim] */
    dbuf f1, f3; /* [T][ffn] */
    dbuf logits; /* [n_seqs][vocab] */
    dbuf picks;  /* the device's draws: sample's scratch (8 * vocab bytes), then ids [n_seqs],
                    top ids and top logits [their n_top], log-sum-exps (rekv_sample_lp
                    [n_seqs], 8-aligned) */
} gbatch;

/* Buffers of one unit parity. */
typedef struct parity {
    dbuf attn_kv;   /* attention buffers: per sequence its context's blocks (kvlayout.h), back
                       to back, in the cache dtype */
    dbuf act_stage; /* context activation rows as stored */
    dbuf out_stage; /* the new rows' attention input to store, [T][hidden] (cache dtype) */
} parity;

/* infinigen (pipeline_infinigen.c): one layer's speculation weights, on the device */
typedef struct ig_layer {
    float *a;   /* [n_kv][head_dim][rk] A[:, cols] of the skew */
    void *wp;   /* the partial query's weight: no RoPE, W_Q·A[:, cols] folded, [n_heads * rk]
                   [hidden] fp32; RoPE, W_Q itself, [q_dim][hidden] in the engine's wdtype */
    float *bp;  /* its bias ([n_heads * rk] or [q_dim] fp32) or NULL */
    int own_wp; /* wp, bp are the pipeline's (else dev_layers' W_Q, b_Q) */
    float *norm_w, *norm_b; /* the layer's attention norm ([hidden] fp32; b may be NULL) */
} ig_layer;

typedef struct ig_state {
    ig_layer *layers; /* [n_layers]; layer 0 is never speculated (only its norm is kept) */
    int rk;           /* partial columns per KV head */
    dbuf hn;          /* [T][hidden] the speculation's input (an attention input) */
    dbuf q;           /* [T][q_dim] the full speculative query (RoPE models; clo) */
    dbuf qp;          /* [T][n_heads][rk] the partial query */
    dbuf scores;      /* every sparse item's speculated scores, [n_heads][len] at ig_off */
    dbuf sscr;        /* the ig_select kernel's scratch, rekv_ig_scratch_floats at ig_scr */
    float *host;      /* their host copy (rekv_host_alloc), host_cap floats */
    size_t host_cap;
    int fold;    /* the partial query weight is W_Q·A[:, cols] (infinigen without RoPE) */
    int queries; /* the speculation keeps each sparse item's whole query in q (clo's
                    similarity test), so the partial query weight is never folded */
    rekv_event *ev[MAX_GPU_BATCHES];      /* batch g's scores have reached the host */
    rekv_event *ev_read[MAX_GPU_BATCHES]; /* batch g's last decisions (clo's, infinigen's
                                             selection) have read them on the h2d stream (the
                                             scores and their host copies may take the next
                                             layer's) */
    float *scratch;                       /* per thread of the pool: rekv_ig_select's,
                                             [(n_kv + 1) * len], then the scores
                                             past the device part (or the pool's live ones),
                                             [n_heads][len], then with a KV pool each KV
                                             head's live positions, [n_kv][len] (int32) */
    size_t scratch_cap;                   /* floats */
    int32_t *sel;                         /* each token's votes [len] (pl_ig_item_plan, when
                                             it recomputes within the selection) */
    int pool_limit; /* cfg.kv_pool_bytes as entries per (layer > 0, KV head); 0: no pool */
} ig_state;

struct rekv_pipeline {
    rekv_engine *e;
    const rekv_model_config *c;
    rekv_backend *be;
    const rekv_backend_iface *bi;
    const rekv_kernel_iface *k;
    rekv_kvstore_client *store;
    rekv_kv_geometry geo;
    uint8_t *arena;
    const uint8_t *arena_dev; /* where the device reads the arena (rekv_host_mapped); NULL: it
                                 cannot (not page-locked on cuda), or no store */
    rekv_pipeline_config cfg;
    size_t kv_rowb; /* bytes of one K or V row in the cache dtype (rekv_kv_row_bytes) */
    size_t act_esz; /* bytes of one activation element (rekv_act_dtype of the cache dtype) */
    const rekv_mode_info *info;    /* cfg.mode's properties (common/mode.h) */
    const struct pl_mode_ops *ops; /* cfg.mode's functions (pl_mode_ops_of) */
    int keep_act; /* rekv_pipeline_keeps_act(cfg) at creation: sequence id + 1 holds activations */
    rekv_stream *s_compute, *s_h2d, *s_d2h;
    /* by unit parity: activations / KV rows loaded, staging merged, new rows staged, stored */
    rekv_event *ev_act[2], *ev_loaded[2], *ev_stage_free[2], *ev_out[2], *ev_out_free[2];
    rekv_event *ev_attn_free[2]; /* the unit's attention has read the parity's buffers */
    /* by weight-buffer parity: W_K,W_V loaded, all loaded, buffer free again */
    rekv_event *ev_wkv[2], *ev_wall[2], *ev_wfree[2];
    layer_w *dev_layers; /* resident weights: [n_layers] device copies; NULL when offloaded */
    layer_w wbuf[2];     /* offloaded weights: two device layer buffers */
    /* resident weights on a backend whose kernels have qkv: per layer, W_Q, W_K, W_V (and their
     * biases) concatenated on the device (pl_qkv_pack), dev_layers' wq..bv pointing into them;
     * w NULL for a layer left apart (its three matrices' dtypes differ). NULL: none fused */
    /* the kernels fold linear's bias into the next pass (bias_activation, bias_add: cuda); read
     * from the real table at creation, since a recorded step's table has every op */
    int fold_bias;
    struct pl_qkv {
        void *w;  /* [q_dim + 2 kv_dim][hidden] in wt */
        float *b; /* [q_dim + 2 kv_dim], zeros for a missing bias; NULL: no biases */
        rekv_dtype wt;
    } * qkv;
    void *wbuf_mem[2];
    void *d_embed, *d_proj_in, *d_proj_out, *d_head; /* matrices, in the engine's wdtype */
    float *d_pos, *d_fnorm_w, *d_fnorm_b;
    int head_tied;
    gbatch gb[MAX_GPU_BATCHES];
    parity par[2];
    dbuf act_f32;        /* recomputation input rows [n][hidden] fp32 */
    dbuf kr, vr;         /* recomputed K, V rows [n][kv_dim] */
    size_t act_rows_cap; /* the recomputation rows of a GPU batch the device held when a step's
                          * split asked for more (pl_ensure_recompute); 0: none asked too much */
    dbuf scores;         /* attention scratch [max context] */
    rekv_layer_counters *counters; /* [n_layers] */
    rekv_layer_counters *step_log; /* [n_steps] each step's totals since the last reset */
    size_t n_steps, cap_steps;
    rekv_layer_counters logged; /* the totals at the end of the last logged step */
    uint64_t next_id;
    rekv_kv_plan_block *plan; /* the pinned window's plan */
    size_t plan_n, plan_cap;
    /* the store's arena (its Stats, read once): what a step's layer windows must fit */
    uint64_t store_host_bytes, store_kv_slot, store_act_slot;
    int read_ahead;  /* windows ask the store to read the next one ahead (REKV_READ_AHEAD=0: no) */
    meta_arena meta; /* per-step metadata kernels read (pipeline_buffers.c) */
    int arena_registered;   /* the backend page-locked the arena (host_register) */
    int weights_registered; /* ... and the engine's layer blocks (offloaded weights) */
    int page_locked;        /* rekv_pipeline_page_locked's answer */
    /* resident weights on a device whose memory is the host's: the engine's own copies adopted
     * (bi->dev_adopt), not copied; what to give back */
    struct {
        void *p;
        size_t bytes;
    } * adopted;
    int n_adopted;
    size_t arena_bytes;
    /* push: handles of the shared attention buffers and events; the store pushes KV rows */
    rekv_ipc_handle h_attn_kv[2], h_attn_free[2], h_pushed[2];
    rekv_event *ev_pushed[2]; /* the store's copies into the parity's buffers are done */
    rekv_kv_push_piece *push_pieces;
    size_t push_cap;
    struct {                   /* resident decode steps as one graph (pipeline_graph.c) */
        rekv_backend_iface bi; /* the backend with its stream operations recorded */
        const rekv_backend_iface *real_bi;
        const rekv_kernel_iface *real_k;
        pl_log log[PL_LOGS];
        rekv_graph *graph; /* NULL until a recording repeats */
        /* the graph's first call: the metadata's copy to the device (chunk by chunk, their
         * bytes in use then), so that a later step launches it only with the same in use */
        rekv_copy_piece *meta_copy;
        size_t n_meta_copy, cap_meta_copy;
        int off;           /* the backend refused a capture */
        uint64_t steps, captures;
    } gr;
    ig_state ig;                 /* infinigen, and clo's speculation */
    struct {                     /* clo (mode_clo.c) */
        double *tau;             /* [n_layers][n_kv] reuse threshold of each KV head (Eq. 7-9;
                                    device: the decisions read it) */
        double *imp;             /* [n_layers][n_heads] query head importance (Eq. 10's weights;
                                    device) */
        uint8_t *persist;        /* [n_layers][n_kv] the KV head keeps its whole KV (Eq. 13) */
        uint8_t *persist_dev;    /* ... its device copy, for the decisions */
        uint64_t *hits, *misses; /* [n_layers][n_kv] rekv_pipeline_head_cache_counts' */
    } clo;
};

struct rekv_pseq {
    rekv_pipeline *p;
    uint64_t id; /* kvstore sequence (keep_act: id holds K,V and id + 1 the activations) */
    int len, cap;
    uint8_t *kv;      /* resident: [n_layers] caches of cap positions (kvlayout.h), cache dtype */
    uint8_t *act_dev; /* ACT_GPU: [n_layers][act_gpu_blocks * 16][hidden] in the cache dtype */
    uint8_t *kv_dev;  /* the device-resident part: [n_layers] caches of dev_tokens positions
                         (kvlayout.h), cache dtype */
    int dev_tokens;   /* min(cfg.device_tokens, cap) */
    int dev_stale;    /* the device part holds nothing yet: a sequence from the prefix cache whose
                         device part is recomputed from activations (act, hybrid); its next step
                         makes the context whole and keeps [0, dev_tokens) (item_stores) */
    float *pk;        /* infinigen, clo: partial keys [n_layers][cap][n_kv][rk] fp32 (device) */
    rekv_kv_pool pool; /* infinigen with cfg.kv_pool_bytes: which entries of each (layer > 0, KV
                          head) are still in the pool (kv_pool.h); zero (count NULL) otherwise */
    void *pool_mem;    /* its state, host_alloc memory: the device's selection updates it */
    int kv_parts, act_parts; /* hybrid: the KV:ACT pattern of its blocks, the pipeline's when the
                                sequence was made (a later rekv_pipeline_set_step leaves it) */
    /* clo (mode_clo.c): layer 0's whole cache and, per layer > 0, a head cache
     * (kvlayout.h) on the device, with each query head's label; each KV head's cached top-k count
     * (-1: not built) in memory both read and write (host_alloc) */
    uint8_t *clo0; /* layer 0: cap positions, valid below clo0_len (-1: not filled) */
    int clo0_len;
    uint8_t *hc;    /* layers > 0's head caches, back to back */
    size_t *hc_off; /* [n_layers] layer l's at hc + hc_off[l] bytes */
    int *hc_k;      /* [n_layers] its top-k region's slots: ceil(max_fraction * cap), or the
                       whole middle of the context (cap - sink - recent) in a layer with a
                       persistent head */
    int clo_slots;  /* the largest head cache's positions (hc_k + sink + recent + 1) */
    float *label;   /* [n_layers][n_heads][head_dim] (device) */
    int32_t *klen;  /* [n_layers][n_kv] (host_alloc: the plan reads and sets it, the decisions
                       write it) */
    /* the prefix cache (cfg.prefix_cache): the tokens it holds, [cap] ([0, len) valid; recorded
       by pl_store_prepare), published when it is freed; NULL when off */
    int32_t *toks;
    int cached;     /* prompt tokens taken from the cache when made */
    int dropped;    /* blocks [0, dropped) of every layer freed in the store: behind the sliding
                       window of every layer (pl_window_drop) */
    int published;  /* full blocks published so far (the cached ones count) */
};

/* The part of s's context of ctx tokens that the device part serves now: [0, return). */
static inline int pl_dev_part(const rekv_pseq *s, int ctx)
{
    return s->dev_stale ? 0 : s->dev_tokens < ctx ? s->dev_tokens : ctx;
}

/* The first position (rounded down to its 16-token block) that a step's queries at `layer` can
 * attend, for s's next step: the layer's sliding window W reaches back from the first query
 * (position s->len) to s->len - W + 1; 0 without a window. The streaming modes fetch, recompute
 * and pin nothing before it (the attention kernels read no key before it either, so the buffer's
 * slots below it are never read), and as s->len only grows no later step reads below it: a stale
 * device part filled from the attention buffer (item_stores) holds garbage there, never read. */
static inline int pl_window_lo(const rekv_model_config *c, const rekv_pseq *s, int layer)
{
    int w = rekv_config_window(c, layer), lo = s->len - w + 1;
    if (w <= 0 || lo <= 0)
        return 0;
    return lo - lo % REKV_KV_BLOCK_TOKENS;
}

/* the device's KV buffers have the store's block layout (kvlayout.h), so blocks copy whole */
_Static_assert(REKV_KV_BLOCK_TOKENS == REKV_KV_ROWS_PER_BLOCK, "one block size");

/* A layer's tensors in load order — W_K and W_V (with biases) first, so recomputation can start
 * before the rest arrives (KVPR §3.3). N_KV_TENSORS: how many of them are the K/V group. */
enum { N_LAYER_TENSORS = 19, N_KV_TENSORS = 4 };

/* ------------------------------------------------------------------ one step */

/* pipeline_graph.c: the recorders' kernel table; set up at creation (after bi and k) and freed;
 * pl_graph_begin starts recording a step that may run as a graph (1), pl_graph_end issues what
 * was recorded (issue: the step's work is complete) and restores the real tables. */
extern const rekv_kernel_iface pl_rec_kernels;
void pl_graph_init(rekv_pipeline *p);
void pl_graph_free(rekv_pipeline *p);
int pl_graph_begin(rekv_pipeline *p, const rekv_pipe_item *items, int n);
int pl_graph_end(rekv_pipeline *p, int issue, rekv_err *err);

/* What the kvstore plan says about one (item, layer): where its blocks are. The plan's blocks of
 * a range [b0 * 16, end) come in order, so the sequence's block b is blocks[first + b - b0]. */
typedef struct range_ref {
    size_t first; /* index into the plan of the range's block b0 */
    size_t count;
    size_t b0; /* the range's first block: 0, or where a sliding window starts (pl_window_lo) */
} range_ref;

typedef struct step {
    rekv_pipe_item *items;
    int n_items;
    int n_g;                          /* GPU batches */
    int g_begin[MAX_GPU_BATCHES + 1]; /* items of batch g: [g_begin[g], g_begin[g+1]) */
    int g_rows[MAX_GPU_BATCHES];      /* new rows of batch g */
    int *row0;                        /* [n_items] first row of the item within its batch */
    int32_t *tok[MAX_GPU_BATCHES], *pos[MAX_GPU_BATCHES]; /* [rows] */
    int32_t *row_seq[MAX_GPU_BATCHES];                    /* [rows] item index within the batch */
    int32_t *last[MAX_GPU_BATCHES]; /* [items of batch] index of each item's last row */
    range_ref *kv_ref, *act_ref;    /* [n_items][n_layers]; act_ref only for kvpr; the pinned
                                       window's units only */
    rekv_kv_range *ranges;          /* [n_ranges] every (sequence, layer) range, unit by unit */
    size_t n_ranges;
    size_t *unit_r0;            /* [n_units + 1] unit u's ranges: [unit_r0[u], unit_r0[u + 1]) */
    int *win_u0;                /* [n_win + 1] window w's units: [win_u0[w], win_u0[w + 1]) */
    int n_win, win;             /* layer windows, and the one pinned now (-1: none) */
    int *split;                 /* [n_items] context tokens recomputed (kvpr) */
    size_t *ig_off;             /* infinigen: [n_items] offset of the item's speculated
                                   scores, SIZE_MAX when it fetches densely */
    size_t *ig_scr;             /* infinigen: [n_items] offset of the item's scratch in ig.sscr
                                   (the device's selection) */
    struct clo_unit *clo_units; /* clo: the units decided on the h2d stream, newest first */
    struct ig_unit *ig_units;   /* infinigen: the units that select, newest first */
    int ig_wait;                /* infinigen: the step thread selects, waiting for the scores
                                   (pl_ig_prepare says when); else the device does, on the h2d
                                   stream (the ig_select kernel) */
    int32_t *picks[MAX_GPU_BATCHES]; /* batch g's draws copied back: ids [items of batch], top
                                        ids, top logits (n_top of each drawing item), the
                                        log-sum-exps; NULL none */
    step_mem mem;
} step;

/* Host-side lists of one unit's context loads and new-row stores. */
typedef struct unit_io {
    piece_list h2d_kv, h2d_act, d2h_kv, d2h_act;
    piece_list d2d_new; /* new rows into device copies, after the layer: ACT_GPU's activations,
                           the device-resident part's K,V */
    piece_list d2d_kv;  /* on the h2d stream before the unit's loads: the device-resident part
                           into the attention buffer; clo: rows leaving the recent window into
                           a persistent head's region */
    conv_list conv_act;
    int32_t *act_seq, *act_pos; /* [n_act] recomputed rows: item within batch, position */
    int32_t *act_slot; /* infinigen: [n_act][n_kv] each KV head's slot for the row (-1: the head
                          did not select it), or NULL: every head's at its position */
    int n_act;
    size_t act_off;  /* bytes of the parity's activation staging taken */
    int32_t *kv_pos; /* infinigen: [rows] where kv_scatter puts each new row (its slot), or NULL:
                        at its position */
    float **pk_rows; /* infinigen: [rows] where each new row's partial key goes, or NULL */
    struct ig_unit *ig; /* infinigen: the unit's selection (a layer > 0 with sparse items), or
                           NULL; then the new rows also go at their positions (layer_compute) */
    struct clo_unit *clo; /* clo: the unit's decisions, made on the h2d stream (or NULL) */
} unit_io;

/* clo: one unit's (layer > 0) decisions, made by the device on the h2d stream (the clo_decide
 * kernel behind the speculation's event, mode_clo.c). Prepared in step memory, which the device
 * reads and writes, when the unit is planned; the decisions' counts reach the counters after the
 * step. */
typedef struct clo_unit {
    int g, layer;
    int n;                   /* sparse items */
    int *at;                 /* [batch items] the index in seqs of a sparse one */
    rekv_clo_seq *seqs;      /* [n] the kernel's sequences */
    uint64_t *rows0;         /* [n] rows the plan fetched already (a fresh cache, persistent
                                heads) */
    rekv_copy_piece *pieces; /* the misses' rows, for copy_h2d_listed */
    size_t n_pieces, max_pieces;
    struct clo_unit *next; /* the step's list */
} clo_unit;

/* infinigen: one unit's (layer > 0) selection — by the device on the h2d stream (the ig_select
 * kernel behind the speculation's event: pl_ig_unit_fetch), or by the step thread itself, once
 * the speculated scores are on the host, where the plan needs the selection (st->ig_wait). In
 * step memory, which the device reads and writes; its counts reach the counters after the step
 * (pl_ig_step_done). */
typedef struct ig_unit {
    rekv_pipeline *p;
    step *st;
    int g, g0, layer;
    int n;                   /* sparse items */
    int *items;              /* [n] their indices in the batch */
    int32_t **sel;           /* [batch items] each sparse item's selection, [n_kv][len] */
    int *sel_m;              /* [batch items] its tokens per KV head */
    rekv_attn_seq *d;        /* the unit's descriptors: the selection sets each d[j].start */
    int32_t *kv_pos;         /* the unit's io->kv_pos: the selection sets each new row's slot */
    size_t per;              /* scratch floats per thread */
    rekv_ig_seq *seqs;       /* [n] the kernel's sequences (not st->ig_wait) */
    rekv_copy_piece *pieces; /* the selected rows, for copy_h2d_listed (not st->ig_wait) */
    size_t n_pieces, max_pieces;
    uint64_t rows, tokens;   /* the selection's counts: K,V row pairs fetched, tokens per head */
    struct ig_unit *next;    /* the step's list */
} ig_unit;

/* ------------------------------------------------------------------ the modes' table */

/* What a mode does, as the pipeline calls it; what a mode is (streams? a split? ACT blocks?) is
 * data, p->info (common/mode.h). A NULL entry does nothing (returns 0). Each mode's entry is in
 * its own file; pl_mode_ops_of (pipeline_modes.c) finds it. */
typedef struct pl_mode_ops {
    rekv_mode mode;
    /* creation: the config's knobs the mode needs beyond the common checks; 0 or -EINVAL */
    int (*check)(const rekv_pipeline_config *cfg, rekv_err *err);
    /* the mode's own state (infinigen's speculation, clo's head profile), after the weights;
     * free releases it, also after a create that failed part way */
    int (*create)(rekv_pipeline *p, rekv_err *err);
    void (*free)(rekv_pipeline *p);
    /* a sequence's device memory of the mode (resident's cache, the partial keys, the head
     * caches), after the streaming modes' common part; seq_free frees it, also part of it */
    int (*seq_alloc)(rekv_pipeline *p, rekv_pseq *s, rekv_err *err);
    void (*seq_free)(rekv_pipeline *p, rekv_pseq *s);
    /* a sequence that starts from the prefix cache's blocks (its first len tokens, its store
     * sequences made): the mode's per-token device state of those tokens, rebuilt from the
     * blocks (the partial keys of infinigen and clo). NULL in an approximate mode: it prefills
     * instead */
    int (*prefix_fill)(rekv_pipeline *p, rekv_pseq *s, rekv_err *err);
    /* per step, once the step's buffers are sized: the mode's step memory (the speculation's) */
    int (*step_prepare)(rekv_pipeline *p, step *st, rekv_err *err);
    /* whether item i fetches sparsely at layers > 0 (the modes that speculate) */
    int (*sparse)(const rekv_pipeline *p, const step *st, int i);
    /* recompute: the context rows of item it a layer recomputes from activations — what the
     * recomputation buffers must hold for it */
    size_t (*recompute_rows)(const rekv_pipeline *p, const step *st, int it);
    /* plan: unit (g, layer)'s loads — device part, recomputed rows, fetched rows — and new-row
     * stores into io, and the attention's descriptors d where the mode moves them; the streaming
     * modes' */
    int (*unit_plan)(rekv_pipeline *p, step *st, int g, int layer, int b, rekv_attn_seq *d,
                     unit_io *io);
    /* fetch: on the h2d stream after the unit's planned copies (clo's decisions, infinigen's
     * selection: kernels and the listed copy of their rows) */
    void (*unit_fetch)(rekv_pipeline *p, const unit_io *io);
    /* once the step's streams are idle, whatever happened (clo: the decisions' counts) */
    int (*step_done)(rekv_pipeline *p, step *st, rekv_err *err);
} pl_mode_ops;

/* Each mode's entry (mode_*.c), and the one for m (NULL: not a mode). */
extern const pl_mode_ops pl_mode_resident, pl_mode_offload, pl_mode_kvpr, pl_mode_act,
    pl_mode_hybrid, pl_mode_infinigen, pl_mode_clo;
const pl_mode_ops *pl_mode_ops_of(rekv_mode m);

/* ------------------------------------------------------------------ across the files */

/* pipeline.c */
/* A linear layer over one of the engine's matrices (w: that matrix, or its copy on the device), in
 * the layout the engine keeps it: tiled where the engine tiles (tileable: the matrix is one the
 * engine may tile — all but a head tied to embed) and the kernels read that layout. qt: the
 * matrix's GGUF block type (rekv_engine.lqt, embed_qt, head_qt), 0 when it is in wdtype; a
 * quantized matrix is row-major and goes to the kernels' linear as pl_wt(p, qt). */
void pl_linear(const rekv_pipeline *p, rekv_stream *s, float *y, const float *x, const void *w,
               uint32_t qt, int tileable, const float *bias, int m, int n, int k);
/* The weight dtype the kernels get for a matrix of block type qt: cpu_qgemm_wt(qt) (its blocks,
 * on every backend), the engine's wdtype for qt 0. */
rekv_dtype pl_wt(const rekv_pipeline *p, uint32_t qt);

/* pipeline_create.c */
/* Whether layer l's W_Q, W_K, W_V reach the kernels in one dtype (each as pl_wt gives it: the
 * engine's wdtype, or one GGUF block type for all three): 1 with *wt that dtype, so they can be
 * one matrix; 0 when they differ. */
int pl_qkv_dtype(const rekv_engine *e, int l, rekv_dtype *wt);
/* Layer l's W_Q, W_K, W_V concatenated by rows into w ([q_dim + 2 kv_dim][hidden] in wt, from
 * pl_qkv_dtype: pl_wt_bytes(wt, q_dim + 2 kv_dim, hidden) bytes; row-major whatever the
 * engine's layout; quantized ones as their blocks, a row's blocks being whole), and when b is not
 * NULL their biases into b ([q_dim + 2 kv_dim] fp32, zeros for a matrix without). 0 or
 * -ENOMEM. */
int pl_qkv_pack(const rekv_engine *e, int l, rekv_dtype wt, void *w, float *b);
/* Bytes of n rows of k weights in wt (pl_wt's): a plain dtype's, or a GGUF type's blocks. */
size_t pl_wt_bytes(rekv_dtype wt, size_t n, size_t k);

/* pipeline_buffers.c */
int pl_reserve_bytes(void **v, size_t *cap, size_t need, size_t elem);
void pl_meta_free(meta_arena *a);
void *pl_smem_alloc(step_mem *m, size_t bytes);
int pl_smem_adopt(step_mem *m, void *ptr);
void pl_smem_free(step_mem *m);
void pl_dbuf_free(rekv_pipeline *p, dbuf *b);
int pl_ensure_buffers(rekv_pipeline *p, step *st, rekv_err *err);
/* The recomputation's buffers for step st, after every other device buffer of the step (they
 * alone can shrink: a split the device cannot hold is lowered, pipeline_buffers.c). */
int pl_ensure_recompute(rekv_pipeline *p, step *st, rekv_err *err);
/* Frees the recomputation's buffers (pipeline_free; pl_ensure_recompute's search). */
void pl_recompute_free(rekv_pipeline *p);
int pl_dbuf_ensure(rekv_pipeline *p, dbuf *b, size_t bytes);

/* pipeline_create.c */
size_t pl_copy_layer(rekv_pipeline *p, rekv_stream *s, const layer_w *src, layer_w *dst, int from,
                     int to);

/* pipeline_kvstore.c */
const rekv_kv_plan_block *pl_block_at(const rekv_pipeline *p, const range_ref *r, int token);
/* The device-resident part of s, positions [lo, dev) (lo a block's first: 0, or where a sliding
 * window starts), of layer into the same slots of the attention buffer buf (io->d2d_kv), counted
 * as tokens_device; and new rows at positions [t, t + n) of buf
 * (within one block) into the part where they are below s->dev_tokens (io->d2d_new). 0 or
 * -ENOMEM. */
int pl_dev_part_load(rekv_pipeline *p, const rekv_pseq *s, int layer, uint8_t *buf, int lo,
                     int dev, unit_io *io);
int pl_dev_part_store(rekv_pipeline *p, const rekv_pseq *s, int layer, const uint8_t *buf, int t,
                      int n, unit_io *io);
void pl_unit_at(const rekv_pipeline *p, const step *st, int u, int *g, int *layer);
/* Publishes s's full blocks a finished step wrote ([0, len)) that are not yet (a hint: a failure,
 * a lost store, only costs later hits): as they fill (pl_store_prepare, before a step) and when
 * the sequence goes. */
void pl_prefix_publish(rekv_pipeline *p, rekv_pseq *s);
/* The prefix cache's device side: copies the first `upto` positions of every layer of store
 * sequence seq (blocks it took from the cache) from the arena into dev, a device KV buffer of
 * `tokens` positions per layer (kvlayout.h, layers back to back): the device-resident part of a
 * streaming sequence, or resident's whole cache. */
int pl_prefix_fill_device(rekv_pipeline *p, uint64_t seq, uint8_t *dev, int tokens, int upto,
                          rekv_err *err);
/* ACT_GPU's device copy of a sequence that starts from cached blocks: its first ACT blocks
 * (cfg.act_gpu_blocks per layer, in the sequence's order) among them, copied whole. */
int pl_prefix_fill_act(rekv_pipeline *p, rekv_pseq *s, rekv_err *err);
int pl_store_prepare(rekv_pipeline *p, step *st, rekv_err *err);
size_t pl_item_recompute_rows(const rekv_pipeline *p, const step *st, int it);
void pl_store_pattern(const rekv_pipeline *p, const rekv_pseq *s, uint32_t *kv, uint32_t *act);
int pl_window_pin(rekv_pipeline *p, step *st, int w, rekv_err *err);
void pl_window_drop(rekv_pipeline *p, rekv_pseq *s);
int pl_window_unpin(rekv_pipeline *p, step *st, rekv_err *err);
int pl_unit_act_alloc(rekv_pipeline *p, step *st, int g, int slots, unit_io *io);
int pl_item_plan_whole(rekv_pipeline *p, step *st, int item, int j, int layer, int b,
                       rekv_attn_seq *d, int considered, unit_io *io);
int pl_unit_plan_whole(rekv_pipeline *p, step *st, int g, int layer, int b, rekv_attn_seq *d,
                       unit_io *io);
int pl_unit_io_keep(step *st, unit_io *io);
int pl_push_release(rekv_pipeline *p, const rekv_ipc_handle *const *h, size_t n, rekv_err *err);
int pl_push_unit(rekv_pipeline *p, int b, const unit_io *io, rekv_err *err);

/* pipeline_infinigen.c */
int pl_ig_create(rekv_pipeline *p, int queries, rekv_err *err);
void pl_ig_free(rekv_pipeline *p);
int pl_ig_sparse(const rekv_pipeline *p, const step *st, int i);
int pl_ig_prepare(rekv_pipeline *p, step *st, rekv_err *err);
int pl_ig_speculates(const rekv_pipeline *p, const step *st, int g, int layer);
/* How many layers ahead layer `layer`'s speculation runs: cfg.lookahead, but 0 for layer 1 —
 * layer 0 changes the residual stream far more than any later layer (on docs8L its FFN output is
 * ~10x the embedding: layer 0's and 1's inputs at cosine -0.05..-0.01, later pairs 0.94..0.98),
 * so layer 1 is speculated from its own input; its fetch then waits for layer 0
 * (pipeline_infinigen.c says what that costs and saves). */
int pl_ig_lookahead(const rekv_pipeline *p, int layer);
int pl_ig_speculate(rekv_pipeline *p, step *st, int g, int layer);
float **pl_ig_pk_rows(rekv_pipeline *p, step *st, int g, int layer, int *rc);
int pl_ig_unit_begin(rekv_pipeline *p, step *st, int g, int layer, unit_io *io);
int pl_ig_seq_alloc(rekv_pipeline *p, rekv_pseq *s, rekv_err *err);
void pl_ig_seq_free(rekv_pipeline *p, rekv_pseq *s);
int pl_ig_prefix_fill(rekv_pipeline *p, rekv_pseq *s, rekv_err *err);
/* Unit (layer > 0) of batch g with descriptors d: its selection's memory (io->ig), when it has
 * sparse items; with st->ig_wait the selection itself, after waiting for the scores. */
int pl_ig_unit_prepare(rekv_pipeline *p, step *st, int g, int layer, rekv_attn_seq *d,
                       unit_io *io);
/* The unit_fetch and step_done entries of infinigen's mode table. */
void pl_ig_unit_fetch(rekv_pipeline *p, const unit_io *io);
int pl_ig_step_done(rekv_pipeline *p, step *st, rekv_err *err);
int pl_ig_item_plan(rekv_pipeline *p, step *st, int item, int j, int layer, const range_ref *kr,
                    const range_ref *ar, int b, rekv_attn_seq *d, unit_io *io);
int pl_ig_new_row_store(rekv_pipeline *p, const range_ref *kr, const uint8_t *buf, int len,
                        int slot, unit_io *io);
/* out[t] (t < len): the sum over KV head g's query heads of their softmax of scores ([heads][len]),
 * head by head, each cpu_softmax_exp's numerators times 1 / their sum; best (unless NULL): each
 * head's largest score. tmp: len floats. Returns out. */
float *pl_ig_group_probs(const float *scores, int group, int g, int len, float *out, float *tmp,
                         float *best);
void pl_ig_top(const float *v, int len, int m, float *tmp, int32_t *out);

#endif
