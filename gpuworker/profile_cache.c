/* profile_cache.c — the profile's cache file (profile.h): the key that says which machine, backend,
 * link and model shape a profile is for, its path, and its JSON, saved atomically and loaded with
 * every field range-checked. */
#define _GNU_SOURCE
#include "gpuworker/profile.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/version.h"

/* ---------------------------------------------------------------- cache key and path */

static void pf_cpu_model(char *buf, size_t cap)
{
    snprintf(buf, cap, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, "model name", 10) != 0)
            continue;
        char *v = strchr(line, ':');
        if (!v)
            continue;
        v++;
        while (*v == ' ' || *v == '\t')
            v++;
        v[strcspn(v, "\n")] = '\0';
        snprintf(buf, cap, "%s", v);
        break;
    }
    fclose(f);
}

int rekv_profile_key(const rekv_model_config *c, const char *backend, const rekv_link_config *link,
                     char *key, size_t key_cap, rekv_err *err)
{
    char host[256] = "unknown", cpu[256];
    if (gethostname(host, sizeof(host) - 1) != 0)
        snprintf(host, sizeof(host), "unknown");
    host[sizeof(host) - 1] = '\0';
    pf_cpu_model(cpu, sizeof(cpu));
    double gbps = link && link->gbps > 0 ? link->gbps : 0;
    double lat = gbps > 0 ? link->latency_us : 0; /* no emulation: the latency setting is moot */
    int n =
        snprintf(key, key_cap,
                 "rekv-profile v%d|rekv=%s|host=%s|cpu=%s|arch=%d|layers=%d|hidden=%d|heads=%d|"
                 "kv_heads=%d|head_dim=%d|ffn=%d|vocab=%d|act=%d|rope=%d|qkv_bias=%d|"
                 "dtype=%s|backend=%s|link_gbps=%.17g|link_latency_us=%.17g",
                 REKV_PROFILE_VERSION, rekv_version(), host, cpu, (int)c->arch, c->n_layers,
                 c->hidden, c->n_heads, c->n_kv_heads, c->head_dim, c->ffn, c->vocab, (int)c->act,
                 (int)c->rope, c->qkv_bias, rekv_dtype_name(c->dtype), backend, gbps, lat);
    if (n < 0 || (size_t)n >= key_cap)
        return rekv_errf(err, -ENAMETOOLONG, "profile: cache key longer than %zu bytes", key_cap);
    return 0;
}

static int pf_default_dir(char *buf, size_t cap, rekv_err *err)
{
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    int n;
    if (xdg && *xdg == '/')
        n = snprintf(buf, cap, "%s/rekv/profiles", xdg);
    else if (home && *home)
        n = snprintf(buf, cap, "%s/.cache/rekv/profiles", home);
    else
        return rekv_errf(err, -ENOENT, "profile: neither XDG_CACHE_HOME nor HOME is set");
    if (n < 0 || (size_t)n >= cap)
        return rekv_errf(err, -ENAMETOOLONG, "profile: cache directory name too long");
    return 0;
}

int rekv_profile_path(const rekv_model_config *c, const char *backend, const rekv_link_config *link,
                      const char *dir, char *path, size_t path_cap, rekv_err *err)
{
    char key[2048], ddir[4096];
    int rc;
    if ((rc = rekv_profile_key(c, backend, link, key, sizeof(key), err)))
        return rc;
    if (!dir) {
        if ((rc = pf_default_dir(ddir, sizeof(ddir), err)))
            return rc;
        dir = ddir;
    }
    uint64_t h = 1469598103934665603ull; /* FNV-1a, 64 bit */
    for (const unsigned char *p = (const unsigned char *)key; *p; p++)
        h = (h ^ *p) * 1099511628211ull;
    int n = snprintf(path, path_cap, "%s/%016llx.json", dir, (unsigned long long)h);
    if (n < 0 || (size_t)n >= path_cap)
        return rekv_errf(err, -ENAMETOOLONG, "profile: cache path too long under %s", dir);
    return 0;
}

/* ---------------------------------------------------------------- JSON */

static json_t *pf_linear_json(const rekv_linear *l)
{
    return json_pack("{s:f,s:f}", "a_s", l->a, "b_s_per_token", l->b);
}

static const char *const pf_dtype_names[REKV_PROFILE_DTYPES] = {"f32", "f16"};

