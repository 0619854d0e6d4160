/* progress.c — see progress.h. Lines go out whole with one fprintf each, so a line another part
 * of the program logs between two of ours is never cut in half (a bar may be: it is redrawn). */
#include "common/progress.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"

#define BAR_WIDTH 30
#define BAR_EVERY_NS 100000000ull   /* 100 ms between redraws of a bar */
#define LINE_EVERY_NS 5000000000ull /* 5 s between lines when the total is unknown */

rekv_progress_style rekv_progress_style_for(FILE *out, int quiet)
{
    if (quiet || out == NULL)
        return REKV_PROGRESS_QUIET;
    return isatty(fileno(out)) ? REKV_PROGRESS_BAR : REKV_PROGRESS_LINES;
}

void rekv_progress_begin(rekv_progress *p, FILE *out, rekv_progress_style style, const char *what,
                         const char *unit, uint64_t total)
{
    memset(p, 0, sizeof(*p));
    p->out = out;
    p->style = out ? style : REKV_PROGRESS_QUIET;
    snprintf(p->what, sizeof(p->what), "%s", what ? what : "");
    snprintf(p->unit, sizeof(p->unit), "%s", unit ? unit : "");
    p->total = total;
    p->start_ns = rekv_now_ns();
    p->delay_ns = REKV_PROGRESS_DELAY_NS;
    const char *env = getenv("REKV_PROGRESS");
    if (env && strcmp(env, "0") == 0)
        p->style = REKV_PROGRESS_QUIET;
    else if (env && strcmp(env, "1") == 0)
        p->delay_ns = 0;
}

/* "12/40 tokens" or "1.5/96.0 MiB" (no total: "12 tokens") */
static void counts(const rekv_progress *p, char *buf, size_t cap)
{
    if (strcmp(p->unit, "bytes") == 0) {
        double mib = 1.0 / (1024.0 * 1024.0);
        if (p->total)
            snprintf(buf, cap, "%.1f/%.1f MiB", (double)p->done * mib, (double)p->total * mib);
        else
            snprintf(buf, cap, "%.1f MiB", (double)p->done * mib);
    } else if (p->total) {
        snprintf(buf, cap, "%llu/%llu %s", (unsigned long long)p->done,
                 (unsigned long long)p->total, p->unit);
    } else {
        snprintf(buf, cap, "%llu %s", (unsigned long long)p->done, p->unit);
    }
}

static int percent(const rekv_progress *p)
{
    if (p->total == 0)
        return 0;
    uint64_t d = p->done < p->total ? p->done : p->total;
    return (int)(d * 100 / p->total);
}

static void write_line(rekv_progress *p)
{
    char c[96];
    counts(p, c, sizeof(c));
    if (p->total)
        fprintf(p->out, "%s: %s (%d%%)%s%s\n", p->what, c, percent(p), p->note[0] ? ", " : "",
                p->note);
    else
        fprintf(p->out, "%s: %s%s%s\n", p->what, c, p->note[0] ? ", " : "", p->note);
    fflush(p->out);
}

static void draw_bar(rekv_progress *p)
{
    char c[96], bar[BAR_WIDTH + 1];
    counts(p, c, sizeof(c));
    int pct = percent(p), fill = p->total ? pct * BAR_WIDTH / 100 : 0;
    for (int i = 0; i < BAR_WIDTH; i++)
        bar[i] = i < fill ? '#' : (p->total ? '.' : ' ');
    bar[BAR_WIDTH] = '\0';
    /* \033[K clears what a longer earlier bar left at the end of the line */
    if (p->total)
        fprintf(p->out, "\r%s [%s] %3d%% %s%s%s\033[K", p->what, bar, pct, c,
                p->note[0] ? ", " : "", p->note);
    else
        fprintf(p->out, "\r%s: %s%s%s\033[K", p->what, c, p->note[0] ? ", " : "", p->note);
    fflush(p->out);
}

void rekv_progress_update(rekv_progress *p, uint64_t done, const char *note)
{
    if (p->style == REKV_PROGRESS_QUIET)
        return;
    p->done = done;
    if (note)
        snprintf(p->note, sizeof(p->note), "%s", note);
    uint64_t now = rekv_now_ns();
    if (now - p->start_ns < p->delay_ns)
        return; /* not long work (yet) */
    if (p->style == REKV_PROGRESS_LINES) {
        if (p->total) {
            /* a line for the highest tenth reached, so a run of every unit writes exactly 10 */
            uint64_t d = done < p->total ? done : p->total;
            int tenth = (int)(d * 10 / p->total);
            if (tenth > p->tenth) {
                p->tenth = tenth;
                write_line(p);
                p->shown_ns = now;
            }
        } else if (p->shown_ns == 0 || now - p->shown_ns >= LINE_EVERY_NS) {
            write_line(p);
            p->shown_ns = now;
        }
        return;
    }
    if (p->shown_ns == 0 || now - p->shown_ns >= BAR_EVERY_NS || (p->total && done >= p->total)) {
        draw_bar(p);
        p->shown_ns = now;
    }
}

void rekv_progress_end(rekv_progress *p)
{
    if (p->style == REKV_PROGRESS_BAR && p->shown_ns != 0) {
        draw_bar(p);
        fputc('\n', p->out);
        fflush(p->out);
    } else if (p->style == REKV_PROGRESS_LINES && p->total == 0 && p->shown_ns != 0) {
        write_line(p);
    }
    p->style = REKV_PROGRESS_QUIET; /* ended: later calls write nothing */
}

void rekv_progress_cb(void *arg, uint64_t done, uint64_t total)
{
    rekv_progress *p = arg;
    if (total)
        p->total = total;
    rekv_progress_update(p, done, NULL);
}
