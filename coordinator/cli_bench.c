/* cli_bench.c — `rekv bench`: benchmarks that print one JSON object. Times mean something as ratios
 * measured in the same run, so every benchmark measures its baseline alongside. */
#include <cblas.h>
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "coordinator/cli.h"
#include "gpuworker/gpuworker.h"
#include "kvstore/kvstore.h"
#include "loader/loader.h"

/* GFLOP/s of OpenBLAS sgemm, y[m][n] = x[m][k]·W[n][k]^T — the shape a linear layer runs. */
static double sgemm_gflops(int m, int n, int k, double min_s)
{
    float *x = calloc((size_t)m * k, sizeof(float)), *w = calloc((size_t)n * k, sizeof(float));
    float *y = calloc((size_t)m * n, sizeof(float));
    double gf = 0;
    if (x && w && y) {
        for (size_t i = 0; i < (size_t)m * k; i++)
            x[i] = (float)(i % 7) * 0.1f;
        for (size_t i = 0; i < (size_t)n * k; i++)
            w[i] = (float)(i % 5) * 0.1f;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1, x, k, w, k, 0, y, n);
        int reps = 0;
        uint64_t t0 = rekv_now_ns(), t;
        do {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1, x, k, w, k, 0, y, n);
            reps++;
            t = rekv_now_ns();
        } while ((double)(t - t0) * 1e-9 < min_s);
        gf = 2.0 * m * n * k * reps / ((double)(t - t0) * 1e-9) * 1e-9;
    }
    free(x);
    free(w);
    free(y);
    return gf;
}