/* The profile as a JSON object (without the key). */
static json_t *pf_to_json(const rekv_profile *p)
{
    json_t *o = json_pack(
        "{s:i,s:s,s:f,s:f,s:f,s:f,s:f,s:f,s:i,s:i,s:f,s:f,s:f,s:i,s:i,s:f,s:f,s:f,s:i,s:f}",
        "version", p->version, "backend", p->backend, "link_gbps", p->link.gbps, "link_latency_us",
        p->link.latency_us, "h2d_bw_bytes_per_s", p->h2d_bw, "h2d_latency_s", p->h2d_latency,
        "d2h_bw_bytes_per_s", p->d2h_bw, "d2h_latency_s", p->d2h_latency, "gemm_rows", p->gemm_rows,
        "gemm_kv_rows", p->gemm_kv_rows, "gemm_kv_flops_per_s", p->gemm_kv_flops,
        "gemm_ffn_flops_per_s", p->gemm_ffn_flops, "gemm_ffn_1_flops_per_s", p->gemm_ffn_1_flops,
        "attn_batch", p->attn_batch, "attn_ctx", p->attn_ctx, "attn_flops_per_s", p->attn_flops,
        "layer_weight_bytes", p->layer_weight_bytes, "t_load_w_s", p->t_load_w, "fit_tokens_max",
        p->fit_tokens_max, "measure_s", p->measure_s);
    if (!o)
        return NULL;
    json_t *lk = json_object(), *kg = json_object(), *rf = json_object();
    for (int d = 0; d < REKV_PROFILE_DTYPES; d++) {
        json_object_set_new(lk, pf_dtype_names[d], pf_linear_json(&p->load_kv[d]));
        json_object_set_new(kg, pf_dtype_names[d], pf_linear_json(&p->kv_gen[d]));
        json_object_set_new(rf, pf_dtype_names[d], json_real(p->recomp_flops[d]));
    }
    json_object_set_new(o, "load_kv", lk);
    json_object_set_new(o, "kv_gen", kg);
    json_object_set_new(o, "recomp_flops_per_s", rf);
    json_object_set_new(o, "attn_chunk_flops_per_s", json_real(p->attn_chunk_flops));
    return o;
}

json_t *rekv_profile_json(const rekv_profile *p)
{
    return pf_to_json(p);
}

int rekv_profile_save(const char *path, const char *key, const rekv_profile *p, rekv_err *err)
{
    int rc = 0;
    char tmp[4200];
    json_t *o = pf_to_json(p);
    if (!o || json_object_set_new(o, "key", json_string(key ? key : "")))
        return rekv_errf(err, -ENOMEM, "profile: out of memory building JSON");
    /* create the directories */
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = '\0';
        for (char *q = dir + 1; *q; q++) {
            if (*q != '/')
                continue;
            *q = '\0';
            if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
                rc = rekv_errf(err, -errno, "%s: %s", dir, strerror(errno));
                goto out;
            }
            *q = '/';
        }
        if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
            rc = rekv_errf(err, -errno, "%s: %s", dir, strerror(errno));
            goto out;
        }
    }
    snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        rc = rekv_errf(err, -errno, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    char *text = json_dumps(o, JSON_INDENT(2) | JSON_SORT_KEYS | JSON_REAL_PRECISION(17));
    size_t len = text ? strlen(text) : 0, off = 0;
    while (text && off < len) {
        ssize_t w = write(fd, text + off, len - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0) {
            rc = rekv_errf(err, -errno, "%s: %s", tmp, strerror(errno));
            break;
        }
        off += (size_t)w;
    }
    if (!text)
        rc = rekv_errf(err, -ENOMEM, "profile: out of memory writing JSON");
    free(text);
    if (rc == 0 && (write(fd, "\n", 1) != 1 || fsync(fd) != 0))
        rc = rekv_errf(err, -(errno ? errno : EIO), "%s: %s", tmp, strerror(errno));
    if (close(fd) != 0 && rc == 0)
        rc = rekv_errf(err, -errno, "%s: %s", tmp, strerror(errno));
    if (rc == 0 && rename(tmp, path) != 0)
        rc = rekv_errf(err, -errno, "%s: %s", path, strerror(errno));
    if (rc)
        unlink(tmp);
out:
    json_decref(o);
    return rc;
}

/* A number field of o in [lo, hi], finite. */
static int pf_get_num(const char *path, json_t *o, const char *name, double lo, double hi,
                      double *out, rekv_err *err)
{
    json_t *v = json_object_get(o, name);
    if (!json_is_number(v))
        return rekv_errf(err, -EINVAL, "%s: \"%s\" is missing or not a number", path, name);
    double d = json_number_value(v);
    if (!isfinite(d) || d < lo || d > hi)
        return rekv_errf(err, -EINVAL, "%s: \"%s\" = %g is out of range", path, name, d);
    *out = d;
    return 0;
}

static int pf_get_int(const char *path, json_t *o, const char *name, int lo, int hi, int *out,
                      rekv_err *err)
{
    json_t *v = json_object_get(o, name);
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return rekv_errf(err, -EINVAL, "%s: \"%s\" is missing, not an integer or out of range",
                         path, name);
    *out = (int)json_integer_value(v);
    return 0;
}

static int pf_get_linear(const char *path, json_t *o, const char *group, const char *dt,
                         rekv_linear *out, rekv_err *err)
{
    json_t *g = json_object_get(o, group);
    json_t *l = json_is_object(g) ? json_object_get(g, dt) : NULL;
    if (!json_is_object(l))
        return rekv_errf(err, -EINVAL, "%s: \"%s.%s\" is missing or not an object", path, group,
                         dt);
    int rc;
    if ((rc = pf_get_num(path, l, "a_s", 0, 1e6, &out->a, err)) ||
        (rc = pf_get_num(path, l, "b_s_per_token", 1e-300, 1e6, &out->b, err)))
        return rc;
    if (!(out->b > 0))
        return rekv_errf(err, -EINVAL, "%s: \"%s.%s.b_s_per_token\" is not positive", path, group,
                         dt);
    return 0;
}

