/* cli_session.h — running the pipeline inside the CLI: options shared by `rekv generate` and
 * `rekv bench decode`, and a session (backend, private kvstore, pipeline). */
#ifndef REKV_COORDINATOR_CLI_SESSION_H
#define REKV_COORDINATOR_CLI_SESSION_H

#include <getopt.h>
#include <sys/types.h>

#include "coordinator/cli/cli.h"
#include "gpuworker/heads.h"
#include "gpuworker/pipeline.h"
#include "gpuworker/skew.h"

/* getopt_long values of the pipeline options */
enum {
    CLI_OPT_MODE = 1000,
    CLI_OPT_OFFLOAD_WEIGHTS,
    CLI_OPT_GPU_BATCHES,
    CLI_OPT_SCHEDULE,
    CLI_OPT_SPLIT,
    CLI_OPT_RATIO,
    CLI_OPT_CACHE_DTYPE,
    CLI_OPT_LINK_GBPS,
    CLI_OPT_LINK_LATENCY,
    CLI_OPT_TRACE,
    CLI_OPT_ACT_GPU,
    CLI_OPT_DEVICE_TOKENS,
    CLI_OPT_BACKEND,
    CLI_OPT_DEVICE_MEMORY,
    CLI_OPT_PUSH,
    CLI_OPT_ALPHA,
    CLI_OPT_FETCH_CAP,
    CLI_OPT_SELECT,
    CLI_OPT_PARTIAL_RATIO,
    CLI_OPT_SKEW,
    CLI_OPT_LOOKAHEAD,
    CLI_OPT_ETA,
    CLI_OPT_POWER,
    CLI_OPT_PERSIST_NP,
    CLI_OPT_KV_POOL_BYTES,
    CLI_OPT_KV_POOL_POLICY,
};

#define CLI_PIPELINE_OPTIONS                                                                       \
    {"mode", required_argument, 0, CLI_OPT_MODE},                                                  \
        {"offload-weights", no_argument, 0, CLI_OPT_OFFLOAD_WEIGHTS},                              \
        {"gpu-batches", required_argument, 0, CLI_OPT_GPU_BATCHES},                                \
        {"schedule", required_argument, 0, CLI_OPT_SCHEDULE},                                      \
        {"split", required_argument, 0, CLI_OPT_SPLIT},                                            \
        {"ratio", required_argument, 0, CLI_OPT_RATIO},                                            \
        {"cache-dtype", required_argument, 0, CLI_OPT_CACHE_DTYPE},                                \
        {"link-gbps", required_argument, 0, CLI_OPT_LINK_GBPS},                                    \
        {"link-latency-us", required_argument, 0, CLI_OPT_LINK_LATENCY},                           \
        {"trace", required_argument, 0, CLI_OPT_TRACE},                                            \
        {"act-gpu-blocks", required_argument, 0, CLI_OPT_ACT_GPU},                                 \
        {"device-tokens", required_argument, 0, CLI_OPT_DEVICE_TOKENS},                            \
        {"backend", required_argument, 0, CLI_OPT_BACKEND},                                        \
        {"push", no_argument, 0, CLI_OPT_PUSH}, {"alpha", required_argument, 0, CLI_OPT_ALPHA},    \
        {"fetch-cap", required_argument, 0, CLI_OPT_FETCH_CAP},                                    \
        {"select", required_argument, 0, CLI_OPT_SELECT},                                          \
        {"partial-ratio", required_argument, 0, CLI_OPT_PARTIAL_RATIO},                            \
        {"skew", required_argument, 0, CLI_OPT_SKEW},                                              \
        {"lookahead", required_argument, 0, CLI_OPT_LOOKAHEAD},                                    \
        {"eta", required_argument, 0, CLI_OPT_ETA},                                                \
        {"power", required_argument, 0, CLI_OPT_POWER},                                            \
        {"persist-np", required_argument, 0, CLI_OPT_PERSIST_NP},                                  \
        {"kv-pool-bytes", required_argument, 0, CLI_OPT_KV_POOL_BYTES},                            \
        {"kv-pool-policy", required_argument, 0, CLI_OPT_KV_POOL_POLICY},                          \
    {                                                                                              \
        "device-memory", required_argument, 0, CLI_OPT_DEVICE_MEMORY                               \
    }