static int bench_forward(int argc, char **argv)
{
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"batches", required_argument, 0, 'b'},
                                         {"prompt-len", required_argument, 0, 'p'},
                                         {"decode-steps", required_argument, 0, 'd'},
                                         {"json", no_argument, 0, 'j'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *model_path = NULL, *batches = "1,2,4,8,16,32";
    long prompt_len = 64, steps = 8;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 'b': batches = optarg; break;
        case 'p': if (cli_parse_int("prompt-len", optarg, 1, 1 << 20, &prompt_len)) return 2; break;
        case 'd': if (cli_parse_int("decode-steps", optarg, 1, 1 << 20, &steps)) return 2; break;
        case 'j': break; /* JSON is the only output */
        case 'h':
        default:
            fprintf(c == 'h' ? stdout : stderr,
                    "usage: rekv bench forward --model PATH [--batches 1,2,4,8,16,32]\n"
                    "                          [--prompt-len S] [--decode-steps N] [--json]\n"
                    "Prints prefill and decode tokens/s and GFLOP/s per batch size, next to\n"
                    "OpenBLAS sgemm's GFLOP/s at the model's shapes, measured in the same run.\n");
            return c == 'h' ? 0 : 2;
        }
    }
    if (model_path == NULL) {
        fprintf(stderr, "rekv bench forward: --model is required\n");
        return 2;
    }
    int32_t *bs = NULL;
    int n_bs = 0;
    if (cli_parse_ids(batches, &bs, &n_bs)) {
        fprintf(stderr, "rekv bench forward: --batches: expected sizes like 1,2,4\n");
        return 2;
    }
    int rc = 1;
    rekv_err err = {0};
    rekv_model *model = NULL;
    rekv_engine *eng = NULL;
    json_t *runs = json_array();
    if (rekv_model_open(model_path, &model, &err) || rekv_engine_create(model, &eng, &err)) {
        fprintf(stderr, "rekv: %s\n", err.msg);
        goto out;
    }
    const rekv_model_config *cfg = &model->config;
    if (prompt_len + steps > cfg->max_pos) {
        fprintf(stderr, "rekv bench forward: prompt-len + decode-steps exceeds the context (%d)\n",
                cfg->max_pos);
        goto out;
    }
    double peak = sgemm_gflops(1024, 1024, 1024, 0.5);
    for (int bi = 0; bi < n_bs; bi++) {
        int B = bs[bi], S = (int)prompt_len;
        if (B <= 0)
            continue;
        rekv_seq **seqs = calloc((size_t)B, sizeof(*seqs));
        rekv_batch_item *items = calloc((size_t)B, sizeof(*items));
        int32_t *toks = malloc(sizeof(int32_t) * (size_t)B * (size_t)S);
        float *logits = malloc(sizeof(float) * (size_t)B * (size_t)cfg->vocab);
        if (!seqs || !items || !toks || !logits) {
            fprintf(stderr, "rekv: out of memory\n");
            free(seqs), free(items), free(toks), free(logits);
            goto out;
        }
        uint64_t x = 12345;
        for (size_t i = 0; i < (size_t)B * S; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            toks[i] = (int32_t)((x >> 33) % (uint64_t)cfg->vocab);
        }
        int ok = 1;
        for (int b = 0; b < B && ok; b++) {
            ok = rekv_seq_create(eng, S + (int)steps, &seqs[b], &err) == 0;
            items[b] = (rekv_batch_item){seqs[b], toks + (size_t)b * S, S, 0,
                                         logits + (size_t)b * cfg->vocab};
        }
        uint64_t t0 = rekv_now_ns();
        ok = ok && rekv_engine_forward(eng, items, B, &err) == 0;
        uint64_t t1 = rekv_now_ns();
        for (long s = 0; s < steps && ok; s++) {
            for (int b = 0; b < B; b++)
                items[b] = (rekv_batch_item){seqs[b], toks + (size_t)b * S + (size_t)s % S, 1, 0,
                                             logits + (size_t)b * cfg->vocab};
            ok = rekv_engine_forward(eng, items, B, &err) == 0;
        }
        uint64_t t2 = rekv_now_ns();
        for (int b = 0; b < B; b++)
            rekv_seq_free(seqs[b]);
        free(seqs), free(items), free(toks), free(logits);
        if (!ok) {
            fprintf(stderr, "rekv: %s\n", err.msg);
            goto out;
        }
        double pre_s = (double)(t1 - t0) * 1e-9, dec_s = (double)(t2 - t1) * 1e-9;
        double ctx_pre = (double)B * S * (S + 1) / 2;
        double ctx_dec = (double)B * ((double)steps * S + (double)steps * (steps + 1) / 2);
        double pre_gf = rekv_engine_flops(eng, (double)B * S, ctx_pre, B) / pre_s * 1e-9;
        double dec_gf = rekv_engine_flops(eng, (double)B * steps, ctx_dec, (double)B * steps) /
                        dec_s * 1e-9;
        /* sgemm at the layer's largest shape for these row counts */
        double sg_pre = sgemm_gflops(B * S, cfg->ffn, cfg->hidden, 0.2);
        double sg_dec = sgemm_gflops(B, cfg->ffn, cfg->hidden, 0.2);
        json_array_append_new(
            runs, json_pack("{s:i, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f}", "batch", B,
                            "prefill_tokens_per_s", (double)B * S / pre_s, "decode_tokens_per_s",
                            (double)B * steps / dec_s, "prefill_gflops", pre_gf, "decode_gflops",
                            dec_gf, "sgemm_gflops_prefill_shape", sg_pre,
                            "sgemm_gflops_decode_shape", sg_dec, "prefill_vs_sgemm",
                            pre_gf / sg_pre, "decode_vs_sgemm", dec_gf / sg_dec));
    }
    json_t *o = json_pack("{s:s, s:s, s:{s:i, s:i, s:i, s:i, s:s}, s:i, s:i, s:f, s:O}", "bench",
                          "forward", "backend", "cpu", "model", "layers", cfg->n_layers, "hidden",
                          cfg->hidden, "ffn", cfg->ffn, "vocab", cfg->vocab, "dtype",
                          rekv_dtype_name(cfg->dtype), "prompt_len", (int)prompt_len,
                          "decode_steps", (int)steps, "sgemm_gflops_1024", peak, "runs", runs);
    char *s = json_dumps(o, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    printf("%s\n", s);
    free(s);
    json_decref(o);
    rc = 0;
out:
    json_decref(runs);
    free(bs);
    rekv_engine_free(eng);
    rekv_model_close(model);
    return rc;
}

int cli_bench(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "forward") == 0)
        return bench_forward(argc - 1, argv + 1);
    if (argc >= 2 && strcmp(argv[1], "kvstore") == 0)
        return rekv_kvstore_bench_main(argc - 1, argv + 1);
    fprintf(stderr, "usage: rekv bench forward|kvstore [options] --json\n");
    return 2;
}