int rekv_profile_load(const char *path, const char *key, rekv_profile *out, rekv_err *err)
{
    json_error_t je;
    json_t *o = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!o) {
        if (access(path, F_OK) != 0)
            return rekv_errf(err, -ENOENT, "%s: no such file", path);
        return rekv_errf(err, -EINVAL, "%s: line %d: %s", path, je.line, je.text);
    }
    rekv_profile p;
    memset(&p, 0, sizeof(p));
    int rc = 0;
    if (!json_is_object(o)) {
        rc = rekv_errf(err, -EINVAL, "%s: not a JSON object", path);
        goto out;
    }
    if ((rc = pf_get_int(path, o, "version", 0, 1 << 30, &p.version, err)))
        goto out;
    if (p.version != REKV_PROFILE_VERSION) {
        rc = rekv_errf(err, -EINVAL, "%s: version %d, this rekv writes %d", path, p.version,
                       REKV_PROFILE_VERSION);
        goto out;
    }
    json_t *jk = json_object_get(o, "key"), *jb = json_object_get(o, "backend");
    if (!json_is_string(jk) || (key && strcmp(json_string_value(jk), key) != 0)) {
        rc = rekv_errf(err, -EINVAL,
                       "%s: \"key\" is missing or names another machine, model, "
                       "backend or link",
                       path);
        goto out;
    }
    if (!json_is_string(jb) || !*json_string_value(jb) ||
        strlen(json_string_value(jb)) >= sizeof(p.backend)) {
        rc = rekv_errf(err, -EINVAL, "%s: \"backend\" is missing or invalid", path);
        goto out;
    }
    snprintf(p.backend, sizeof(p.backend), "%s", json_string_value(jb));
    const double big = 1e30;
    if ((rc = pf_get_num(path, o, "link_gbps", 0, 1e6, &p.link.gbps, err)) ||
        (rc = pf_get_num(path, o, "link_latency_us", 0, 1e9, &p.link.latency_us, err)) ||
        (rc = pf_get_num(path, o, "h2d_bw_bytes_per_s", 1, big, &p.h2d_bw, err)) ||
        (rc = pf_get_num(path, o, "h2d_latency_s", 0, 1e3, &p.h2d_latency, err)) ||
        (rc = pf_get_num(path, o, "d2h_bw_bytes_per_s", 1, big, &p.d2h_bw, err)) ||
        (rc = pf_get_num(path, o, "d2h_latency_s", 0, 1e3, &p.d2h_latency, err)) ||
        (rc = pf_get_int(path, o, "gemm_rows", 1, 1 << 30, &p.gemm_rows, err)) ||
        (rc = pf_get_int(path, o, "gemm_kv_rows", 1, 1 << 30, &p.gemm_kv_rows, err)) ||
        (rc = pf_get_num(path, o, "gemm_kv_flops_per_s", 1, big, &p.gemm_kv_flops, err)) ||
        (rc = pf_get_num(path, o, "gemm_ffn_flops_per_s", 1, big, &p.gemm_ffn_flops, err)) ||
        (rc = pf_get_num(path, o, "gemm_ffn_1_flops_per_s", 1, big, &p.gemm_ffn_1_flops, err)) ||
        (rc = pf_get_int(path, o, "attn_batch", 1, 1 << 30, &p.attn_batch, err)) ||
        (rc = pf_get_int(path, o, "attn_ctx", 1, 1 << 30, &p.attn_ctx, err)) ||
        (rc = pf_get_num(path, o, "attn_flops_per_s", 1, big, &p.attn_flops, err)) ||
        (rc = pf_get_num(path, o, "attn_chunk_flops_per_s", 1, big, &p.attn_chunk_flops, err)) ||
        (rc = pf_get_num(path, o, "layer_weight_bytes", 1, big, &p.layer_weight_bytes, err)) ||
        (rc = pf_get_num(path, o, "t_load_w_s", 0, 1e6, &p.t_load_w, err)) ||
        (rc = pf_get_int(path, o, "fit_tokens_max", 2, 1 << 30, &p.fit_tokens_max, err)) ||
        (rc = pf_get_num(path, o, "measure_s", 0, 1e6, &p.measure_s, err)))
        goto out;
    for (int d = 0; d < REKV_PROFILE_DTYPES; d++)
        if ((rc = pf_get_linear(path, o, "load_kv", pf_dtype_names[d], &p.load_kv[d], err)) ||
            (rc = pf_get_linear(path, o, "kv_gen", pf_dtype_names[d], &p.kv_gen[d], err)) ||
            (rc = pf_get_num(path, json_object_get(o, "recomp_flops_per_s"), pf_dtype_names[d], 1,
                             big, &p.recomp_flops[d], err)))
            goto out;
    *out = p;
out:
    json_decref(o);
    return rc;
}