#define CLI_PIPELINE_USAGE                                                                         \
    "  --mode resident|offload|kvpr|act|hybrid|infinigen|clo   where the KV cache lives and\n"     \
    "                        what moves (default resident; infinigen and clo are approximate)\n"   \
    "  --offload-weights     stream each layer's weights host->device\n"                           \
    "  --gpu-batches N       split the batch into N GPU batches (default 1)\n"                     \
    "  --schedule row|column row-by-row (latency) or column-by-column (throughput)\n"              \
    "  --split L             kvpr: tokens recomputed from activations (default: the planner's);\n" \
    "                        infinigen: recompute up to L of a layer's fetched tokens (whole\n"    \
    "                        layers: the first L; selecting ones: those most KV heads chose)\n"    \
    "  --ratio KV:ACT        hybrid: block pattern (default: HybridServe Algorithm 1)\n"           \
    "  --cache-dtype f16|f32|int8|int4 host cache dtype (default f32: exact)\n"                    \
    "  --act-gpu-blocks N    keep each sequence's first N ACT blocks on the device (ACT_GPU)\n"    \
    "  --device-tokens N     keep each sequence's first N tokens' K,V on the device too, and\n"    \
    "                        move only the rest of its context (the streaming exact modes)\n"      \
    "  --backend auto|cpu|cuda  the device (auto: cuda when there is a GPU, else cpu)\n"           \
    "  --link-gbps G         emulate a host<->device link of G Gbit/s each way\n"                  \
    "  --link-latency-us U   and U microseconds per copy (default 10)\n"                           \
    "  --device-memory SIZE  emulate a device of SIZE bytes (e.g. 512M) on the cpu backend\n"      \
    "  --push                the kvstore writes the KV rows into the device's buffers (IPC)\n"     \
    "  --trace FILE          write a Chrome trace (Perfetto) of the streams (several runs:\n"      \
    "                        one per run, FILE with the run's name before its extension)\n"        \
    "  --alpha A             infinigen: fetch the tokens whose speculated score is within A of\n"  \
    "                        the best (default 4)\n"                                               \
    "  --fetch-cap F         infinigen: at most this fraction of the context per layer; clo:\n"    \
    "                        the top-k a miss fetches, besides sink and recent window (0.2)\n"     \
    "  --select speculate|random|all  infinigen: which tokens (random: as many, at random, to\n"   \
    "                        compare; all: every token, resident's results)\n"                     \
    "  --partial-ratio R     infinigen: skewed columns the speculation uses (default 0.3)\n"       \
    "  --lookahead 1|0       infinigen, clo: speculate at the layer before (1, InfiniGen's:\n"     \
    "                        the fetch overlaps it; layer 1 always from its own input) or\n"       \
    "                        from the layer's own input (0, clo's default: a better guess)\n"      \
    "  --skew FILE           infinigen, clo: the skew `rekv skew` wrote (default: made once "      \
    "from\n"                                                                                       \
    "                        a sample the model generates, cached in $XDG_CACHE_HOME/rekv)\n"      \
    "  --eta E               clo: the most important head's reuse threshold (default 0.95)\n"      \
    "  --power P             clo: thresholds from importance^P (default 2; CLO Eq. 7-9)\n"         \
    "  --persist-np auto|N   clo: N_p of Eq. 12, the heads per layer whose misses the link\n"      \
    "                        serves; harder heads keep their whole KV on the device (default\n"    \
    "                        auto: from the measured link and forward rate)\n"                     \
    "  --kv-pool-bytes SIZE  infinigen: keep at most SIZE bytes (K, M, G) of each sequence's\n"    \
    "                        K,V of layers 1.. (InfiniGen's pool limit; layer 0 stays whole);\n"   \
    "                        past it each new token evicts one, never attended again\n"            \
    "  --kv-pool-policy counter|fifo  infinigen: the victim — the least prefetched (counter,\n"  \
    "                        the paper's) or the oldest (fifo)\n"

typedef struct cli_pipeline_opts {
    rekv_pipeline_config cfg; /* split / kv_parts < 0: chosen by cli_session_choose */
    rekv_link_config link;
    const char *trace;
    const char *backend;  /* "auto", "cpu", "cuda" */
    const char *skew;     /* infinigen: --skew FILE, or NULL: rekv_skew_prepare's */
    double partial_ratio; /* infinigen: for rekv_skew_prepare */
} cli_pipeline_opts;

void cli_pipeline_opts_defaults(cli_pipeline_opts *o);
/* Handles one getopt result: 1 consumed, 0 not a pipeline option, -1 bad value (printed). */
int cli_parse_pipeline_opt(int c, const char *arg, cli_pipeline_opts *o);

/* `auto` (rekv bench decode --modes auto): what the coordinator would assign a worker started with
 * --mode auto (and --approximate when approximate) for `batch` sequences of up to ctx_max tokens
 * (rekv_plan_pick_mode over the exact techniques, and infinigen at the prior f when approximate,
 * with this machine's profile and the device's room, rekv_backend_kv_room): sets cfg->mode and
 * cfg->device_tokens (resident when the whole cache fits; then each sequence's first tokens on
 * the device beside the technique priced cheapest for the rest). why (may be NULL) receives one
 * line: the pick, its part, its price and, when approximate, infinigen's. */
int cli_session_auto(rekv_engine *e, const cli_pipeline_opts *po, int batch, int ctx_max,
                     int approximate, rekv_pipeline_config *cfg, char *why, size_t why_len,
                     rekv_err *err);

/* Fills a kvpr split or hybrid ratio left unset (< 0) from measured speeds: the split a step runs
 * (rekv_plan_kvpr_choose) and hybrid's pattern (rekv_plan_hybrid_pattern), coordinator/planner.h,
 * for `batch` sequences of `ctx` tokens, of which cfg->device_tokens stay on the device (the split
 * is then device_tokens plus the solver's for the rest). */
int cli_session_choose(const rekv_model_config *c, const char *backend,
                       const rekv_link_config *link, int batch, int ctx, rekv_pipeline_config *cfg,
                       rekv_err *err);

typedef struct cli_session {
    rekv_backend *be;
    rekv_skew skew;   /* infinigen, clo: the model's (when the config brought none) */
    rekv_heads heads; /* clo: the model's head profile (when the config brought none) */
    pid_t store_pid;  /* the private kvstore, 0 when resident */
    rekv_kvstore_client *store;
    rekv_pipeline *p;
    char dir[4096]; /* private socket/spill directory */
} cli_session;

/* Sized for `batch` sequences of up to `ctx` tokens, on po's backend and link, with pipeline
 * config cfg (po->cfg or a variant of it). infinigen without a skew in cfg: the session loads
 * po->skew, or prepares the model's (cached; says so on stderr). */
int cli_session_open(cli_session *s, rekv_engine *e, const cli_pipeline_opts *po,
                     const rekv_pipeline_config *cfg, int batch, int ctx, rekv_err *err);
void cli_session_close(cli_session *s);

#endif
